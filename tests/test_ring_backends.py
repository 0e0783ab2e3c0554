"""Each attention backend inside the context-parallel ring (gloo, cp = 2 and 4) vs the dense float64 reference:
out, lse, dq, dk, dv with padding, GQA and rows that read no key; the flex per-pair recompute backward (with the dense
pair forward standing in for flex, whose backward needs CUDA) and flex's forward in the ring; and the whole TTT
draft under CP with ``auto``. One launch per cp size (module fixture)."""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from helpers.ranks import run_ranks
from helpers.parity import assert_parity, run_layout
from kernels.attention_backends import make_causal_attention
from kernels.flex_attention import FLEX_KERNEL
from kernels.ring_attention import RingCausalAttention, make_ring_causal_attention
from kernels.sdpa_attention import SDPA_KERNEL
from kernels.registry import BlockKernel
from kernels.tiled_attention import _dense_forward, recompute_block_backward
from helpers.tp_reference import pad_to_multiple
from helpers.tolerance import FP32_REORDERED, FP64_REORDERED, assert_close_rel
from recipe.parallel.cp_shard import zigzag_indices
from test_attention_backends import reference
from test_ring_attention import _inputs, _loss, _split, _unsplit

S_TRUE = 13
RECOMPUTE_DENSE = BlockKernel("dense-recompute", _dense_forward, recompute_block_backward(_dense_forward))
# name -> (kernel, num_chunks, tile_size); "auto" goes through make_causal_attention
RINGS = {"sdpa": (SDPA_KERNEL, 2, None), "sdpa-tile1": (SDPA_KERNEL, 2, 1), "sdpa-tile3": (SDPA_KERNEL, 2, 3),
         "recompute": (RECOMPUTE_DENSE, 1, None), "recompute-tile2": (RECOMPUTE_DENSE, 2, 2)}


def _ring_case(x, idx, attention):
    q, k, v = (_split(x[n], idx, 2).requires_grad_() for n in "qkv")
    pos, valid = x["pos"][:, idx], x["valid"][:, idx]
    out, lse = attention(q, k, v, pos, pos, valid)
    _loss(out, lse, x["w"][:, :, idx], x["u"][:, :, idx]).backward()
    return dict(idx=idx, out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _rank_results(rank, cp, seq_len):
    idx = zigzag_indices(seq_len, cp, rank)
    x = _inputs(seq_len)
    group = dist.new_group(list(range(cp)))
    res = {name: _ring_case(x, idx, make_ring_causal_attention(group, chunks, tile, kernel))
           for name, (kernel, chunks, tile) in RINGS.items()}
    auto = make_causal_attention("auto", 2, "cpu", group)
    assert isinstance(auto, RingCausalAttention) and auto.kernel is SDPA_KERNEL and auto.exchange.size == cp
    res["auto"] = _ring_case(x, idx, auto)
    flex = make_ring_causal_attention(group, 1, None, FLEX_KERNEL)  # forward only: flex has no CPU backward
    with torch.no_grad():
        out, lse = flex(*(x[n][:, :, idx] for n in "qkv"), x["pos"][:, idx], x["pos"][:, idx], x["valid"][:, idx])
    res["flex-forward"] = dict(idx=idx, out=out, lse=lse)
    res["draft-auto"] = run_layout(rank, cp, tp=1, cp=cp, K=3, seed=2, seq_len=24, attention_backend="auto")
    buffer = io.BytesIO()
    torch.save(res, buffer)  # bytes, not tensors: shared-memory handles die with the worker
    return buffer.getvalue()


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ring_run(request):
    cp = request.param
    seq_len = pad_to_multiple(torch.zeros(S_TRUE), 2 * cp, dim=0).shape[0]
    return cp, seq_len, [torch.load(io.BytesIO(b)) for b in run_ranks(cp, _rank_results, seq_len)]


def _dense(seq_len):
    x = _inputs(seq_len)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out, lse = reference(q, k, v, x["pos"], x["pos"], x["valid"])
    _loss(out, lse, x["w"], x["u"]).backward()
    assert torch.isinf(lse[1, :, :2]).all() and torch.isfinite(lse[0]).all()  # rows that read no key
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _gathered(results, key, names):
    idxs = [r[key]["idx"] for r in results]
    return {n: _unsplit([r[key][n] for r in results], idxs, 2) for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("key", [*RINGS, "auto"])
def test_ring_backend_matches_dense_fp64_reference(ring_run, key):
    cp, seq_len, results = ring_run
    ref = _dense(seq_len)
    got = _gathered(results, key, ("out", "lse", "dq", "dk", "dv"))
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(ref["lse"]))
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.isfinite(got[name]).all() or name == "lse", name
        assert_close_rel(got[name], ref[name], FP64_REORDERED, name)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_in_the_ring_matches_reference(ring_run):
    cp, seq_len, results = ring_run
    ref = _dense(seq_len)
    got = _gathered(results, "flex-forward", ("out", "lse"))
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(ref["lse"]))
    assert_close_rel(got["out"], ref["out"], FP64_REORDERED, "out")
    assert_close_rel(got["lse"], ref["lse"], FP64_REORDERED, "lse")


@pytest.mark.slow
def test_whole_draft_under_cp_with_auto_matches_single_process(ring_run):
    cp, _, results = ring_run
    for rank, r in enumerate(results):  # float64 draft, but the loss sums are float32 (TTTOutput)
        assert assert_parity(r["draft-auto"], FP32_REORDERED, f"auto cp={cp} rank {rank}") == 13
        assert r["draft-auto"]["counts"]["kv_hops"] == 2 * 3 * (cp - 1)  # really the ring, K = 3
