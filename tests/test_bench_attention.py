"""recipe.bench attention / step: the speed-up bookkeeping, the flags, a real CPU run of each (tiny shapes), and the
bench's draft carrying the requested backend."""
from __future__ import annotations

import json

import pytest
import torch

from kernels.sdpa_attention import SDPA_KERNEL
from recipe.bench import attention, step
from recipe.bench.measure import build_model
from recipe.plan.spec import BenchSpec


def test_speedups_are_relative_to_tiled_at_the_same_dtype_and_length():
    rows = [{"backend": "tiled", "dtype": "fp32", "length": 8, "status": "ok", "forward_backward_seconds": 3.0},
            {"backend": "sdpa", "dtype": "fp32", "length": 8, "status": "ok", "forward_backward_seconds": 1.5},
            {"backend": "sdpa", "dtype": "bf16", "length": 8, "status": "ok", "forward_backward_seconds": 1.0},
            {"backend": "sdpa", "dtype": "fp32", "length": 16, "status": "error"}]
    attention.add_speedups(rows)
    assert [r.get("speedup_vs_tiled") for r in rows] == [1.0, 2.0, None, None]
    rounds = [{"backend": b, "length": 8, "status": "ok", "seconds": s, "peak_bytes": 1}
              for b, s in (("tiled", 4.0), ("sdpa", 2.0), ("tiled", 6.0), ("sdpa", 1.0), ("tiled", 5.0))]
    summary = {e["backend"]: e for e in step.summarise(rounds + [{"backend": "sdpa", "length": 8, "status": "oom"}])}
    assert summary["tiled"]["seconds"] == 5.0 and summary["tiled"]["x_vs_tiled"] == 1.0
    assert summary["sdpa"]["rounds"] == 2 and summary["sdpa"]["x_vs_tiled"] == 5.0 / 1.5


def test_step_summary_speed_fields_from_the_flop_model():
    """``summarise`` with the specs: positions and supervised tokens per second, model and hardware TFLOP/s a GPU
    from ``spec_flops`` (the world of tp·cp ranks sharing the step), MFU against the peak."""
    from recipe.plan.spec import spec_flops

    spec = BenchSpec(seq_len=64, layout="chunked+ckpt", hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     draft_vocab=40, vocab=50, target_hidden=24, ttt_steps=2, cp=2, mask="long10",
                     attention_backend="tiled")
    rounds = [{"backend": "tiled", "length": 64, "mask": "long10", "status": "ok", "seconds": 2.0, "peak_bytes": 1}]
    entry = step.summarise(rounds, {("tiled", 64, "long10", False): spec}, peak_tflops=1e-6)[0]
    flops = spec_flops(spec)
    assert flops.hardware_total > flops.model_total  # chunked loss and checkpointed steps recompute
    assert entry["positions_per_s"] == 32.0 and entry["supervised_tokens_per_s"] == 6 / 2.0
    assert entry["model_tflops_per_gpu"] == flops.model_total / 2.0 / 2 / 1e12
    assert entry["hardware_tflops_per_gpu"] == flops.hardware_total / 2.0 / 2 / 1e12
    assert entry["mfu"] == entry["model_tflops_per_gpu"] / 1e-6


def test_bench_draft_carries_the_backend():
    spec = BenchSpec(seq_len=16, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=40,
                     vocab=50, target_hidden=24, ttt_steps=2, attention_backend="sdpa", attention_tile=8)
    causal = build_model(spec, torch.device("cpu")).draft.midlayer.self_attn.causal_attention
    assert causal.kernel is SDPA_KERNEL and causal.tile_size == 8


def test_bad_flags_exit_with_a_message(capsys):
    for main, argv, message in ((attention.main, ["--backends", "fast"], "unknown backend"),
                                (attention.main, ["--backends", "flex", "--device", "cpu"], "does not run on cpu"),
                                (attention.main, ["--heads", "6", "--kv-heads", "4"], "--kv-heads must divide"),
                                (step.main, ["--backends", "tiled,fast"], "unknown backend"),
                                (step.main, ["--lengths", "4q"], "bad length '4q'")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_attention_and_step_benchmarks_run_on_cpu(tmp_path):
    out = tmp_path / "attention.json"
    assert attention.main(["--lengths", "64,128", "--dtypes", "fp32", "--heads", "2", "--kv-heads", "1",
                           "--head-dim", "8", "--repeats", "1", "--tile", "32", "--device", "cpu",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["auto"] == "sdpa" and report["config"]["tile"] == 32
    assert [(r["backend"], r["length"], r["status"]) for r in report["results"]] == [
        ("tiled", 64, "ok"), ("tiled", 128, "ok"), ("sdpa", 64, "ok"), ("sdpa", 128, "ok")]
    assert all(r["forward_backward_seconds"] > 0 and r["forward_seconds"] > 0 and r["speedup_vs_tiled"] > 0
               and r["peak_bytes"] >= 0 for r in report["results"])
    out = tmp_path / "step.json"
    assert step.main(["--lengths", "32", "--rounds", "1", "--steps", "1", "--hidden", "32", "--heads", "4",
                      "--kv-heads", "2", "--head-dim", "8", "--intermediate", "48", "--vocab", "50",
                      "--draft-vocab", "40", "--target-hidden", "24", "--ttt-steps", "2", "--device", "cpu",
                      "--peak-tflops", "0.5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for e in report["summary"]:
        assert e["positions_per_s"] == e["supervised_tokens_per_s"] == 32 / e["seconds"]  # the full mask
        assert e["hardware_tflops_per_gpu"] > e["model_tflops_per_gpu"] > 0  # sdpa/tiled: flash-style backward
        assert e["mfu"] == e["model_tflops_per_gpu"] / 0.5
    assert [(e["backend"], e["length"], e["rounds"]) for e in report["summary"]] == [("tiled", 32, 1),
                                                                                    ("sdpa", 32, 1)]
    assert report["summary"][0]["x_vs_tiled"] == 1.0 and report["summary"][1]["x_vs_tiled"] > 0
