"""One home per setting (issue 53): each section of the run JSON is parsed once into its typed object
(``recipe.config.load_sections``), and run.py's set-up (``recipe.train.setup.run_config``) and the planner
(``recipe.plan.load_inputs``) receive those same objects; every default is written once. No processes: the run side
is resolved for a world size as ``build_run`` resolves it, before any group exists."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.training import write_ds_config

import recipe.config
from kernels.registry import DEFAULT_SEQUENCE_PARALLEL
from recipe.config import KernelOptions, RunSections, load_sections
from recipe.config_data import DataOptions
from recipe.config_keys import ConfigError
from recipe.config_memory import CPU_AUTO, FLAG, PLANNED, MemoryOptions
from recipe.parallel.dims import ParallelDims, ParallelismOptions
from recipe.plan import PlanError, load_inputs
from recipe.plan.spec import BenchSpec, planned_sparse, spec_for_memory, spec_memory
from recipe.target.options import TargetOptions
from recipe.train.flags import parse_args
from recipe.train.setup import run_config

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = ROOT / "tests" / "data" / "llama-3.1-8b-instruct"
# kernels that both sides resolve alike (the run resolves for the CPU, the planner for CUDA)
KERNELS = {"attention": "tiled", "compile_small_ops": False}
MEMORY = {"sparse_anchors": "auto", "mlp_tile_size": "auto", "loss_chunk_size": 2048, "argmax_chunk_size": 256}


def _config(tmp_path, cp_size, **memory):
    return write_ds_config(tmp_path / f"ds_cp{cp_size}.json", base="zero3_bf16.json", train_batch_size=None,
                           gradient_accumulation_steps=None, train_micro_batch_size_per_gpu=1,
                           parallelism={"tp_size": 1, "cp_size": cp_size}, kernels=KERNELS,
                           memory={**MEMORY, **memory})


def _run_side(path, world_size, tmp_path, *flags):
    args = parse_args(["--ds_config", str(path), "--target", str(LLAMA_8B), "--hidden-states", str(tmp_path),
                       "--output", str(tmp_path / "out"), *flags])
    return run_config(args, load_sections(path), world_size, torch.device("cpu"))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_config_change_reaches_run_py_and_the_planner_through_the_same_objects(tmp_path, cp_size):
    path = _config(tmp_path, cp_size, teacher_logits_once=cp_size == 4)
    run = _run_side(path, cp_size, tmp_path)
    plan = load_inputs(path, LLAMA_8B, "h200", offline=True)
    assert run.dims == ParallelDims(world_size=cp_size, cp=cp_size, tp=1) and run.dims.cp_enabled
    assert (plan.spec.cp, plan.spec.tp, plan.dp) == (run.dims.cp, run.dims.tp, run.dims.dp) == (cp_size, 1, 1)
    # the memory section as configured, "auto" values intact, on both sides (resolved later, by one rule)
    expected = MemoryOptions(**{**MEMORY, "teacher_logits_once": cp_size == 4})
    assert run.memory == plan.memory == expected
    assert plan.spec.sparse_anchors == "auto" and plan.spec.memory.argmax_chunk_size == 256
    assert run.kernels == plan.kernels == KernelOptions(**KERNELS) and plan.spec.attention_backend == "tiled"
    # --cp-size and the planner's cp override the same field of the same object
    assert _run_side(path, 2, tmp_path, "--cp-size", "1").dims == ParallelDims(world_size=2, cp=1, tp=1, dp=2)
    assert load_inputs(path, LLAMA_8B, "h200", cp=1, offline=True).spec.cp == 1


def test_each_section_is_parsed_once_per_read(tmp_path, monkeypatch):
    """The planner and run.py's set-up each read the JSON once: every section's parser runs once, nothing re-reads
    a key of the dict downstream."""
    calls = []

    def spy(cls, name):
        original = getattr(cls, name).__func__

        def wrapper(klass, *a, **k):
            calls.append(f"{cls.__name__}.{name}")
            return original(klass, *a, **k)

        monkeypatch.setattr(cls, name, classmethod(wrapper))

    for cls, name in ((ParallelismOptions, "from_section"), (MemoryOptions, "pop_from"), (KernelOptions, "pop_from"),
                      (TargetOptions, "from_section"), (DataOptions, "pop_from")):
        spy(cls, name)
    reads = []
    real_read = recipe.config.read_ds_config
    monkeypatch.setattr(recipe.config, "read_ds_config", lambda path: reads.append(path) or real_read(path))
    path = _config(tmp_path, 2)
    parsers = sorted(["ParallelismOptions.from_section", "MemoryOptions.pop_from", "KernelOptions.pop_from",
                      "TargetOptions.from_section", "DataOptions.pop_from"])
    load_inputs(path, LLAMA_8B, "h200", offline=True)
    assert sorted(calls) == parsers and reads == [path]
    calls.clear(), reads.clear()
    _run_side(path, 2, tmp_path)
    assert sorted(calls) == parsers and reads == [path]


def test_sparse_anchors_auto_is_decided_by_the_run_rule_in_the_planner():
    """"auto" reaches the planned step intact; the step decides it for its batch with the model's own rule
    (``sparse_pays``): a fully supervised batch dense, a long prompt with a short answer sparse where that pays."""
    spec = spec_for_memory(BenchSpec(seq_len=4096, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                                     draft_vocab=512, vocab=640, target_hidden=64, ttt_steps=3),
                           MemoryOptions(sparse_anchors="auto:h200", attention_tile_size=256))
    assert spec.sparse_anchors == "auto:h200" and spec.memory.sparse_anchors == "auto:h200"
    assert planned_sparse(spec) is False  # every position supervised: the dense path, as the run computes it
    assert planned_sparse(dataclasses.replace(spec, mask="long10")) is True
    assert planned_sparse(dataclasses.replace(spec, sparse_anchors=True)) is True
    assert spec_memory(spec).sparse_anchors == "auto:h200" and spec_memory(spec).attention_tile_size == 256
    assert BenchSpec(**dataclasses.asdict(spec)) == spec  # as the benchmarks hand a spec to their ranks


def test_defaults_are_written_once():
    """Each section's defaults are its dataclass's: an absent section parses to the dataclass defaults, the CPU's
    "auto" is those defaults, and the sequence-split default is one constant."""
    sections = _sections_of({"train_batch_size": 1})
    assert sections.parallelism == ParallelismOptions() and sections.memory == MemoryOptions()
    assert sections.kernels == KernelOptions() and sections.target == TargetOptions()
    assert sections.data == DataOptions()
    assert ParallelismOptions().dims(1) == ParallelDims(world_size=1) and ParallelismOptions().world_size == 1
    defaults = {f.name: f.default for f in dataclasses.fields(MemoryOptions)}
    assert CPU_AUTO == {k: defaults[k] for k in PLANNED}
    assert KernelOptions().sequence_parallel == DEFAULT_SEQUENCE_PARALLEL == "ring"
    literal = '"ring"'
    holders = sorted(str(f.relative_to(ROOT)) for root in ("recipe", "kernels") for f in (ROOT / root).rglob("*.py")
                     if any(literal in line and "=" in line.split(literal)[0] and "register" not in line
                            for line in f.read_text().splitlines()))
    assert holders == ["kernels/registry.py"]


def _sections_of(cfg: dict) -> RunSections:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ds.json"
        path.write_text(json.dumps(cfg))
        return load_sections(path)


def test_a_new_memory_switch_is_one_field_and_its_consumer():
    """A switch added as one field (with its kind) is validated by the section's parser and reaches the model the
    planner traces (``spec_memory``) without another edit."""
    extended = dataclasses.make_dataclass(
        "ExtendedMemory", [("new_switch", bool, dataclasses.field(default=False, metadata=FLAG))],
        bases=(MemoryOptions,), frozen=True)
    assert extended.pop_from({"memory": {"new_switch": True}}, "x.json").new_switch is True
    with pytest.raises(ConfigError, match=r"x.json: 'memory.new_switch' must be true or false, got 'yes'"):
        extended.pop_from({"memory": {"new_switch": "yes"}}, "x.json")
    spec = spec_for_memory(BenchSpec(seq_len=64), extended(new_switch=True, sparse_anchors=False))
    assert spec_memory(spec).new_switch is True


def test_the_parallelism_section_is_validated_in_one_place(tmp_path):
    with pytest.raises(ValueError, match=r"'parallelism.cp_size' must be an integer >= 1, got 0"):
        ParallelismOptions(cp_size=0)
    with pytest.raises(ConfigError, match=r"'parallelism.tp_size' must be an integer >= 1, got '2'"):
        _sections_of({"train_batch_size": 1, "parallelism": {"tp_size": "2"}})
    sections = _sections_of({"train_batch_size": 2, "parallelism": {"cp_size": 2, "dp_size": 2}})
    assert sections.resolve().dims == ParallelDims(world_size=4, cp=2, dp=2)  # the section's own world size
    with pytest.raises(ConfigError, match="must equal world_size"):
        sections.resolve(2)
    with pytest.raises(PlanError, match="must equal world_size"):
        load_inputs(write_ds_config(tmp_path / "ds.json", parallelism={"dp_size": 2}), LLAMA_8B, world_size=3)
