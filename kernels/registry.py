"""The kernel contract: what one (query tile, key tile) pair computes (``BlockKernel``), what an attention backend
declares (``AttentionBackend``), what a sequence-split strategy declares (``SequenceSplit``), and the two registries.

A backend module registers itself at import (``register_attention_backend``); ``kernels.attention_backends``
imports every built-in backend and strategy module (one import line each) and builds the causal block from these
declarations, so the run (``recipe.parallel.parallelize``), the online target's split forward, the inference KV
cache, the benchmarks and the planner (``recipe.plan.trace``) all read the same entries: a new kernel is one module
that registers itself plus one import line there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from kernels.block_attention import accum_dtype


class BlockKernel(NamedTuple):
    """What the tile loops run on one readable (query tile, key tile) pair.

    ``forward(q, k, v, q_pos, k_pos, k_valid, scale) -> (out, lse)``: ``block_attention``'s contract (k_valid a bool
    tensor, out [B, H, Tq, D], lse [B, H, Tq] in the accumulation dtype, -inf / 0 on rows without a readable key);
    called without autograd. ``backward(dout, dlse, delta, lse, q, k, v, q_pos, k_pos, k_valid, scale) -> (dq, dk,
    dv)``: ``attention_block_backward``'s contract (lse, delta and dlse are the FINAL ones, over all key blocks).
    ``compute_dtype(dtype)``: the dtype q/k/v are cast to before reaching the kernel (outputs and merges always
    accumulate in ``accum_dtype``).
    """

    name: str
    forward: Callable
    backward: Callable
    compute_dtype: Callable[[torch.dtype], torch.dtype] = accum_dtype


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: a name for the ``kernels.attention`` switch and how to build it.

    Fields:
        name: the name in ``kernels.attention`` (and ``--backends`` of the benchmarks).
        kernel: ``() -> BlockKernel``, the per-pair kernel of the tile loops and of every ring hop (called once per
            causal block built: a kernel with a cache, flex's block masks, makes a fresh one).
        single_device: ``(tile_size, device) -> callable`` with the causal-block signature ``(q, k, v, q_pos,
            k_pos, k_valid) -> (out, lse)`` on one device; None: ``TiledCausalAttention(tile_size, kernel())``.
        refusal: ``(device_type) -> str | None``: why the backend cannot run on that device type (completing
            "attention backend NAME ..."), None when it can; None: it runs everywhere.
        auto_on: device types on which ``"auto"`` picks this backend (when it can run there).
        fallback: ``"auto"``'s choice on a device type no backend's ``auto_on`` claims (exactly one backend: the
            pure-PyTorch reference).
        uses_tiles: whether ``memory.attention_tile_size`` cuts its blocks (False: its own blocking, one pair per
            ring hop, as flex).
        traced_as: the backend the planner's fake-tensor trace builds in its place (a kernel that reads position
            values, which fake tensors lack, is traced as another with the same memory); None: itself.
        order: its place in ``attention_backend_names`` (error messages, benchmark defaults, ``auto``'s scan), so
            the listing does not depend on which module was imported first; ties keep registration order.
    """

    name: str
    kernel: Callable[[], BlockKernel]
    single_device: Callable | None = None
    refusal: Callable[[str], str | None] | None = None
    auto_on: tuple[str, ...] = ()
    fallback: bool = False
    uses_tiles: bool = True
    traced_as: str | None = None
    order: int = 100


@dataclass(frozen=True)
class SequenceSplit:
    """One strategy for the causal block across a sequence split over ranks (``kernels.sequence_parallel``).

    ``build(backend, tile_size, device, group) -> callable``: the causal-block callable ``(q, k, v, q_pos, k_pos,
    k_valid) -> (out, lse)`` of this rank's part of the split sequence (zigzag shards, ``recipe.parallel.cp_shard``),
    over the process ``group`` (size > 1), each block computed by ``backend`` (an :class:`AttentionBackend`).
    """

    name: str
    build: Callable


_BACKENDS: dict[str, AttentionBackend] = {}
_SPLITS: dict[str, SequenceSplit] = {}


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` under ``backend.name`` (a later registration of the same name replaces it) and return it."""
    _BACKENDS[backend.name] = backend
    return backend


def unregister_attention_backend(name: str) -> None:
    """Remove a registered backend (tests that register their own); a missing name is ignored."""
    _BACKENDS.pop(name, None)


def attention_backend_names() -> tuple[str, ...]:
    """The registered backend names by ``AttentionBackend.order``, then registration order ("auto" not included)."""
    return tuple(sorted(_BACKENDS, key=lambda name: _BACKENDS[name].order))


def attention_backend(name: str) -> AttentionBackend:
    """The registered backend ``name``. Raises ValueError naming it and the registered names when unknown."""
    if name not in _BACKENDS:
        allowed = ", ".join(repr(n) for n in ("auto", *attention_backend_names()))
        raise ValueError(f"unknown attention backend {name!r}; allowed: {allowed}")
    return _BACKENDS[name]


def register_sequence_parallel(split: SequenceSplit) -> SequenceSplit:
    """Add ``split`` under ``split.name`` (a later registration of the same name replaces it) and return it."""
    _SPLITS[split.name] = split
    return split


def unregister_sequence_parallel(name: str) -> None:
    """Remove a registered sequence-split strategy; a missing name is ignored."""
    _SPLITS.pop(name, None)


DEFAULT_SEQUENCE_PARALLEL = "ring"
"""The sequence-split strategy when none is named: the one default of the ``kernels.sequence_parallel`` switch
(``recipe.config.KernelOptions``) and of every builder below it (ring attention over the zigzag shards,
``kernels.ring_attention``)."""


def sequence_parallel_names() -> tuple[str, ...]:
    """The registered sequence-split strategy names, in registration order."""
    return tuple(_SPLITS)


def sequence_parallel(name: str) -> SequenceSplit:
    """The registered strategy ``name``. Raises ValueError naming it and the registered names when unknown."""
    if name not in _SPLITS:
        raise ValueError(f"unknown sequence-parallel strategy {name!r}; registered: {list(_SPLITS)}")
    return _SPLITS[name]
