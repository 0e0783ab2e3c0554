"""Parallel degrees (dp × cp × tp) and the rank-grid math, as pure code with no processes.

Rank layout (docs/algorithm.md, "Rank layout"): tp is the fastest axis, then cp, then dp, i.e.
``rank = (dp_idx · cp + cp_idx) · tp + tp_idx`` — the same order as DeepSpeed's
``ProcessTopology(axes=["dp", "cp", "tp"], dims=[dp, cp, tp])`` (its last axis varies fastest).

Our JSON run config carries a section ``"parallelism": {"tp_size": 2, "cp_size": 1}`` next to the DeepSpeed keys;
``recipe.config.load_run_config`` removes it before the dict goes to ``deepspeed.initialize``. (DeepSpeed 0.19.8
ignores an unknown top-level key silently, so removing it keeps the dict clean; it is not needed for DeepSpeed.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, NamedTuple

PARALLEL_SECTION = "parallelism"  # our section of the run JSON (recipe.config reads it)
_KNOWN_KEYS = ("tp_size", "cp_size", "dp_size")
AXES = ("dp", "cp", "tp")


class RankCoord(NamedTuple):
    """Coordinates of one global rank in the (dp, cp, tp) grid."""
    dp: int
    cp: int
    tp: int


def rank_coords(rank: int, dp: int, cp: int, tp: int) -> RankCoord:
    """Coordinates of global ``rank`` (tp fastest, then cp, then dp). Raises ValueError when out of range."""
    if not 0 <= rank < dp * cp * tp:
        raise ValueError(f"rank {rank} is outside the grid dp={dp} × cp={cp} × tp={tp} = {dp * cp * tp} ranks")
    return RankCoord(dp=rank // (cp * tp), cp=(rank // tp) % cp, tp=rank % tp)


def seq_divisor(cp: int, tp: int) -> int:
    """Sequence lengths are padded to a multiple of ``2·cp·tp``: 2·cp zigzag chunks, each divisible by tp."""
    return 2 * cp * tp


def check_tp_divides(tp: int, sizes: Mapping[str, int]) -> None:
    """Raise ValueError listing every entry of ``sizes`` (name -> size: heads, KV heads, intermediate, draft vocab)
    that ``tp`` does not divide; the TP layers split each of them into tp equal contiguous shards."""
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(f"tensor-parallel size tp={tp} must divide every split draft dimension; not divisible: "
                         f"{', '.join(bad)}")


@dataclass(frozen=True)
class ParallelDims:
    """The single source of truth for the parallel degrees of a run.

    Fields: ``world_size`` (processes), ``tp`` (tensor-parallel degree, draft heads/intermediate/vocab split),
    ``cp`` (context-parallel degree, zigzag sequence split), ``dp`` (data-parallel degree; -1 = infer as
    world_size / (tp·cp)). Raises ValueError (one message listing every degree) unless every degree ≥ 1 and
    dp·cp·tp == world_size.
    """
    world_size: int
    tp: int = 1
    cp: int = 1
    dp: int = -1

    def __post_init__(self):
        listing = f"world_size={self.world_size}, dp={self.dp}{' (infer)' if self.dp == -1 else ''}, " \
                  f"cp={self.cp}, tp={self.tp}"
        for name in ("world_size", "tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel degree {name} must be an integer >= 1 ({listing})")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"parallel degree dp must be an integer >= 1 or -1 to infer it ({listing})")
        if self.dp == -1:
            if self.world_size % (self.cp * self.tp):
                raise ValueError(f"cannot infer dp: world_size is not divisible by cp·tp = {self.cp * self.tp} "
                                 f"({listing})")
            object.__setattr__(self, "dp", self.world_size // (self.cp * self.tp))
        if self.dp * self.cp * self.tp != self.world_size:
            raise ValueError(f"dp·cp·tp = {self.dp * self.cp * self.tp} must equal world_size ({listing})")

    # ---- derived facts -------------------------------------------------------------------------------------------
    @property
    def dp_cp(self) -> int:
        """Size of the ZeRO group (parameters are replicated over dp and cp)."""
        return self.dp * self.cp

    @property
    def seq_divisor(self) -> int:
        """Sequence lengths are padded to a multiple of this (:func:`seq_divisor`: 2·cp·tp)."""
        return seq_divisor(self.cp, self.tp)

    def coords(self, rank: int) -> RankCoord:
        """Grid coordinates of global ``rank``."""
        return rank_coords(rank, self.dp, self.cp, self.tp)

    @property
    def cp_enabled(self) -> bool:
        """Whether the sequence is split over context-parallel ranks (cp > 1): the one place "cp > 1" is decided
        for a run's layout (ring attention, zigzag shards, the split target forward)."""
        return self.cp > 1


@dataclass(frozen=True)
class ParallelismOptions:
    """Our ``"parallelism"`` section of the run JSON, parsed once (``recipe.config.load_sections``), before the
    world size is known: ``tp_size`` (default 1), ``cp_size`` (default 1), ``dp_size`` (None: inferred from the world
    size). The degrees' defaults and validation live here only; :meth:`dims` makes the run's :class:`ParallelDims`.
    Raises ValueError naming ``parallelism.<key>`` for a degree that is not an integer >= 1."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int | None = None

    def __post_init__(self):
        for key in _KNOWN_KEYS:
            value = getattr(self, key)
            if (value is not None or key != "dp_size") and (not isinstance(value, int) or isinstance(value, bool)
                                                             or value < 1):
                raise ValueError(f"'{PARALLEL_SECTION}.{key}' must be an integer >= 1, got {value!r}")

    @classmethod
    def from_section(cls, section: Mapping | None) -> "ParallelismOptions":
        """Parse ``{"tp_size": int, "cp_size": int, "dp_size": int}`` (all optional; None: the defaults). Raises
        ValueError naming unknown keys (listing the known ones) or a bad degree."""
        section = dict(section or {})
        unknown = sorted(set(section) - set(_KNOWN_KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in the '{PARALLEL_SECTION}' config section; known keys: "
                             f"{list(_KNOWN_KEYS)}")
        return cls(**section)

    def with_overrides(self, overrides: Mapping | None) -> "ParallelismOptions":
        """A copy with the command line's degrees (``run.py --tp-size/--cp-size``, the planner's ``--tp/--cp``:
        ``{"tp_size": 2, "cp_size": None}``; None values ignored). Raises ValueError as the constructor does."""
        changes = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(changes) - set(_KNOWN_KEYS))
        if unknown:
            raise ValueError(f"unknown parallelism override(s) {unknown}; known keys: {list(_KNOWN_KEYS)}")
        return dataclasses.replace(self, **changes)

    @property
    def world_size(self) -> int:
        """The processes this section describes by itself: tp·cp·dp (dp 1 when not given; the planner's default)."""
        return self.tp_size * self.cp_size * (self.dp_size or 1)

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The :class:`ParallelDims` of ``world_size`` processes (None: :attr:`world_size`). Raises ValueError when
        the degrees do not fit it."""
        return ParallelDims(world_size=self.world_size if world_size is None else world_size, tp=self.tp_size,
                            cp=self.cp_size, dp=-1 if self.dp_size is None else self.dp_size)
