"""Small random TTT problems (draft, target head, batch) for the memory-switch tests; any sequence length."""
from __future__ import annotations

import copy

import torch

from recipe.model.draft import Eagle3Draft, Eagle3DraftConfig
from recipe.model.target_head import lm_head_argmax
from recipe.model.ttt import TTTBatch, TTTModel, make_ttt_batch, target_in_draft_vocab

V, VD, H, HT = 100, 8, 32, 24


def tiny_config(**kw) -> Eagle3DraftConfig:
    base = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT, aux_layer_ids=[1, 2, 4], rope_theta=500.0)
    base.update(kw)
    return Eagle3DraftConfig(**base)


def random_draft(seed: int, config: Eagle3DraftConfig, g: torch.Generator):
    """(draft, target head [V, H_t], t2d): a draft of ``config`` initialised from ``seed`` with embeddings and lm_head
    redrawn larger from ``g`` (so the soft CE is far from uniform), a random sorted vocab map, and a target head whose
    draft-id rows are scaled up so most target argmaxes fall in the draft vocab."""
    v, vd = config.vocab_size, config.draft_vocab_size
    draft = Eagle3Draft(config, seed=seed)
    draft.embed_tokens.weight.data.normal_(0, 1.0, generator=g)
    draft.lm_head.weight.data.normal_(0, 0.3, generator=g)
    ids = torch.sort(torch.randperm(v, generator=g)[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(vd), t2d)
    head_VH = torch.randn(v, config.target_hidden_size, generator=g)
    head_VH[ids] *= 3.0
    return draft, head_VH, t2d


def build_case(seed: int, K: int, seq_len: int = 13, lengths=(13, 9), dtype=torch.float32):
    """A draft with a random vocab map, the full target head [V, H_t] and a padded TTT batch (rows of ``lengths``)."""
    g = torch.Generator().manual_seed(seed)
    draft, head_VH, t2d = random_draft(seed, tiny_config(), g)
    b = len(lengths)
    attention = torch.zeros(b, seq_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        attention[row, :n] = True
    loss_mask = (torch.rand(b, seq_len, generator=g) < 0.8) & attention
    input_ids = torch.randint(0, V, (b, seq_len), generator=g) * attention
    aux = torch.randn(b, seq_len, 3 * HT, generator=g)
    last = torch.randn(b, seq_len, HT, generator=g)
    in_vocab = target_in_draft_vocab(lm_head_argmax(last, head_VH, chunk_size=5), t2d)
    batch = make_ttt_batch(input_ids, loss_mask, attention, aux, last, in_vocab, K)
    return draft.to(dtype), head_VH.to(dtype), batch


def step_weights(K: int) -> torch.Tensor:
    """A distinct positive weight per TTT step, so each step's gradient counts separately."""
    return torch.rand(K, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5


def run_model(model: TTTModel, batch: TTTBatch, weights_K: torch.Tensor | None = None):
    """Forward + backward of ``Σ_k w_k · loss_sum_k``; returns (output, {param name: grad}, aux grad)."""
    aux = batch.aux_hidden_BSA.clone().requires_grad_(True)
    out = model(TTTBatch(**{**batch.__dict__, "aux_hidden_BSA": aux}))
    weights_K = step_weights(out.loss_sum_K.shape[0]) if weights_K is None else weights_K
    (weights_K.to(out.loss_sum_K.dtype) * out.loss_sum_K).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return out, grads, aux.grad.detach().clone()


def model_pair(seed: int, K: int, **kw):
    """(draft, head, batch) and a deep copy of the draft, for a switched model vs the plain one."""
    draft, head_VH, batch = build_case(seed, K, **kw)
    return draft, copy.deepcopy(draft), head_VH, batch


def assert_rel_close(got: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "") -> None:
    """``‖got − ref‖ / ‖ref‖ <= tol`` (relative error of the whole tensor; elementwise rtol fails on entries that
    are sums with cancellation, whose absolute error is set by the tensor's scale), and the shapes/dtypes agree."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, ref.shape, got.dtype, ref.dtype)
    assert ref.norm() > 0, f"{name}: reference is zero, the comparison would be vacuous"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= tol, f"{name}: relative error {rel:.3g} > {tol:g}"


def assert_same_run(got, ref, tol: float = 1e-6) -> None:
    """Two ``run_model`` results agree: loss sums and every gradient within relative error ``tol``, counts exactly."""
    (out, grads, aux_grad), (ref_out, ref_grads, ref_aux_grad) = got, ref
    assert_rel_close(out.loss_sum_K, ref_out.loss_sum_K, tol, "loss_sum_K")
    assert torch.equal(out.correct_K, ref_out.correct_K) and torch.equal(out.valid_K, ref_out.valid_K)
    assert ref_out.correct_K.sum() > 0 and ref_out.valid_K.min() > 0  # not vacuous
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name, grad in grads.items():
        assert_rel_close(grad, ref_grads[name], tol, name)
    assert_rel_close(aux_grad, ref_aux_grad, tol, "aux_hidden_BSA")
