"""Document isolation in every CPU attention kernel (``kernels.documents``; docs/algorithm.md, "Packing"): packed rows
whose attention positions carry the document (``document·2³² + position``) against an independent dense float64
reference that masks by explicit document ids and per-document positions: out, lse, dq, dk, dv of the dense block,
the tiled reference, the fused CPU kernel, the per-pair recompute the ring uses with flex, flex's eager forward and
its compiled path through ``aot_eager`` with gradients; documents of one token, padding after the last document,
sparse (compacted) queries. The host pair decision skips the tile pairs of other documents, and an unpacked row's
rule is unchanged."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.utils import counters

from kernels.block_attention import block_attention, expand_kv
from kernels.documents import (document_positions, document_start, document_tiles, has_readable_key, readable,
                                token_positions)
from kernels.flex_attention import CompiledFlex, FlexCausalAttention, flex_block_attention, make_flex_kernel
from kernels.sdpa_attention import SDPA_KERNEL, pair_mask
from kernels.registry import BlockKernel
from kernels.tiled_attention import DENSE_KERNEL, TiledCausalAttention, block_pairs
from helpers.attention import run_attention
from helpers.tolerance import FP32_REORDERED, FP64_REORDERED, assert_close_rel

H, HKV, D = 4, 2, 16
ROWS = ((5, 1, 7, 3), (2, 9))  # document lengths per row; row 1 ends in 5 padding positions
S = 16


def packed_layout():
    """(documents [B, S], token positions [B, S], valid [B, S]): row b holds ``ROWS[b]`` one after another, then
    padding (its own document, positions restarting, invalid)."""
    docs = torch.zeros(len(ROWS), S, dtype=torch.long)
    pos = torch.zeros_like(docs)
    valid = torch.zeros(len(ROWS), S, dtype=torch.bool)
    for b, lengths in enumerate(ROWS):
        start = 0
        for d, n in enumerate((*lengths, S - sum(lengths))):
            docs[b, start:start + n], pos[b, start:start + n] = d, torch.arange(n)
            valid[b, start:start + n] = d < len(lengths)
            start += n
    return docs, pos, valid


def reference(q, k, v, q_doc, q_tok, k_doc, k_tok, valid):
    """Dense masked softmax in float64 from explicit documents: query i reads key j iff same document, k_tok <= q_tok,
    valid; out 0 / lse -inf on rows without a key."""
    s = q.double() @ expand_kv(k.double(), q.shape[1]).transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = ((q_doc[:, :, None] == k_doc[:, None, :]) & (k_tok[:, None, :] <= q_tok[:, :, None])
               & valid[:, None, :])[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p @ expand_kv(v.double(), q.shape[1]), lse


def case(kind: str, dtype=torch.float64, seed: int = 0):
    """(q, k, v, q_pos, k_pos, valid, w, u, ref_args): "square" (queries = keys) or "subset" (the compacted queries
    of the sparse path: 7 of the 16 anchors, in order)."""
    g = torch.Generator().manual_seed(seed)
    docs, tok, valid = packed_layout()
    k_pos = document_positions(docs, tok)
    rows = torch.arange(S) if kind == "square" else torch.tensor([0, 4, 5, 6, 9, 12, 15])
    q_doc, q_tok, q_pos = docs[:, rows], tok[:, rows], k_pos[:, rows]
    q = torch.randn(len(ROWS), H, rows.numel(), D, generator=g, dtype=dtype)
    k, v = (torch.randn(len(ROWS), HKV, S, D, generator=g, dtype=dtype) for _ in range(2))
    w = torch.randn(q.shape, generator=g, dtype=dtype)
    u = torch.randn(q.shape[:-1], generator=g, dtype=dtype)
    return (q, k, v, q_pos, k_pos, valid, w, u), (q_doc, q_tok, docs, tok, valid)


def _ref_run(attention_case, ref_args):
    q, k, v, _, _, _, w, u = attention_case

    def ref(q_, k_, v_, *_):
        return reference(q_, k_, v_, *ref_args)
    return run_attention(ref, *(t.double() for t in (q, k, v)), None, None, None, w.double(), u.double())


def _assert_same(got, ref, tol):
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, ref
    assert torch.isinf(ref_lse).any() and torch.isfinite(ref_lse).any()  # the padding row reads nothing
    assert_close_rel(out.double(), ref_out, tol, "out")
    assert_close_rel(lse.double(), ref_lse, tol, "lse")
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert r.abs().sum() > 0, name
        assert_close_rel(g.double(), r, tol, name)


KERNELS = {"dense": lambda tile: block_attention, "tiled": lambda tile: TiledCausalAttention(tile, DENSE_KERNEL),
           "sdpa": lambda tile: TiledCausalAttention(tile, SDPA_KERNEL)}


@pytest.mark.parametrize("kind", ["square", "subset"])
@pytest.mark.parametrize("name, tile", [("dense", None), ("tiled", None), ("tiled", 1), ("tiled", 3), ("sdpa", None),
                                        ("sdpa", 3), ("sdpa", 16)])
def test_cpu_kernels_isolate_documents_fp64(name, tile, kind):
    attention_case, ref_args = case(kind)
    got = run_attention(KERNELS[name](tile), *attention_case)
    _assert_same(got, _ref_run(attention_case, ref_args), FP64_REORDERED)


def test_flex_eager_forward_isolates_documents():
    """flex's eager CPU forward (no gradients on the CPU) with 4-position blocks: skipped, full and partial blocks."""
    (q, k, v, q_pos, k_pos, valid, _, _), ref_args = case("square", torch.float32)
    out, lse = flex_block_attention(q, k, v, q_pos, k_pos, valid, compiled=False, block_size=4)
    ref_out, ref_lse = reference(q, k, v, *ref_args)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close_rel(out.double(), ref_out, FP32_REORDERED, "out")
    assert_close_rel(lse[finite].double(), ref_lse[finite], FP32_REORDERED, "lse")


@pytest.fixture
def aot_flex(monkeypatch):
    """flex compiled on ``aot_eager`` with torch's CPU-backward refusal lifted (as ``tests/test_flex_compiled.py``)."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    torch._dynamo.reset()
    counters.clear()
    yield CompiledFlex(backend="aot_eager")
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["direct", "ring-pair"])
def test_compiled_flex_with_gradients_isolates_documents(aot_flex, how):
    attention_case, ref_args = case("square", torch.float32)
    attention = FlexCausalAttention(compiled=aot_flex) if how == "direct" else \
        TiledCausalAttention(5, make_flex_kernel(compiled=aot_flex))
    _assert_same(run_attention(attention, *attention_case), _ref_run(attention_case, ref_args), FP32_REORDERED)


def test_pairs_of_other_documents_are_skipped_on_the_host():
    """One row, two documents of 8, tiles of 4: of the 10 pairs a causal block visits, the 4 whose keys lie in the
    first document and queries in the second are skipped (6 computed); an unpacked row of 16 keeps all 10."""
    docs = torch.tensor([[0] * 8 + [1] * 8])
    pos = document_positions(docs, torch.arange(16).remainder(8)[None])
    valid = torch.ones(1, 16, dtype=torch.bool)
    packed = block_pairs(pos, pos, valid, 4)
    assert packed == [[True, False, False, False], [True, True, False, False],
                      [False, False, True, False], [False, False, True, True]]
    plain = torch.arange(16)[None]
    assert sum(map(sum, block_pairs(plain, plain, valid, 4))) == 10


def test_document_tiles_cut_at_every_boundary():
    """Tiles aligned to the documents of any row, each document run cut into near-equal tiles of at most the tile
    size; an unpacked block keeps the fixed tiles (None)."""
    docs, tok, _ = packed_layout()  # row 0 boundaries after 5, 6, 13, 16; row 1 after 2, 11
    pos = document_positions(docs, tok)
    assert document_tiles(pos, 3) == (2, 3, 1, 3, 2, 2, 3)  # runs 2, 3, 1, 5, 2, 3
    assert document_tiles(pos, None) == (2, 3, 1, 5, 2, 3)
    assert document_tiles(pos[:1], 4) == (3, 2, 1, 4, 3, 3)  # runs 5, 1, 7, 3
    assert document_tiles(torch.arange(16)[None], 4) is None


def _recorded_pairs(attention_of):
    """One row of documents 6, 5 and 5: the pair layouts the fused kernel sees under ``attention_of(kernel)`` (a
    causal-block callable around the recording kernel), its result checked against the reference's."""
    seen = []

    def forward(q, k, v, q_pos, k_pos, k_valid, scale):
        seen.append(pair_mask(q_pos, k_pos, k_valid, q.dtype)[2])
        return SDPA_KERNEL.forward(q, k, v, q_pos, k_pos, k_valid, scale)
    docs = torch.tensor([[0] * 6 + [1] * 5 + [2] * 5])
    tok = torch.cat([torch.arange(6), torch.arange(5), torch.arange(5)])[None]
    pos, valid = document_positions(docs, tok), torch.ones(1, 16, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 16, D, generator=g, dtype=torch.float64)
    k, v, w = (torch.randn(1, HKV if i < 2 else H, 16, D, generator=g, dtype=torch.float64) for i in range(3))
    u = torch.randn(1, H, 16, generator=g, dtype=torch.float64)
    got = run_attention(attention_of(BlockKernel("recording", forward, SDPA_KERNEL.backward), pos, valid), q, k, v,
                        pos, pos, valid, w, u)
    ref_args = (docs, tok, docs, tok, valid)
    ref = run_attention(lambda q_, k_, v_, *_: reference(q_, k_, v_, *ref_args), q, k, v, None, None, None, w, u)
    for a_, b_, name in zip((got[0], got[1], *got[2]), (ref[0], ref[1], *ref[2]), ("out", "lse", "dq", "dk", "dv")):
        assert_close_rel(a_, b_, FP64_REORDERED, name)
    return seen


def test_packed_pairs_take_the_cheap_sdpa_layouts():
    """One device, tiles of 4: every pair the fused kernel computes lies in one document (causal on the diagonal,
    full below it: no dense mask), 3 pairs a document, and the result is the reference's."""
    seen = _recorded_pairs(lambda kernel, pos, valid: TiledCausalAttention(4, kernel))
    assert sorted(seen) == ["causal"] * 6 + ["full"] * 3  # documents of 6 (tiles 3, 3), 5 and 5 (3, 2 each)


@pytest.mark.parametrize("cut", [True, False])
def test_the_ring_cuts_packed_tiles_at_documents(cut):
    """The ring (one rank, its two zigzag chunks of 8, tiles of 4, host copies attached as the batch builder
    attaches them): cut at the documents (``cut_documents``), chunk 0's tiles are 3, 3 | 2 and chunk 1's 3 | 3, 2,
    every computed pair in one document, the same 9 pairs as one device; with fixed tiles a tile straddles a
    boundary and its pairs take the general mask. Both equal the reference."""
    from kernels.host_positions import attach_host_copies
    from kernels.ring_attention import RingExchange, make_ring_causal_attention, ring_tiling

    def ring(kernel, pos, valid):
        attach_host_copies(pos, [pos])
        attach_host_copies(valid, [valid])
        tiling = ring_tiling(pos, pos, RingExchange(None), 4, 2, cut, host=True)
        assert (tiling.queries, tiling.keys, tiling.groups) == (((3, 3, 2, 3, 3, 2), ((3, 3, 2, 3, 3, 2),), 1)
                                                                if cut else (4, (4,), 2))
        return make_ring_causal_attention(None, tile_size=4, kernel=kernel, cut_documents=cut)
    seen = _recorded_pairs(ring)
    if cut:
        assert sorted(seen) == ["causal"] * 6 + ["full"] * 3
    else:
        assert not set(seen) <= {"causal", "full"}


def test_sdpa_layouts_see_documents():
    """The fused kernel's cheap layouts only inside one document: a tile of two documents takes the general mask."""
    one = document_positions(torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None])
    two = document_positions(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 1, 0, 1]]))
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert pair_mask(one, one, valid, torch.float32)[2] == "causal"
    assert pair_mask(one[:, 2:], one[:, :2], valid[:, :2], torch.float32)[2] == "full"
    assert pair_mask(two, two, valid, torch.float32)[:3:2] == (True, "causal-documents")  # + the causal skipping
    assert pair_mask(two[:, 2:], two[:, :2], valid[:, :2], torch.float32)[2] == "general"


def test_encoding_rules():
    docs, tok, valid = packed_layout()
    pos = document_positions(docs, tok)
    assert torch.equal(token_positions(pos), tok) and torch.equal(document_start(pos), docs << 32)
    assert torch.equal(document_positions(torch.zeros_like(tok), tok), tok)  # document 0: the plain positions
    plain = torch.arange(6)
    assert torch.equal(readable(plain[:, None], plain[None, :]), plain[None, :] <= plain[:, None])
    allowed = readable(pos[:, :, None], pos[:, None, :]) & valid[:, None, :]
    expected = (docs[:, :, None] == docs[:, None, :]) & (tok[:, None, :] <= tok[:, :, None]) & valid[:, None, :]
    assert torch.equal(allowed, expected)
    assert torch.equal(has_readable_key(pos, pos, valid), expected.any(-1))
    shuffled = torch.randperm(S, generator=torch.Generator().manual_seed(1))  # any key order
    assert torch.equal(has_readable_key(pos, pos[:, shuffled], valid[:, shuffled]), expected.any(-1))
    with pytest.raises(ValueError, match="token positions"):
        document_positions(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[1 << 32]]))
