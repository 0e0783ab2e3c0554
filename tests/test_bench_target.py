"""Smoke test of ``python -m recipe.bench target`` on the tiny target: the JSON rows and the exact bytes the capture
keeps per rank (no timing is asserted)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_target_bench_json(tiny_target, tmp_path):
    from recipe.bench.__main__ import main
    from recipe.parallel.cp_shard import label_rows

    out = tmp_path / "target.json"
    length, k = 64, 3
    assert main(["target", "--cp", "1,2", "--length", str(length), "--target", str(tiny_target), "--ttt-steps",
                 str(k), "--tile", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "target" and [r["cp"] for r in res["rows"]] == [1, 2]
    one, two = res["rows"]
    assert one["forward"] == "TargetModel.capture" and two["forward"] == "CPTarget.capture"
    assert len(one["ranks"]) == 1 and len(two["ranks"]) == 2
    hidden, fp32, int64 = 32, 4, 8  # the tiny target: hidden 32, fp32; argmax [1, S] int64 on every rank
    assert one["kept_bytes"] == length * 4 * hidden * fp32 + length * int64  # aux (3·H) + last (H) + argmax
    for rank, r in enumerate(two["ranks"]):
        rows = label_rows(length, 2, rank, k).numel()
        assert r["kept_bytes"] == (length // 2) * 3 * hidden * fp32 + rows * hidden * fp32 + length * int64
        assert r["act_bytes"] >= 0 and r["seconds"] > 0 and r["cpu_seconds"] > 0
    assert "act_cp4_over_cp1" not in res["targets"]  # needs both cp = 1 and cp = 4
