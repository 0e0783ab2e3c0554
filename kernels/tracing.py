"""The kernels' tracing mode: what they do differently under a fake-tensor memory trace (``recipe.plan.trace``).

Inside ``with tracing():`` (and only there):
- the tile loops' pair decision (``kernels.tiled_attention.readable_pairs``) computes EVERY (query tile, key tile)
  pair when the positions it is handed are fake tensors (no values to read). Tiles have equal sizes and one pair's
  temporaries live at a time, so the peak is the same as with the real skipping; host tensors with values are read
  as always.
- flex attention (``kernels.flex_attention.flex_block_attention``) calls :func:`flex_stand_in`, a memory-equivalent
  stand-in, instead of the compiled (or eager) ``flex_attention``; the block mask is still built for real.
Outside it nothing changes. The mode is a process-wide depth counter (traces run on one thread).
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor

_DEPTH = [0]


@contextlib.contextmanager
def tracing():
    """Enter the tracing mode (module docstring) for the block; nests."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def is_tracing() -> bool:
    """Whether a :func:`tracing` block is active."""
    return _DEPTH[0] > 0


def unreadable(*tensors) -> bool:
    """Inside the tracing mode: whether any of ``tensors`` is a fake tensor (has no values); False outside it."""
    return is_tracing() and any(isinstance(t, FakeTensor) for t in tensors)


class FusedStandIn(torch.autograd.Function):
    """Memory-equivalent stand-in of one fused attention call: ``apply(q, k, v) -> (out, lse)``; q [B, H, S, D],
    k/v [B, Hkv, Sk, D]; out like q, lse [B, H, S] float32; forward saves q, k, v, out, lse; backward allocates dq,
    dk, dv and delta [B, H, S] fp32 (flex's backward keeps it alive while dq, dk, dv are written). Values are
    unspecified (``empty``)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, _, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)  # rowsum(dout · out), fp32, alive while dq, dk, dv are written
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv


class _Aux:
    def __init__(self, lse):
        self.lse = lse


def flex_stand_in(q, k, v, block_mask=None, scale=None, enable_gqa=False, return_aux=None, **_):
    """``flex_attention``'s call signature and ``(out, aux.lse)`` result through :class:`FusedStandIn`."""
    out, lse = FusedStandIn.apply(q, k, v)
    return out, _Aux(lse)
