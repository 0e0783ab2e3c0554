"""Smoke tests of ``python -m recipe.bench tp|cp`` at tiny sizes: the JSON fields and the byte accounting (no timing
is asserted); the attention-work count of the zigzag vs contiguous split; the dispatcher's errors."""
from __future__ import annotations

import json

import pytest

TINY = ["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--intermediate", "128",
        "--draft-vocab", "256", "--vocab", "512"]


@pytest.mark.slow
def test_tp_bench_json(tmp_path):
    from recipe.bench.__main__ import main

    out = tmp_path / "tp.json"
    assert main(["tp", "--tp", "1,2", "--length", "32", "--ttt-steps", "2", "--target-hidden", "64", *TINY,
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "tp" and [r["tp"] for r in res["results"]] == [1, 2]
    one, two = res["results"]
    assert len(one["ranks"]) == 1 and len(two["ranks"]) == 2
    for r in res["results"]:
        assert r["grad_bytes"] == r["param_bytes"]  # fp32 gradients of every trainable parameter
        assert r["optimizer_bytes"] >= 2 * r["param_bytes"]  # AdamW exp_avg + exp_avg_sq (+ step counters)
        assert r["peak_bytes"] > 0 and r["step_act_bytes"] >= 0 and r["seconds"] > 0
    # replicated: fc [64, 192] and 4 norms [64]; sharded over tp: q/k/v/o, gate/up/down, lm_head
    replicated = (64 * 192 + 4 * 64) * 4
    assert two["param_bytes"] - replicated == (one["param_bytes"] - replicated) // 2


@pytest.mark.slow
def test_cp_bench_json(tmp_path):
    from recipe.bench.__main__ import main

    out = tmp_path / "cp.json"
    assert main(["cp", "--cp", "2", "--length", "32", "--ttt-steps", "2", *TINY, "--budget-gib", "8",
                 "--search-step", "32", "--max-length", "32", "--json", str(out),
                 "--plot", str(tmp_path / "p.png")]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "cp" and res["spec"]["seq_len"] == 32
    (fixed,) = res["fixed"]
    assert fixed["cp"] == 2 and fixed["status"] == "ok" and fixed["act_bytes"] >= 0 and fixed["seconds"] > 0
    (search,) = res["search"]
    assert search["longest"] == 32 and search["capped"] and [p["length"] for p in search["probes"]] == [32]
    (work,) = res["work"]
    assert work["zigzag"]["scores"] == [264, 264]  # 32·33/2 split evenly
    assert set(res["targets"]) == set()  # needs cp 1 and 4


def test_attention_work_zigzag_is_balanced_and_contiguous_is_not():
    from recipe.bench.cp import attention_work
    from recipe.parallel.cp_shard import contiguous_indices, zigzag_indices

    for cp in (2, 4):
        z, c = attention_work(64, cp, zigzag_indices), attention_work(64, cp, contiguous_indices)
        assert sum(z["scores"]) == sum(c["scores"]) == 64 * 65 // 2
        assert len(set(z["scores"])) == 1 and len(set(z["pairs"])) == 1
        assert max(c["scores"]) > 2 * min(c["scores"]) and max(c["pairs"]) > min(c["pairs"])
    assert attention_work(64, 1, zigzag_indices) == {"pairs": [3], "scores": [64 * 65 // 2]}


def test_dispatcher_errors(capsys):
    from recipe.bench.__main__ import main

    assert main(["nope"]) == 2 and "unknown benchmark 'nope'" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["cp", "--cp", "0"])
