"""Flex attention (``torch.nn.attention.flex_attention``, public PyTorch) for the causal block on CUDA.

The mask is a ``mask_mod(b, h, q_idx, kv_idx) = k_valid[b, kv] & (k_pos[b, kv] <= q_pos[b, q])`` over the captured
GLOBAL positions and validity, so one function serves one device, every ring hop and an inference KV cache. The
``BlockMask`` is built from per-block position ranges (``flex_block_mask``: O((S/128)²) work and memory, no S x S
mask is ever evaluated): blocks no query can read are skipped, fully readable ones run without the mask_mod, the
rest apply it. ``flex_attention`` is called compiled on CUDA (``torch.compile``, created lazily on first use);
importing this module touches neither CUDA nor the compiler.

What is supported where (torch 2.13): on CUDA forward and backward, including the gradient through the returned LSE,
in float32 and bfloat16 (LSE float32). On CPU the eager (uncompiled, O(Sq·Sk) memory) forward only: flex attention
has no CPU backward and its compiled CPU kernel returns no LSE; ``flex_block_attention(..., compiled=False)`` on
detached CPU tensors is what the CPU tests check the mask and LSE conventions with.

In the ring (``FLEX_KERNEL``) the backward cannot be handed the final LSE, so each hop's block is recomputed under
autograd and the final merge's gradient is pulled through its own (out, lse)
(``kernels.tiled_attention.recompute_block_backward``): one extra block forward per hop, and no per-hop graph (or
received K/V block) is kept alive between forward and backward.
"""
from __future__ import annotations

import math

import torch

from kernels.block_attention import accum_dtype
from kernels.tiled_attention import BlockKernel, check_block_shapes, keys_valid, recompute_block_backward

FLEX_BLOCK = 128
"""flex attention's default sparse block size (positions per query and key block)."""

_INT64_MAX, _INT64_MIN = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
_COMPILED: dict[str, object] = {}


def _compiled_flex():
    """``torch.compile(flex_attention)``, created on the first call of the process."""
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"]


def _pad(x_BS: torch.Tensor, length: int, value) -> torch.Tensor:
    return torch.cat([x_BS, x_BS.new_full((x_BS.shape[0], length - x_BS.shape[1]), value)], dim=1)


def _ordered(blocks_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [B, 1, nq] int32, indices [B, 1, nq, nk] int32): per query block the count of True key blocks and
    their indices first (ascending), the form ``BlockMask.from_kv_blocks`` takes."""
    num = blocks_BQK.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def flex_block_mask(q_pos_BS: torch.Tensor, k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor | None,
                    block_size: int = FLEX_BLOCK):
    """The ``BlockMask`` of "query i reads key j iff k_valid[j] and k_pos[j] <= q_pos[i]" for [B, Sq] / [B, Sk]
    int64 positions and [B, Sk] bool validity (None: all valid), on their device, broadcast over heads.

    Per (query block, key block): skipped when no valid key is at or before the block's latest query; "full" (no
    mask_mod) when every key of the block is valid and at or before the block's earliest query; otherwise the
    mask_mod decides per element. Positions are padded to whole blocks (padding keys invalid) so the mask_mod never
    indexes past its tensors. Raises ValueError when ``block_size`` is not a positive integer.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"flex block size must be a positive integer, got {block_size!r}")
    b, sq = q_pos_BS.shape
    sk = k_pos_BS.shape[1]
    nq, nk = -(-sq // block_size), -(-sk // block_size)
    valid = keys_valid(k_pos_BS, k_valid_BS)
    q_pos = _pad(q_pos_BS.long(), nq * block_size, _INT64_MIN)
    k_pos = _pad(k_pos_BS.long(), nk * block_size, _INT64_MAX)
    k_ok = _pad(valid, nk * block_size, False)
    real_q = _pad(torch.ones_like(q_pos_BS, dtype=torch.bool), nq * block_size, False).view(b, nq, block_size)
    q_blocks = q_pos.view(b, nq, block_size)
    q_last = q_blocks.amax(dim=-1)
    q_first = q_blocks.masked_fill(~real_q, _INT64_MAX).amin(dim=-1)
    k_blocks, ok_blocks = k_pos.view(b, nk, block_size), k_ok.view(b, nk, block_size)
    k_first = k_blocks.masked_fill(~ok_blocks, _INT64_MAX).amin(dim=-1)
    k_last = k_blocks.amax(dim=-1)
    readable = k_first[:, None, :] <= q_last[:, :, None]
    full = ok_blocks.all(dim=-1)[:, None, :] & (k_last[:, None, :] <= q_first[:, :, None])
    partial_num, partial_idx = _ordered(readable & ~full)
    full_num, full_idx = _ordered(full)

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        return k_ok[b_idx, kv_idx] & (k_pos[b_idx, kv_idx] <= q_pos[b_idx, q_idx])

    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(sq, sk))


def flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None, scale=None, *,
                         compiled: bool = True, block_size: int = FLEX_BLOCK):
    """``block_attention``'s (out, lse) through flex attention; differentiable in q, k, v (through lse too) on CUDA.

    q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (GQA), positions [B, Sq] / [B, Sk] int64, k_valid [B, Sk] bool or None.
    Returns out [B, H, Sq, D] in q's dtype (0 on rows with no readable key) and lse [B, H, Sq] in the accumulation
    dtype (-inf there). ``compiled=False`` runs flex's eager path (O(Sq·Sk) memory; on CPU forward only, with inputs
    that do not require grad). Raises NotImplementedError (torch's) for a CPU call that needs gradients.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    block_mask = flex_block_mask(q_pos_BS, k_pos_BS, k_valid_BS, block_size)
    fn = _compiled_flex() if compiled else flex_attention
    out, aux = fn(q_BHSD, k_BHkvSD, v_BHkvSD, block_mask=block_mask, scale=scale, enable_gqa=True,
                  return_aux=AuxRequest(lse=True))
    valid = keys_valid(k_pos_BS, k_valid_BS)
    first_BS = k_pos_BS.long().masked_fill(~valid, _INT64_MAX).amin(dim=1, keepdim=True)
    has_key = (q_pos_BS.long() >= first_BS)[:, None, :]
    lse = aux.lse.to(accum_dtype(q_BHSD.dtype))
    return (torch.where(has_key[..., None], out, torch.zeros_like(out)),
            torch.where(has_key, lse, torch.full_like(lse, float("-inf"))))


def _flex_pair_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale):
    """Forward of one ring pair: no graph (detached inputs), compiled on CUDA, eager elsewhere."""
    q, k, v = (t.detach() for t in (q_BHSD, k_BHkvSD, v_BHkvSD))
    return flex_block_attention(q, k, v, q_pos_BS, k_pos_BS, k_valid_BS, scale, compiled=q.is_cuda)


def _flex_pair_differentiable(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale):
    return flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale,
                                compiled=q_BHSD.is_cuda)


FLEX_KERNEL = BlockKernel("flex", _flex_pair_forward, recompute_block_backward(_flex_pair_differentiable),
                          compute_dtype=lambda dtype: dtype)
"""Flex attention in the tile loops (the ring): inputs stay in their dtype (bf16 runs bf16, LSE float32), forward
on CUDA (compiled) or CPU (eager), backward on CUDA only (per-pair recompute, module docstring)."""


class FlexCausalAttention:
    """Callable with the draft's causal-block signature ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)`` on one
    device: one compiled flex call (its 128-position blocks do the causal skipping; memory O(S·D), so no tile size),
    differentiated by flex's own backward. Raises ValueError (naming the shapes) when they disagree."""

    def __call__(self, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None):
        check_block_shapes(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, "flex attention")
        scale = 1.0 / math.sqrt(q_BHSD.shape[-1])
        return flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale,
                                    compiled=q_BHSD.is_cuda)

    def __repr__(self) -> str:
        return "FlexCausalAttention()"
