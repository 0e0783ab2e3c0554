"""Block attention returning log-sum-exp, and the numerically stable LSE merge.

Shapes use B batch, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), Sq queries, Sk keys, D head dim.
Positions are *global* token positions, so the same kernel serves one device and zigzag context-parallel shards.
"""
from __future__ import annotations

import math

import torch

from kernels.documents import readable


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types, else the input's (float64 stays float64 for gradchecks)."""
    return torch.promote_types(dtype, torch.float32)


def expand_kv(x_BHkvSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat KV heads for GQA: [B, Hkv, S, D] -> [B, H, S, D] (query head h reads KV head h // (H/Hkv)).

    Raises ValueError when ``num_heads`` is not a multiple of the KV head count.
    """
    hkv = x_BHkvSD.shape[1]
    if num_heads % hkv:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_key_value_heads={hkv}")
    rep = num_heads // hkv
    return x_BHkvSD if rep == 1 else x_BHkvSD.repeat_interleave(rep, dim=1)


def block_attention(
    q_BHSD: torch.Tensor,
    k_BHkvSD: torch.Tensor,
    v_BHkvSD: torch.Tensor,
    q_pos_BS: torch.Tensor,
    k_pos_BS: torch.Tensor,
    k_valid_BS: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of queries over one block of keys, returning the normalised output and its LSE.

    Query i may read key j when ``k_valid[j]`` and ``k_pos[j] <= q_pos[i]`` in the same document (position-causal:
    positions are global, so the same rule serves one device, a context-parallel shard and an inference KV cache;
    packed documents are encoded in the positions, ``kernels.documents.readable``).

    Args:
        q_BHSD: [B, H, Sq, D] queries.  k_BHkvSD, v_BHkvSD: [B, Hkv, Sk, D] keys and values.
        q_pos_BS: [B, Sq] int64 global positions of the queries.  k_pos_BS: [B, Sk] int64 of the keys.
        k_valid_BS: [B, Sk] bool, False for padding keys (None: all valid).
        scale: softmax scale (keyword only), default 1/sqrt(D).
    Returns:
        out_BHSD: [B, H, Sq, D] in q's dtype; rows with no readable key are 0.
        lse_BHS: [B, H, Sq] log-sum-exp (accumulation dtype, float32 for half inputs) of the scaled scores; -inf for rows with no readable key.
    The scores are computed in the accumulation dtype (``accum_dtype``). Memory is O(Sq*Sk) per head for this block only.
    """
    h = q_BHSD.shape[1]
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    acc = accum_dtype(q_BHSD.dtype)
    k = expand_kv(k_BHkvSD, h).to(acc)
    v = expand_kv(v_BHkvSD, h).to(acc)
    s_BHQK = torch.matmul(q_BHSD.to(acc), k.transpose(-1, -2)) * scale
    allowed_BQK = readable(q_pos_BS[:, :, None], k_pos_BS[:, None, :])
    if k_valid_BS is not None:
        allowed_BQK = allowed_BQK & k_valid_BS[:, None, :]
    s_BHQK = s_BHQK.masked_fill(~allowed_BQK[:, None], float("-inf"))
    lse_BHS = torch.logsumexp(s_BHQK, dim=-1)
    # exp(s - lse) with lse = -inf would be nan; such rows have no key and get weight 0.
    safe_lse = torch.where(torch.isfinite(lse_BHS), lse_BHS, torch.zeros_like(lse_BHS))
    p_BHQK = torch.exp(s_BHQK - safe_lse[..., None])
    out_BHSD = torch.matmul(p_BHQK, v)
    return out_BHSD.to(q_BHSD.dtype), lse_BHS


def merge_lse(
    out_a_BHSD: torch.Tensor, lse_a_BHS: torch.Tensor, out_b_BHSD: torch.Tensor, lse_b_BHS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets into the attention over their union.

    ``lse = logaddexp(lse_a, lse_b)``; ``out = out_a*exp(lse_a-lse) + out_b*exp(lse_b-lse)`` (the softmax
    decomposition used by blockwise/flash attention), accumulated in the LSE dtype (float32 or wider). A side with lse = -inf (no readable
    key) gets weight 0; when both are -inf the result is out = 0, lse = -inf, with finite gradients.

    Shapes: out_* [B, H, S, D], lse_* [B, H, S] float32/64. Returns (out [B, H, S, D] in out_a's dtype, lse).
    """
    # logaddexp(-inf, -inf) has a NaN gradient; such rows take lse = -inf through a branch with no gradient.
    empty = torch.isneginf(lse_a_BHS) & torch.isneginf(lse_b_BHS)
    zero = torch.zeros_like(lse_a_BHS)
    lse = torch.where(empty, lse_a_BHS, torch.logaddexp(torch.where(empty, zero, lse_a_BHS),
                                                        torch.where(empty, zero, lse_b_BHS)))
    finite = torch.isfinite(lse)
    safe_lse = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a_BHS - safe_lse), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b_BHS - safe_lse), torch.zeros_like(lse))
    acc = lse.dtype
    out = out_a_BHSD.to(acc) * w_a[..., None] + out_b_BHSD.to(acc) * w_b[..., None]
    return out.to(out_a_BHSD.dtype), lse
