"""Shared set-up for end-to-end training tests (the tiny target and its store: ``helpers.tiny_target``): DeepSpeed
configs derived from the shipped ones, ``run.py`` argv, and a worker that runs ``run.main`` on every rank of a gloo
group."""
from __future__ import annotations

import json
from pathlib import Path

from helpers.tolerance import FP32_REORDERED, within

ROOT = Path(__file__).resolve().parents[2]  # the repository


def write_ds_config(path: Path, base: str = "zero0.json", **changes) -> Path:
    """A copy of ``ds_configs/<base>`` with top-level keys replaced (``None`` removes a key)."""
    cfg = json.loads((ROOT / "ds_configs" / base).read_text())
    cfg["optimizer"]["params"]["lr"] = 5e-3  # large steps: a layout bug shows up within a few steps
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


def train_argv(ds_config: Path, target: Path, store: Path, output: Path, *extra: str) -> list[str]:
    return ["--ds_config", str(ds_config), "--target", str(target), "--hidden-states", str(store),
            "--output", str(output), "--draft-vocab-size", "64", "--ttt-steps", "3", "--seed", "0",
            "--lm-head-init", "random", *extra]


def run_training(rank: int, world_size: int, argvs: list[list[str]]) -> list[list[dict]]:
    """``run_ranks`` worker: run ``run.main`` once per argv (sequentially, same process group); rank 0 returns the
    metrics.jsonl records of each run."""
    import sys

    sys.path.insert(0, str(ROOT))
    from run import main

    out = []
    for argv in argvs:
        rc = main(argv)
        assert rc == 0, f"run.py exited with {rc} for {argv}"
        output = Path(argv[argv.index("--output") + 1])
        out.append([json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
                   if rank == 0 else [])
    return out


def assert_curves_close(ref: list[dict], other: list[dict], rtol: float, label: str,
                        keys=("loss", "grad_norm")) -> None:
    """Two metrics.jsonl curves of the same run in another layout or order of sums: per step, each of ``keys``
    within relative ``rtol`` (``helpers.tolerance.FP32_CURVE`` for float32 runs), except step 1's, which come
    from the same initial weights and so are held to ``FP32_REORDERED`` (the smaller bound wins); accuracies
    within 1e-9 (ratios of integer argmax counts: equal unless an argmax flips); token, sample and valid counts
    exactly."""
    assert len(ref) == len(other), f"{label}: {len(other)} steps vs {len(ref)}"
    for a, b in zip(ref, other):
        bound = min(rtol, FP32_REORDERED) if a["step"] == 1 else rtol
        for key in keys:
            x, y = a[key], b[key]
            assert x is not None and y is not None, f"{label}: step {a['step']} {key} missing"
            within(abs(x - y) / abs(x) if x else abs(y), bound, f"{label}: step {a['step']} {key} {y!r} vs {x!r}, rel")
        for k, (x, y) in enumerate(zip(a["acc"], b["acc"])):
            assert abs(x - y) <= 1e-9, f"{label}: step {a['step']} acc_{k} {y} vs {x}"
        assert a["tokens"] == b["tokens"] and a["samples"] == b["samples"] and a["valid"] == b["valid"], label
