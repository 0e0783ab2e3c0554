"""Test-only parallel references: the gather/scatter autograd pair along the last dim (the library's TP layers need
only ``recipe.parallel.mappings``' copy/reduce pair), the rank grid of every group (what DeepSpeed's topology must
give), and the zigzag inverse and padding the CP tests build their inputs with."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.parallel.cp_shard import zigzag_indices
from recipe.parallel.dims import AXES, rank_coords
from recipe.parallel.mappings import group_rank, group_size


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region sharded on the last dim. Forward: all-gather, concatenated along the last dim in rank
    order ([..., n/tp] → [..., n]). Backward: keep this rank's slice of the gradient ([..., n] → [..., n/tp])."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region sharded on the last dim. Forward: keep this rank's contiguous slice ([..., n] →
    [..., n/tp]; ValueError unless tp divides n). Backward: all-gather the gradient ([..., n/tp] → [..., n])."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def group_rank_lists(axis: str, dp: int, cp: int, tp: int) -> list[list[int]]:
    """Global rank lists of every group along ``axis``, ordered by their smallest rank.

    ``axis``: ``"tp"``, ``"cp"``, ``"dp"`` (ranks differing only in that coordinate) or ``"dp_cp"`` (ranks sharing the
    tp coordinate: the group ZeRO partitions and averages over). Each list is ascending. Raises ValueError for an
    unknown axis.
    """
    world = dp * cp * tp
    varying = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}
    if axis not in varying:
        raise ValueError(f"unknown axis {axis!r}; expected one of {sorted(varying)}")
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        coord = rank_coords(rank, dp, cp, tp)
        key = tuple(getattr(coord, a) for a in AXES if a not in varying[axis])
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int, value=0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` to the next multiple of ``multiple`` (unchanged if already
    one)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    dim = dim % x.dim()
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), pad, value=int(value)).bool()
    return F.pad(x, pad, value=value)


def zigzag_unsplit(shards: list[torch.Tensor], cp_size: int, dim: int) -> torch.Tensor:
    """Inverse of ``zigzag_split``: the full tensor from all ranks' shards (in rank order). Exact.

    Raises ValueError if the number of shards is not cp_size.
    """
    if len(shards) != cp_size:
        raise ValueError(f"zigzag_unsplit got {len(shards)} shards for cp_size={cp_size}")
    stacked = torch.cat(shards, dim=dim)
    seq_len = stacked.shape[dim]
    order = torch.cat([zigzag_indices(seq_len, cp_size, r) for r in range(cp_size)]).to(stacked.device)
    return torch.empty_like(stacked).index_copy_(dim, order, stacked)
