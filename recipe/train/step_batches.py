"""One optimizer step's micro-batches of this rank (:class:`StepBatches`): the counts the loss normalisation needs
before the first backward, then the device micro-batches one at a time (``recipe.train.batches.BatchBuilder``)."""
from __future__ import annotations

from concurrent.futures import Future

import torch

from recipe.model.call_extent import CallExtent
from recipe.train.batches import BatchBuilder, MicroBatch, supervised_per_step


class StepBatches:
    """This rank's micro-batches of one optimizer step (``micro``: the sample indices of each, in order), with the
    counts the loss normalisation needs before the first backward.

    ``local_valid_K`` [K] int64: this rank's valid positions per TTT step over all micro-batches (this cp rank's
    shard; summed over dp×cp by the loop). ``supervised_K`` [K] int64 and ``supervised_tokens``: the whole
    micro-batches' (CPU). ``shape``: (samples, rows, tokens a row) of the largest micro-batch (rows < samples:
    packed), for an out-of-memory report.

    Offline the counts come from the host tokens and the store's ``target_argmax`` alone (``BatchBuilder.tokens``,
    ``local_valid``; on the CPU), before any hidden state is read; iterating then yields one device micro-batch at
    a time, the store reads of micro-batch m+1 running in the builder's background thread while m is used. Online
    the in-vocabulary flags need the target's argmax, i.e. the target forward of every micro-batch, so all
    micro-batches are built up front (``local_valid_K`` on the device, like the batches; with one micro-batch per
    step this is the same as building lazily). Either way the batches are those of ``builder.build`` on each
    index list, in order. ``extents``: each micro-batch's ``TTTBatch.call_extent`` (None: their own).
    """

    def __init__(self, builder: BatchBuilder, micro: list[list[int]], extents: list[CallExtent] | None = None):
        self.builder, self.micro = builder, micro
        self.extents = extents if extents is not None else [None] * len(micro)
        self._built: list[MicroBatch] | None = None
        self._first: Future | None = None
        if builder.store is not None:
            self._hosts = [builder.tokens(ix) for ix in micro]
            self._first = builder.prefetch(self._hosts[0]) if micro else None  # overlaps the counts below
            self.local_valid_K = torch.stack([builder.local_valid(h) for h in self._hosts]).sum(0)
            self.shape = _largest([(h.samples, h.attention_BS.shape[0], h.seq) for h in self._hosts])
            loss_masks = [h.loss_mask_BS for h in self._hosts]
        else:
            self._built = [builder.build(ix, extent=e) for ix, e in zip(micro, self.extents)]
            self.local_valid_K = torch.stack([b.ttt.valid_KBS.sum(dim=(1, 2)) for b in self._built]).sum(0)
            self.shape = _largest([(b.samples, *b.ttt.input_ids_KBS.shape[-2:]) for b in self._built], builder.dims.cp)
            loss_masks = None
        if loss_masks is not None:
            self.supervised_K = torch.stack([supervised_per_step(h.loss_mask_BS, builder.ttt_steps, h.documents_BS)
                                             for h in self._hosts]).sum(0)
            self.supervised_tokens = sum(int(m.sum()) for m in loss_masks)
        else:
            self.supervised_K = torch.stack([b.supervised_K for b in self._built]).sum(0)
            self.supervised_tokens = sum(b.supervised_tokens for b in self._built)

    def __len__(self) -> int:
        return len(self.micro)

    def __iter__(self):
        if self._built is not None:
            yield from self._built
            return
        pending = self._first
        for m, ix in enumerate(self.micro):
            staged = pending.result()
            pending = self.builder.prefetch(self._hosts[m + 1]) if m + 1 < len(self.micro) else None
            yield self.builder.build(ix, staged, self.extents[m])


def _largest(shapes: list[tuple[int, int, int]], cp_size: int = 1) -> tuple[int, int, int] | None:
    """The (samples, rows, tokens a row) of the micro-batch with the most positions, tokens whole (``cp_size`` times a
    cp rank's shard); None for no micro-batch."""
    if not shapes:
        return None
    samples, rows, seq = max(shapes, key=lambda s: s[1] * s[2])
    return samples, rows, seq * cp_size
