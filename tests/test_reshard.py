"""Resume on another layout (``recipe.lifecycle.reshard``): a checkpoint written on any (world size, dp, tp, cp, ZeRO
stage) continues on any other with the same global batch, data, seed and settings.

Real SmolLM2 store (``real_store``), fp32, gloo, global batch 4, the shipped warm-up/cosine schedule and clipping,
6 steps; each chain is stopped by SIGTERM after a step (a checkpoint of that step) and resumed with ``--resume`` on
the next layout:

- ``z3tp2-z1dp2-z0``: ZeRO-3 tp2·dp2 on 4 ranks → (step 2) ZeRO-1 dp2 on 2 ranks → (step 4) one process, ZeRO-0;
- ``z2dp2-z3tp2cp2``: ZeRO-2 dp2 on 2 ranks → (step 3) ZeRO-3 tp2·cp2 on 4 ranks;
- ``cp2-cp1``: ZeRO-3 cp2 on 2 ranks → (step 3) ZeRO-3 cp1, one process.

Every chain's losses and grad norms equal the uninterrupted one-process ZeRO-0 run's at rel ≤ ``FP32_CURVE`` per
step (``helpers.tolerance``; step 1 at ``FP32_REORDERED``), its learning rates and accuracies exactly, and its final
export equals that run's export within ``FP32_AFTER_ADAM`` of each tensor's largest value. Those bounds are the
layouts' own disagreement, not resharding's: straight
(never resumed) 6-step runs at ZeRO-1 dp2 and ZeRO-3 cp2 differ from the reference by 1.0-1.3e-5 in grad norm from
step 4 on (Adam's first updates are nearly lr·sign(g), so summation-order noise in tiny gradient entries moves
whole updates), in loss by ≤ 6.7e-7, and the chains measure the same: ≤ 1.0e-6 in loss, ≤ 1.8e-5 in grad norm,
exports within 6.1e-6 (torch 2.13 CPU). A wrong Adam step, moment, master or learning rate after a switch moves
the next loss by orders of magnitude more. Each switch is announced in the run plan, and a checkpoint without the
layout-free state (a run whose optimizer is not Adam writes none) is refused on another layout with a message
naming its own layout. Runs of one world size share one process launch; the chains advance together (4 + 2 + 1 ranks, then
2 + 4, then 1).
"""
from __future__ import annotations

import json
import shutil

import pytest

from helpers.faults import Job, run_jobs
from helpers.ranks import run_ranks
from helpers.training import ROOT, assert_curves_close
from helpers.tolerance import FP32_AFTER_ADAM, FP32_CURVE, within
from recipe.lifecycle.manifest import MANIFEST, manifest_dict
from recipe.lifecycle.reshard import TRAIN_STATE_FILE

pytestmark = pytest.mark.slow  # DeepSpeed training on 1, 2 and 4 ranks with the real target's hidden states

STEPS = 6
# chain -> [(ds_config base, world, tp, cp, SIGTERM after this step or None: run to the end)]
CHAINS = {
    "z3tp2-z1dp2-z0": [("zero3.json", 4, 2, 1, 2), ("zero1.json", 2, 1, 1, 4), ("zero0.json", 1, 1, 1, None)],
    "z2dp2-z3tp2cp2": [("zero2.json", 2, 1, 1, 3), ("zero3.json", 4, 2, 2, None)],
    "cp2-cp1": [("zero3.json", 2, 1, 2, 3), ("zero3.json", 1, 1, 1, None)],
}
REFERENCE = ("zero0.json", 1, 1, 1, None)
PHASES = [{"z3tp2-z1dp2-z0": 0, "z2dp2-z3tp2cp2": 0, "cp2-cp1": 0, "reference": 0},
          {"z3tp2-z1dp2-z0": 1, "z2dp2-z3tp2cp2": 1}, {"z3tp2-z1dp2-z0": 2, "cp2-cp1": 1}]


def _config(path, base):
    cfg = json.loads((ROOT / "ds_configs" / base).read_text())
    cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=1)
    cfg["optimizer"]["params"]["lr"] = 1e-3
    cfg.pop("parallelism", None)  # the layout comes from the flags
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def chains(real_store, tmp_path_factory):
    """{chain: (metrics.jsonl records, stderr of every stage, output folder)} and the reference's, plus the
    outcome of resuming a checkpoint stripped of its layout-free state on another layout."""
    tmp = tmp_path_factory.mktemp("reshard")
    _, flags = real_store
    stages = {**CHAINS, "reference": [REFERENCE]}
    stderr = {name: [] for name in stages}

    def job(name, index):
        base, world, tp, cp, stop = stages[name][index]
        argv = ["--ds_config", str(_config(tmp / f"{name}-{index}.json", base)), "--output", str(tmp / name),
                *flags, "--max-steps", str(STEPS), "--tp-size", str(tp), "--cp-size", str(cp),
                *(["--resume"] if index else [])]
        return world, Job(argv, sigterm_after=stop)

    stripped = None
    for number, phase in enumerate(PHASES):
        by_world: dict[int, list] = {}
        for name, index in phase.items():
            world, j = job(name, index)
            by_world.setdefault(world, []).append((name, j))
        if number == 2:  # the cp2 checkpoint of step 3 without layout-free state (a run whose optimizer is not
            old = tmp / "old" / "checkpoints"  # Adam writes none), its manifest listing what is there
            shutil.copytree(tmp / "cp2-cp1" / "checkpoints", old)
            step3 = old / "step-00000003"
            (step3 / TRAIN_STATE_FILE).unlink()
            (step3 / MANIFEST).write_text(json.dumps(manifest_dict(step3.name, folder=step3), indent=2))
            _, j = job("cp2-cp1", 1)
            argv = list(j.argv)
            argv[argv.index("--output") + 1] = str(tmp / "old")
            by_world[1].append(("old", Job(argv)))
        for world, named in by_world.items():
            outcomes = run_ranks(world, run_jobs, [j for _, j in named])[0]
            for (name, _), outcome in zip(named, outcomes):
                if name == "old":
                    stripped = outcome
                    continue
                expected = 0 if stages[name][phase[name]][4] is None else 75
                assert outcome.rc == expected, (name, phase[name], outcome.rc, outcome.stderr[-3000:])
                stderr[name].append(outcome.stderr)
    out = {name: ([json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()],
                  stderr[name], tmp / name) for name in stages}
    return out, stripped


@pytest.mark.parametrize("name", list(CHAINS))
def test_resharded_chain_continues_the_straight_curve(chains, name):
    runs, _ = chains
    ref, _, _ = runs["reference"]
    records, stderr, _ = runs[name]
    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_curves_close(ref, records, FP32_CURVE, name)  # also: accuracies, tokens, samples exactly
    assert [r["lr"] for r in records] == [r["lr"] for r in ref]  # the schedule carried over
    for index in range(1, len(CHAINS[name])):  # each switch said so in the run plan, naming both layouts
        before, after = CHAINS[name][index - 1], CHAINS[name][index]
        line = (f"resuming a tp{before[2]} cp{before[3]} dp{before[1] // (before[2] * before[3])} "
                f"ZeRO-{before[0][4]} float32 ({before[1]} rank{'s' if before[1] > 1 else ''}) checkpoint on "
                f"tp{after[2]} cp{after[3]} dp{after[1] // (after[2] * after[3])} ZeRO-{after[0][4]} float32 "
                f"({after[1]} rank{'s' if after[1] > 1 else ''}): resharding")
        assert line in " ".join(stderr[index].split()), (name, index, line)


@pytest.mark.parametrize("name", list(CHAINS))
def test_resharded_chain_exports_the_straight_weights(chains, name):
    from recipe.export import check_export, load_export

    runs, _ = chains
    ref_tensors, _ = load_export(runs["reference"][2] / "export")
    export = runs[name][2] / "export"
    assert check_export(export) == []
    tensors, _ = load_export(export)
    assert sorted(tensors) == sorted(ref_tensors)
    for key, ref in ref_tensors.items():
        if ref.is_floating_point():
            scale = ref.abs().max().item()
            within((tensors[key] - ref).abs().max().item() / scale, FP32_AFTER_ADAM, f"{name} export {key}")
        else:
            assert (tensors[key] == ref).all(), (name, key)


def test_checkpoint_without_layout_free_state_is_refused_on_another_layout(chains):
    _, stripped = chains
    assert stripped.rc == 2, stripped.stderr[-2000:]
    text = " ".join(stripped.stderr.split())
    assert f"has no {TRAIN_STATE_FILE} (written by an earlier version" in text
    assert "resume it on its own layout, tp1 cp2 dp1 ZeRO-3 float32 (2 ranks)" in text
