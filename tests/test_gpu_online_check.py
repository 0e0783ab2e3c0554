"""scripts/gpu_online_check.py on the CPU: the schedule fits one device call with the rows in order (the planner's
misfits left out), a stage that cannot finish before its deadline is skipped and recorded without starting, a row's
record is made from what run.py wrote (seconds per step after the first, positions and supervised tokens/s, the
planner's prediction), a resume is compared step for step with the straight run, and (slow) the 8k rows and their
ZeRO-3 resume, then the eval, run at tiny sizes through run.py and recipe.eval."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import pytest

from helpers.training import ROOT
from helpers.tolerance import FP32_REORDERED

GIB = 2 ** 30


def _check():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("gpu_online_check", ROOT / "scripts" / "gpu_online_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(total_gib: float, fits: bool = True) -> dict:
    total = int(total_gib * GIB)
    return {"total": total, "fits": fits, "cuda_context": GIB // 2, "nccl": GIB // 4, "allocator_slack": GIB // 4}


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    """A plan file in which 128k does not fit the H100 (it is then left out of its schedule)."""
    module = _check()
    rows = {r.name: _plan(30) for r in module.ROWS}
    plans = {"date": "2026-12-06", "gpus": {"h100": {"longest": 118784, "rows": {**rows, "128k_zero1_mlp":
                                                                                   _plan(84.8, False)}},
                                            "h200": {"longest": 253952, "rows": rows}}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plans))
    monkeypatch.setattr(module, "PLAN_FILE", path)
    return module


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_dry_run_orders_the_stages_within_the_budget(plan_file, gpu, capsys):
    assert plan_file.main(["--dry-run", "--gpu", gpu]) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = [line.split()[0] for line in lines[1:] if " est " in line and not line.startswith("total")]
    rows = ["8k_zero1", "8k_zero3_resume", "32k_zero1"] + (["128k_zero1_mlp"] if gpu == "h200" else [])
    assert stages == ["imports", "target", *rows, "eval", "longest_zero1_mlp"]
    ends = [float(line.split("deadline")[1].split()[0]) for line in lines[1:] if " est " in line]
    assert ends == sorted(ends) and max(ends) <= plan_file.BUDGET_S <= 540 < 600
    assert (gpu == "h100") == any("not scheduled" in line and "128k_zero1_mlp" in line for line in lines)
    longest = next(line for line in lines if line.startswith("longest_zero1_mlp"))
    assert "steps" in longest and "save" in longest  # estimated at the planned longest fit, terms printed


def test_longer_rows_are_estimated_longer_and_the_first_pays_the_compile():
    module = _check()
    import scripts.gpu_online_rows as rows_mod

    est = module.ESTIMATES_S
    rows = module.ROW
    first = module.row_estimate(rows["8k_zero1"], 8192, True, est)
    later = module.row_estimate(rows["32k_zero1"], 32768, False, est)
    assert first["compile"] == est["compile"] > later["compile"] == est["compile_cached"]
    assert first["save"] == 2 * est["save"]  # the checkpoint the resume reads, then the final one
    assert rows_mod.step_seconds(131072, True, est) > 4 * rows_mod.step_seconds(32768, True, est)  # superlinear
    assert module.target_forward_flops(8192) == pytest.approx(2 * 32 * 218_103_808 * 8192 + 2 * 4096 * 32 * 8192
                                                              * 8193)


def test_a_stage_that_cannot_finish_in_time_is_skipped_and_recorded(tmp_path):
    module = _check()
    args = argparse.Namespace(smoke=False, stages={"eval"}, wheels=tmp_path)
    with open(tmp_path / "log", "w") as log:
        check = module.Check(args, list(module.ROWS), tmp_path, tmp_path, log)
        check.start -= 10_000  # far behind the schedule: nothing fits any more
        record = check.stage("eval", [sys.executable, "-c", "raise SystemExit(3)"], predicted=1.0)
    assert record["rc"] == "skipped" and "not started" in record["detail"] and record["predicted_s"] == 1.0
    saved = json.loads((tmp_path / "gpu_online_check.json").read_text())
    assert saved["stages"] == [record] and saved["info"]["budget_s"] == 540


def test_row_record_from_the_runs_files(tmp_path):
    module = _check()
    run = tmp_path / "run"
    run.mkdir()
    steps = [{"step": 1, "loss": 9.0, "time_s": 30.0, "tokens": 500, "positions": 8192},
             {"step": 2, "loss": 8.0, "time_s": 2.0, "tokens": 600, "positions": 8192},
             {"step": 3, "loss": 7.0, "time_s": 4.0, "tokens": 400, "positions": 4096}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    raw = {"run_rc": 0, "max_memory_allocated": 27 * GIB, "max_memory_reserved": 29 * GIB,
           "outside_allocator_max": GIB, "samples": 20, "truncated": 19}
    rec = module.row_record(module.ROW["8k_zero1"], 8192, raw, run, tmp_path / "target", _plan(30))
    assert rec["seconds_per_step"] == 3.0 and rec["supervised_per_step"] == 500  # steps 2 and 3: after the first
    assert rec["positions_per_step"] == 6144 and rec["positions_source"] == "metrics.jsonl"
    assert rec["tokens_per_s"] == {"positions": 2048.0, "supervised": 500 / 3}
    assert (rec["loss_first"], rec["loss_last"]) == (9.0, 7.0)
    assert rec["planned_tensors"] == 29 * GIB and rec["allocated_over_planned_tensors"] == pytest.approx(27 / 29)
    assert rec["device_over_planned_total"] == pytest.approx(30 / 30)
    # without run.py's positions: the length, named as an upper bound when a sample was shorter
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in s.items() if k != "positions"}) + "\n"
                                               for s in steps))
    rec = module.row_record(module.ROW["8k_zero1"], 8192, raw, run, tmp_path / "target", None)
    assert rec["positions_per_step"] == 8192 and "upper bound" in rec["positions_source"]
    assert rec["plan"] is None and "allocated_over_planned_tensors" not in rec


def test_resume_continuity_compares_the_common_steps():
    module = _check()
    straight = [{"step": s, "loss": loss} for s, loss in ((1, 9.0), (2, 8.0), (3, 7.0))]
    same = module.resume_continuity(straight, [{"step": 3, "loss": 7.0}])
    assert same == {"steps": [3], "straight": [7.0], "resumed": [7.0], "max_rel_diff": 0.0}
    assert module.resume_continuity(straight, [{"step": 3, "loss": 7.7}])["max_rel_diff"] == pytest.approx(0.1)
    assert module.resume_continuity(straight, [{"step": 4, "loss": 1.0}])["max_rel_diff"] is None


@pytest.fixture(scope="module")
def smoke_work(tmp_path_factory):
    return tmp_path_factory.mktemp("online_smoke")


@pytest.mark.slow  # imports stage, target, two run.py processes
def test_smoke_8k_rows_and_their_resume(smoke_work):
    out = smoke_work / "out"
    assert _check().main(["--smoke", "--rows", "8k_zero1,8k_zero3_resume", "--out", str(out), "--work",
                          str(smoke_work / "work"), "--wheels", str(smoke_work / "none")]) == 0
    report = json.loads((out / "gpu_online_check.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == ["imports", "target", "8k_zero1", "8k_zero3_resume"]
    assert all(s["rc"] == 0 for s in stages.values()), report["stages"]
    straight, resumed = stages["8k_zero1"], stages["8k_zero3_resume"]
    assert straight["steps"] == [1, 2, 3] and resumed["steps"] == [3] and straight["length"] == 128
    assert straight["seconds_per_step"] > 0 and straight["tokens_per_s"]["supervised"] > 0
    assert straight["backend"] == "gloo on cpu" and straight["samples"] >= 3
    # step 3 from the ZeRO-1 checkpoint of step 2 under ZeRO-3: the same weights and the same bf16 forward, its
    # loss a float32 sum in another order at most (FP32_REORDERED / 10: nothing of bf16 rounding is allowed)
    assert resumed["resume"]["steps"] == [3], resumed["resume"]
    assert resumed["resume"]["max_rel_diff"] <= FP32_REORDERED / 10, resumed["resume"]
    assert resumed["resume"]["straight"][0] > 0  # positions were valid: a loss to compare, not two zeros
    assert not (smoke_work / "work" / "8k_zero1" / "checkpoints").exists()  # deleted once resumed
    assert (smoke_work / "work" / "8k_zero3_resume" / "export" / "model.safetensors").is_file()


@pytest.mark.slow  # recipe.eval in a process, on the smoke target and export above
def test_smoke_eval_records_memory_time_and_mismatches_per_length(smoke_work):
    if not (smoke_work / "work" / "target" / "config.json").is_file():
        pytest.skip("needs the target of test_smoke_8k_rows_and_their_resume")
    out = smoke_work / "out_eval"
    assert _check().main(["--smoke", "--rows", "eval", "--out", str(out), "--work", str(smoke_work / "work"),
                          "--wheels", str(smoke_work / "none")]) == 0
    report = json.loads((out / "gpu_online_check.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["target"]["detail"].startswith("reused") and stages["eval"]["rc"] == 0
    ev = stages["eval"]
    assert ev["draft_source"] == "8k_zero3_resume" and ev["target_dtype"] == "bfloat16"
    assert [e["context_length"] for e in ev["lengths"]] == [128, 256]
    for entry in ev["lengths"]:
        assert entry["prefill_seconds"] > 0 and entry["device_memory"] is None  # CUDA peaks only on a GPU
        assert entry["runs"][0]["seconds_per_verification_step"] > 0 and entry["mismatches"] >= 0
