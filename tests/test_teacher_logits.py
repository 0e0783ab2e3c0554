"""Teacher (target) logits computed once per micro-batch vs recomputed in every TTT step: bitwise-equal loss, counts
and every gradient, and the head matmul really runs once (or per step / per chunk where it must stream)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recipe.model.ttt import TTTModel, teacher_logits
from helpers.cases import model_pair, run_model


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


def _assert_identical(got, ref):
    (out, grads, aux_grad), (ref_out, ref_grads, ref_aux_grad) = got, ref
    assert ref_out.valid_K.min() > 0 and ref_out.loss_sum_K.abs().min() > 0  # not vacuous
    assert torch.equal(out.loss_sum_K, ref_out.loss_sum_K)
    assert torch.equal(out.correct_K, ref_out.correct_K) and torch.equal(out.valid_K, ref_out.valid_K)
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    assert torch.equal(aux_grad, ref_aux_grad)


@pytest.mark.parametrize("K, checkpoint_steps", [(1, False), (3, False), (5, True)])
def test_teacher_logits_once_is_bitwise_equal_to_per_step(K, checkpoint_steps):
    draft, ref_draft, head_VH, batch = model_pair(seed=21 + K, K=K)
    once = TTTModel(draft, head_VH, checkpoint_steps=checkpoint_steps)
    per_step = TTTModel(ref_draft, head_VH, checkpoint_steps=checkpoint_steps)
    per_step.teacher_logits_once = False
    assert once.teacher_logits_once  # the default
    _assert_identical(run_model(once, batch), run_model(per_step, batch))


@pytest.mark.parametrize("once, chunk, expected", [(True, None, lambda k, n: 1), (False, None, lambda k, n: k),
                                                   (True, 5, lambda k, n: k * n)])
def test_head_matmul_runs_once_unless_the_loss_streams(once, chunk, expected):
    """Once per micro-batch by default; K times when switched off; per chunk and step with the chunked loss."""
    K = 3
    draft, _, head_VH, batch = model_pair(seed=3, K=K)
    model = TTTModel(draft, head_VH, loss_chunk_size=chunk)
    model.teacher_logits_once = once
    n_chunks = -(-batch.valid_KBS[0].numel() // chunk) if chunk else 1
    with _HeadMatmuls(model.target_head_d) as counter:
        model(batch)
    assert counter.count == expected(K, n_chunks)


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
        torch.testing.assert_close(logits_BUV[:, index_KS[k]], ref, rtol=0, atol=1e-12)
