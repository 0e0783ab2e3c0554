"""Smoke test of ``python -m recipe.bench target`` on the tiny target: the JSON rows and the exact bytes the capture
keeps and the bytes it exchanges per rank (no timing is asserted)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_target_bench_json(tiny_target, tmp_path):
    from recipe.bench.__main__ import main
    from recipe.parallel.cp_shard import label_rows

    out = tmp_path / "target.json"
    length, k = 64, 3
    assert main(["target", "--cp", "1,2", "--tp", "1,2", "--length", str(length), "--target", str(tiny_target),
                 "--ttt-steps", str(k), "--tile", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "target" and [(r["cp"], r["tp"]) for r in res["rows"]] == [(1, 1), (1, 2), (2, 1),
                                                                                          (2, 2)]
    assert res["argmax_chunk"] == 128 * 1024 ** 2 // (96 * 4)  # sized from the tiny vocabulary (96), fp32
    hidden, fp32, int64 = 32, 4, 8  # the tiny target: hidden 32, fp32; argmax [1, S] int64 on every rank
    for row in res["rows"]:
        cp, tp = row["cp"], row["tp"]
        assert row["forward"] == ("TargetModel.capture" if cp * tp == 1 else "SplitTarget.capture")
        assert len(row["ranks"]) == cp * tp
        for rank, r in enumerate(row["ranks"]):
            rows = length - 1 if cp == 1 else label_rows(length, cp, rank // tp, k).numel()  # label rows 1..S-1
            if cp * tp == 1:
                rows = length  # the whole last hidden state
            assert r["kept_bytes"] == (length // cp) * 3 * hidden * fp32 + rows * hidden * fp32 + length * int64
            assert r["forward_positions"] == length // (cp * tp)
            halo = 2 * k * hidden * fp32 if cp == 2 else 0  # the first K rows of chunks 1 and 3
            gathered = (tp - 1) * length // (cp * tp) * 4 * hidden * fp32
            assert r["exchange_bytes"] == (0 if cp * tp == 1 else gathered + halo + length * int64)
            assert r["act_bytes"] >= 0 and r["seconds"] > 0 and r["cpu_seconds"] > 0
    assert set(res["targets"]) == {"act_cp2tp2_over_cp1tp1", "cpu_cp2tp2_over_cp1tp1"}  # no (4, 1) row


def test_target_packing_arms_isolate_the_documents(tiny_target):
    """``target --packing``'s arms on the tiny target: the same samples padded and packed, through the whole target
    and the one-rank split, their aux states equal within ``FP32_REORDERED`` (another order of sums) over every
    sample's tokens; the packed arms are one row of all the tokens."""
    import torch
    from rich.console import Console

    from helpers.tolerance import FP32_REORDERED
    from recipe.bench.target_packing import ARMS, measure_mixes
    from recipe.parallel.collectives import Collectives
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget

    target = TargetModel(tiny_target, dtype=torch.float32, device="cpu")
    split = SplitTarget(target, Collectives("cpu"), None, 1, 0, "tiled", 8, 64)
    (row,) = measure_mixes(target, split, [[30, 7, 19, 2]], 3, 64, 1, Console(quiet=True))
    assert row["padded"]["shape"] == [4, 30] and row["packed, whole"]["shape"] == row["packed, split"]["shape"] == [
        1, 58]
    assert row["padded"]["aux_max_rel"] == 0 and row["padded"]["padding_share"] == pytest.approx(1 - 58 / 120)
    for name in ARMS[1:]:
        assert row[name]["aux_max_rel"] <= FP32_REORDERED, name  # other sums, the same states
        assert row[name]["seconds"] > 0 and row[name]["padding_share"] == 0
