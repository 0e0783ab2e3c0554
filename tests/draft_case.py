"""Whole-draft parity harness for the TP / CP integration tests: a tiny EAGLE-3 draft, a padded TTT batch, the
single-process reference and the same forward+backward under any (tp, cp) layout of a gloo group.

Every rank builds the same full model and batch from the seed (weights first, then sharded from outside), runs the
single-process reference itself, then its own layout, and returns both as full tensors (CP partial sums summed over
cp, TP shards gathered over tp) so the test compares them in the parent process.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from recipe.config import MemoryOptions
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.target_head import lm_head_argmax
from recipe.model.ttt import TTTModel, make_ttt_batch, target_in_draft_vocab, ttt_objective
from recipe.parallel.parallelize import parallelize
from recipe.parallel.cp_shard import pad_to_multiple, shard_ttt_batch
from recipe.parallel.dims import ParallelDims
from recipe.parallel.topology import ParallelState
from recipe.parallel.tp_layers import gather_tensor
from ttt_cases import random_draft

V, VD, H, HT = 96, 64, 32, 24
LENGTHS = (19, 14)  # two rows of different length: right padding in row 1 (and in row 0 once S is rounded up)


def tiny_config() -> Eagle3DraftConfig:
    """hidden 32, 4 heads / 2 KV heads of dim 8, intermediate 64, vocab 96, draft vocab 64, target hidden 24."""
    return Eagle3DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT,
                             aux_layer_ids=[1, 2, 4], rope_theta=500.0)


def build_case(seed: int, K: int, seq_len: int, dtype: torch.dtype = torch.float64):
    """(TTTModel with full weights, full TTTBatch) for ``seed``: random vocab map, scaled embeddings/lm_head so the
    soft CE is far from uniform, a target head favouring draft ids, and rows of ``LENGTHS`` padded to ``seq_len``."""
    g = torch.Generator().manual_seed(seed)
    draft, head_VH, t2d = random_draft(seed, tiny_config(), g)
    b, s = len(LENGTHS), max(LENGTHS)
    if seq_len < s:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest row ({s})")
    # drawn at the true length, then padded: the same case for every seq_len
    attention = torch.zeros(b, s, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        attention[row, :n] = True
    loss_mask = (torch.rand(b, s, generator=g) < 0.8) & attention
    input_ids = torch.randint(0, V, (b, s), generator=g) * attention
    aux = torch.randn(b, s, 3 * HT, generator=g) * attention[..., None]
    last = torch.randn(b, s, HT, generator=g)
    attention, loss_mask, input_ids = (pad_to_multiple(t, seq_len, dim=1) for t in (attention, loss_mask, input_ids))
    aux, last = (pad_to_multiple(t, seq_len, dim=1) for t in (aux, last))
    in_vocab = target_in_draft_vocab(lm_head_argmax(last, head_VH), t2d)
    batch = make_ttt_batch(input_ids, loss_mask, attention, aux.to(dtype), last.to(dtype), in_vocab, K)
    model = TTTModel(draft, head_VH).to(dtype)
    return model, batch


def forward_backward(model: TTTModel, batch, n_valid_K: torch.Tensor):
    """One forward + backward of the global objective's local part; (loss_sum_K, correct_K, valid_K)."""
    model.zero_grad(set_to_none=True)
    out = model(batch)
    ttt_objective(out, n_valid_K).backward()
    return out.loss_sum_K.detach(), out.correct_K, out.valid_K


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.detach().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def full_grads(model: TTTModel, cp_group, tp_group) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient as the full tensor: summed over cp, TP shards gathered over tp."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"{name} got no gradient"
        g = _sum(p.grad, cp_group)
        if getattr(p, "tensor_model_parallel", False):
            g = gather_tensor(g, p.partition_dim, tp_group)
        grads[name] = g
    return grads


def run_layout(rank: int, world: int, tp: int, cp: int, K: int, seed: int, seq_len: int,
               dtype: torch.dtype = torch.float64) -> dict:
    """Reference and (tp, cp) layout on this rank (world = tp·cp·dp, dp ignored: every dp rank repeats the case).

    Returns {"ref": (loss_K, correct_K, valid_K, grads), "par": (same, full), "counts": RingCounts dict or None,
    "cp_rank", "tp_rank", "local_valid" (this rank's valid_K), "local_seq" (S/cp), "lm_head_shape" (local shard)}.
    """
    model, batch = build_case(seed, K, seq_len, dtype)
    n_valid = batch.valid_KBS.sum(dim=(1, 2))
    ref_model = copy.deepcopy(model)
    ref = forward_backward(ref_model, batch, n_valid)
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.requires_grad}

    pstate = ParallelState(ParallelDims(world_size=world, tp=tp, cp=cp))
    par_model = parallelize(copy.deepcopy(model), pstate, MemoryOptions(attention_tile_size=None))
    counts = None
    local = batch
    if cp > 1:
        local = shard_ttt_batch(batch, cp, pstate.cp_rank)
    loss_K, correct_K, valid_K = forward_backward(par_model, local, n_valid)
    if cp > 1:
        counts = dict(vars(par_model.draft.midlayer.self_attn.causal_attention.comm.counts))
    par = (_sum(loss_K, pstate.cp_group), _sum(correct_K, pstate.cp_group), _sum(valid_K, pstate.cp_group),
           full_grads(par_model, pstate.cp_group, pstate.tp_group))
    return {"ref": (*ref, ref_grads), "par": par, "counts": counts, "cp_rank": pstate.cp_rank,
            "tp_rank": pstate.tp_rank, "local_valid": valid_K, "local_seq": local.position_ids_BS.shape[1],
            "lm_head_shape": tuple(par_model.draft.lm_head.weight.shape)}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


def assert_parity(result: dict, rtol: float, label: str) -> int:
    """Loss sums rel ≤ rtol, correct/valid counts exact, every gradient rel ≤ rtol; returns the gradient count."""
    loss_r, correct_r, valid_r, grads_r = result["ref"]
    loss_p, correct_p, valid_p, grads_p = result["par"]
    assert valid_r.min() > 0 and correct_r.sum() > 0, f"{label}: vacuous case (no valid or correct positions)"
    assert max_rel(loss_p, loss_r) <= rtol, f"{label}: loss {loss_p} vs {loss_r}"
    assert torch.equal(correct_p, correct_r), f"{label}: correct {correct_p} vs {correct_r}"
    assert torch.equal(valid_p, valid_r), f"{label}: valid {valid_p} vs {valid_r}"
    assert grads_p.keys() == grads_r.keys(), f"{label}: parameter names differ"
    for name, g in grads_r.items():
        assert g.abs().max() > 0, f"{label}: reference gradient of {name} is zero (vacuous)"
        rel = max_rel(grads_p[name], g)
        assert rel <= rtol, f"{label}: grad {name} rel {rel:.2e}"
    return len(grads_r)
