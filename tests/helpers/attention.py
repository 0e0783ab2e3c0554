"""Shared cases of the attention-kernel tests: small causal-block problems (padding, GQA, rows with no readable key,
Sq != Sk), the dense float64 reference, and one forward + backward whose loss reads out and every finite lse."""
from __future__ import annotations

import math

import torch

from kernels.block_attention import expand_kv

B, H, HKV, D, SK = 2, 4, 2, 8, 16


def run_attention(attention, q, k, v, q_pos, k_pos, valid, w, u):
    """out, lse and (dq, dk, dv) of ``Σ out·w + Σ_finite lse·u`` (so the lse gradient is exercised too), for any
    causal-block callable ``attention(q, k, v, q_pos, k_pos, valid) -> (out, lse)``."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, q_pos, k_pos, valid)
    finite = torch.isfinite(lse)
    ((out * w).sum() + torch.where(finite, lse * u, torch.zeros_like(lse)).sum()).backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def dense_reference(q, k, v, q_pos, k_pos, valid):
    """Dense masked softmax in float64, written out: (out, lse), out 0 / lse -inf on rows without a key."""
    s = q.double() @ expand_kv(k.double(), q.shape[1]).transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = ((k_pos[:, None, :] <= q_pos[:, :, None]) & valid[:, None, :])[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p @ expand_kv(v.double(), q.shape[1]), lse


def attention_case(kind: str, dtype=torch.float64, seed: int = 0, d: int = D):
    """(q, k, v, q_pos, k_pos, valid, w, u). Keys 0..15, the last 3 padding and, in batch row 1, keys 0-1 too (so
    its first queries read nothing). kind: "square" (queries = keys), "subset" (7 of the key positions), "later"
    (5 queries after the last key: inference chain), "mixed" (queries interleaved with keys, Sq > Sk/2). B = 2 rows,
    H = 4 query / HKV = 2 KV heads of dim ``d``."""
    g = torch.Generator().manual_seed(seed)
    k_pos = torch.arange(SK).expand(B, SK).clone()
    q_pos = {"square": k_pos, "subset": torch.tensor([0, 1, 3, 6, 7, 12, 15]).expand(B, 7),
             "later": torch.arange(16, 21).expand(B, 5), "mixed": (torch.arange(11) * 3 // 2).expand(B, 11)}[kind]
    q_pos = q_pos.clone()
    valid = torch.ones(B, SK, dtype=torch.bool)
    valid[:, SK - 3:] = False
    valid[1, :2] = False
    q = torch.randn(B, H, q_pos.shape[1], d, generator=g, dtype=dtype)
    k, v = (torch.randn(B, HKV, SK, d, generator=g, dtype=dtype) for _ in range(2))
    w = torch.randn(q.shape, generator=g, dtype=dtype)
    u = torch.randn(q.shape[:-1], generator=g, dtype=dtype)
    return q, k, v, q_pos, k_pos, valid, w, u
