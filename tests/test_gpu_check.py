"""scripts/gpu_check.py on the CPU: the stage plan fits one device call with eval last, the import stage fails fast on
a wheel that does not import, table rows that cannot finish in time are skipped and recorded, the table and the
end-to-end stages run at tiny sizes with the same code paths (``--smoke``), a missing online export is replaced by a
random-weight one, and the copy step files the returned JSON under docs/results/gpu."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile

import pytest

from helpers.tiny_target import save_tiny_llama
from helpers.tolerance import FP32_REORDERED, within
from helpers.training import ROOT


def _gpu_check():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts():
    sys.path.insert(0, str(ROOT))
    import scripts.gpu_check_parts as parts

    return parts


def test_dry_run_stage_caps_fit_one_device_call_with_eval_last(capsys):
    gpu_check = _gpu_check()
    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    caps = {line.split()[0]: int(line.split()[1]) for line in lines}
    stages = [k for k in caps if not k.startswith("table:") and k != "total"]
    assert stages == ["imports", "target", "online", "check_export", "table", "eval"]
    assert [k for k in caps if k.startswith("table:")] == ["table:4096", "table:32768", "table:131072"]
    assert sum(caps[k] for k in stages) == caps["total"] <= 540
    assert sum(v for k, v in caps.items() if k.startswith("table:")) < caps["table"]
    assert gpu_check.BUDGET_S <= 540 < 600  # a device command may run 600 s
    # each cap is its estimates' sum rounded up to 5 s, and the line says what it is made of
    online = next(line for line in lines if line.startswith("online"))
    assert "2×flex_fwd" in online and "2×flex_bwd" in online and caps["online"] % 5 == 0
    est = gpu_check.ESTIMATES_S
    assert caps["online"] >= 2 * (est["flex_fwd"] + est["flex_bwd"]) + est["start"] + est["ds_init"]


def test_schedule_passes_unused_time_on_and_never_past_the_budget():
    gpu_check = _gpu_check()
    sched = gpu_check.Schedule(False)
    assert abs(sched.timeout("imports") - sched.caps["imports"]) < 1
    sched.start -= 5  # imports took 5 s of its 20
    assert abs(sched.timeout("target") - (sched.caps["imports"] + sched.caps["target"] - 5)) < 1
    sched.start -= 1000  # far behind: a stage still gets a 1 s floor, never a negative timeout
    assert sched.timeout("eval") == 1.0


def test_row_estimate_counts_compiles_and_scales_from_the_last_row():
    parts = _parts()
    est = dict(_gpu_check().ESTIMATES_S, steps={4096: 2, 32768: 2, 131072: 1})
    first = parts.gpu_row_estimate(4096, 0, None, est)
    assert first == pytest.approx(est["flex_fwd"] + est["flex_bwd"] + 2 * est["row_step"] + est["row_batch"])
    third = parts.gpu_row_estimate(131072, 2, {"length": 32768, "seconds": 4.0}, est)
    units = parts.step_units(131072, est["attn_crossover"]) / parts.step_units(32768, est["attn_crossover"])
    assert third == pytest.approx(4.0 * units + est["row_batch"]) and 4 < units < 16  # between linear and quadratic


def test_rows_that_cannot_finish_in_time_are_skipped_and_recorded(tmp_path):
    gpu_check = _gpu_check()
    rows = _parts().table_rows([(64, 10), (128, 10)], lambda n: gpu_check.table_spec(True, n), 0.0, tmp_path,
                               dict(gpu_check.ESTIMATES_S, steps={64: 2, 128: 2}), True, {})
    assert [(r["length"], r["status"]) for r in rows] == [(64, "skipped"), (128, "skipped")]
    assert all("not started" in r["detail"] and "peak_bytes" not in r for r in rows)
    assert json.loads((tmp_path / "table.json").read_text()) == rows


def _wheel(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_wheel_modules_from_top_level_or_file_names(tmp_path):
    parts = _parts()
    a = _wheel(tmp_path / "a-1.0-py3-none-any.whl", {"a-1.0.dist-info/top_level.txt": "a_pkg\n_a_ext\n",
                                                      "a_pkg/__init__.py": ""})
    b = _wheel(tmp_path / "b_dist-2.0-py3-none-any.whl", {"b_mod.py": "", "b_pkg/__init__.py": "", "b.pth": "",
                                                           "b_dist-2.0.dist-info/RECORD": "",
                                                           "b_dist-2.0.data/scripts/tool": ""})
    assert parts.wheel_modules(a) == ("a", ["_a_ext", "a_pkg"])
    assert parts.wheel_modules(b) == ("b_dist", ["b_mod", "b_pkg"])


def test_import_stage_fails_fast_on_a_wheel_that_does_not_import(tmp_path):
    parts = _parts()
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels / "json-0-py3-none-any.whl", {"json/__init__.py": ""})  # imports (the standard library's)
    _wheel(wheels / "nope-1.0-py3-none-any.whl", {"nope_missing_module/__init__.py": ""})
    assert parts.import_stage(wheels, tmp_path, need_cuda=False) == 1
    report = json.loads((tmp_path / "imports.json").read_text())
    assert report["failed"] == ["nope-1.0-py3-none-any.whl:nope_missing_module"]
    assert report["wheels"]["json-0-py3-none-any.whl"]["json"] is None
    assert report["modules"]["recipe.bench.measure"] is None and report["modules"]["kernels.flex_attention"] is None
    assert report["table_ok"] and report["versions"]["torch"] and report["python"] == sys.version.split()[0]
    assert not any(name.endswith("__main__") for name in report["modules"])


@pytest.mark.slow
def test_smoke_table_writes_rows_with_memory_flex_and_plan_fields(tmp_path):
    """``--smoke --parts table``: the import stage and the table, each a child process (two processes: slow)."""
    assert _gpu_check().main(["--smoke", "--parts", "table", "--out", str(tmp_path), "--wheels",
                              str(tmp_path / "none")]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["imports"]["rc"] == 0 and report["imports"]["failed"] == []
    assert report["info"]["source"]["commit"] and report["info"]["budget_s"] == 540
    rows = report["table"]["rows"]
    assert [(r["length"], r["status"]) for r in rows] == [(64, "ok"), (128, "ok"), (256, "ok")]
    for r in rows:
        assert r["spec"]["dtype"] == "bf16" and r["spec"]["layout"] == "chunked+ckpt" and r["spec"]["ttt_steps"] == 2
        assert r["peak_bytes"] > 0 and r["seconds_wall"] <= r["allowed_s"]
        assert r["positions_per_s"] == r["length"] / r["seconds"] == r["supervised_tokens_per_s"]  # every token
        assert r["hardware_tflops_per_gpu"] > r["model_tflops_per_gpu"] > 0 and r["mfu"] is None  # CPU: no peak
        assert r["seconds_first"] > 0 and r["model_build_s"] == rows[0]["model_build_s"]  # one model for all rows
        assert set(r["flex"]) >= {"compiles", "calls", "dynamic", "recompile_limit"}
        assert r["plan"]["peak_bytes"] > 0
    assert report["table"]["stage"]["rc"] == 0 and report["info"]["stage_caps_s"]["table:256"] == 75 * 4


def test_collect_files_the_report_under_docs_results_gpu(tmp_path, monkeypatch):
    gpu_check = _gpu_check()
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"info": {"device": "x", "date": "2026-12-05"},
                                                                 "e2e": []}))
    dest = gpu_check.collect(tmp_path / "out")
    assert dest == tmp_path / "docs" / "results" / "gpu" / "gpu_check_2026-12-05.json"
    assert json.loads(dest.read_text())["info"]["device"] == "x"


def test_the_report_source_comes_from_the_carried_provenance_file(tmp_path):
    gpu_check = _gpu_check()
    (tmp_path / gpu_check.PROVENANCE).write_text(json.dumps({"commit": "c" * 40, "uncommitted": []}))
    assert gpu_check._source(tmp_path)["commit"] == "c" * 40


@pytest.mark.slow
def test_provenance_of_this_checkout_names_its_commit():  # runs git
    here = _gpu_check().provenance()
    assert len(here["commit"]) == 40 and isinstance(here["uncommitted"], list) and "torch" in here["versions_here"]


@pytest.mark.slow
def test_a_missing_online_export_is_replaced_by_a_random_one_and_checked(tmp_path):
    gpu_check = _gpu_check()
    save_tiny_llama(tmp_path / "target", vocab=320)  # the smoke draft vocabulary is 256
    with open(tmp_path / "log", "w") as log:
        ctx = dict(smoke=True, work=tmp_path, env=gpu_check.e2e_env(True), schedule=gpu_check.Schedule(True),
                   log=log, cmds=gpu_check.e2e_commands(True, tmp_path / "assets", tmp_path))
        record = gpu_check.run_e2e_stage("check_export", ctx)
    assert record["rc"] == 0 and record["export_source"].startswith("random weights"), record
    from recipe.export import load_export

    tensors, config = load_export(tmp_path / "online" / "export")
    assert config["torch_dtype"] == "bfloat16" and config["draft_vocab_size"] == 256
    assert tensors["lm_head.weight"].shape == (256, config["hidden_size"])


@pytest.mark.slow
def test_smoke_runs_the_recipe_end_to_end(tmp_path):
    """The e2e stages on the CPU: random-weight SmolLM2-shaped target, an online ZeRO-3 bf16 run through run.py
    (gloo), its export checked, recipe.eval of the bf16 draft on 2 prompts (last)."""
    out = tmp_path / "out"
    assert _gpu_check().main(["--smoke", "--parts", "e2e", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in report["e2e"]}
    assert list(stages) == ["target", "online", "check_export", "eval"]
    assert all(s["rc"] == 0 and s["seconds"] <= s["allowed_s"] for s in stages.values()), report["e2e"]
    online = stages["online"]
    assert online["steps"] == 3 and online["export"] and online["backend"] == "gloo on cpu" and online["loss_last"] > 0
    assert stages["check_export"]["export_source"] == "online"
    assert list(stages["eval"]["draft_dtypes"].values()) == ["bfloat16"] and stages["eval"]["tau"] >= 1.0


@pytest.mark.slow
def test_a_wheel_that_does_not_import_skips_the_e2e_stages_in_seconds(tmp_path):
    """The fail-fast import stage: a carried wheel whose module is missing fails it; the e2e stages are recorded as
    skipped without starting, the report is still written, and the check exits 1."""
    (tmp_path / "whl").mkdir()
    _wheel(tmp_path / "whl" / "nope-1.0-py3-none-any.whl", {"nope_missing_module/__init__.py": ""})
    out = tmp_path / "out"
    assert _gpu_check().main(["--smoke", "--parts", "e2e", "--out", str(out), "--work", str(tmp_path / "work"),
                              "--wheels", str(tmp_path / "whl")]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["imports"]["rc"] == 1
    assert report["imports"]["failed"] == ["nope-1.0-py3-none-any.whl:nope_missing_module"]
    assert [(s["stage"], s["rc"]) for s in report["e2e"]] == [(n, "skipped") for n in ("target", "online",
                                                                                     "check_export", "eval")]
    assert not (tmp_path / "work" / "target").exists()


@pytest.mark.slow
def test_sparse_check_smoke_is_exact_on_the_cpu(tmp_path):
    """``scripts/gpu_sparse_check.py --smoke``: dense and sparse anchors from the same weights agree (tiled kernel,
    fp32), both masks' rows are written, and the speed rows record both switches."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_sparse_check.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "sparse_check.json").read_text())
    assert [r["mask"] for r in report["exact"]] == ["sharegpt", "long10"]
    for row in report["exact"]:
        assert row["valid_equal"] and row["same_params"]
        within(row["loss_rel"], FP32_REORDERED, f"{row['mask']} loss")
        within(row["grad_rel_max"], FP32_REORDERED, f"{row['mask']} gradients")
        assert sum(row["valid_K"]) > 0  # valid positions per TTT step
    for row in report["speed"]:
        assert row["dense"]["peak_bytes"] > 0 and row["sparse"]["seconds"] > 0
