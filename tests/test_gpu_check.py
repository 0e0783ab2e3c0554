"""scripts/gpu_check.py on the CPU: the stage plan fits one device call, the table and the end-to-end stages run at
tiny sizes with the same code paths (``--smoke``), and the copy step files the returned JSON under docs/results/gpu."""
from __future__ import annotations

import importlib.util
import json

import pytest

from helpers.training import ROOT


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_stage_caps_fit_one_device_call(capsys):
    gpu_check = _gpu_check()
    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    caps = {line.split()[0]: int(line.split()[1]) for line in lines}
    assert list(caps)[:4] == ["target", "online", "check_export", "eval"]
    assert [k for k in caps if k.startswith("table:")] == ["table:4096", "table:32768", "table:131072"]
    assert sum(v for k, v in caps.items() if k != "total") == caps["total"] <= 540
    assert gpu_check.BUDGET_S <= 540 < 600  # a device command may run 600 s


def test_smoke_table_writes_rows_with_flex_and_plan_fields(tmp_path):
    assert _gpu_check().main(["--smoke", "--parts", "table", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["table"]["rows"]
    assert [(r["length"], r["status"]) for r in rows] == [(64, "ok"), (128, "ok"), (256, "ok")]
    for r in rows:
        assert r["spec"]["dtype"] == "bf16" and r["spec"]["layout"] == "chunked+ckpt" and r["spec"]["ttt_steps"] == 2
        assert r["peak_bytes"] > 0 and r["tokens_per_s"] > 0 and r["seconds_wall"] <= r["cap_s"]
        assert set(r["flex"]) >= {"compiles", "calls", "dynamic", "recompile_limit"}
        assert "plan" in r
    assert report["table"]["stage"]["rc"] == 0 and report["info"]["stage_caps_s"]["table:256"] == 140 * 4


def test_collect_files_the_report_under_docs_results_gpu(tmp_path, monkeypatch):
    gpu_check = _gpu_check()
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"info": {"device": "x"}, "e2e": []}))
    dest = gpu_check.collect(tmp_path / "out")
    assert dest.parent == tmp_path / "docs" / "results" / "gpu" and dest.name.startswith("gpu_check_")
    assert json.loads(dest.read_text())["info"]["device"] == "x"


@pytest.mark.slow
def test_smoke_runs_the_recipe_end_to_end(tmp_path):
    """The e2e stages on the CPU: random-weight SmolLM2-shaped target, an online ZeRO-3 bf16 run through run.py
    (gloo), its export checked, recipe.eval of the bf16 draft on 2 prompts."""
    out = tmp_path / "out"
    assert _gpu_check().main(["--smoke", "--parts", "e2e", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in report["e2e"]}
    assert list(stages) == ["target", "online", "check_export", "eval"]
    assert all(s["rc"] == 0 and s["seconds"] <= s["cap_s"] for s in stages.values()), report["e2e"]
    online = stages["online"]
    assert online["steps"] == 3 and online["export"] and online["backend"] == "gloo on cpu" and online["loss_last"] > 0
    assert list(stages["eval"]["draft_dtypes"].values()) == ["bfloat16"] and stages["eval"]["tau"] >= 1.0
