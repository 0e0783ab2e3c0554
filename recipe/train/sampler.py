"""Which samples make up each optimizer step, independent of the parallel layout.

Epoch e visits the samples in the order ``randperm(N, seed + e)``; step i of the epoch takes the next
``global_batch`` of them (an incomplete tail is dropped). The layout only decides which data-parallel rank reads a
sample: micro-batch m of dp rank d holds positions ``[(m·dp + d)·micro, (m·dp + d + 1)·micro)`` of the step. Every
tp/cp rank of one dp index reads the same samples. So for the same seed the sequence of global batches is identical
for every (tp, cp, dp) layout and ZeRO stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepSampler:
    num_samples: int
    global_batch: int
    seed: int

    def __post_init__(self):
        if self.num_samples < self.global_batch:
            raise ValueError(f"only {self.num_samples} samples, fewer than one global batch of {self.global_batch}"
                             " (train_batch_size): lower train_batch_size or add data")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def total_steps(self, epochs: float, max_steps: int | None = None) -> int:
        """Optimizer steps for ``epochs`` passes (fractions allowed), capped by ``max_steps``."""
        steps = max(1, int(epochs * self.steps_per_epoch))
        return min(steps, max_steps) if max_steps else steps

    def step_indices(self, step: int) -> list[int]:
        """Sample indices of global optimizer step ``step`` (0-based, counting across epochs)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        gen = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        return perm[i * self.global_batch:(i + 1) * self.global_batch].tolist()

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


def rank_micro_batches(step_indices: list[int], micro_batch: int, grad_accum: int, dp: int, dp_rank: int
                       ) -> list[list[int]]:
    """Split one step's samples into this dp rank's ``grad_accum`` micro-batches of ``micro_batch`` samples."""
    if len(step_indices) != micro_batch * grad_accum * dp:
        raise ValueError(f"step has {len(step_indices)} samples, expected micro {micro_batch} × accum {grad_accum}"
                         f" × dp {dp}")
    out = []
    for m in range(grad_accum):
        start = (m * dp + dp_rank) * micro_batch
        out.append(step_indices[start:start + micro_batch])
    return out
