"""Uniform module-call counts across the ZeRO group: the extent a micro-batch's tiled and chunked work is counted from.

Under DeepSpeed ZeRO-3 each parameter is all-gathered over the ZeRO group (the dp×cp ranks) every time its module is
called (those above ``stage3_param_persistence_threshold`` are released after each call), so every rank of the group
must call every parameterised module equally often per micro-batch. Two memory switches make calls per piece of the
sequence: the tiled MLP (``memory.mlp_tile_size``, ``recipe.model.tiled_mlp``: the layer's norm + MLP once per tile
of S, ⌈S / tile⌉ tiles) and the chunked loss (``memory.loss_chunk_size``, ``recipe.model.chunked_loss``: the draft's
``lm_head`` once per chunk of the flattened B·S positions, ⌈B·S / chunk⌉ chunks). Data-parallel ranks pad their own
micro-batches (``recipe.train.batches``: S = the longest sample rounded up to 2·cp·tp), so their S and B·S differ.

A :class:`CallExtent` carries, on the batch (``TTTBatch.call_extent``), the largest S and B·S of the micro-batch over
the group; each rank counts its pieces from it and appends empty pieces after its own (an empty call still gathers,
gives the parameters zero gradient, and in backward is recomputed like the others). The training loop and the
validation know every dp rank's sample indices and the lengths are on the host (``BatchBuilder.call_extent``), so the
extent is computed locally and identically on every rank: no collective. The online target's argmax chunks
(``memory.argmax_chunk_size``) need none of this: a ZeRO-3 partitioned target gathers its lm_head once per capture
(``PartitionedTargetModel.full_lm_head``) and multiplies by the raw weight per chunk, calling no module.
"""
from __future__ import annotations

from typing import NamedTuple


class CallExtent(NamedTuple):
    """The largest local padded work of one micro-batch over the ZeRO group (dp×cp ranks), in positions.

    seq_len: positions per batch row on a rank (the padded sequence / cp, the S of the rank's ``TTTBatch``): the
    tiled MLP makes ⌈seq_len / mlp_tile_size⌉ calls. positions: flattened positions B·S on a rank: the chunked loss
    makes ⌈positions / loss_chunk_size⌉ calls. Both ints ≥ 1 and at least the batch's own S and B·S
    (``TTTBatch`` raises ValueError otherwise).
    """

    seq_len: int
    positions: int

    @classmethod
    def of(cls, shapes, cp_size: int = 1) -> CallExtent:
        """The extent of whole (unsplit) micro-batches ``shapes``, an iterable of (B, S) with S the padded length of
        the whole sequence, one per dp rank; each cp rank holds S / cp of it. Raises ValueError for no shapes, a
        non-positive size or an S that cp does not divide."""
        shapes = [(int(b), int(s)) for b, s in shapes]
        if not shapes or any(b < 1 or s < 1 or s % cp_size for b, s in shapes):
            raise ValueError(f"CallExtent.of: shapes {shapes} must be (B >= 1, S >= 1) with S a multiple of "
                             f"cp={cp_size}")
        return cls(max(s for _, s in shapes) // cp_size, max(b * s for b, s in shapes) // cp_size)

    def shard(self, cp_size: int) -> CallExtent:
        """The extent of one cp rank's zigzag shard of a whole-sequence batch of this extent (both sizes / cp)."""
        return CallExtent(self.seq_len // cp_size, self.positions // cp_size)

    def check_covers(self, batch: int, seq_len: int) -> None:
        """ValueError unless this extent is at least the batch's own ``seq_len`` (S) and ``batch·seq_len`` (B·S)."""
        if self.seq_len < seq_len or self.positions < batch * seq_len:
            raise ValueError(f"call_extent {tuple(self)} (seq_len, positions) is smaller than the batch's own "
                             f"({seq_len}, {batch * seq_len}) for B={batch}, S={seq_len}: it must be the largest "
                             "over the ZeRO group, this rank included")


def piece_count(extent_positions: int, piece: int) -> int:
    """⌈extent_positions / piece⌉: the calls a tiled or chunked module makes for that many positions."""
    return -(-extent_positions // piece)
