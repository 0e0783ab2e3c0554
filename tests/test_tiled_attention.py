"""Tiled causal block attention vs the dense ``block_attention``: out, lse and every gradient (fp64), the tensors it
keeps for backward (no score matrix), its pair skipping, and the whole TTT draft with it."""
from __future__ import annotations

import pytest
import torch

from helpers.attention import run_attention
from helpers.cases import assert_same_run, model_pair, run_model
from helpers.tolerance import BF16_ROUNDED, FP32_REORDERED, FP64_REORDERED, assert_close_rel, within
from kernels.block_attention import block_attention
from kernels.tiled_attention import TiledCausalAttention, forward_tiles, split_tiles, tiled_block_attention
from recipe.model.ttt import TTTModel

B, H, HKV, D = 2, 4, 2, 8


def _inputs(sq: int, sk: int, dtype=torch.float64, seed: int = 0):
    """q/k/v, query positions (a subset of the key positions when sq < sk), key validity with trailing padding and
    two leading invalid keys in row 1 (so rows 0-1 of batch row 1 read no key), loss weights for out and lse."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, HKV, sk, D, generator=g, dtype=dtype) for _ in range(2))
    k_pos = torch.arange(sk).expand(B, sk).clone()
    q_pos = torch.sort(torch.randperm(sk, generator=g)[:sq]).values.expand(B, sq).clone() if sq < sk else k_pos
    valid = torch.ones(B, sk, dtype=torch.bool)
    valid[:, sk - 3:] = False
    valid[1, :2] = False
    w = torch.randn(B, H, sq, D, generator=g, dtype=dtype)
    u = torch.randn(B, H, sq, generator=g, dtype=dtype)
    return q, k, v, q_pos, k_pos, valid, w, u


@pytest.mark.parametrize("tile", [1, 3, 4, 16, 100])
@pytest.mark.parametrize("sq", [16, 7])
def test_tiled_matches_dense_forward_and_every_gradient(tile, sq):
    x = _inputs(sq, 16)
    out, lse, grads = run_attention(TiledCausalAttention(tile), *x)
    ref_out, ref_lse, ref_grads = run_attention(block_attention, *x)
    if sq == 16:
        assert torch.isinf(ref_lse[1, :, :2]).all()  # the case covers rows that read no key
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close_rel(out, ref_out, FP64_REORDERED, "out")
    assert_close_rel(lse[finite], ref_lse[finite], FP64_REORDERED, "lse")
    for got, ref, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert torch.isfinite(got).all() and ref.abs().sum() > 0, name
        assert_close_rel(got, ref, FP64_REORDERED, name)


def test_tiled_bf16_keeps_dtypes_and_matches_fp32():
    x = _inputs(32, 32, dtype=torch.float32, seed=3)
    low = [t.bfloat16() if t.is_floating_point() else t for t in x]
    out, lse, grads = run_attention(TiledCausalAttention(8), *low)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    ref_out, ref_lse, ref_grads = run_attention(block_attention, *[t.float() if t.is_floating_point() else t for t in low])
    assert_close_rel(out.float(), ref_out, BF16_ROUNDED, "bf16 out")
    finite = torch.isfinite(ref_lse)  # from the same bf16 inputs, scores accumulate in fp32 both ways
    assert torch.equal(finite, torch.isfinite(lse))
    assert_close_rel(lse[finite], ref_lse[finite], FP32_REORDERED, "lse")
    for got, ref, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        within(((got.float() - ref).norm() / ref.norm()).item(), BF16_ROUNDED, f"bf16 {name}")


def _saved_bytes(attention, *args) -> int:
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(*args)
    return sum(sizes)


def test_tiled_keeps_no_score_matrix_for_backward():
    """Exactly q, k, v, out, lse, both positions and the validity are saved: O(S·D), where dense keeps O(H·S²)."""
    s = 1024
    q, k, v, q_pos, k_pos, valid, _, _ = _inputs(s, s, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tiled = _saved_bytes(TiledCausalAttention(128), *leaves, q_pos, k_pos, valid)
    f32, i64 = 4, 8
    expected = 2 * B * H * s * D * f32 + 2 * B * HKV * s * D * f32 + B * H * s * f32 + 2 * B * s * i64 + B * s
    assert tiled == expected
    dense = _saved_bytes(block_attention, *leaves, q_pos, k_pos, valid)
    assert dense > B * H * s * s * f32 > 10 * tiled


def test_forward_tiles_skips_pairs_no_query_can_read():
    """16 positions in tiles of 4: the 10 causal (query tile, key tile) pairs; with keys 12.. padding the last key
    tile is still read by the last query tile (key 12 is padding, so 9 pairs when 12..15 are all padding)."""
    q, k, v, pos, _, _, _, _ = _inputs(16, 16)
    for padding_from, pairs in ((13, 10), (12, 9)):
        valid = torch.arange(16).expand(B, 16) < padding_from
        tiles = [split_tiles(t, 2, 4) for t in (q, k, v)]
        outs = [torch.zeros_like(t) for t in tiles[0]]
        lses = [torch.full(t.shape[:-1], float("-inf"), dtype=t.dtype) for t in tiles[0]]
        keys = (tiles[1], tiles[2], split_tiles(pos, 1, 4), split_tiles(valid, 1, 4))
        assert forward_tiles((tiles[0], split_tiles(pos, 1, 4)), keys, outs, lses, 0.5) == pairs


def test_split_tiles_cuts_each_group_into_tiles():
    x = torch.arange(10)
    assert [t.tolist() for t in split_tiles(x, 0, 3, groups=2)] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
    assert [len(t) for t in split_tiles(x, 0, 4)] == [4, 3, 3]
    assert [len(t) for t in split_tiles(x, 0)] == [10]
    assert [len(t) for t in split_tiles(x, 0, None, groups=2)] == [5, 5]
    for bad in (0, -2):
        with pytest.raises(ValueError, match="tile_size"):
            split_tiles(x, 0, bad)
        with pytest.raises(ValueError, match="tile_size"):
            TiledCausalAttention(bad)
    q, k, v, pos, _, valid, _, _ = _inputs(4, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiled_block_attention(q, k[:, :1].expand(B, 3, 4, D), v[:, :1].expand(B, 3, 4, D), pos, pos, valid)


@pytest.mark.parametrize("K, memory_switches", [(1, False), (3, False), (3, True)])
def test_ttt_draft_with_tiled_attention_matches_dense(K, memory_switches):
    """Loss and all 13 parameter gradients (and the aux-state gradient) of the whole TTT unroll, fp32; with the
    chunked loss and per-step checkpointing too (the checkpoint recomputation re-runs the tiled forward)."""
    draft, ref_draft, head_VH, batch = model_pair(seed=11 + K, K=K)
    draft.midlayer.self_attn.causal_attention = TiledCausalAttention(4)
    switches = dict(loss_chunk_size=5, checkpoint_steps=True) if memory_switches else {}
    got = run_model(TTTModel(draft, head_VH, **switches, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref)


def test_parallelize_installs_the_configured_attention_or_refuses():
    from kernels.sdpa_attention import sdpa_available
    from recipe.config import KernelOptions
    from recipe.config_memory import MemoryOptions
    from recipe.parallel.parallelize import parallelize

    tiled = KernelOptions(attention="tiled")
    draft, _, head_VH, _ = model_pair(seed=1, K=1)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    parallelize(model, None, MemoryOptions(attention_tile_size=256), kernel_options=tiled)
    attention = draft.midlayer.self_attn.causal_attention
    assert isinstance(attention, TiledCausalAttention) and attention.tile_size == 256
    parallelize(model, None, MemoryOptions(attention_tile_size=None), kernel_options=tiled)
    assert draft.midlayer.self_attn.causal_attention is block_attention
    if sdpa_available():  # "auto" on the CPU is the fused kernel inside the same tile loops
        parallelize(model, None, MemoryOptions(attention_tile_size=128))
        attention = draft.midlayer.self_attn.causal_attention
        assert isinstance(attention, TiledCausalAttention) and attention.tile_size == 128
        assert attention.kernel.name == "sdpa"
    with pytest.raises(ValueError, match="tile_size must be a positive"):
        parallelize(model, None, MemoryOptions(attention_tile_size=0))
    with pytest.raises(ValueError, match="'flex' needs a CUDA device"):
        parallelize(model, None, MemoryOptions(), kernel_options=KernelOptions(attention="flex"))


def test_mismatched_positions_or_validity_are_refused_naming_the_shapes():
    q, k, v, pos, _, valid, _, _ = _inputs(8, 8)
    for bad in (dict(q_pos_BS=pos[:, :4]), dict(k_pos_BS=pos[:, :4]), dict(k_valid_BS=valid[:, :4]),
                dict(q_pos_BS=torch.arange(12).expand(B, 12))):
        args = {**dict(q_pos_BS=pos, k_pos_BS=pos, k_valid_BS=valid), **bad}
        with pytest.raises(ValueError, match=r"tiled_block_attention: shapes disagree: q \(2, 4, 8, 8\)"):
            tiled_block_attention(q, k, v, tile_size=2, **args)
    with pytest.raises(ValueError, match="tile_size must be a positive integer"):
        tiled_block_attention(q, k, v, pos, pos, valid, tile_size=1.5)


def test_nan_lse_gradient_on_rows_without_keys_does_not_spread():
    """Merging with an empty key set (lse -inf on both sides) sends no NaN back: grads equal the dense ones."""
    from kernels.block_attention import merge_lse

    q, k, v, pos, _, valid, w, _ = _inputs(16, 16)

    def merged_with_nothing(*args):
        out, lse = args[0](*args[1:])
        return merge_lse(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))

    grads = {}
    for name, attention in (("tiled", TiledCausalAttention(4)), ("dense", block_attention)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = merged_with_nothing(attention, *leaves, pos, pos, valid)
        assert torch.isinf(lse[1, :, :2]).all()
        (out * w).sum().backward()
        grads[name] = [t.grad for t in leaves]
    for got, ref in zip(grads["tiled"], grads["dense"]):
        assert torch.isfinite(got).all()
        assert_close_rel(got, ref, FP64_REORDERED, "gradient")
    # an explicit NaN arriving at a -inf lse is ignored too
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = TiledCausalAttention(4)(*leaves, pos, pos, valid)
    dlse = torch.where(torch.isinf(lse), torch.full_like(lse, float("nan")), torch.ones_like(lse))
    torch.autograd.backward([out, lse], [w, dlse])
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_merge_lse_of_two_empty_sets_has_finite_gradients():
    from kernels.block_attention import merge_lse

    lse_a = torch.tensor([[[float("-inf"), 0.5]]], dtype=torch.float64, requires_grad=True)
    lse_b = torch.tensor([[[float("-inf"), float("-inf")]]], dtype=torch.float64, requires_grad=True)
    out_a = torch.ones(1, 1, 2, 3, dtype=torch.float64, requires_grad=True)
    out, lse = merge_lse(out_a, lse_a, torch.zeros_like(out_a), lse_b)
    assert torch.isneginf(lse[0, 0, 0]) and lse[0, 0, 1] == 0.5 and out[0, 0, 0].abs().sum() == 0
    (out.sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()).backward()
    assert lse_a.grad.tolist() == [[[0.0, 1.0]]] and lse_b.grad.tolist() == [[[0.0, 0.0]]]
    assert torch.isfinite(out_a.grad).all() and out_a.grad[0, 0, 1].tolist() == [1.0, 1.0, 1.0]


def test_readable_pairs_one_matrix_with_empty_tiles():
    from kernels.tiled_attention import readable_pairs

    q_pos = [torch.tensor([[0, 1]]), torch.tensor([[6, 7]]), torch.zeros(1, 0, dtype=torch.long)]
    k_pos = [torch.tensor([[2, 3]]), torch.tensor([[4, 5]]), torch.zeros(1, 0, dtype=torch.long)]
    k_valid = [torch.tensor([[True, True]]), torch.tensor([[False, False]]), torch.zeros(1, 0, dtype=torch.bool)]
    assert readable_pairs(q_pos, k_pos, k_valid) == [[False, False, False], [True, False, False],
                                                     [False, False, False]]
