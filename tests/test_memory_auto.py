"""The memory section's "auto" (recipe.config_memory.MemoryOptions.resolve): the documented order on given device
sizes, explicit values untouched, the CPU's defaults, the measured sparse/dense table of sparse_anchors "auto", the
planner's facts, and a run.py run with the switches "auto" equal bit for bit to the same run with the resolved values
written explicitly."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config

from recipe.config_memory import AUTO_LOSS_CHUNK, AUTO_MLP_TILE, CPU_AUTO, PLANNED, MemoryOptions
from recipe.model.sparse_anchors import (AUTO_SPARSE_SHARE, SPARSE_TIME_RATIOS, needed_share, sparse_pays,
                                         sparse_time_ratio)

AUTO = {key: "auto" for key in PLANNED}
COST = {"checkpoint_ttt_steps": 10, "loss_chunk_size": 20, "teacher_logits_once": 40, "mlp_tile_size": 80}
SAVES = {"checkpoint_ttt_steps": 30, "loss_chunk_size": 40, "teacher_logits_once": 10, "mlp_tile_size": 15}


@dataclass
class Facts:
    """A run whose switches add FLOPs (``COST``) and save bytes (``SAVES``) independently, from a peak of 100."""

    length: int = 8192
    rank_tokens: int = 8192
    predicted: list = field(default_factory=list)

    def hardware_flops(self, memory: MemoryOptions) -> int:
        return 1000 + sum(COST[k] for k in memory.savings())

    def peak_bytes(self, memory: MemoryOptions) -> int:
        self.predicted.append(memory.savings())
        return 100 - sum(SAVES[k] for k in memory.savings())


ON = {"ckpt": "checkpoint_ttt_steps", "chunk": "loss_chunk_size", "teacher": "teacher_logits_once",
      "mlp": "mlp_tile_size"}


def on(*names: str) -> frozenset:
    return frozenset(ON[n] for n in names)


@pytest.mark.parametrize("budget, chosen, rejected", [
    (100, on(), None),  # a small run: nothing to recompute
    (75, on("ckpt"), on()),  # longer: step checkpointing (70), the cheapest saving
    (35, on("ckpt", "chunk"), on("chunk")),  # longer still: + the chunked loss (30); chunk alone (60) did not fit
    (25, on("ckpt", "chunk", "teacher"), on("chunk", "teacher")),  # + the teacher table off (20)
    (12, on("ckpt", "chunk", "teacher", "mlp"), on("chunk", "teacher", "mlp")),  # every saving (5)
])
def test_auto_takes_the_cheapest_candidate_that_fits(budget, chosen, rejected):
    """Candidates in hardware-FLOP order (ladder order on ties); the first that fits wins, the one before it is the
    rejected alternative."""
    memory, report = MemoryOptions(**AUTO).resolve(Facts(), "NVIDIA H100 80GB HBM3", budget)
    assert memory.savings() == chosen and memory.resolved and report.rule == "planned" and report.fits
    assert report.predicted_peak_bytes == 100 - sum(SAVES[k] for k in chosen) <= budget
    assert (None if report.rejected is None else MemoryOptions(**report.rejected["switches"]).savings()) == rejected
    if rejected is not None:
        assert report.rejected["predicted_peak_bytes"] > budget
    flops = [c["hardware_flops"] for c in report.candidates]
    assert flops == sorted(flops) and len(flops) == 12  # 2 ckpt × (chunk: 2 teacher, none: 1) × 2 mlp
    assert memory.attention_tile_size == 1024 and memory.sparse_anchors == "auto:h200"
    assert memory.loss_chunk_size == (AUTO_LOSS_CHUNK if "loss_chunk_size" in chosen else None)
    assert memory.mlp_tile_size == (AUTO_MLP_TILE if "mlp_tile_size" in chosen else None)


def test_nothing_fits_takes_the_least_memory_after_one_prediction():
    facts = Facts()
    memory, report = MemoryOptions(**AUTO).resolve(facts, "cuda", 4)
    assert memory.savings() == on("ckpt", "chunk", "teacher", "mlp") and not report.fits
    assert facts.predicted == [memory.savings()] and report.rejected is None
    assert "does not fit" in report.line()


def test_explicit_values_are_kept_and_limit_the_candidates():
    explicit = MemoryOptions(checkpoint_ttt_steps=False, loss_chunk_size="auto", teacher_logits_once="auto",
                             mlp_tile_size="auto", attention_tile_size=256)
    memory, report = explicit.resolve(Facts(), "cuda", 35)
    assert memory.checkpoint_ttt_steps is False and memory.attention_tile_size == 256
    assert memory.savings() == on("chunk", "teacher", "mlp")  # 100 - 65; without checkpointing the cheapest fit
    assert all(c["switches"]["checkpoint_ttt_steps"] is False for c in report.candidates)
    assert all(c["switches"]["attention_tile_size"] == 256 for c in report.candidates)
    every = MemoryOptions(loss_chunk_size=512, checkpoint_ttt_steps=True, sparse_anchors=True)
    facts = Facts()
    resolved, report = every.resolve(facts, "cuda", 0)  # nothing to plan: no prediction, no change
    assert resolved == every and report.rule == "explicit" and facts.predicted == []
    chunked = MemoryOptions(**{**AUTO, "loss_chunk_size": None})  # an unchunked loss never turns the teacher off
    assert all(c.teacher_logits_once is True for c in chunked.candidates(8192))


def test_the_cpu_keeps_todays_defaults():
    """No free memory to plan against: "auto" is what an absent key is (CPU_AUTO), so CPU runs do not change."""
    memory, report = MemoryOptions(**AUTO).resolve(None, "cpu", None)
    assert memory == dataclasses.replace(MemoryOptions(), sparse_anchors="auto:cpu") and report.rule == "cpu"
    assert CPU_AUTO == {k: getattr(MemoryOptions(), k) for k in PLANNED}
    assert "the defaults" in report.line()
    with pytest.raises(ValueError, match="without the run's facts"):
        MemoryOptions(**AUTO).resolve(None, "cuda", 10)


def test_short_runs_do_not_offer_mlp_tiles_and_unresolved_switches_are_refused():
    assert all(c.mlp_tile_size is None for c in MemoryOptions(**AUTO).candidates(AUTO_MLP_TILE))
    assert MemoryOptions(**AUTO).most_saving().savings() == on("ckpt", "chunk", "teacher", "mlp")
    with pytest.raises(ValueError, match="still \"auto\""):
        MemoryOptions(**AUTO).check_resolved()
    from recipe.parallel.parallelize import build_training_model

    with pytest.raises(ValueError, match="still \"auto\""):
        build_training_model(None, None, MemoryOptions(checkpoint_ttt_steps="auto"), None)


# ---- sparse_anchors "auto": the measured table ------------------------------------------------------------------
MEASURED = {"cpu": ["step_sparse_cpu_2k.json", "step_sparse_cpu_8k.json"],
            "h200": ["gpu/step_sparse_gpu_2026-12-04.json"]}


def test_the_sparse_time_table_is_the_measured_one():
    """Every ratio of SPARSE_TIME_RATIOS is a committed benchmark's sparse_vs_dense (2 decimals), and every share the
    needed share of its mask (recipe.plan.spec.supervised_mask, K = 7) at that length."""
    from recipe.model.ttt import make_ttt_batch
    from recipe.plan.spec import supervised_mask

    for kind, files in MEASURED.items():
        rows = [r for f in files for r in json.loads((ROOT / "docs" / "results" / f).read_text())["summary"]
                if r.get("sparse")]
        table = {}
        for r in rows:
            s = r["length"]
            ones = torch.ones(1, s, dtype=torch.bool)
            batch = make_ttt_batch(torch.zeros(1, s, dtype=torch.int64), supervised_mask(r["mask"], 1, s), ones,
                                   torch.empty(1, s, 0), torch.empty(1, s, 0), ones, 7)
            table.setdefault(s, []).append((round(needed_share(batch.valid_KBS), 3), round(r["sparse_vs_dense"], 2)))
        assert {s: tuple(sorted(v)) for s, v in table.items()} == SPARSE_TIME_RATIOS[kind]


@pytest.mark.parametrize("kind, seq_len, share, sparse", [
    ("cpu", 2048, 0.71, True), ("cpu", 512, 0.84, True), ("cpu", 32768, 0.5, True),  # the old rule: share < 0.85
    ("cpu", 2048, 0.86, False), ("cpu", 8192, 0.999, False),
    ("h200", 2048, 0.71, False),  # launch-bound: 1.12x measured
    ("h200", 2048, 0.103, True),  # 0.98x
    ("h200", 2048, 0.3, False),  # between 0.98 and 1.12: 1.03
    ("h200", 4096, 0.71, True),  # halfway in log2(S): (1.12 + 0.71) / 2 = 0.92
    ("h200", 8192, 0.723, True), ("h200", 131072, 0.6, True), ("h200", 8192, 0.999, False),
])
def test_sparse_auto_decides_by_device_length_and_share(kind, seq_len, share, sparse):
    assert (share < AUTO_SPARSE_SHARE and sparse_time_ratio(kind, seq_len, share) < 1) == sparse
    needed = round(share * seq_len)
    valid = torch.zeros(1, 1, seq_len, dtype=torch.bool)
    valid[..., :needed] = True
    assert sparse_pays(f"auto:{kind}", valid) == sparse
    assert math.isclose(sparse_time_ratio("h200", 4096, 0.723), (sparse_time_ratio("h200", 2048, 0.723) + 0.72) / 2)
    if kind == "cpu":  # a bare "auto" takes the kind of the tensor's device
        assert sparse_pays("auto", valid) == sparse


# ---- the planner's facts ---------------------------------------------------------------------------------------
def test_the_planner_resolves_what_a_search_of_every_candidate_finds():
    """PlanFacts on a small geometry: the choice is the cheapest of every candidate's traced peak that fits."""
    from recipe.plan import PlanFacts, PlanInputs, plan_length, resolve_inputs
    from recipe.plan.spec import BenchSpec, spec_for_memory, spec_draft_config
    from recipe.plan import states

    spec = BenchSpec(seq_len=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=512,
                     vocab=640, target_hidden=64, ttt_steps=2, loss_chunk_size=64, attention_tile=32)
    target = states.TargetShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=640,
                                params=200_000, layer_params=50_000, embed_params=40_000)
    inputs = PlanInputs(spec=spec, dp=1, zero_stage=1, reduce_bucket=10 ** 6,
                        params=states.count_draft_params(spec_draft_config(spec)), target=target, offline=True,
                        partitioned_target=False, gpu="test", gpu_bytes=0, memory=MemoryOptions(**AUTO))
    facts = PlanFacts(inputs, 256)
    every = {}
    for cand in MemoryOptions(**AUTO).candidates(facts.rank_tokens):
        peak = plan_length(dataclasses.replace(inputs, spec=spec_for_memory(spec, cand), memory=cand), 256)["total"]
        every[cand] = (facts.hardware_flops(cand), peak)
    peaks = sorted(p for _, p in every.values())
    budget = (peaks[0] + peaks[1]) // 2  # only the least-memory candidate fits ... or ties with it
    resolved, report = resolve_inputs(inputs, 256, "cuda", budget)
    best = min((c for c, (_, p) in every.items() if p <= budget), key=lambda c: every[c][0])
    assert resolved.memory == dataclasses.replace(best, sparse_anchors="auto:h200")
    assert report.predicted_peak_bytes == every[best][1] <= budget
    assert resolved.spec == spec_for_memory(spec, dataclasses.replace(best, sparse_anchors="auto:h200"))
    generous, report = resolve_inputs(inputs, 256, "cuda", peaks[-1])
    assert generous.memory.savings() == frozenset() and report.rejected is None


# ---- run.py: "auto" equals the resolved values written out ------------------------------------------------------
def _auto_runs(rank: int, world_size: int, tmp: str, target: str, store: str) -> dict:
    """Rank-0 worker: a run with every switch "auto" and a budget everything fits (its report has the peaks of the
    cheapest candidate and of the one saving the most), then "auto" against a budget halfway between them, then that
    run's resolved values written explicitly."""
    import sys

    sys.path.insert(0, str(ROOT))
    from run import main

    tmp = Path(tmp)

    def run(name: str, memory: dict, *extra: str) -> tuple[list[dict], dict, str]:
        ds = write_ds_config(tmp / f"{name}.json", "zero0.json", memory=memory)
        argv = train_argv(ds, Path(target), Path(store), tmp / name, "--max-steps", "2", *extra)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(argv) == 0
        lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines], json.loads((tmp / name / "run_config.json").read_text()), err.getvalue()

    _, probe, _ = run("probe", AUTO, "--memory-budget", "1000")
    peaks = [c["predicted_peak_bytes"] for c in probe["memory_auto"]["candidates"] if c["predicted_peak_bytes"]]
    first = next(c for c in probe["memory_auto"]["candidates"] if c["predicted_peak_bytes"] is not None)
    budget = (max(peaks) + min(peaks)) / 2  # the cheapest candidate (the largest peak) does not fit
    auto, config, text = run("auto", AUTO, "--memory-budget", repr(budget / 1024 ** 3))
    written = {k: config["memory"][k] for k in (*PLANNED, "sparse_anchors")}
    explicit, config2, _ = run("explicit", written)
    return {"probe": probe, "first": first, "budget": budget, "auto": auto, "explicit": explicit, "config": config,
            "config2": config2, "text": " ".join(text.split()),
            "exports": [str(tmp / n / "export" / "model.safetensors") for n in ("auto", "explicit")]}


@pytest.mark.slow
def test_run_with_auto_switches_equals_the_resolved_values_written_out(tiny_target_and_store, tmp_path):
    """fp32, one process, offline: every metric of every step and every exported tensor bit for bit; run_config.json
    records the resolved values and the report, the run plan prints the choice and the rejected alternative."""
    from safetensors.torch import load_file

    from recipe.train.metrics import TIMED_FIELDS

    target, store = tiny_target_and_store
    out = run_ranks(1, _auto_runs, str(tmp_path), str(target), str(store))[0]
    probe = out["probe"]["memory_auto"]
    assert probe["fits"] and probe["chosen"] == out["first"]["switches"] == CPU_AUTO  # 1000 GiB: nothing recomputed
    report = out["config"]["memory_auto"]
    assert report["rule"] == "planned" and report["fits"] and report["predicted_peak_bytes"] <= out["budget"]
    assert report["rejected"]["predicted_peak_bytes"] > out["budget"] and report["candidates"][0]["fits"] is False
    assert report["chosen"] != out["first"]["switches"] and MemoryOptions(**report["chosen"]).savings()
    assert out["config"]["memory"] == out["config2"]["memory"] and out["config"]["memory"]["sparse_anchors"] == "auto:cpu"
    assert out["config2"]["memory_auto"]["rule"] == "explicit"
    assert "memory auto for" in out["text"] and "rejected" in out["text"]
    assert len(out["auto"]) == len(out["explicit"]) == 2
    for a, b in zip(out["auto"], out["explicit"]):
        assert {k: v for k, v in a.items() if k not in TIMED_FIELDS} == \
            {k: v for k, v in b.items() if k not in TIMED_FIELDS}
    first, second = (load_file(p) for p in out["exports"])
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_a_cp_run_plans_in_a_child_process_and_every_rank_takes_rank_0s_choice(tiny_target_and_store, tmp_path):
    """At cp 2 the planner's trace needs a fake process group of its own, which cannot be made beside the run's: rank
    0 plans in a spawned child process (recipe.train.memory_plan), and the run goes on with its choice."""
    from helpers.training import run_training

    target, store = tiny_target_and_store
    ds = write_ds_config(tmp_path / "cp2.json", "zero3_cp2.json", memory=AUTO)
    argv = train_argv(ds, target, store, tmp_path / "cp2", "--max-steps", "1", "--memory-budget", "1000")
    records = run_ranks(2, run_training, [argv])[0][0]
    config = json.loads((tmp_path / "cp2" / "run_config.json").read_text())
    report = config["memory_auto"]
    assert config["parallelism"]["cp"] == 2 and report["rule"] == "planned" and report["fits"]
    assert report["chosen"] == CPU_AUTO and len(records) == 1  # 1000 GiB: nothing recomputed
    assert report["length"] % 4 == 0 and report["budget_bytes"] == 1000 * 1024 ** 3
