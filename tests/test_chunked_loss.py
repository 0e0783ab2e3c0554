"""Chunked TTT loss (recipe.model.chunked_loss) vs the plain full-logits path: forward and every gradient, on one
process and under tensor parallelism (tp=2, gloo)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.cases import assert_rel_close, assert_same_run, build_case, model_pair, run_model
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_REORDERED
from recipe.model.chunked_loss import chunked_soft_ce
from recipe.model.loss import soft_ce
from recipe.model.ttt import TTTModel
from recipe.parallel.apply_tp import apply_tensor_parallel
from recipe.parallel.tp_layers import gather_tensor

K = 3


@pytest.mark.parametrize("chunk", [1, 5, 26, 1000])  # B·S = 26: single positions, uneven last chunk, exact, oversize
def test_chunked_loss_matches_full_logits(chunk):
    draft, ref_draft, head_VH, batch = model_pair(seed=chunk, K=K)
    got = run_model(TTTModel(draft, head_VH, loss_chunk_size=chunk, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref)


def test_chunked_soft_ce_matches_soft_ce_including_target_logits_gradient_free():
    g = torch.Generator().manual_seed(0)
    b, s, h, ht, vd = 2, 7, 6, 5, 11
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(vd, h, generator=g, requires_grad=True)
    target_hidden = torch.randn(b, s + 2, ht, generator=g)
    row_S = torch.randint(0, s + 2, (s,), generator=g)
    head = torch.randn(vd, ht, generator=g)
    valid = torch.rand(b, s, generator=g) < 0.7
    loss, correct = chunked_soft_ce(lambda x: x @ weight.T, soft_ce, hidden, target_hidden, row_S, head, valid, 4)
    ref_loss, ref_correct = soft_ce(hidden @ weight.T, target_hidden[:, row_S] @ head.T, valid)
    assert_rel_close(loss, ref_loss, FP32_REORDERED, "loss")
    assert correct.dtype == torch.int64 and torch.equal(correct, ref_correct)
    grads = torch.autograd.grad(loss, [hidden, weight])
    ref_grads = torch.autograd.grad(ref_loss, [hidden, weight])
    for got, ref, name in zip(grads, ref_grads, ("hidden", "weight")):
        assert_rel_close(got, ref, FP32_REORDERED, name)


def test_bad_chunk_sizes_raise():
    draft, head_VH, batch = build_case(seed=0, K=1)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_size"):
            TTTModel(draft, head_VH, loss_chunk_size=bad, sparse_anchors=False)
    with pytest.raises(ValueError, match="loss chunk size 0"):
        chunked_soft_ce(draft.logits, soft_ce, torch.zeros(1, 2, 32), torch.zeros(1, 2, 24),
                        torch.zeros(2, dtype=torch.int64), torch.zeros(8, 24), torch.ones(1, 2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_soft_ce(draft.logits, soft_ce, torch.zeros(1, 2, 32), torch.zeros(1, 2, 24),
                        torch.zeros(3, dtype=torch.int64), torch.zeros(8, 24), torch.ones(1, 2, dtype=torch.bool), 1)


TP_CASES = [(5, False), (7, True)]  # (loss chunk size, checkpoint_steps)


def _tp_worker(rank, world_size):
    """Every TP case on this rank; per case the outputs and the FULL gradients (shards gathered in rank order)."""
    group = dist.new_group(list(range(world_size)))
    results = []
    for chunk, checkpoint_steps in TP_CASES:
        draft, head_VH, batch = build_case(seed=5, K=K)
        model = apply_tensor_parallel(TTTModel(draft, head_VH, loss_chunk_size=chunk,
                                               checkpoint_steps=checkpoint_steps, sparse_anchors=False), group)
        assert model.draft.lm_head.weight.shape[0] == 8 // world_size  # really vocab-parallel
        out, grads, aux_grad = run_model(model, batch)
        params = dict(model.named_parameters())
        full = {name: gather_tensor(grad, params[name].partition_dim, group)
                if getattr(params[name], "tensor_model_parallel", False) else grad for name, grad in grads.items()}
        results.append((out, full, aux_grad))
    return results


@pytest.mark.slow
def test_chunked_loss_under_tensor_parallelism_matches_single_process():
    """tp=2 with the vocab-parallel lm_head and loss, chunked (with and without step checkpointing) vs one process
    with full logits."""
    draft, head_VH, batch = build_case(seed=5, K=K)
    ref = run_model(TTTModel(draft, head_VH, sparse_anchors=False), batch)
    for rank_results in run_ranks(2, _tp_worker):
        assert len(rank_results) == len(TP_CASES)
        for got in rank_results:
            assert_same_run(got, ref)
