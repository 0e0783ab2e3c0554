"""Per-step activation checkpointing of the draft layer (TTTModel.checkpoint_steps): identical outputs and gradients,
alone, with the chunked loss, and under context parallelism where the recomputation re-runs the ring (cp=2, gloo)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.cases import assert_same_run, build_case, model_pair, run_model, zero3_two_steps
from helpers.ranks import run_ranks
from kernels.ring_attention import make_ring_causal_attention
from kernels.ttt_attention import TTTKVCache
from recipe.model.step_checkpoint import checkpointed_step
from recipe.model.ttt import TTTModel
from helpers.tp_reference import zigzag_unsplit
from helpers.tolerance import FP32_AFTER_ADAM, FP32_REORDERED, max_rel, within
from recipe.parallel.cp_shard import shard_ttt_batch

K = 4


def _assert_identical(got, ref):
    (out, grads, aux_grad), (ref_out, ref_grads, ref_aux_grad) = got, ref
    assert torch.equal(out.loss_sum_K, ref_out.loss_sum_K)
    assert torch.equal(out.correct_K, ref_out.correct_K) and torch.equal(out.valid_K, ref_out.valid_K)
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name, grad in grads.items():
        assert ref_grads[name].abs().sum() > 0, name
        assert torch.equal(grad, ref_grads[name]), name
    assert torch.equal(aux_grad, ref_aux_grad)


@pytest.mark.parametrize("K_steps", [1, K])
def test_checkpointed_steps_give_identical_gradients(K_steps):
    draft, ref_draft, head_VH, batch = model_pair(seed=K_steps, K=K_steps)
    model = TTTModel(draft, head_VH, checkpoint_steps=True, sparse_anchors=False)
    got = run_model(model, batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    _assert_identical(got, ref)


def test_checkpointing_actually_drops_the_layer_activations():
    """Fewer tensors are saved for backward with checkpointing (the attention scores are not among them)."""
    draft, head_VH, batch = build_case(seed=2, K=K)

    def saved_bytes(model):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch)
        return sum(total)

    plain = saved_bytes(TTTModel(draft, head_VH, sparse_anchors=False))
    ckpt = saved_bytes(TTTModel(draft, head_VH, checkpoint_steps=True, sparse_anchors=False))
    assert ckpt < plain / 2, (ckpt, plain)


def test_checkpointed_steps_compose_with_chunked_loss():
    draft, ref_draft, head_VH, batch = model_pair(seed=9, K=K)
    got = run_model(TTTModel(draft, head_VH, loss_chunk_size=4, checkpoint_steps=True, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref)


def test_no_grad_forward_skips_checkpointing_and_matches():
    draft, head_VH, batch = build_case(seed=3, K=K)
    with torch.no_grad():
        a = TTTModel(draft, head_VH, checkpoint_steps=True, sparse_anchors=False)(batch)
        b = TTTModel(draft, head_VH, sparse_anchors=False)(batch)
    assert torch.equal(a.loss_sum_K, b.loss_sum_K) and torch.equal(a.correct_K, b.correct_K)


def test_checkpointed_step_extends_the_callers_cache():
    draft, head_VH, batch = build_case(seed=4, K=2)
    hidden = draft.project_aux(batch.aux_hidden_BSA)
    hidden, cache = checkpointed_step(draft, hidden, batch.input_ids_KBS[0], batch.position_ids_BS,
                                      batch.key_valid_BS, None)
    assert isinstance(cache, TTTKVCache) and cache.num_steps == 1 and cache.block[2] is batch.position_ids_BS
    same, cache = checkpointed_step(draft, hidden, batch.input_ids_KBS[1], batch.position_ids_BS,
                                    batch.key_valid_BS, cache)
    assert cache.num_steps == 2 and len(cache.diag_k) == 1 and same.shape == hidden.shape


CP_SEQ = 16  # a multiple of 2·cp


def _cp_worker(rank, world_size):
    """The same CP model with and without checkpointed steps (ring attention re-run in backward); returns per mode
    (loss sums, correct counts, gradients all-reduced over the ranks, this rank's aux-gradient shard)."""
    group = dist.new_group(list(range(world_size)))
    results = {}
    for checkpoint_steps, chunk in ((False, None), (True, None), (True, 6)):
        draft, head_VH, batch = build_case(seed=21, K=K, seq_len=CP_SEQ, lengths=(CP_SEQ, 11))
        draft.midlayer.self_attn.causal_attention = make_ring_causal_attention(group)
        model = TTTModel(draft, head_VH, loss_chunk_size=chunk, checkpoint_steps=checkpoint_steps, sparse_anchors=False)
        out, grads, aux_grad = run_model(model, shard_ttt_batch(batch, world_size, rank))
        hops = draft.midlayer.self_attn.causal_attention.exchange.counts.kv_hops
        for tensor in [out.loss_sum_K, out.correct_K, out.valid_K, *grads.values()]:
            dist.all_reduce(tensor, group=group)
        results[(checkpoint_steps, chunk)] = (out, grads, aux_grad, hops)
    return results


def _two_rank_worker(rank, world_size):
    return _cp_worker(rank, world_size), _zero3_worker(rank, world_size)


@pytest.fixture(scope="module")
def two_rank_results():
    """Both 2-rank workers in one spawn (process start-up dominates their cost)."""
    return run_ranks(2, _two_rank_worker)


@pytest.mark.slow
def test_checkpointing_under_context_parallel_ring_attention(two_rank_results):
    draft, head_VH, batch = build_case(seed=21, K=K, seq_len=CP_SEQ, lengths=(CP_SEQ, 11))
    ref = run_model(TTTModel(draft, head_VH, sparse_anchors=False), batch)
    ranks = [cp for cp, _ in two_rank_results]
    for mode in ((False, None), (True, None), (True, 6)):
        aux_grad = zigzag_unsplit([r[mode][2] for r in ranks], 2, dim=1)
        out, grads = ranks[0][mode][:2]
        assert_same_run((out, grads, aux_grad), ref)  # ring (blockwise fp32 merges) vs dense, one process
        assert torch.equal(out.valid_K, ref[0].valid_K)
    plain, ckpt = ranks[0][(False, None)], ranks[0][(True, None)]
    _assert_identical(plain[:2] + (zigzag_unsplit([r[(False, None)][2] for r in ranks], 2, dim=1),),
                      ckpt[:2] + (zigzag_unsplit([r[(True, None)][2] for r in ranks], 2, dim=1),))
    # forward K steps + backward K steps, plus K recomputed forwards: the ring really ran again in backward
    assert plain[3] == 2 * K and ckpt[3] == 3 * K


def _zero3_worker(rank, world_size):
    """Two optimizer steps under DeepSpeed ZeRO-3 (parameters partitioned over 2 ranks and re-gathered by ZeRO's
    hooks during the recomputation), plain vs both memory switches; returns the losses and the full parameters."""
    results = {}
    for chunk, ckpt in ((None, False), (4, True)):
        draft, head_VH, batch = build_case(seed=3, K=3)
        model = TTTModel(draft, head_VH, loss_chunk_size=chunk, checkpoint_steps=ckpt, sparse_anchors=False)
        results[(chunk, ckpt)] = zero3_two_steps(model, batch, 3, world_size)
    return results


@pytest.mark.slow
def test_memory_switches_under_deepspeed_zero3(two_rank_results):
    for _, result in two_rank_results:
        (plain_loss, plain_params), (loss, params) = result[(None, False)], result[(4, True)]
        assert not torch.equal(plain_loss[0], plain_loss[1])  # the first step changed the weights
        within(max_rel(loss, plain_loss), FP32_REORDERED, "ZeRO-3 losses")
        for name, value in plain_params.items():
            within(max_rel(params[name], value), FP32_AFTER_ADAM, name)
