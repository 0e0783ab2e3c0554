"""The compiled flex path is never silently slow: one dynamic-shape compile serves every length, the recompile
limit and a request to run uncompiled on CUDA are hard errors, compiles are counted and logged, and one block mask
per micro-batch serves every TTT step. Checked on CPU: Dynamo traces flex attention here exactly as on CUDA, with its
"eager" backend standing in for Inductor (whose CPU flex kernel has no LSE output)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from kernels.flex_attention import (BlockMaskCache, CompiledFlex, FlexCausalAttention, FlexCompileError,
                                    flex_block_attention, flex_block_mask, make_flex_kernel)
from recipe.model.ttt import TTTModel
from helpers.cases import build_case
from helpers.tolerance import FP32_REORDERED, assert_close_rel


def _inputs(s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, s, 16, generator=g)
    k, v = (torch.randn(1, 2, s, 16, generator=g) for _ in range(2))
    pos = torch.arange(s)[None]
    valid = torch.ones(1, s, dtype=torch.bool)
    valid[:, -3:] = False
    return q, k, v, pos, valid


def _call(fn, s):
    q, k, v, pos, valid = _inputs(s)
    mask = flex_block_mask(pos, pos, valid)
    out, aux = fn(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def test_dynamic_policy_compiles_once_for_every_length(caplog):
    """Five lengths (128-aligned and not, 2 to 6 blocks): the first compile makes lengths and block counts symbolic
    (duck sizing off), none after; each output equals flex's eager one exactly. (A first call of one block compiles
    once more: ``tests/test_flex_compiled.py``'s online sequence.)"""
    compiled = CompiledFlex(flex_attention, dynamic=True, backend="eager")
    with caplog.at_level(logging.INFO, logger="kernels.flex_attention"):
        for s in (256, 384, 200, 640, 129):
            out, lse = _call(compiled, s)
            ref_out, ref_lse = _call(flex_attention, s)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), s
    assert compiled.compiles == 1 and compiled.calls == 5
    logged = [r.getMessage() for r in caplog.records if "flex attention compile" in r.getMessage()]
    assert len(logged) == 1 and logged[-1] == (f"flex attention compile #1 (dynamic=True, backend eager): input "
                                               f"shapes {compiled.last_shapes}")
    assert compiled.stats()["compiles"] == 1


def test_recompile_limit_is_a_hard_error_not_an_uncompiled_fallback():
    """A static policy recompiles per length; past the limit Dynamo would run flex uncompiled: here it raises."""
    def attention(q, k, v, block_mask):  # own code object: its own Dynamo cache and recompile count
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    compiled = CompiledFlex(attention, dynamic=False, recompile_limit=2, backend="eager")
    for s in (128, 256):
        q, k, v, pos, valid = _inputs(s)
        compiled(q, k, v, flex_block_mask(pos, pos, valid))
    assert compiled.compiles == 2
    q, k, v, pos, valid = _inputs(384)
    with pytest.raises(FlexCompileError, match=r"reached its recompile limit \(2 compiles, dynamic=False"):
        compiled(q, k, v, flex_block_mask(pos, pos, valid))
    assert compiled.compiles == 2


def test_uncompiled_flex_on_cuda_is_refused():
    """The guard runs before anything touches the tensors (a CUDA-looking stand-in suffices on a CPU machine)."""
    q = SimpleNamespace(is_cuda=True, shape=(2, 32, 131072, 128))
    k = SimpleNamespace(is_cuda=True, shape=(2, 8, 131072, 128))
    with pytest.raises(FlexCompileError, match=r"uncompiled on CUDA.*\[2, 32, 131072, 131072\]"):
        flex_block_attention(q, k, k, None, None, compiled=False)


def test_block_mask_cache_reuses_live_tensors_only():
    masks = BlockMaskCache(capacity=4)
    _, _, _, pos, valid = _inputs(300)
    first = masks.get(pos, pos, valid)
    assert masks.get(pos, pos, valid)[0] is first[0] and (masks.hits, masks.misses) == (1, 1)
    assert masks.get(pos[:, :200], pos, valid)[0] is not first[0]  # another view: another mask
    valid[0, 5] = False  # modified in place: its version changes, the mask is rebuilt
    rebuilt = masks.get(pos, pos, valid)
    assert rebuilt[0] is not first[0] and masks.misses == 3
    assert torch.equal(rebuilt[1], flex_block_attention.__globals__["_has_key"](pos, pos, valid))
    del pos, valid, first, rebuilt
    _, _, _, other, other_valid = _inputs(64)
    masks.get(other, other, other_valid)
    assert len(masks) == 1  # entries of freed tensors were dropped


def test_one_block_mask_per_micro_batch_across_ttt_steps():
    """The draft's K TTT steps read the same causal block: one mask build, K - 1 reuses; same numbers as the
    dense block (flex forward, eager on CPU; no gradients, which flex computes on CUDA only)."""
    K = 3
    draft, head_VH, batch = build_case(0, K, seq_len=16)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    with torch.no_grad():
        want = model(batch)
        attention = FlexCausalAttention()
        model.draft.midlayer.self_attn.causal_attention = attention
        got = model(batch)
    assert (attention.masks.misses, attention.masks.hits) == (1, K - 1)
    assert_close_rel(got.loss_sum_K, want.loss_sum_K, FP32_REORDERED, "flex against the tiled kernel")
    assert torch.equal(got.valid_K, want.valid_K) and torch.equal(got.correct_K, want.correct_K)


def test_flex_kernel_has_its_own_mask_cache():
    a, b = make_flex_kernel(), make_flex_kernel()
    assert a.forward.masks is not b.forward.masks


def test_a_graph_break_is_a_hard_error_not_a_partly_eager_flex():
    """``fullgraph``: a break would run the pieces around it (flex included) eagerly; here it raises."""
    def broken(q, k, v, block_mask):
        torch._dynamo.graph_break()
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    compiled = CompiledFlex(broken, backend="eager")
    q, k, v, pos, valid = _inputs(128)
    with pytest.raises(FlexCompileError, match="could not be compiled"):
        compiled(q, k, v, flex_block_mask(pos, pos, valid))
