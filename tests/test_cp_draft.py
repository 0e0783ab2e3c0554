"""Whole-draft context parallelism: the TTT batch zigzag-sharded over cp ranks with the ring attention as the draft's
causal block, vs the single-process draft: per-step loss sums and correct counts summed over cp, EVERY parameter
gradient all-reduced over cp (and TP shards gathered for tp×cp), rel ≤ ``helpers.tolerance.FP32_REORDERED``; cp=2
(K = 1, 3, 7), cp=4 and tp=2×cp=2. Also the exact number of ring send/recv calls per draft forward+backward. gloo,
one launch per world size.
"""
from __future__ import annotations

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.parity import assert_parity, run_layout
from helpers.tolerance import FP32_REORDERED

SEQ = 24  # rows of 19 and 14 tokens padded to a multiple of 2·cp·tp = 8
SEED = 2  # a case where the draft already matches a few target argmaxes, so the correct counts are not all 0
# (tp, cp, K, dtype); few cases per launch: process start-up and the 2 shared cores dominate the run time
WORLD2 = {"cp2-K1": (1, 2, 1, torch.float64), "cp2-K7": (1, 2, 7, torch.float64),
          "cp2-K3-fp32": (1, 2, 3, torch.float32)}
WORLD4 = {"cp4-K3": (1, 4, 3, torch.float64), "tp2cp2-K3": (2, 2, 3, torch.float64)}


def ring_calls(K: int, cp: int) -> dict:
    """Ring traffic of one draft forward+backward per rank (kernels/ring_attention.py docstring): the causal block is
    attended once per TTT step; each call makes cp-1 K/V hops forward (2 tensors: K/V and positions/validity) and,
    in backward, cp-1 K/V hops plus cp-1 dK/dV hops (1 tensor each)."""
    return {"sends": 4 * K * (cp - 1), "recvs": 4 * K * (cp - 1), "kv_hops": 2 * K * (cp - 1),
            "grad_hops": K * (cp - 1)}


def _cases(rank, world, cases):
    return {name: run_layout(rank, world, tp=tp, cp=cp, K=K, seed=SEED, seq_len=SEQ, dtype=dtype)
            for name, (tp, cp, K, dtype) in cases.items()}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(2, _cases, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(4, _cases, WORLD4)


def _check(results, name, layout):
    tp, cp, K, dtype = layout
    local_valid = torch.zeros(K, dtype=torch.int64)
    for rank, result in enumerate(results):
        r = result[name]
        assert r["cp_rank"] == (rank // tp) % cp and r["tp_rank"] == rank % tp
        assert r["local_seq"] == SEQ // cp
        assert r["lm_head_shape"] == (64 // tp, 32)
        assert assert_parity(r, FP32_REORDERED, f"{name} rank {rank}") == 13
        counts = r["counts"]
        assert {k: counts[k] for k in ("sends", "recvs", "kv_hops", "grad_hops")} == ring_calls(K, cp), name
        assert counts["forward_pairs"] > 0 and counts["backward_pairs"] == counts["forward_pairs"]
        if r["tp_rank"] == 0:
            local_valid += r["local_valid"]
    # every cp rank had its own share of the valid positions (the split is real), and the shares add up
    assert torch.equal(local_valid, results[0][name]["ref"][2]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_cp2_matches_single_process(world2, name):
    _check(world2, name, WORLD2[name])
    assert all(0 < r[name]["local_valid"][0] < r[name]["ref"][2][0] for r in world2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_cp4_and_tp2_cp2_match_single_process(world4, name):
    _check(world4, name, WORLD4[name])


def test_ring_call_formula():
    assert ring_calls(7, 1) == {"sends": 0, "recvs": 0, "kv_hops": 0, "grad_hops": 0}
    assert ring_calls(3, 4) == {"sends": 36, "recvs": 36, "kv_hops": 18, "grad_hops": 9}
