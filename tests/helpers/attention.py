"""Shared driver of the attention-kernel tests: one forward + backward whose loss reads out and every finite lse."""
from __future__ import annotations

import torch


def run_attention(attention, q, k, v, q_pos, k_pos, valid, w, u):
    """out, lse and (dq, dk, dv) of ``Σ out·w + Σ_finite lse·u`` (so the lse gradient is exercised too), for any
    causal-block callable ``attention(q, k, v, q_pos, k_pos, valid) -> (out, lse)``."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, q_pos, k_pos, valid)
    finite = torch.isfinite(lse)
    ((out * w).sum() + torch.where(finite, lse * u, torch.zeros_like(lse)).sum()).backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]
