"""Every attention backend that runs on CPU vs an independent dense float64 reference: out, lse, dq, dk, dv with
padding, GQA, rows with no readable key and Sq != Sk; the fused kernel's mask layouts and its backward paths; flex
attention's block mask and forward (its backward needs CUDA); backend selection; the whole draft with ``auto``."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.attention_backends import backend_names, make_causal_attention, resolve_attention_backend
from kernels.block_attention import block_attention
from kernels.flex_attention import flex_block_attention, flex_block_mask
from kernels.sdpa_attention import SDPA_KERNEL, pair_mask
from kernels.registry import BlockKernel
from kernels.tiled_attention import DENSE_KERNEL, TiledCausalAttention, _dense_forward, recompute_block_backward
from recipe.model.ttt import TTTModel
from helpers.attention import B, D, attention_case as _case, dense_reference as reference, run_attention
from helpers.cases import assert_same_run, model_pair, run_model
from helpers.tolerance import BF16_ROUNDED, FP32_REORDERED, FP64_REORDERED, assert_close_rel, within

D_CUDA = 16
"""Head dim of the CUDA cases: Inductor's flex kernel refuses head dims below 16 (``tl.dot``)."""
RECOMPUTE_DENSE = BlockKernel("dense-recompute", _dense_forward, recompute_block_backward(_dense_forward))
"""The ring backward flex uses (per-pair recompute through the pair's own out and lse), with the dense forward."""


def _assert_matches_reference(got, case, tol):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = run_attention(reference, *[t.double() if t.is_floating_point() else t for t in case])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close_rel(out.double(), ref_out, tol, "out")
    assert_close_rel(lse.double(), ref_lse, tol, "lse")
    for g, ref, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert torch.isfinite(g).all() and ref.abs().sum() > 0, name
        assert_close_rel(g.double(), ref, tol, name)


CPU_CALLABLES = {"tiled": lambda t: TiledCausalAttention(t, DENSE_KERNEL), "sdpa": lambda t: TiledCausalAttention(
    t, SDPA_KERNEL), "recompute": lambda t: TiledCausalAttention(t, RECOMPUTE_DENSE)}


@pytest.mark.parametrize("kind", ["square", "subset", "later", "mixed"])
@pytest.mark.parametrize("tile", [None, 1, 3, 16])
@pytest.mark.parametrize("name", sorted(CPU_CALLABLES))
def test_cpu_backends_match_dense_fp64_reference(name, tile, kind):
    case = _case(kind)
    if kind == "square":  # the case covers rows that read no key
        assert torch.isinf(reference(*case[:6])[1][1, :, :2]).all()
    _assert_matches_reference(run_attention(CPU_CALLABLES[name](tile), *case), case, tol=FP64_REORDERED)


class _BackwardHeadDims(TorchDispatchMode):
    """Head dim of q at every call of the fused CPU backward op."""

    def __init__(self):
        super().__init__()
        self.dims = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            self.dims.append(args[1].shape[-1])
        return func(*args, **(kwargs or {}))


def test_sdpa_backward_with_lse_gradient_on_rows_without_output_gradient():
    """dout = 0 with dlse != 0 cannot go in through out (beta·dout); that call takes one padded head dim instead.
    Both paths give the reference gradients."""
    q, k, v, q_pos, k_pos, valid, w, u = _case("square")
    for zero_rows, padded in ((False, False), (True, True)):
        w_case = w.clone()
        if zero_rows:
            w_case[:, :, 5:9] = 0
        with _BackwardHeadDims() as seen:
            got = run_attention(TiledCausalAttention(None, SDPA_KERNEL), q, k, v, q_pos, k_pos, valid, w_case, u)
        assert seen.dims == [D + 1 if padded else D]
        _assert_matches_reference(got, (q, k, v, q_pos, k_pos, valid, w_case, u), tol=FP64_REORDERED)


def test_sdpa_pair_layouts_pick_the_cheapest_mask():
    pos = torch.arange(6).expand(2, 6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    assert pair_mask(pos, pos, valid, torch.float32)[:3:2] == (True, "causal")
    assert pair_mask(pos, pos, valid, torch.float32)[1] is None
    causal, mask, layout = pair_mask(pos + 6, pos, valid & (pos < 4), torch.float32)
    assert (causal, layout, mask.shape) == (False, "full", (2, 1, 1, 6))
    assert torch.equal(torch.isinf(mask[:, 0, 0]), pos >= 4) and mask.dtype == torch.float32
    causal, mask, layout = pair_mask(pos[:, 2:], pos, valid, torch.float64)
    assert (causal, layout, mask.shape) == (False, "general", (2, 1, 4, 6))
    assert torch.equal(torch.isinf(mask[:, 0]), pos[:, None, :] > pos[:, 2:, None])


def test_sdpa_float32_and_bfloat16_against_the_fp64_reference():
    """fp32 computes in fp32: within ``FP32_REORDERED`` of the fp64 reference. bf16 inputs compute in fp32 too (lse
    float32, grads back in bf16): within bf16 rounding of the inputs' own reference (``BF16_ROUNDED``)."""
    case = _case("square", dtype=torch.float32)
    _assert_matches_reference(run_attention(TiledCausalAttention(4, SDPA_KERNEL), *case), case, tol=FP32_REORDERED)
    low = [t.bfloat16() if t.is_floating_point() else t for t in case]
    out, lse, grads = run_attention(TiledCausalAttention(4, SDPA_KERNEL), *low)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and {g.dtype for g in grads} == {torch.bfloat16}
    ref_out, ref_lse, ref_grads = run_attention(reference, *[t.double() if t.is_floating_point() else t for t in low])
    assert_close_rel(lse.double(), ref_lse, FP32_REORDERED, "lse")  # scores in fp32 from bf16 inputs
    for got, ref in zip([out] + grads, [ref_out] + ref_grads):
        within(((got.double() - ref).norm() / ref.norm()).item(), BF16_ROUNDED, "bf16 gradient")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@pytest.mark.parametrize("kind", ["square", "subset", "later", "mixed"])
@pytest.mark.parametrize("block", [1, 3, 4, 128])
def test_flex_forward_matches_reference_on_cpu(kind, block):
    """flex attention's eager CPU forward with our block mask and LSE handling (the CUDA path compiles the same)."""
    q, k, v, q_pos, k_pos, valid, _, _ = _case(kind)
    out, lse = flex_block_attention(q, k, v, q_pos, k_pos, valid, compiled=False, block_size=block)
    ref_out, ref_lse = reference(q, k, v, q_pos, k_pos, valid)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and lse.dtype == torch.float64
    assert_close_rel(out, ref_out, FP64_REORDERED, "out")
    assert_close_rel(lse, ref_lse, FP64_REORDERED, "lse")


@pytest.mark.parametrize("kind", ["square", "subset", "later", "mixed"])
@pytest.mark.parametrize("block", [1, 3, 4, 5])
def test_flex_block_mask_skips_only_unreadable_blocks_and_marks_only_full_ones(kind, block):
    """Against the element mask: a skipped block holds no readable (query, key), a "full" block only readable
    ones, and every readable element lies in a computed block."""
    _, _, _, q_pos, k_pos, valid, _, _ = _case(kind)
    allowed_BQK = (k_pos[:, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
    bm = flex_block_mask(q_pos, k_pos, valid, block)
    sq = q_pos.shape[1]
    computed = bm.to_dense()[:, 0].bool()  # [B, nq, nk]: partial or full
    full = torch.zeros_like(computed)
    for b in range(B):
        for i in range(computed.shape[1]):
            n = int(bm.full_kv_num_blocks[b, 0, i])
            full[b, i, bm.full_kv_indices[b, 0, i, :n].long()] = True
    assert full.any() and (block == 1) != bool((computed & ~full).any())  # one-position blocks are never partial
    for b in range(B):
        for i in range(computed.shape[1]):
            for j in range(computed.shape[2]):
                elems = allowed_BQK[b, i * block:min((i + 1) * block, sq), j * block:(j + 1) * block]
                assert bool(elems.any()) <= bool(computed[b, i, j]), (b, i, j)
                assert not full[b, i, j] or (elems.all() and elems.shape[1] == block), (b, i, j)


@pytest.mark.slow
def test_flex_module_imports_on_cpu_without_cuda_or_compiling():
    code = ("import torch, kernels.flex_attention as f, kernels.attention_backends as a; "
            "assert not torch.cuda.is_initialized() and not f._COMPILED; "
            "print(a.resolve_attention_backend('auto', 'cuda'), a.resolve_attention_backend('auto', 'cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["flex", "sdpa"]


def test_backend_resolution_and_factory():
    assert backend_names() == ("tiled", "sdpa", "flex")
    assert [resolve_attention_backend(n, "cpu") for n in ("auto", "tiled", "sdpa")] == ["sdpa", "tiled", "sdpa"]
    assert resolve_attention_backend("auto", torch.device("cuda", 1)) == "flex"
    assert resolve_attention_backend("auto", "meta") == "tiled" and resolve_attention_backend("tiled", "cuda")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; allowed: 'auto', 'tiled', 'sdpa', 'flex'"):
        resolve_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="'flex' needs a CUDA device, got 'cpu'"):
        make_causal_attention("flex", 64, "cpu")
    with pytest.raises(ValueError, match="'sdpa' is PyTorch's fused CPU kernel and got device 'cuda'"):
        resolve_attention_backend("sdpa", "cuda")
    with pytest.raises(ValueError, match="tile_size must be a positive integer"):
        make_causal_attention("auto", 0, "cpu")
    auto = make_causal_attention("auto", 64, "cpu")
    assert isinstance(auto, TiledCausalAttention) and auto.kernel is SDPA_KERNEL and auto.tile_size == 64
    assert make_causal_attention("tiled", None, "cpu") is block_attention
    assert make_causal_attention("tiled", 32, "cpu").kernel is DENSE_KERNEL
    assert repr(make_causal_attention("sdpa", None, "cpu")) == "TiledCausalAttention(tile_size=None, kernel='sdpa')"


@pytest.mark.parametrize("K, memory_switches", [(1, False), (3, False), (3, True)])
def test_whole_draft_with_auto_matches_dense_fp64(K, memory_switches):
    """Loss and all 13 parameter gradients (and the aux-state gradient) of the TTT unroll in float64, with ``auto``
    (the fused CPU kernel) vs the dense block; with the chunked loss and per-step checkpointing too."""
    draft, ref_draft, head_VH, batch = model_pair(seed=11 + K, K=K, dtype=torch.float64)
    draft.midlayer.self_attn.causal_attention = make_causal_attention("auto", 4, "cpu")
    switches = dict(loss_chunk_size=5, checkpoint_steps=True) if memory_switches else {}
    got = run_model(TTTModel(draft, head_VH, **switches, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref, tol=FP64_REORDERED)


def test_inference_cache_with_auto_matches_dense():
    """Prefill (causal), a second extend (general mask) and chain steps (keys all before the query) of the draft's
    inference KV cache, with ``auto`` vs the dense block."""
    from recipe.eval.draft_runtime import DraftKVCache

    draft, ref_draft, _, _ = model_pair(seed=2, K=1, dtype=torch.float64)
    draft.midlayer.self_attn.causal_attention = make_causal_attention("auto", None, "cpu")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 9, draft.config.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, draft.config.vocab_size, (1, 9), generator=g)
    outs = {}
    with torch.no_grad():
        for name, model in (("auto", draft), ("dense", ref_draft)):
            cache, got = DraftKVCache(), []
            for lo, hi in ((0, 5), (5, 8), (8, 9)):
                pos = torch.arange(lo, hi)[None]
                got.append(model.step(hidden[:, lo:hi], ids[:, lo:hi], pos, kv_cache=cache)[0])
            got.append(model.step(got[-1][:, -1:], ids[:, :1], torch.tensor([[9]]), kv_cache=cache)[0])
            outs[name] = torch.cat(got, dim=1)
    assert_close_rel(outs["auto"], outs["dense"], FP64_REORDERED, "inference cache")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward runs on CUDA only")


@needs_cuda
# fp32: a GPU kernel may round its dot products' inputs to TF32 (10 mantissa bits) unless told otherwise, so ten
# times FP32_REORDERED against the fp64 reference (relative to each tensor); bf16: BF16_ROUNDED
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 10 * FP32_REORDERED), (torch.bfloat16, BF16_ROUNDED)])
@pytest.mark.parametrize("kind", ["square", "subset", "later", "mixed"])
@pytest.mark.parametrize("how", ["direct", "ring-pair"])
def test_flex_on_cuda_matches_fp64_reference(how, kind, dtype, tol):
    """Compiled flex on CUDA, differentiated directly (one device) and through the ring's per-pair recompute:
    fp32 within 1e-4 of the fp64 reference; bf16 each tensor's relative error < 2e-2 (out, dq, dk, dv; lse within
    1e-2, it is float32 from bf16 scores)."""
    from kernels.flex_attention import FLEX_KERNEL, FlexCausalAttention

    case = [t.cuda() for t in _case(kind, dtype=torch.float64, d=D_CUDA)]
    case = [t.to(dtype) if t.is_floating_point() else t for t in case]
    attention = FlexCausalAttention() if how == "direct" else TiledCausalAttention(None, FLEX_KERNEL)
    got = [x.cpu() if torch.is_tensor(x) else [g.cpu() for g in x] for x in run_attention(attention, *case)]
    cpu_case = [t.cpu() for t in case]
    if dtype == torch.float32:
        _assert_matches_reference(got, cpu_case, tol)
        return
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = run_attention(reference, *[t.double() if t.is_floating_point() else t for t in cpu_case])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-2, atol=1e-2)
    for g, ref in zip([out, *grads], [ref_out, *ref_grads]):
        assert g.dtype == torch.bfloat16 and ((g.double() - ref).norm() / ref.norm()).item() < tol
