"""Whole-draft parity harness for the TP / CP integration tests: a tiny EAGLE-3 draft and a padded TTT batch (the
``PARITY`` geometry of ``helpers.cases``), the single-process reference and the same forward+backward under any
(tp, cp) layout of a gloo group.

Every rank builds the same full model and batch from the seed (weights first, then sharded from outside), runs the
single-process reference itself, then its own layout, and returns both as full tensors (CP partial sums summed over
cp, TP shards gathered over tp) so the test compares them in the parent process.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from helpers.cases import PARITY, answer_only, build_case
from helpers.tolerance import max_rel, within
from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.model.ttt import TTTModel, ttt_objective
from recipe.parallel.parallelize import parallelize
from recipe.parallel.cp_shard import shard_ttt_batch
from recipe.parallel.dims import ParallelDims
from recipe.parallel.topology import ParallelState
from recipe.parallel.tp_layers import gather_tensor


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
               dtype: torch.dtype = torch.float64, attention_backend: str | None = None,
               sparse: bool | str | tuple = False,
               answers: tuple[int, ...] | None = None, tile_size: int | None = None,
               switches: dict | None = None, lengths: tuple[int, ...] | None = None,
               packing_tokens: int | None = None) -> dict:
    """Reference and (tp, cp) layout on this rank (world = tp·cp·dp, dp ignored: every dp rank repeats the case).
    ``attention_backend``: the attention backend of the layout by ``make_causal_attention`` name (None: "tiled",
    the pure-PyTorch kernel; untiled, i.e. the dense block on one cp rank and one tile per zigzag chunk in the ring;
    ``tile_size`` tiles it). ``sparse``: the layout runs with ``TTTModel.sparse_anchors`` (the reference stays
    dense); a tuple: one mode per cp rank (ranks of one step on different paths). ``answers``: per row, supervise only the last that many real tokens (``cases.answer_only``; a
    long-prompt/short-answer mask, 0: a row with nothing supervised). ``switches``: memory switches of the layout
    (``loss_chunk_size``, ``checkpoint_steps``: TTTModel attributes; ``mlp_tile_size``: the memory section's).
    ``lengths``: the rows' real lengths (default ``PARITY.lengths``). ``packing_tokens``: the layout runs the same
    samples packed into rows of at most that many tokens, padded to ``seq_len`` (``build_case``), against the
    padded single-process reference.

    Returns {"ref": (loss_K, correct_K, valid_K, grads), "par": (same, full), "counts": RingCounts dict or None,
    "cp_rank", "tp_rank", "local_valid" (this rank's valid_K), "local_seq" (S/cp), "lm_head_shape" (local shard),
    "local_needed" ([K] this rank's needed anchors per step with ``sparse``, else None), "real_positions" (of the whole
    batch)}.
    """
    draft, head_VH, batch = build_case(seed, K, seq_len, lengths, geometry=PARITY, dtype=dtype)
    if answers is not None:
        batch = answer_only(batch, answers)
    ref_batch = batch
    if packing_tokens is not None:
        batch = build_case(seed, K, seq_len, lengths, geometry=PARITY, dtype=dtype, packing_tokens=packing_tokens)[2]
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    n_valid = ref_batch.valid_KBS.sum(dim=(1, 2))
    ref_model = copy.deepcopy(model)
    ref = forward_backward(ref_model, ref_batch, n_valid)
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.requires_grad}

    pstate = ParallelState(ParallelDims(world_size=world, tp=tp, cp=cp))
    switches = dict(switches or {})
    memory = MemoryOptions(attention_tile_size=tile_size, mlp_tile_size=switches.pop("mlp_tile_size", None))
    par_model = parallelize(copy.deepcopy(model), pstate, memory,
                            kernel_options=KernelOptions(attention=attention_backend or "tiled"))
    mode = sparse[pstate.cp_rank] if isinstance(sparse, tuple) else sparse
    par_model.sparse_anchors = mode
    for name, value in switches.items():
        setattr(par_model, name, value)
    counts = None
    local = batch
    if cp > 1:
        local = shard_ttt_batch(batch, cp, pstate.cp_rank)
    loss_K, correct_K, valid_K = forward_backward(par_model, local, n_valid)
    needed = None
    if mode:
        from recipe.model.sparse_anchors import anchor_sets

        needed = anchor_sets(local.valid_KBS, local.position_ids_BS, local.target_row_KS).counts_KB.sum(dim=1)
    if cp > 1:
        counts = dict(vars(par_model.draft.midlayer.self_attn.causal_attention.exchange.counts))
    par = (_sum(loss_K, pstate.cp_group), _sum(correct_K, pstate.cp_group), _sum(valid_K, pstate.cp_group),
           full_grads(par_model, pstate.cp_group, pstate.tp_group))
    return {"ref": (*ref, ref_grads), "par": par, "counts": counts, "cp_rank": pstate.cp_rank,
            "tp_rank": pstate.tp_rank, "local_valid": valid_K, "local_seq": local.position_ids_BS.shape[1],
            "lm_head_shape": tuple(par_model.draft.lm_head.weight.shape), "local_needed": needed,
            "real_positions": int(batch.key_valid_BS.sum())}


def assert_parity(result: dict, rtol: float, label: str) -> int:
    """Loss sums rel ≤ rtol, correct/valid counts exact, every gradient rel ≤ rtol; returns the gradient count."""
    loss_r, correct_r, valid_r, grads_r = result["ref"]
    loss_p, correct_p, valid_p, grads_p = result["par"]
    assert valid_r.min() > 0 and correct_r.sum() > 0, f"{label}: vacuous case (no valid or correct positions)"
    within(max_rel(loss_p, loss_r), rtol, f"{label}: loss {loss_p} vs {loss_r}, rel")
    assert torch.equal(correct_p, correct_r), f"{label}: correct {correct_p} vs {correct_r}"
    assert torch.equal(valid_p, valid_r), f"{label}: valid {valid_p} vs {valid_r}"
    assert grads_p.keys() == grads_r.keys(), f"{label}: parameter names differ"
    for name, g in grads_r.items():
        assert g.abs().max() > 0, f"{label}: reference gradient of {name} is zero (vacuous)"
        within(max_rel(grads_p[name], g), rtol, f"{label}: grad {name} rel")
    return len(grads_r)
