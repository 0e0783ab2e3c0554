"""The kernel seams (``kernels.registry``): an attention backend and a sequence-split strategy registered here, in
this file only, are accepted by the config check, recorded in ``run_config.json``, built by the run's factory, traced
by the planner and trained with through ``run.py``; unregistered, the config check refuses them naming the field and
the registered choices. The dummy backend is the dense reference math (``DENSE_KERNEL``'s forward and backward)
behind a call counter, so every number it gives must equal the ``tiled`` backend's exactly."""
from __future__ import annotations

import dataclasses
import json

import pytest
from helpers.ranks import run_ranks
from helpers.training import run_training, train_argv, write_ds_config

from kernels.attention_backends import backend_names, make_causal_attention, resolve_attention_backend
from kernels.registry import (AttentionBackend, BlockKernel, attention_backend, SequenceSplit, register_attention_backend,
                              register_sequence_parallel, sequence_parallel_names, unregister_attention_backend,
                              unregister_sequence_parallel)
from kernels.tiled_attention import DENSE_KERNEL, TiledCausalAttention
from recipe.config import ConfigError, load_run_config
from recipe.plan.spec import BenchSpec
from recipe.plan.trace import fake_world, trace_step, traced_backend

CALLS = {"forward": 0, "backward": 0}
SMALL = dict(hidden=64, heads=2, kv_heads=2, head_dim=32, intermediate=128, draft_vocab=64, vocab=96,
             target_hidden=32)
"""A small draft geometry for the traces."""


def _forward(*args):
    CALLS["forward"] += 1
    return DENSE_KERNEL.forward(*args)


def _backward(*args):
    CALLS["backward"] += 1
    return DENSE_KERNEL.backward(*args)


DUMMY = AttentionBackend("dummy", lambda: BlockKernel("dummy", _forward, _backward))
"""Runs anywhere, never ``auto``'s choice, tiled: ``TiledCausalAttention(tile_size, <the counting kernel>)``."""


def _dummy_split(backend, tile_size, device, group):
    return ("dummy-split", backend.name, tile_size, group)


@pytest.fixture
def dummy_backend():
    register_attention_backend(DUMMY)
    CALLS.update(forward=0, backward=0)
    yield DUMMY
    unregister_attention_backend("dummy")


@pytest.fixture
def dummy_split():
    register_sequence_parallel(SequenceSplit("dummy_split", _dummy_split))
    yield
    unregister_sequence_parallel("dummy_split")


def _config(tmp_path, **kernels):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train_batch_size": 1, "kernels": kernels}))
    return load_run_config(path, world_size=1)


def test_a_registered_backend_is_accepted_resolved_built_and_recorded(tmp_path, dummy_backend):
    assert backend_names() == ("tiled", "sdpa", "flex", "dummy")
    config = _config(tmp_path, attention="dummy").for_device("cpu")
    assert config.record()["kernels"] == {"attention": "dummy", "sequence_parallel": "ring", "compile_small_ops": False}
    assert resolve_attention_backend("dummy", "cuda") == "dummy" and resolve_attention_backend("auto", "cpu") != "dummy"
    attention = make_causal_attention("dummy", 16, "cpu")
    assert isinstance(attention, TiledCausalAttention) and attention.kernel.name == "dummy" and attention.tile_size == 16


def test_an_unregistered_backend_is_refused_naming_the_field_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"run.json: 'kernels.attention' must be one of "
                                          r"\['auto', 'tiled', 'sdpa', 'flex'\], got 'dummy'"):
        _config(tmp_path, attention="dummy")


def test_the_planner_traces_a_registered_backend_as_the_tiled_one_it_wraps(dummy_backend):
    spec = BenchSpec(seq_len=64, ttt_steps=2, attention_tile=32, attention_backend="dummy", **SMALL)
    assert traced_backend(spec) == "dummy"
    dummy = trace_step(spec)
    assert CALLS["forward"] > 0 and CALLS["backward"] > 0  # the trace went through the registered kernel
    tiled = trace_step(dataclasses.replace(spec, attention_backend="tiled"))
    assert (dummy.step_bytes, dummy.peak_bytes, dummy.base_bytes) == (tiled.step_bytes, tiled.peak_bytes,
                                                                      tiled.base_bytes)
    assert dummy.step_bytes > 0


def test_one_auto_rule_for_run_and_planner():
    for device, traced in (("cpu", "tiled"), ("cuda", "flex")):  # sdpa is traced as its tiles (traced_as)
        spec = BenchSpec(seq_len=64, attention_backend="auto", device=device)
        resolved = resolve_attention_backend("auto", device)  # the run's choice (RunConfig.for_device)
        assert traced_backend(spec) == (attention_backend(resolved).traced_as or resolved) == traced


def test_a_registered_sequence_split_is_accepted_recorded_and_built(tmp_path, dummy_split):
    assert sequence_parallel_names() == ("ring", "dummy_split")
    config = _config(tmp_path, sequence_parallel="dummy_split")
    assert config.kernels.sequence_parallel == "dummy_split"
    assert config.for_device("cpu").record()["kernels"]["sequence_parallel"] == "dummy_split"
    with pytest.raises(ConfigError, match=r"run.json: 'kernels.sequence_parallel' must be one of "
                                          r"\['ring', 'dummy_split'\], got 'ulysses'"):
        _config(tmp_path, sequence_parallel="ulysses")
    with fake_world(1, 2) as pstate:  # a cp group of two ranks on PyTorch's fake process group
        built = make_causal_attention("tiled", 8, "cpu", pstate.cp_group, "dummy_split")
        assert built == ("dummy-split", "tiled", 8, pstate.cp_group)
        assert type(make_causal_attention("tiled", 8, "cpu", pstate.cp_group)).__name__ == "RingCausalAttention"
        assert make_causal_attention("tiled", 8, "cpu", None, "dummy_split").kernel is DENSE_KERNEL  # one rank


def test_an_unregistered_sequence_split_is_refused(tmp_path):
    assert _config(tmp_path).kernels.sequence_parallel == "ring"
    with pytest.raises(ConfigError, match=r"'kernels.sequence_parallel' must be one of \['ring'\], got 'dummy_split'"):
        _config(tmp_path, sequence_parallel="dummy_split")
    with pytest.raises(ValueError, match=r"unknown sequence-parallel strategy 'x'; registered: \['ring'\]"):
        with fake_world(1, 2) as pstate:
            make_causal_attention("tiled", 8, "cpu", pstate.cp_group, "x")


def _train_with_dummy(rank, world_size, argvs):
    """``run_training`` with the dummy backend registered in this rank's process; also its kernel's call counts."""
    register_attention_backend(DUMMY)
    return run_training(rank, world_size, argvs), dict(CALLS)


@pytest.mark.slow
def test_run_py_trains_with_a_registered_backend_exactly_as_with_the_one_it_wraps(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    argvs = []
    for name in ("tiled", "dummy"):
        cfg = write_ds_config(tmp_path / f"{name}.json", train_batch_size=4, train_micro_batch_size_per_gpu=2,
                              kernels={"attention": name}, memory={"attention_tile_size": 8})
        argvs.append(train_argv(cfg, target, store, tmp_path / name, "--max-steps", "2", "--no-export"))
    (tiled, dummy), calls = run_ranks(1, _train_with_dummy, argvs)[0]
    assert calls["forward"] > 0 and calls["backward"] > 0
    assert len(dummy) == len(tiled) == 2
    for a, b in zip(tiled, dummy):
        assert (a["loss"], a["grad_norm"], a["acc"], a["valid"]) == (b["loss"], b["grad_norm"], b["acc"], b["valid"])
    recorded = json.loads((tmp_path / "dummy" / "run_config.json").read_text())["kernels"]
    assert recorded == {"attention": "dummy", "sequence_parallel": "ring", "compile_small_ops": False}
