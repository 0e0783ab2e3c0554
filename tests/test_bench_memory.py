"""recipe.bench: length parsing, the static estimate against real parameter counts, the report's budget logic, a
real CPU measurement (chunked loss vs full logits), and the GPU check script's --smoke run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from recipe.bench import memory
from recipe.bench.estimate import StepShape, estimate_step_bytes, trainable_params
from recipe.bench.measure import BenchSpec, build_model, random_batch, time_step

ROOT = Path(__file__).resolve().parent.parent


def test_parse_length():
    assert [memory.parse_length(t) for t in ("512", "4k", "1.5k", " 2K ")] == [512, 4096, 1536, 2048]
    for bad in ("abc", "0", "1.3", "-2k", "0.0001k"):
        with pytest.raises(ValueError, match="bad length"):
            memory.parse_length(bad)


def test_bad_flags_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        memory.main(["--lengths", "4q"])
    assert exc.value.code == 2 and "bad length '4q'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["--lengths", "102", "--cp", "2", "--device", "cpu"])  # not a multiple of 2·cp
    assert "not a multiple of 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["--lengths", "64", "--tp", "2", "--hidden", "64", "--device", "cpu"])  # 1 head
    err = capsys.readouterr().err
    assert "tp=2 must divide" in err and "num_attention_heads=1" in err


def test_estimate_counts_the_real_parameters_and_orders_layouts():
    spec = BenchSpec(seq_len=64, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=40,
                     vocab=50, target_hidden=24, ttt_steps=3)
    model = build_model(spec, torch.device("cpu"))
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable_params(spec.shape()) == real
    est = estimate_step_bytes(spec.shape())
    assert est["weights"] == (real + 50 * 32 + 40 * 24) * 4 and est["grads"] == real * 4
    assert est["optimizer"] == real * 8
    assert est["total"] == sum(est[c] for c in ("weights", "grads", "optimizer", "aux_states", "logits", "labels",
                                                "attention", "layer"))
    shape = StepShape(seq_len=8192, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=896,
                      draft_vocab=32000, vocab=32000, target_hidden=256)
    full = estimate_step_bytes(shape)
    assert full["logits"] == (7 * 4 + 8) * 8192 * 32000  # K fp32 log-probs kept + the step in flight
    chunked = estimate_step_bytes(StepShape(**{**shape.__dict__, "loss_chunk_size": 1024}))
    assert chunked["logits"] + chunked["labels"] == 16 * 1024 * 32000
    ckpt = estimate_step_bytes(StepShape(**{**shape.__dict__, "checkpoint_steps": True}))
    assert ckpt["attention"] < full["attention"] / 7
    tp2 = estimate_step_bytes(StepShape(**{**shape.__dict__, "tp": 2}))
    assert tp2["labels"] == full["labels"] / 2  # fp32: the vocab-parallel CE keeps fp32 shards
    tiled = estimate_step_bytes(StepShape(**{**shape.__dict__, "attention_tile": 1024}))
    assert tiled["attention"] == 4 * 4 * 1024 ** 2 * 4 + 7 * 8192 * 4 * 65 * 4  # one tile pair + out/lse per step
    assert full["attention"] == 16 * 4 * 8192 ** 2 * 4 > 50 * tiled["attention"]
    cp2 = estimate_step_bytes(StepShape(**{**shape.__dict__, "cp": 2, "attention_tile": 1024}))
    assert cp2["attention"] == 4 * 4 * 1024 ** 2 * 4 + 7 * 4096 * 4 * 65 * 4  # tiles within 2048-token chunks
    batch4 = estimate_step_bytes(StepShape(**{**shape.__dict__, "seq_len": 512, "batch": 4, "attention_tile": 1024}))
    assert batch4["attention"] == 4 * 4 * 4 * 512 ** 2 * 4 + 7 * 2048 * 4 * 65 * 4  # tile capped by one sequence


def _fake_measurement(peaks_gib):
    def fake(spec, timeout):
        peak = int(peaks_gib[(spec.layout, spec.seq_len)] * memory.GIB)
        return {"status": "ok", "detail": "", "ranks": [{"peak_bytes": peak, "step_bytes": peak // 2,
                                                         "base_bytes": peak // 2, "seconds": 1.0, "method": "x"}]}
    return fake


def test_report_finds_the_longest_length_within_budget_and_stops_after(monkeypatch, tmp_path):
    peaks = {("full", 1024): 1.0, ("full", 2048): 3.0, ("chunked", 1024): 0.5, ("chunked", 2048): 1.0,
             ("chunked", 4096): 2.0}
    monkeypatch.setattr(memory, "run_measurement", _fake_measurement(peaks))  # ("full", 4096) would raise KeyError
    monkeypatch.setattr(memory, "_available_gib", lambda: 1000.0)  # the machine's free memory must not decide
    out = tmp_path / "r.json"
    assert memory.main(["--lengths", "1k,2k,4k", "--layouts", "full,chunked", "--budget-gib", "2.5", "--device",
                        "cpu", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    report = json.loads(out.read_text())
    assert report["max_length"] == {"full": 1024, "chunked": 4096}
    status = {(r["layout"], r["length"]): r["status"] for r in report["results"]}
    assert status[("full", 4096)] == "not run" and status[("full", 2048)] == "ok"
    assert report["chunked_vs_full"] == {"length": 2048, "peak_ratio": 3.0, "step_ratio": 3.0}


def test_time_step_reports_a_positive_peak():
    spec = BenchSpec(seq_len=32, hidden=32, heads=2, kv_heads=2, head_dim=16, intermediate=64, draft_vocab=64,
                     vocab=64, target_hidden=32, ttt_steps=2)
    model = build_model(spec, torch.device("cpu"))
    result = time_step(model, random_batch(spec, torch.device("cpu")), steps=2)
    assert result["peak_bytes"] >= result["base_bytes"] > 0 and result["seconds"] > 0
    assert all(p.grad is None for p in model.parameters())  # grads dropped after the measurement


@pytest.mark.slow
def test_real_cpu_measurement_chunked_loss_cuts_the_step_peak(tmp_path):
    """Fresh processes, VmHWM: at Vd=32000 the full-logits step keeps K·[S, Vd] fp32 tensors; chunks of 32 do not."""
    out = tmp_path / "r.json"
    assert memory.main(["--lengths", "256", "--layouts", "full,chunked", "--hidden", "64", "--ttt-steps", "2",
                        "--loss-chunk-size", "32", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["layout"]: r for r in report["results"]}
    assert rows["full"]["status"] == "ok" and rows["chunked"]["status"] == "ok", report["results"]
    assert rows["full"]["step_bytes"] > 100 * 2 ** 20  # ≈ (2·4+8+2·4+4)·256·32000 B estimated
    assert report["chunked_vs_full"]["step_ratio"] > 1.5  # 2.1 measured; attention and grads are shared


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_smoke_table_writes_json(tmp_path):
    assert _gpu_check().main(["--smoke", "--parts", "table", "--out", str(tmp_path), "--layouts", "full,chunked+ckpt",
                              "--steps", "1"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())["table"]
    assert [(r["layout"], r["length"], r["status"]) for r in report["results"]] == [
        ("full", 64, "ok"), ("full", 128, "ok"), ("chunked+ckpt", 64, "ok"), ("chunked+ckpt", 128, "ok")]
    assert report["config"]["dtype"] == "bf16" and report["config"]["ttt_steps"] == 2
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 for r in report["results"])


@pytest.mark.slow
def test_gpu_check_smoke_runs_the_recipe_end_to_end(tmp_path):
    """The GPU script's e2e part on the CPU: random-weight SmolLM2-shaped target, online and offline ZeRO-3 bf16 runs
    through run.py (gloo), both exports checked, recipe.eval of the bf16 draft."""
    out = tmp_path / "out"
    assert _gpu_check().main(["--smoke", "--out", str(out), "--work", str(tmp_path / "work"), "--layouts",
                              "chunked+ckpt", "--steps", "1"]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in report["e2e"]}
    assert list(stages) == ["online", "dump", "offline", "check_online_export", "check_offline_export", "eval"]
    assert all(s["rc"] == 0 for s in stages.values()), report["e2e"]
    for name in ("online", "offline"):
        assert stages[name]["steps"] == 3 and stages[name]["export"] and stages[name]["backend"] == "gloo on cpu"
        assert stages[name]["loss_last"] > 0
    assert list(stages["eval"]["draft_dtypes"].values()) == ["bfloat16"] and stages["eval"]["tau"] >= 1.0
    assert [r["status"] for r in report["table"]["results"]] == ["ok", "ok"]
    assert "===== offline" in (out / "gpu_check.log").read_text()
