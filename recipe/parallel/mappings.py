"""Tensor-parallel collectives as autograd pairs, named by region (the convention of Megatron-LM's mappings).

The two pairs the TP layers use (``tests/helpers/tp_reference.py`` holds the gather/scatter pair the tests compare
against). Each function takes the tensor-parallel ``group`` explicitly. A group of size 1 returns the input
untouched, so one code path serves tp=1 and tp>1. Collectives run inside ``torch.autograd.Function`` (grad mode off,
on a copy), never as an in-place ``dist.all_reduce`` on a tensor that requires grad.

| function                 | forward                       | backward                      |
|--------------------------|-------------------------------|-------------------------------|
| ``copy_to_tp_region``    | identity                      | all-reduce (sum)              |
| ``reduce_from_tp_region``| all-reduce (sum)              | identity                      |
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region with a replicated input. Forward: identity. Backward: sum the gradient over ``group``."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region by summing partial results. Forward: all-reduce over ``group``. Backward: identity."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)
