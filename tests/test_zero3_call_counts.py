"""Equal module-call counts over the ZeRO group (``recipe.model.call_extent``, ``TTTBatch.call_extent``): ZeRO-3
gathers a parameter collectively at every call of its module, and the chunked loss and the tiled MLP call per piece
of the rank's own padded length, which differs between data-parallel ranks. With the group's extent on the batch a
shorter rank makes exactly the longer rank's calls (dense and sparse anchors), its dense numbers bitwise unchanged;
the builder computes the extent from every dp rank's sample lengths alone; two dp ranks padded to different lengths
train under ZeRO-3 like ZeRO-1 (model level: losses and gradients) and like the single process (``run.py`` with
validation)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.cases import assert_rel_close, assert_same_run, build_case, run_model
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_CURVE, FP32_REORDERED, max_rel, within

from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.model.call_extent import CallExtent
from recipe.model.ttt import TTTModel
from recipe.parallel.cp_shard import shard_ttt_batch
from recipe.parallel.parallelize import parallelize

K = 3
SHORT, LONG = {"seq_len": 16}, {"seq_len": 24, "lengths": (21, 17)}  # MEMORY geometry rows of 13 and 9 tokens
EXTENT = CallExtent.of([(2, 16), (2, 24)])  # the longer rank's S = 24 and B·S = 48


def _model(draft, head_VH, sparse, chunk=5, tile=5):
    model = TTTModel(draft, head_VH, loss_chunk_size=chunk, checkpoint_steps=True, sparse_anchors=sparse)
    parallelize(model, None, MemoryOptions(attention_tile_size=4, mlp_tile_size=tile),
                kernel_options=KernelOptions("sdpa"))
    return model


def _counted_run(sparse, batch_kw, extent=None):
    """``run_model`` (forward + backward, step checkpointing: recomputations count too) of one case, with the calls
    of ``lm_head`` and of the MLP counted; returns (result, (lm_head calls, MLP calls))."""
    draft, head_VH, batch = build_case(seed=8, K=K, **batch_kw)
    if extent is not None:
        batch = dataclasses.replace(batch, call_extent=extent)
    model = _model(draft, head_VH, sparse)
    calls = {"lm_head": 0, "mlp": 0}
    for name, module in (("lm_head", model.draft.lm_head), ("mlp", model.draft.midlayer.mlp)):
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    return run_model(model, batch), (calls["lm_head"], calls["mlp"])


@pytest.mark.parametrize("sparse", [False, True])
def test_a_shorter_rank_makes_the_longer_ranks_calls(sparse):
    _, long_calls = _counted_run(sparse, LONG)
    alone, short_calls = _counted_run(sparse, SHORT)
    assert short_calls != long_calls  # the mismatch ZeRO-3 cannot survive (its collectives pair up wrongly)
    widened, calls = _counted_run(sparse, SHORT, EXTENT)
    assert calls == long_calls
    # the longer rank with its own extent stated: nothing changes
    _, stated_calls = _counted_run(sparse, LONG, EXTENT)
    assert stated_calls == long_calls
    if not sparse:  # dense: its own chunks and tiles, then empty ones adding exact zeros (a left fold of the chunk
        # sums and autograd's accumulation: x + 0 = x), so the same operations on the same values: bitwise
        (out, grads, aux), (ref_out, ref_grads, ref_aux) = widened, alone
        assert torch.equal(out.loss_sum_K, ref_out.loss_sum_K) and torch.equal(aux, ref_aux)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    else:  # sparse: as many near-equal pieces as the longer dense path cuts, float summation order apart
        assert_same_run(widened, alone)


def test_call_extent_checks_and_shards():
    assert EXTENT == CallExtent(24, 48)
    assert CallExtent.of([(2, 16), (1, 40)]) == CallExtent(40, 40)  # the longest S and the largest B·S
    assert CallExtent.of([(2, 16), (1, 24)], cp_size=2) == CallExtent(12, 16)
    with pytest.raises(ValueError, match="multiple of cp=2"):
        CallExtent.of([(2, 15)], cp_size=2)
    with pytest.raises(ValueError, match="shapes"):
        CallExtent.of([])
    _, _, batch = build_case(seed=8, K=K, **LONG)
    with pytest.raises(ValueError, match=r"call_extent \(16, 32\) .* smaller than the batch's own \(24, 48\)"):
        dataclasses.replace(batch, call_extent=CallExtent(16, 32))
    shard = shard_ttt_batch(dataclasses.replace(batch, call_extent=CallExtent(32, 64)), 2, 1)
    assert shard.call_extent == CallExtent(16, 32) and shard.input_ids_KBS.shape[-1] == 12


def test_builder_extent_is_the_largest_padded_micro_batch(tiny_target_and_store):
    """``BatchBuilder.call_extent`` from the sample lengths alone equals the largest shape the builder pads to."""
    from recipe.data.store import HiddenStateStore
    from recipe.data.vocab import VocabMap
    from recipe.parallel.dims import ParallelDims
    from recipe.train.batches import BatchBuilder

    _, store_dir = tiny_target_and_store
    t2d = VocabMap.from_draft_ids(torch.arange(0, 96, 2), 96).t2d
    groups = [[0, 3], [5], [7, 2]]
    for cp in (1, 2):
        builder = BatchBuilder(store=HiddenStateStore(store_dir), t2d=t2d, ttt_steps=K, seq_divisor=2 * cp,
                               dims=ParallelDims(cp, cp=cp), cp_rank=cp - 1)
        shapes = [builder.build(ix).ttt.input_ids_KBS.shape[1:] for ix in groups]
        extent = builder.call_extent(groups)
        assert len({s for _, s in shapes}) > 1  # the ranks pad differently
        assert extent == (max(s for _, s in shapes), max(b * s for b, s in shapes))
        assert builder.build(groups[1], extent=extent).ttt.call_extent == extent
    # online: the lengths of the tokenised examples (no target forward needed for the extent)
    from types import SimpleNamespace

    from helpers.tiny_target import random_chats

    examples = random_chats(8)
    online = BatchBuilder(examples=examples, target=SimpleNamespace(device=torch.device("cpu")), t2d=t2d, ttt_steps=K,
                          seq_divisor=4)
    n = [len(examples[i]["input_ids"]) for i in range(8)]
    padded = [-(-max(n[i] for i in ix) // 4) * 4 for ix in groups]
    assert online.call_extent(groups + [[]]) == (max(padded), max(len(ix) * p for ix, p in zip(groups, padded)))


def _steps(model, batch, stage: int, world: int):
    """Two AdamW steps (lr 1e-2) under ZeRO ``stage``; returns (losses [2], {name: full averaged gradient of the
    first step}, read with DeepSpeed's ``safe_get_full_grad`` before its optimizer step)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from helpers.cases import step_weights

    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses, grads = [], None
    for _ in range(2):
        loss = (step_weights(K).float() * engine(batch).loss_sum_K).sum()
        engine.backward(loss)
        if grads is None:
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def _zero_worker(rank, world):
    """Two AdamW steps over 2 dp ranks whose micro-batches are padded to 16 and 24, chunked loss and tiled MLP, under
    ZeRO-1 (dense: the reference) and ZeRO-3 (dense, sparse and one rank on each path); every batch carries the
    group's extent."""
    results = {}
    for stage, sparse in ((1, False), (3, False), (3, True), (3, "mixed")):
        draft, head_VH, batch = build_case(seed=8, K=K, **(SHORT if rank == 0 else LONG))
        batch = dataclasses.replace(batch, call_extent=EXTENT)
        mode = (rank == 0) if sparse == "mixed" else sparse
        results[(stage, sparse)] = _steps(_model(draft, head_VH, mode), batch, stage, world)
    return results


@pytest.mark.slow
def test_zero3_with_ranks_of_different_lengths_matches_zero1():
    """Before the extent, ZeRO-3 failed here (gloo: "Received data size doesn't match expected size"). Compared: both
    steps' losses and every averaged gradient of the first step (rel ≤ ``FP32_REORDERED``), which decide the weights;
    not the weights after AdamW, whose g/sqrt(v) amplifies gradient differences on near-zero entries."""
    for rank, result in enumerate(run_ranks(2, _zero_worker)):
        ref_loss, ref_grads = result[(1, False)]
        assert not torch.equal(ref_loss[0], ref_loss[1]) and len(ref_grads) == 13  # the first step moved the weights
        for stage, sparse in ((3, False), (3, True), (3, "mixed")):
            loss, grads = result[(stage, sparse)]
            within(max_rel(loss, ref_loss), FP32_REORDERED, f"rank {rank}, ZeRO-{stage}, sparse {sparse}: loss")
            assert grads.keys() == ref_grads.keys()
            for name, value in ref_grads.items():
                label = f"rank {rank}, ZeRO-{stage}, sparse {sparse}: {name}"
                assert_rel_close(grads[name], value, FP32_REORDERED, label)


@pytest.mark.slow
def test_training_zero3_with_chunks_and_tiles_matches_one_process(tiny_target_and_store, tmp_path):
    """``run.py`` offline, fp32, 3 steps of 4 samples with validation: ZeRO-3 over 2 dp ranks (each micro-batch of one
    sample padded to its own length) with the chunked loss and the tiled MLP, dense and ``sparse_anchors`` "auto",
    equals the single process (4 micro-batches) in loss, grad norm, accuracies and the evaluation."""
    from helpers.training import assert_curves_close, run_training, train_argv, write_ds_config

    target, store = tiny_target_and_store
    memory = {"loss_chunk_size": 4, "mlp_tile_size": 4, "checkpoint_ttt_steps": True}

    def argv(name, base, sparse):
        cfg = write_ds_config(tmp_path / f"{name}.json", base=base, train_batch_size=4,
                              train_micro_batch_size_per_gpu=1, scheduler=None,
                              memory={**memory, "sparse_anchors": sparse})
        return train_argv(cfg, target, store, tmp_path / name, "--max-steps", "3", "--no-export",
                          "--eval-fraction", "0.25", "--eval-every", "2")

    (ref,) = run_ranks(1, run_training, [argv("ref", "zero0.json", False)])[0]
    dense, auto = run_ranks(2, run_training, [argv("dense", "zero3.json", False),
                                              argv("auto", "zero3.json", "auto")])[0]
    train = [r for r in ref if "eval" not in r]
    assert len(train) == 3 and len(ref) == 5  # 3 steps and 2 evaluations
    for label, run in (("ZeRO-3 dense", dense), ("ZeRO-3 auto", auto)):
        assert_curves_close(train, [r for r in run if "eval" not in r], FP32_CURVE, label)
        evals = [r["eval"] for r in run if "eval" in r]
        assert len(evals) == 2
        for a, b in zip([r["eval"] for r in ref if "eval" in r], evals):
            within(abs(a["loss"] - b["loss"]) / a["loss"], FP32_CURVE, f"{label} validation loss")
            assert a["valid"] == b["valid"], label
