"""Ring attention (CP causal block) vs dense single-process attention: out, lse and every gradient, in fp64.

Multi-rank cases run once per cp size (module fixture, gloo via helpers.ranks) and feed several tests.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

from helpers.ranks import run_ranks
from kernels.block_attention import block_attention, expand_kv, merge_lse
from kernels.ring_attention import RingExchange, make_ring_causal_attention, ring_block_attention
from kernels.tiled_attention import attention_block_backward
from helpers.tp_reference import pad_to_multiple
from helpers.tolerance import FP32_REORDERED, FP64_REORDERED, assert_close_rel
from recipe.parallel.cp_shard import contiguous_indices, zigzag_indices

B, H, HKV, D, S_TRUE = 2, 4, 2, 8, 13
DT = torch.float64


def _inputs(seq_len: int, seed: int = 0):
    """Full-sequence q/k/v, positions, key validity (padding + two leading invalid keys in batch row 1, so some
    query rows read no key at all) and loss weights w (for out) and u (for lse)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, seq_len, D, generator=g, dtype=DT) for h in (H, HKV, HKV))
    pos = torch.arange(seq_len).expand(B, seq_len).clone()
    valid = pad_to_multiple(torch.ones(B, S_TRUE, dtype=torch.bool), seq_len, dim=1, value=False)
    valid[1, :2] = False
    w = torch.randn(B, H, seq_len, D, generator=g, dtype=DT)
    u = torch.randn(B, H, seq_len, generator=g, dtype=DT)
    return dict(q=q, k=k, v=v, pos=pos, valid=valid, w=w, u=u)


def _loss(out, lse, w, u):
    """Uses out and every finite lse, so the lse-gradient path is exercised."""
    finite = torch.isfinite(lse)
    return (out * w).sum() + torch.where(finite, lse * u, torch.zeros_like(lse)).sum()


def _diag_attention(q_BHSD, ks, vs, scale):
    """Attention of each query over its diagonal keys K_i[p] (same position), i = 1..k: (out, lse)."""
    h = q_BHSD.shape[1]
    k_BHSKD = torch.stack([expand_kv(x, h) for x in ks], dim=3)
    v_BHSKD = torch.stack([expand_kv(x, h) for x in vs], dim=3)
    s_BHSK = torch.einsum("bhsd,bhskd->bhsk", q_BHSD, k_BHSKD) * scale
    lse = torch.logsumexp(s_BHSK, dim=-1)
    out = torch.einsum("bhsk,bhskd->bhsd", torch.softmax(s_BHSK, dim=-1), v_BHSKD)
    return out, lse


def _ttt_inputs(seq_len, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(B, H, seq_len, D, generator=g, dtype=DT) for _ in range(steps + 1)]
    ks = [torch.randn(B, HKV, seq_len, D, generator=g, dtype=DT) for _ in range(steps + 1)]
    vs = [torch.randn(B, HKV, seq_len, D, generator=g, dtype=DT) for _ in range(steps + 1)]
    ws = [torch.randn(B, H, seq_len, D, generator=g, dtype=DT) for _ in range(steps + 1)]
    us = [torch.randn(B, H, seq_len, generator=g, dtype=DT) for _ in range(steps + 1)]
    return qs, ks, vs, ws, us


def _ttt_loss(causal, qs, ks, vs, ws, us, pos, valid):
    """Steps k = 0..K: causal block over (K_0, V_0) merged with the k diagonal keys (K_i, V_i), i = 1..k."""
    scale = 1.0 / math.sqrt(D)
    total = 0.0
    for step, q in enumerate(qs):
        out, lse = causal(q, ks[0], vs[0], pos, pos, valid)
        if step:
            out, lse = merge_lse(out, lse, *_diag_attention(q, ks[1:step + 1], vs[1:step + 1], scale))
        total = total + _loss(out, lse, ws[step], us[step])
    return total


def _dense_ttt_loss(qs, ks, vs, ws, us, pos, valid):
    """Independent reference: one dense masked softmax per step over [K_0 | K_1 | ... | K_k] (S·(k+1) keys)."""
    s_len, scale, total = pos.shape[1], 1.0 / math.sqrt(D), 0.0
    causal_BQK = (pos[:, None, :] <= pos[:, :, None]) & valid[:, None, :]
    eye_BQK = torch.eye(s_len, dtype=torch.bool).expand(B, s_len, s_len)
    for step, q in enumerate(qs):
        keys = torch.cat([expand_kv(x, H) for x in ks[:step + 1]], dim=2)
        vals = torch.cat([expand_kv(x, H) for x in vs[:step + 1]], dim=2)
        mask = torch.cat([causal_BQK] + [eye_BQK] * step, dim=2)[:, None]
        s = (q @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        total = total + _loss(p @ vals, lse, ws[step], us[step])
    return total


def _split(x, idx, dim):
    return x.index_select(dim, idx).detach().clone().requires_grad_(x.requires_grad)


def _rank_worker(rank, cp, seq_len):
    """Everything one cp rank computes, as torch.save bytes (tensors put on the run_ranks queue travel as shared
    memory handles that die with the worker); holds local shards, global order is restored by the parent."""
    buffer = io.BytesIO()
    torch.save(_rank_results(rank, cp, seq_len), buffer)
    return buffer.getvalue()


def _basic(x, idx, group, tile_size=None):
    """Ring out/lse/grads of the local shard ``idx`` over ``group``, with the exchange counts of forward and
    backward."""
    q, k, v = (_split(x[n], idx, 2).requires_grad_() for n in "qkv")
    pos, valid = x["pos"][:, idx], x["valid"][:, idx]
    ring = make_ring_causal_attention(group, tile_size=tile_size)
    out, lse = ring(q, k, v, pos, pos, valid)
    fwd_counts = dict(vars(ring.exchange.counts))
    ring.exchange.counts.reset()
    _loss(out, lse, x["w"][:, :, idx], x["u"][:, :, idx]).backward()
    return dict(idx=idx, out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                fwd_counts=fwd_counts, bwd_counts=dict(vars(ring.exchange.counts)))


def _rank_results(rank, cp, seq_len):
    idx = zigzag_indices(seq_len, cp, rank)
    x = _inputs(seq_len)
    pos, valid = x["pos"][:, idx], x["valid"][:, idx]
    res = {"basic": _basic(x, idx, None), "tiled": _basic(x, idx, None, tile_size=1)}
    if cp == 4:  # two cp=2 subgroups whose group ranks differ from global ranks: peers must be translated
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        res["subgroup"] = _basic(x, zigzag_indices(seq_len, 2, rank // 2), groups[rank % 2])
    # TTT composition, K in {1, 3} diagonal-key steps.
    for steps in (1, 3):
        qs, ks, vs, ws, us = _ttt_inputs(seq_len, steps)
        qs, ks, vs = ([_split(t, idx, 2).requires_grad_() for t in ts] for ts in (qs, ks, vs))
        ws, us = [w[:, :, idx] for w in ws], [u[:, :, idx] for u in us]
        _ttt_loss(make_ring_causal_attention(None), qs, ks, vs, ws, us, pos, valid).backward()
        res[f"ttt{steps}"] = [t.grad for t in qs + ks + vs]
    # Work balance: zigzag vs contiguous split of a fully valid sequence (forward and backward pair counts).
    for name, layout in (("zigzag", zigzag_indices), ("contiguous", contiguous_indices)):
        lidx = layout(seq_len, cp, rank)
        q2, k2, v2 = (_split(x[n], lidx, 2).requires_grad_() for n in "qkv")
        exchange = RingExchange(None)
        out2, lse2 = ring_block_attention(q2, k2, v2, x["pos"][:, lidx], x["pos"][:, lidx], None, exchange=exchange)
        (out2.sum() + lse2.sum()).backward()
        res[name] = dict(idx=lidx, out=out2.detach(), dq=q2.grad, fwd=exchange.counts.forward_pairs,
                         bwd=exchange.counts.backward_pairs)
    return res


def _unsplit(shards, idxs, dim):
    full = torch.empty_like(torch.cat(shards, dim))
    return full.index_copy_(dim, torch.cat(idxs), torch.cat(shards, dim))


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ring_run(request):
    cp = request.param
    seq_len = pad_to_multiple(torch.zeros(S_TRUE), 2 * cp, dim=0).shape[0]  # 13 -> 16 for cp 2 and 4
    results = [torch.load(io.BytesIO(b)) for b in run_ranks(cp, _rank_worker, seq_len)]
    return cp, seq_len, results


def _close(a, b, what):
    assert_close_rel(a, b, FP64_REORDERED, what)


@pytest.mark.slow
def test_ring_matches_dense_forward_and_grads(ring_run):
    cp, seq_len, results = ring_run
    x = _inputs(seq_len)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out, lse = block_attention(q, k, v, x["pos"], x["pos"], x["valid"])
    _loss(out, lse, x["w"], x["u"]).backward()
    assert torch.isinf(lse[1, :, :2]).all() and torch.isfinite(lse[0]).all()  # the case covers empty rows
    cases = [("basic", results), ("tiled", results)]
    if cp == 4:  # ranks (0, 2) and (1, 3) each ran a cp=2 ring in their own subgroup
        cases += [("subgroup", results[0::2]), ("subgroup", results[1::2])]
    for key, members in cases:
        _check_against_dense(members, key, out, lse, q.grad, k.grad, v.grad)


def _check_against_dense(results, key, out, lse, dq, dk, dv):
    idxs = [r[key]["idx"] for r in results]
    got = {n: _unsplit([r[key][n] for r in results], idxs, 2) for n in ("out", "lse", "dq", "dk", "dv")}
    _close(got["out"], out.detach(), "out")
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(lse))
    _close(got["lse"], lse.detach(), "lse")
    for name, ref in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(got[name]).all(), name
        _close(got[name], ref, name)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_composition_matches_dense(ring_run, steps):
    cp, seq_len, results = ring_run
    x = _inputs(seq_len)
    qs, ks, vs, ws, us = _ttt_inputs(seq_len, steps)
    leaves = [t.requires_grad_() for t in qs + ks + vs]
    _dense_ttt_loss(qs, ks, vs, ws, us, x["pos"], x["valid"]).backward()
    idxs = [r["basic"]["idx"] for r in results]
    for i, leaf in enumerate(leaves):
        _close(_unsplit([r[f"ttt{steps}"][i] for r in results], idxs, 2), leaf.grad, f"grad of input {i}")


@pytest.mark.slow
def test_exchange_counts(ring_run):
    """Per rank per call: forward cp-1 K/V hops (2 tensors each), backward cp-1 K/V + cp-1 dK/dV hops (1 each);
    tiling changes the work per block, not the traffic."""
    cp, seq_len, results = ring_run
    for r in (r[key] for r in results for key in ("basic", "tiled")):
        assert r["fwd_counts"]["kv_hops"] == cp - 1 and r["fwd_counts"]["grad_hops"] == 0
        assert r["fwd_counts"]["sends"] == r["fwd_counts"]["recvs"] == 2 * (cp - 1)
        assert r["bwd_counts"]["kv_hops"] == cp - 1 and r["bwd_counts"]["grad_hops"] == cp - 1
        assert r["bwd_counts"]["sends"] == r["bwd_counts"]["recvs"] == 2 * (cp - 1)
    # one position per tile: a pair is computed exactly when its key is valid and not later than its query
    x = _inputs(seq_len)
    readable = int(((x["pos"][0][None, :] <= x["pos"][0][:, None]) & (x["valid"][0] | x["valid"][1])[None, :]).sum())
    assert sum(r["tiled"]["fwd_counts"]["forward_pairs"] for r in results) == readable
    assert sum(r["tiled"]["bwd_counts"]["backward_pairs"] for r in results) == readable


@pytest.mark.slow
def test_work_balance_zigzag_vs_contiguous(ring_run):
    """Pairs of (query chunk, key chunk) with any readable key: zigzag 2cp+1 on every rank; contiguous 4r+3."""
    cp, seq_len, results = ring_run
    zig = [r["zigzag"]["fwd"] for r in results]
    contiguous = [r["contiguous"]["fwd"] for r in results]
    assert zig == [2 * cp + 1] * cp and max(zig) / min(zig) == 1
    assert contiguous == [4 * r + 3 for r in range(cp)]
    assert [r["zigzag"]["bwd"] for r in results] == zig
    assert [r["contiguous"]["bwd"] for r in results] == contiguous
    x = _inputs(seq_len)
    q = x["q"].clone().requires_grad_()
    out, lse = block_attention(q, x["k"], x["v"], x["pos"], x["pos"])
    (out.sum() + lse.sum()).backward()
    for name in ("zigzag", "contiguous"):  # both layouts are exact, only their balance differs
        idxs = [r[name]["idx"] for r in results]
        _close(_unsplit([r[name]["out"] for r in results], idxs, 2), out.detach(), f"{name} out")
        _close(_unsplit([r[name]["dq"] for r in results], idxs, 2), q.grad, f"{name} dq")


# ---- single-process checks (ring of size 1: no communication) ----

def test_single_rank_ring_equals_block_attention_and_skips_future_chunks():
    x = _inputs(16)
    ref_in = [x[n].clone().requires_grad_() for n in "qkv"]
    ring_in = [x[n].clone().requires_grad_() for n in "qkv"]
    out, lse = block_attention(*ref_in, x["pos"], x["pos"], x["valid"])
    _loss(out, lse, x["w"], x["u"]).backward()
    exchange = RingExchange(None)
    out_r, lse_r = ring_block_attention(*ring_in, x["pos"], x["pos"], x["valid"], exchange=exchange, num_chunks=4)
    _loss(out_r, lse_r, x["w"], x["u"]).backward()
    _close(out_r, out, "out")
    _close(lse_r, lse, "lse")
    for a, b, n in zip(ring_in, ref_in, "qkv"):
        _close(a.grad, b.grad, f"d{n}")
    # 4 chunks of 4 positions: causal pairs (i, j <= i) = 10; chunk 3 is positions 12..15 (13..15 padding) and
    # still readable by chunk 3 itself via key 12.
    assert exchange.counts.forward_pairs == exchange.counts.backward_pairs == 10
    assert exchange.counts.sends == exchange.counts.kv_hops == 0


def test_attention_block_backward_matches_autograd_with_dlse():
    x = _inputs(16)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out, lse = block_attention(q, k, v, x["pos"], x["pos"], x["valid"])
    _loss(out, lse, x["w"], x["u"]).backward()
    dlse = torch.where(torch.isfinite(lse), x["u"], torch.zeros_like(lse))
    delta = (x["w"] * out.detach()).sum(-1)
    dq, dk, dv = attention_block_backward(x["w"], dlse, delta, lse.detach(), x["q"], x["k"], x["v"], x["pos"],
                                          x["pos"], x["valid"], 1.0 / math.sqrt(D))
    _close(dq, q.grad, "dq")
    _close(dk, k.grad, "dk")
    _close(dv, v.grad, "dv")
    assert dk.shape == (B, HKV, 16, D)


def test_float32_inputs_accumulate_in_float32():
    x = _inputs(16)
    q, k, v = (x[n].float().requires_grad_() for n in "qkv")
    out, lse = ring_block_attention(q, k, v, x["pos"], x["pos"], x["valid"])
    assert out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = block_attention(x["q"], x["k"], x["v"], x["pos"], x["pos"], x["valid"])
    assert_close_rel(out.double(), ref_out, FP32_REORDERED, "float32 ring out")
    _loss(out, lse, x["w"].float(), x["u"].float()).backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_shape_errors_are_clear():
    x = _inputs(16)
    with pytest.raises(ValueError, match="shapes disagree"):
        ring_block_attention(x["q"], x["k"], x["v"][:, :, :8], x["pos"], x["pos"], x["valid"])
