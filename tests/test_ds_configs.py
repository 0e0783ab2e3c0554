"""Every shipped ``ds_configs/*.json`` resolves at its intended world size, through the recipe's own config
resolution (``recipe.config.load_run_config``: our sections, unknown keys, layout, batch plan) and then DeepSpeed's
own parser (``DeepSpeedConfig``: batch arithmetic over its data-parallel world dp·cp, ZeRO, bf16), hands DeepSpeed
neither the recipe's own sections nor a ``_comment``-style key, and says in its name what it selects. A new file is
covered by the glob. The one place the shipped configs are tested. No process group, no model: a few seconds.

Intended world size: ``_world_size`` where the file states it (the recipes for real targets), else tp·cp (dp = 1),
or 2 for the demo's config (the demo trains on 2 ranks).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recipe.config import load_run_config
from recipe.config_keys import OUR_SECTIONS, ConfigError
from recipe.config_memory import PLANNED

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))


class _Mpu:
    """What ``DeepSpeedConfig`` asks of an mpu: its data-parallel world (the recipe's dp·cp)."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


def intended_world(path: Path, raw: dict) -> int:
    if "_world_size" in raw:
        return int(raw["_world_size"])
    if path.name.startswith("demo"):
        return 2
    section = raw.get("parallelism") or {}
    return int(section.get("tp_size", 1)) * int(section.get("cp_size", 1))


def _underscore_keys(tree, where: str = "") -> list[str]:
    """The dotted names of every key of ``tree`` (nested dicts) that starts with ``_``."""
    if not isinstance(tree, dict):
        return []
    return [f"{where}{k}" for k in tree if k.startswith("_")] + [
        name for k, v in tree.items() for name in _underscore_keys(v, f"{where}{k}.")]


def deepspeed_parse(ds_dict: dict, dp_cp: int, monkeypatch):
    """DeepSpeed's parser on the dict the recipe hands ``deepspeed.initialize``, with a data-parallel world of
    ``dp_cp`` (its ``dist.get_rank`` answers 0 without a process group)."""
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    return ds_config.DeepSpeedConfig(json.loads(json.dumps(ds_dict)), mpu=_Mpu(dp_cp))


def test_every_config_is_found():
    names = {p.name for p in CONFIGS}
    assert {"target8b_32k_8gpu.json", "target8b_128k_8gpu.json", "target70b_32k_16gpu.json", "zero0.json",
            "demo_zero1.json"} <= names and len(names) >= 18


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_resolves_at_its_world_size(path, monkeypatch):
    raw = json.loads(path.read_text())
    world = intended_world(path, raw)
    run = load_run_config(path, world).with_total_steps(1000)
    dims, plan = run.dims, run.plan
    assert "zero_optimization" in run.deepspeed and "optimizer" in run.deepspeed
    assert not set(OUR_SECTIONS) & set(run.deepspeed)  # parallelism, memory, kernels, target: read by the recipe
    assert not _underscore_keys(run.deepspeed)  # "_comment" and the like are dropped at every depth
    section = raw.get("parallelism") or {}
    assert (dims.tp, dims.cp) == (section.get("tp_size", 1), section.get("cp_size", 1))
    assert dims.dp * dims.tp * dims.cp == world
    assert plan.global_batch == raw["train_batch_size"] == plan.micro_batch * plan.grad_accum * plan.dp
    ds = deepspeed_parse(run.deepspeed_config(), dims.dp * dims.cp, monkeypatch)
    assert ds.train_batch_size == plan.global_batch * dims.cp  # DeepSpeed's view: dp·cp data-parallel ranks
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (plan.micro_batch, plan.grad_accum)
    stage = raw["zero_optimization"]["stage"]
    assert ds.zero_optimization_stage == stage
    assert ds.bfloat16_config.enabled == run.bf16 == bool((raw.get("bf16") or {}).get("enabled"))
    name = path.stem
    if m := re.match(r"zero(\d)", name):
        assert int(m.group(1)) == stage
    for axis, size in (("tp", dims.tp), ("cp", dims.cp)):
        if m := re.search(rf"_{axis}(\d)", name):
            assert int(m.group(1)) == size
    assert ("bf16" in name) <= run.bf16
    if "_world_size" in raw:  # the recipes for real targets: bf16, documented
        assert run.bf16 and len(raw["_comment"]) > 200 and f"--ds_config ds_configs/{path.name}" in raw["_comment"]
        assert name.endswith(f"_{world}gpu")
    if run.bf16:  # every bf16 config leaves its memory trade-offs to the planner at start (recipe.config_memory)
        assert set(run.memory.auto_switches) == set(PLANNED), name


def test_a_broken_batch_is_refused_by_both_checks(tmp_path, monkeypatch):
    """The checks above can fail: a global batch the layout cannot split, and a dict DeepSpeed's own arithmetic
    refuses."""
    raw = json.loads((ROOT / "ds_configs" / "target8b_32k_8gpu.json").read_text())
    raw["train_batch_size"] = 12  # 12 samples over dp 8 at micro 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="not divisible"):
        load_run_config(bad, 8)
    good = load_run_config(ROOT / "ds_configs" / "target8b_32k_8gpu.json", 8).with_total_steps(10).deepspeed_config()
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_parse({**good, "train_batch_size": 17}, 8, monkeypatch)
