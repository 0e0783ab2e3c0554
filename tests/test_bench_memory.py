"""recipe.bench: length parsing, the planner's prediction against real parameter counts, the report's budget logic, a
real CPU measurement (chunked loss vs full logits)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from recipe.arg_types import parse_length
from recipe.bench import memory
from recipe.bench.measure import build_model, random_batch, time_step
from recipe.plan import predict_step
from recipe.plan.spec import BenchSpec

ROOT = Path(__file__).resolve().parent.parent


def test_parse_length():
    assert [parse_length(t) for t in ("512", "4k", "1.5k", " 2K ")] == [512, 4096, 1536, 2048]
    for bad in ("abc", "0", "1.3", "-2k", "0.0001k"):
        with pytest.raises(ValueError, match="bad length"):
            parse_length(bad)


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


@pytest.mark.slow
def test_prediction_counts_the_real_parameters_and_orders_layouts():
    """recipe.plan.predict_step (the report's prediction column) traces the same model build_model builds."""
    spec = BenchSpec(seq_len=64, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=40,
                     vocab=50, target_hidden=24, ttt_steps=3, loss_chunk_size=16, attention_tile=16)
    model = build_model(spec, torch.device("cpu"))
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pred = predict_step(spec)
    assert pred["params"]["trainable"] == real and pred["params"]["frozen"] == 50 * 32
    assert pred["step_bytes"] >= real * 4  # the gradients are part of the step
    big = {"seq_len": 512, "draft_vocab": 4000, "vocab": 4000}
    full = predict_step(dataclasses.replace(spec, layout="full", **big))["step_bytes"]
    chunked = predict_step(dataclasses.replace(spec, layout="chunked", **big))["step_bytes"]
    assert full > 3 * chunked  # K·[S, Vd] fp32 logits kept vs one chunk's


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
    monkeypatch.setattr(memory, "predict_step", lambda spec, fit=None: {"step_bytes": 1, "peak_bytes": 2,
                                                                       "method": "trace"})
    monkeypatch.setattr(memory, "trace_limit", lambda spec: 1 << 30)  # no fit: the prediction is faked
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
