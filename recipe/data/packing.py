"""Where a micro-batch's samples go: one per right-padded row, or packed several to a row up to a token budget
(the ``data.packing`` switch; docs/algorithm.md, "Packing").

A micro-batch of B samples padded to its longest computes B·S positions, most of them padding when the lengths vary
(ShareGPT's do by 10× and more). Packed, the samples are laid one after another into rows of at most
``packing_tokens`` tokens (first fit, longest first: a sample longer than the budget gets a row of its own; no
budget, the default: one row for the whole micro-batch, which never holds more positions than its padded rows), each
sample a *document* of its row: the batch builder gives every document its own positions from 0 and the kernels
isolate the documents (``kernels.documents``), so every number equals the padded batch's up to float summation
order. This module is the host arithmetic only: lengths in, a :class:`RowLayout` out, the same on every rank (no
collective); the training builder (``recipe.train.batches``), the call extents, the step benchmark and the data
report all read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PACKING_MODES = (False, True, "auto")
"""``data.packing``: false (one sample per padded row), true (pack every micro-batch of two or more samples),
``"auto"`` (the default: pack where the packed rows hold fewer positions than the padded ones)."""


@dataclass(frozen=True)
class Placement:
    """Sample ``slot`` of the micro-batch (its index in the micro-batch's sample list) holds ``length`` tokens at
    ``[offset, offset + length)`` of row ``row``."""

    slot: int
    row: int
    offset: int
    length: int


@dataclass(frozen=True)
class RowLayout:
    """The rows of one micro-batch: ``placements`` (one per sample, in row order then offset order), ``rows`` (B),
    ``seq`` (S: the longest row rounded up to the sequence divisor) and whether it is ``packed`` (False: sample j
    alone in row j at offset 0, the padded batch; a batch of one sample is never packed: it is the same batch)."""

    placements: tuple[Placement, ...]
    rows: int
    seq: int
    packed: bool

    @property
    def positions(self) -> int:
        """B·S, the positions the draft computes (real tokens and padding)."""
        return self.rows * self.seq

    @property
    def tokens(self) -> int:
        """The real tokens of the micro-batch."""
        return sum(p.length for p in self.placements)

    @property
    def padding_share(self) -> float:
        """The share of the B·S positions that are padding (0 for an empty layout)."""
        return 1.0 - self.tokens / self.positions if self.positions else 0.0

    def documents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(document index [B, S] int64, token position [B, S] int64): in row b the documents in offset order are
        0, 1, …; the padding after the last one is one more document (its positions restart at 0 as well, and the
        batch marks it invalid). An unpacked layout is document 0 with positions 0..S−1 in every row."""
        docs = torch.zeros(self.rows, self.seq, dtype=torch.int64)
        pos = torch.arange(self.seq, dtype=torch.int64).repeat(self.rows, 1)
        ends = [0] * self.rows
        count = [0] * self.rows
        for p in self.placements:
            docs[p.row, p.offset:p.offset + p.length] = count[p.row]
            pos[p.row, p.offset:p.offset + p.length] = torch.arange(p.length)
            ends[p.row], count[p.row] = p.offset + p.length, count[p.row] + 1
        for row, end in enumerate(ends):
            docs[row, end:] = count[row]
            pos[row, end:] = torch.arange(self.seq - end)
        return docs, pos


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_layout(lengths: list[int], divisor: int = 1) -> RowLayout:
    """One sample per row, right-padded to the longest rounded up to ``divisor``."""
    return RowLayout(tuple(Placement(j, j, 0, n) for j, n in enumerate(lengths)), len(lengths),
                     _round_up(max(lengths, default=1), divisor), False)


def packed_layout(lengths: list[int], budget: int, divisor: int = 1) -> RowLayout:
    """The samples packed into rows of at most ``budget`` tokens, first fit in order of decreasing length (ties:
    the earlier sample first), a sample longer than ``budget`` alone in its row; S is the longest row rounded up to
    ``divisor``. Raises ValueError for a budget below 1 or an empty ``lengths``."""
    if budget < 1 or not lengths:
        raise ValueError(f"packing needs a positive token budget and samples, got budget {budget}, {len(lengths)} "
                         "samples")
    loads: list[int] = []
    rows: list[list[tuple[int, int]]] = []
    for slot in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[slot]
        row = next((r for r, load in enumerate(loads) if load + n <= budget), None)
        if row is None:
            row = len(loads)
            loads.append(0)
            rows.append([])
        rows[row].append((slot, loads[row]))
        loads[row] += n
    placements = tuple(Placement(slot, r, offset, lengths[slot]) for r, members in enumerate(rows)
                       for slot, offset in members)
    return RowLayout(placements, len(rows), _round_up(max(loads), divisor), True)


def packing_counts(layouts: list[RowLayout]) -> dict:
    """A training step's packing metrics from the layouts of its micro-batches (every dp rank's, before the cp
    split): ``micro_batches``, ``packed_micro_batches`` (those laid out packed; under ``"auto"`` the ones whose
    packed rows hold fewer positions) and ``padding_share`` (padding among the B·S positions the draft computes;
    0.0 without positions)."""
    positions = sum(layout.positions for layout in layouts)
    tokens = sum(layout.tokens for layout in layouts)
    return {"micro_batches": len(layouts), "packed_micro_batches": sum(layout.packed for layout in layouts),
            "padding_share": 1 - tokens / positions if positions else 0.0}


def check_packing(mode) -> bool | str:
    """``mode`` if it is one of :data:`PACKING_MODES`; ValueError naming it and the choices otherwise."""
    if mode is True or mode is False or mode == "auto":
        return mode
    raise ValueError(f"packing={mode!r}: choose from true, false or \"auto\"")


def micro_batch_layout(lengths: list[int], packing: bool | str, budget: int | None = None,
                       divisor: int = 1) -> RowLayout:
    """The layout a micro-batch of samples of ``lengths`` tokens gets under ``packing`` (:data:`PACKING_MODES`):
    padded for false or a single sample; packed (``packed_layout`` at ``budget`` tokens a row; None: no budget,
    one row holding the whole micro-batch) for true; for ``"auto"`` packed when that holds fewer positions than the
    padded layout, else padded. Packing that leaves every sample alone in its row (a budget below every pair of
    them) is the padded layout: padded."""
    padded = padded_layout(lengths, divisor)
    if check_packing(packing) is False or len(lengths) < 2:
        return padded
    packed = packed_layout(lengths, budget or sum(lengths), divisor)
    if packed.rows == len(lengths):
        return padded
    return packed if packing is True or packed.positions < padded.positions else padded
