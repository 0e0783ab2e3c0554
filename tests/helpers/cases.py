"""Small random TTT problems (draft, target head, padded batch) of a given geometry, and the forward+backward and
comparison helpers of the memory-switch tests.

Two geometries: ``MEMORY`` (vocab 100, draft vocab 8, rows of 13 and 9 tokens) for the memory-switch / TTT tests
and ``PARITY`` (vocab 96, draft vocab 64 so the lm_head shards over tp, rows of 19 and 14 tokens, aux hidden states
zero at padding) for the TP / CP parity harness (``helpers.parity``). The same (seed, geometry, lengths) gives the
same tensors for every ``seq_len``: the rows are drawn at their longest length and padded after.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from recipe.data.packing import packed_layout
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.ttt import TTTBatch, TTTModel, make_ttt_batch, target_in_draft_vocab
from helpers.tolerance import FP32_REORDERED, within
from helpers.tp_reference import pad_to_multiple
from recipe.target.head import lm_head_argmax

H, HT = 32, 24  # draft hidden, target hidden


@dataclass(frozen=True)
class CaseGeometry:
    """Sizes of a random case: target vocab V, draft vocab Vd, the draft MLP width, the rows' true lengths (right
    padding after), whether the aux hidden states are zeroed at padding (else random there too), and the position
    chunk of ``lm_head_argmax`` (None: its default chunk)."""

    vocab_size: int
    draft_vocab_size: int
    intermediate_size: int
    lengths: tuple[int, ...]
    mask_padding: bool
    vocab_chunk: int | None

    def draft_config(self) -> Eagle3DraftConfig:
        """hidden 32, 4 heads / 2 KV heads of dim 8, target hidden 24, aux layers [1, 2, 4], RoPE base 500."""
        return Eagle3DraftConfig(hidden_size=H, intermediate_size=self.intermediate_size, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, vocab_size=self.vocab_size,
                                 draft_vocab_size=self.draft_vocab_size, target_hidden_size=HT,
                                 aux_layer_ids=[1, 2, 4], rope_theta=500.0)


MEMORY = CaseGeometry(vocab_size=100, draft_vocab_size=8, intermediate_size=48, lengths=(13, 9), mask_padding=False,
                      vocab_chunk=5)
PARITY = CaseGeometry(vocab_size=96, draft_vocab_size=64, intermediate_size=64, lengths=(19, 14), mask_padding=True,
                      vocab_chunk=None)


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


def build_case(seed: int, K: int, seq_len: int | None = None, lengths: tuple[int, ...] | None = None,
               geometry: CaseGeometry = MEMORY, dtype: torch.dtype = torch.float32,
               packing_tokens: int | None = None):
    """(draft, target head [V, H_t], TTTBatch of K steps) for ``seed``, all floating tensors in ``dtype``.

    Rows of ``lengths`` (default ``geometry.lengths``) are drawn at the longest length: 80% of the real positions
    supervised, random ids, aux [B, S, 3·H_t] and last [B, S, H_t] hidden states from N(0, 1) (aux zero at padding
    when ``geometry.mask_padding``); then padded to ``seq_len`` (default: the longest length). The in-draft-vocab
    flags come from the fp32 hidden states. ``packing_tokens``: the same samples packed into rows of at most that
    many tokens (``recipe.data.packing.packed_layout``, documents isolated: docs/algorithm.md, "Packing"), each row
    padded to ``seq_len`` (default: the longest row). ValueError if ``seq_len`` is shorter than the longest row.
    """
    lengths = geometry.lengths if lengths is None else tuple(lengths)
    b, s = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    draft, head_VH, t2d = random_draft(seed, geometry.draft_config(), g)
    attention = torch.zeros(b, s, dtype=torch.bool)
    for row, n in enumerate(lengths):
        attention[row, :n] = True
    loss_mask = (torch.rand(b, s, generator=g) < 0.8) & attention
    input_ids = torch.randint(0, geometry.vocab_size, (b, s), generator=g) * attention
    aux = torch.randn(b, s, 3 * HT, generator=g)
    if geometry.mask_padding:
        aux = aux * attention[..., None]
    last = torch.randn(b, s, HT, generator=g)
    rows = (attention, loss_mask, input_ids, aux, last)
    documents = None
    if packing_tokens is not None:
        layout = packed_layout(list(lengths), packing_tokens)
        s = layout.seq
        placed = [torch.zeros(layout.rows, s, *t.shape[2:], dtype=t.dtype) for t in rows]
        for p in layout.placements:
            for out, t in zip(placed, rows):
                out[p.row, p.offset:p.offset + p.length] = t[p.slot, :p.length]
        rows, documents = placed, layout.documents()[0]
    seq_len = s if seq_len is None else seq_len
    if seq_len < s:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest row ({s})")
    attention, loss_mask, input_ids, aux, last = (pad_to_multiple(t, seq_len, dim=1) for t in rows)
    if documents is not None:
        documents = pad_to_multiple(documents, seq_len, dim=1, value=int(documents.max()) + 1)
    chunk = {} if geometry.vocab_chunk is None else {"chunk_size": geometry.vocab_chunk}
    in_vocab = target_in_draft_vocab(lm_head_argmax(last, head_VH, **chunk), t2d)
    batch = make_ttt_batch(input_ids, loss_mask, attention, aux.to(dtype), last.to(dtype), in_vocab, K, documents)
    return draft.to(dtype), head_VH.to(dtype), batch


def answer_only(batch: TTTBatch, answers: tuple[int, ...]) -> TTTBatch:
    """``batch`` with its labels kept only where the predicted token is among the last ``answers[b]`` real tokens of
    row b (a long prompt and a short answer; 0: nothing supervised in that row): ``valid[k, b, p] &= p + 2 + k >=
    n_b - answers[b]``, n_b the row's real length (its non-padding keys)."""
    k, b, s = batch.valid_KBS.shape
    if len(answers) != b:
        raise ValueError(f"answer_only: {len(answers)} answer lengths for {b} rows")
    lengths = batch.key_valid_BS.sum(dim=1)
    cut_B = lengths - torch.tensor(answers, dtype=lengths.dtype)
    label_KBS = (batch.position_ids_BS[None] + 2 + torch.arange(k)[:, None, None]).expand(k, b, s)
    keep = label_KBS >= cut_B[None, :, None]
    return TTTBatch(**{**batch.__dict__, "valid_KBS": batch.valid_KBS & keep})


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
    within(((got - ref).norm() / ref.norm()).item(), tol, f"{name}: relative error")


def assert_same_run(got, ref, tol: float = FP32_REORDERED) -> None:
    """Two ``run_model`` results agree: loss sums and every gradient within relative error ``tol`` (default: the same
    function in another summation order, ``helpers.tolerance``), correct/valid counts exactly (integer counts of
    argmax matches: a flip needs two logits within ~1e-6 relative of each other)."""
    (out, grads, aux_grad), (ref_out, ref_grads, ref_aux_grad) = got, ref
    assert_rel_close(out.loss_sum_K, ref_out.loss_sum_K, tol, "loss_sum_K")
    assert torch.equal(out.correct_K, ref_out.correct_K) and torch.equal(out.valid_K, ref_out.valid_K)
    assert ref_out.correct_K.sum() > 0 and ref_out.valid_K.min() > 0  # not vacuous
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name, grad in grads.items():
        assert_rel_close(grad, ref_grads[name], tol, name)
    assert_rel_close(aux_grad, ref_aux_grad, tol, "aux_hidden_BSA")


def zero3_two_steps(model: TTTModel, batch: TTTBatch, K: int, world_size: int, stage: int = 3):
    """Two AdamW steps (lr 1e-2) of ``model`` on ``batch`` under DeepSpeed ZeRO (``stage``, default 3), one
    micro-batch per rank; returns (losses [2] fp32, {name: full parameter} gathered after the second step)."""
    import deepspeed

    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = []
    for _ in range(2):
        out = engine(batch)
        loss = (step_weights(K).float() * out.loss_sum_K).sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return torch.stack(losses), params
