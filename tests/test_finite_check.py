"""The training step agrees the finite flag of its micro-batches ONCE per optimizer step (the collectives counted
through a wrapped ``Collectives``), after the last forward: a non-finite loss stops before the optimizer step, and
``--skip-nonfinite`` (one micro-batch per step) leaves the engine untouched. ``Trainer.train_step`` runs with a
stand-in engine on 2 gloo ranks over the tiny store.
"""
from __future__ import annotations

import pytest

from helpers.ranks import run_ranks
from test_host_syncs import K, TILE, _builder, _model

from recipe.model.flops import DraftShape
from recipe.train.metrics import StepSpeed


class FakeEngine:
    """The slice of DeepSpeed's engine the loop's step uses; records forward/backward/step calls."""

    def __init__(self, model, grad_accum):
        self.module, self.grad_accum, self.micro, self.calls = model, grad_accum, 0, []

    def __call__(self, batch):
        self.calls.append("forward")
        return self.module(batch)

    def backward(self, loss):
        self.calls.append("backward")
        loss.backward()

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.grad_accum == 0

    def step(self):
        self.calls.append("optimizer_step" if self.is_gradient_accumulation_boundary() else "micro_step")
        self.micro += 1

    def zero_optimization_stage(self):
        return 1

    def bfloat16_enabled(self):
        return False

    def get_global_grad_norm(self):
        return 0.0


def _loop_worker(rank, world_size, store_dir, output, grad_accum, nan_sample, skip):
    from types import SimpleNamespace

    from kernels.tiled_attention import TiledCausalAttention
    from recipe.parallel.collectives import Collectives
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.topology import ParallelState
    from recipe.train import loop
    from recipe.train.sampler import StepSampler

    class CountingComm(Collectives):
        def __init__(self, device):
            super().__init__(device)
            self.sums = []

        def sum(self, values, group=None):
            self.sums.append((tuple(values.shape), str(values.dtype).removeprefix("torch."),
                              values.device == self.device))
            return super().sum(values, group)

    dims = ParallelDims(world_size=world_size)
    pstate = ParallelState(dims)
    pstate.comm = CountingComm(pstate.device)
    builder = _builder(store_dir)
    if nan_sample is not None:
        build = builder.build

        def build_nan(indices, *args):
            micro = build(indices, *args)
            if nan_sample in indices:  # the whole micro-batch: some row of it has valid positions
                micro.ttt.aux_hidden_BSA.fill_(float("nan"))
            return micro
        builder.build = build_nan
    micro_batch = 2
    plan = SimpleNamespace(micro_batch=micro_batch, grad_accum=grad_accum)
    trainer = object.__new__(loop.Trainer)
    trainer.settings = loop.TrainSettings(output=output, ttt_steps=K, max_length=64, seed=0, skip_nonfinite=skip)
    trainer.parts = SimpleNamespace(sampler=StepSampler(len(builder), micro_batch * grad_accum * world_size, 0),
                                    builder=builder)
    trainer.config = SimpleNamespace(dims=dims, plan=plan)
    trainer.pstate = pstate
    trainer.engine = FakeEngine(_model(store_dir, TiledCausalAttention(TILE)), grad_accum)
    trainer.speed = StepSpeed(DraftShape.of_config(trainer.engine.module.draft.config, K), None, world_size, None,
                              builder.sample_lengths)
    trainer.step = 0
    out = []
    for _ in range(2):
        pstate.comm.sums.clear()
        trainer.engine.calls.clear()
        try:
            record = trainer.train_step()
            error = None
        except loop.NonFiniteLossError as exc:
            record, error = None, str(exc)
        out.append({"sums": list(pstate.comm.sums), "calls": list(trainer.engine.calls), "error": error,
                    "record": record, "indices": trainer.parts.sampler.step_indices(trainer.step)})
        if error is not None:
            break
        trainer.step += 1
    return out


def _flag_sums(sums):
    return [s for s in sums if s[1] == "int32"]


@pytest.mark.slow  # spawns 2 gloo ranks
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_finite_check_is_agreed_once_per_step(tiny_target_and_store, tmp_path, grad_accum):
    _, store_dir = tiny_target_and_store
    for rank, steps in enumerate(run_ranks(2, _loop_worker, str(store_dir), tmp_path, grad_accum, None, False)):
        assert len(steps) == 2
        for s in steps:
            assert s["error"] is None and s["record"]["loss"] == s["record"]["loss"]
            # one flag table [world, micro-batches] per step, whatever grad_accum; 4 sums per step in all
            assert _flag_sums(s["sums"]) == [((2, grad_accum), "int32", True)], s["sums"]
            assert len(s["sums"]) == 4 and all(on_device for *_, on_device in s["sums"])
            assert s["calls"] == ["forward", "backward", "micro_step"] * (grad_accum - 1) + [
                "forward", "backward", "optimizer_step"]


@pytest.mark.slow  # spawns 2 gloo ranks
def test_nonfinite_first_micro_batch_stops_before_the_optimizer_step(tiny_target_and_store, tmp_path):
    from recipe.train.sampler import StepSampler, rank_micro_batches

    _, store_dir = tiny_target_and_store
    first = StepSampler(24, 8, 0).step_indices(0)
    nan_sample = rank_micro_batches(first, 2, 2, 2, 1)[0][0]  # rank 1's first micro-batch of step 1
    results = run_ranks(2, _loop_worker, str(store_dir), tmp_path, 2, nan_sample, False)
    for steps in results:
        (s,) = steps
        assert "non-finite loss at step 1 (micro-batch 0) on rank(s) [1]" in s["error"], s["error"]
        assert f"{nan_sample}" in s["error"].split("samples")[1]
        assert len(_flag_sums(s["sums"])) == 1
        # micro-batch 0 back-propagated (a non-boundary step), the check after the last forward stopped the rest
        assert s["calls"] == ["forward", "backward", "micro_step", "forward"]


@pytest.mark.slow  # spawns 2 gloo ranks
def test_skip_nonfinite_leaves_the_engine_untouched(tiny_target_and_store, tmp_path):
    from recipe.train.sampler import StepSampler, rank_micro_batches

    _, store_dir = tiny_target_and_store
    nan_sample = rank_micro_batches(StepSampler(24, 4, 0).step_indices(0), 2, 1, 2, 0)[0][1]
    for steps in run_ranks(2, _loop_worker, str(store_dir), tmp_path, 1, nan_sample, True):
        skipped, after = steps
        assert "non-finite loss at step 1 (micro-batch 0) on rank(s) [0]" in skipped["record"]["skipped"]
        assert skipped["calls"] == ["forward"]  # no backward, no optimizer step
        assert after["calls"] == ["forward", "backward", "optimizer_step"] and "loss" in after["record"]
