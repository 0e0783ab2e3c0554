"""Host (CPU) copies of the position and validity tensors from which the tile loops decide their pair lists.

Which (query tile, key tile) pairs can read anything (``kernels.tiled_attention.readable_pairs``) is a host decision:
a Python list drives the loops. Decided from device tensors it costs a device->host sync per call, i.e. per TTT
step, per ring hop. Yet in training the positions are host-known (arange / zigzag arithmetic) and the key validity is
the batch's padding, which the batch builder has on the CPU. So the builder attaches CPU copies to the device tensors
it hands to the draft (:func:`attach_host_copies`) and the attention looks them up (:func:`host_copy`): no signature
of the causal-block convention changes, the copies follow the tensors through ``torch.utils.checkpoint`` and the
engine, and a tensor without a copy (an inference caller) falls back to one device sync per call.

Under context parallelism the key block travelling around the ring is another rank's; its positions and validity are
host-known too (every rank holds the whole padded sequence before the zigzag split), so a copy holds the tensor of
EVERY cp rank: ``per_rank[r]`` is what cp rank r's tensor holds, ``rank`` is the one the device tensor is.

The registry is keyed by what the tensor views (device, dtype, data pointer, offset, shape, strides), not by the
Python object: DeepSpeed ZeRO-3 hands every submodule ``input.detach()`` of its tensor inputs, a new object on the same
memory, which must still find its copies. An entry holds a weak reference to the tensor it was attached to and counts
only while that tensor lives: its memory cannot be reused by another tensor meanwhile, so a match is the same data
(an alias: a detach, a same-shaped view). A new tensor (a ``.to(...)`` copy, a clone, a slice) has no entry. The
copies are a promise that the tensor is not written in place afterwards (positions and validity never are).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostCopies:
    """``per_rank``: one CPU tensor per cp rank (entry r: the values of cp rank r's tensor, same shape and dtype as
    the device tensor); ``rank``: the cp rank whose tensor this entry is attached to."""

    per_rank: tuple[torch.Tensor, ...]
    rank: int


_COPIES: dict[tuple, tuple[weakref.ref, HostCopies]] = {}


def _key(tensor: torch.Tensor) -> tuple | None:
    """What ``tensor`` views; None for a tensor without real memory (meta, fake)."""
    try:
        return (tensor.device, tensor.dtype, tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tensor.stride())
    except (RuntimeError, NotImplementedError):
        return None


def _forget(key: tuple, ref: weakref.ref) -> None:
    entry = _COPIES.get(key)
    if entry is not None and entry[0] is ref:
        del _COPIES[key]


def attach_host_copies(tensor: torch.Tensor, per_rank, rank: int = 0) -> torch.Tensor:
    """Record the CPU copies ``per_rank`` (a list of CPU tensors, one per cp rank; a single tensor means one rank)
    of ``tensor`` (cp rank ``rank``'s). Returns ``tensor``. Raises ValueError when a copy is not on the CPU or its
    shape differs from ``tensor``'s, or ``rank`` is out of range; the copies are trusted to hold the same values."""
    per_rank = (per_rank,) if isinstance(per_rank, torch.Tensor) else tuple(per_rank)
    if not 0 <= rank < len(per_rank):
        raise ValueError(f"rank {rank} is not in [0, {len(per_rank)})")
    for r, t in enumerate(per_rank):
        if t.device.type != "cpu" or t.shape != tensor.shape:
            raise ValueError(f"host copy {r}: a {tuple(t.shape)} tensor on {t.device}, expected a CPU tensor of "
                             f"shape {tuple(tensor.shape)}")
    key = _key(tensor)
    if key is not None:
        _COPIES[key] = (weakref.ref(tensor, lambda ref, key=key: _forget(key, ref)), HostCopies(per_rank, rank))
    return tensor


def host_copies(tensor: torch.Tensor | None) -> HostCopies | None:
    """The copies attached to ``tensor`` or to a live tensor it aliases (None: none, or ``tensor`` is None)."""
    key = None if tensor is None else _key(tensor)
    entry = None if key is None else _COPIES.get(key)
    return entry[1] if entry is not None and entry[0]() is not None else None


def host_copy(tensor: torch.Tensor, rank: int | None = None) -> torch.Tensor | None:
    """A CPU tensor with the values of cp rank ``rank``'s tensor (default: ``tensor``'s own rank), without a
    device sync: the attached copy, or ``tensor`` itself when it is on the CPU and no other rank is asked for; else
    None."""
    copies = host_copies(tensor)
    if copies is not None:
        r = copies.rank if rank is None else rank
        return copies.per_rank[r] if 0 <= r < len(copies.per_rank) else None
    return tensor if tensor.device.type == "cpu" and rank is None else None


def host_block_meta(q_pos_BS: torch.Tensor, k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor | None,
                    key_rank: int | None = None):
    """``(q_pos, k_pos, k_valid)`` of a causal block as CPU tensors (k_valid None stays None), the keys those of cp
    rank ``key_rank`` (default: their own), when all are known on the host without a sync; else None."""
    hq, hk = host_copy(q_pos_BS), host_copy(k_pos_BS, key_rank)
    hv = None if k_valid_BS is None else host_copy(k_valid_BS, key_rank)
    if hq is None or hk is None or (k_valid_BS is not None and hv is None):
        return None
    return hq, hk, hv
