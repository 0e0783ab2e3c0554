"""Teacher (target) logits computed once per micro-batch vs recomputed in every TTT step: the same loss, counts and
every gradient (``helpers.tolerance.FP32_REORDERED``), and the head matmul really runs once (or per step / per chunk
where it must stream)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recipe.model.ttt import TTTModel
from recipe.model.ttt_steps import teacher_logits
from helpers.cases import assert_same_run, model_pair, run_model
from helpers.tolerance import FP64_REORDERED, assert_close_rel


class _HeadMatmuls(TorchDispatchMode):
    """Counts matrix products that read the given weight's storage (the target head rows)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.ptr, self.count = weight.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in args):
                self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("K, checkpoint_steps", [(1, False), (3, False), (5, True)])
def test_teacher_logits_once_matches_per_step(K, checkpoint_steps):
    """The same teacher rows from one matmul over the U distinct rows or from K matmuls over S rows each: a BLAS may
    block a matmul by its row count (so not bitwise by construction), the same function to ``FP32_REORDERED``."""
    draft, ref_draft, head_VH, batch = model_pair(seed=21 + K, K=K)
    once = TTTModel(draft, head_VH, checkpoint_steps=checkpoint_steps, sparse_anchors=False)
    per_step = TTTModel(ref_draft, head_VH, checkpoint_steps=checkpoint_steps, sparse_anchors=False)
    per_step.teacher_logits_once = False
    assert once.teacher_logits_once  # the default
    assert_same_run(run_model(once, batch), run_model(per_step, batch))


def _distinct_rows(batch) -> int:
    return int(torch.unique(batch.target_row_KS).numel())


@pytest.mark.parametrize("once, chunk", [(True, None), (False, None), (True, 5), (False, 5)])
def test_head_matmul_calls_per_micro_batch_forward_and_backward(once, chunk, monkeypatch):
    """The target head's matmul per micro-batch (forward, then forward + backward): once over the U distinct rows by
    default; K times when switched off; with the chunked loss once per chunk of rows (⌈B·U / c⌉ calls, none in the
    backward recompute), or, streamed, per chunk and step in the forward and again in the backward (the previous
    chunked path: 2·K·⌈B·S / c⌉)."""
    import recipe.model.chunked_loss as chunked_loss

    K = 3
    draft, _, head_VH, batch = model_pair(seed=3, K=K)
    model = TTTModel(draft, head_VH, loss_chunk_size=chunk, teacher_logits_once=once, sparse_anchors=False)
    calls = []
    real = chunked_loss.target_logits
    monkeypatch.setattr(chunked_loss, "target_logits", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    b, s = batch.valid_KBS.shape[1:]
    rows_per_pass = b * _distinct_rows(batch) if once else K * b * s  # teacher rows one forward computes
    if chunk is None:
        n_chunks = 1 if once else K
    else:  # the table's row chunks, or every step's position chunks
        n_chunks = -(-rows_per_pass // chunk) if once else K * -(-b * s // chunk)
    backward_reruns = 0 if once or chunk is None else n_chunks  # the streamed chunks' recompute
    with _HeadMatmuls(model.target_head_d) as counter:
        out = model(batch)
        forward_count = counter.count
        (out.loss_sum_K * torch.arange(1.0, K + 1)).sum().backward()
    assert forward_count == n_chunks and counter.count == n_chunks + backward_reruns
    if chunk is not None:  # every chunk's matmul goes through target_logits (monkeypatched count, row counts)
        assert len(calls) == counter.count and sum(calls) == rows_per_pass * (2 if backward_reruns else 1)
    assert draft.lm_head.weight.grad is not None and draft.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk, checkpoint_steps, sparse", [(5, False, False), (7, True, False), (4, False, True),
                                                              (1000, True, True)])
def test_chunked_teacher_once_matches_the_unchunked_and_the_streamed_chunked_path(chunk, checkpoint_steps, sparse):
    """fp32: the chunked loss reading the teacher table equals the unchunked path and the chunked path that
    recomputes the teacher rows per chunk and step (the previous one): loss sums and every gradient within 1e-5
    relative (the same function, sums in another order), counts exactly."""
    from helpers.cases import build_case

    K = 4
    runs = {}
    for name, kw in {"once": dict(loss_chunk_size=chunk), "streamed": dict(loss_chunk_size=chunk,
                                                                          teacher_logits_once=False),
                     "unchunked": {}}.items():
        draft, head_VH, batch = build_case(seed=40 + chunk, K=K)
        model = TTTModel(draft, head_VH, checkpoint_steps=checkpoint_steps, sparse_anchors=sparse, **kw)
        runs[name] = run_model(model, batch)
    assert_same_run(runs["once"], runs["unchunked"])
    assert_same_run(runs["once"], runs["streamed"])


def test_teacher_logits_indexes_the_distinct_rows():
    g = torch.Generator().manual_seed(0)
    b, L, ht, vd = 2, 11, 5, 7
    hidden_BLH = torch.randn(b, L, ht, generator=g, dtype=torch.float64)
    head = torch.randn(vd, ht, generator=g, dtype=torch.float64)
    rows_KS = torch.stack([torch.tensor([0, 1, 2, 8, 9, 10]) + k for k in range(3)]).clamp(max=L - 1)
    logits_BUV, index_KS = teacher_logits(hidden_BLH.float(), rows_KS, head)
    assert logits_BUV.shape == (b, len(set(rows_KS.flatten().tolist())), vd) and logits_BUV.dtype == head.dtype
    assert index_KS.shape == rows_KS.shape and index_KS.dtype == torch.int64
    for k in range(3):
        ref = hidden_BLH.float().double()[:, rows_KS[k]] @ head.T
        assert_close_rel(logits_BUV[:, index_KS[k]], ref, FP64_REORDERED, f"step {k}")
