"""What a fake-tensor memory trace (``recipe.plan.trace``) hands the TTT model in place of values its tensors lack.

``TTTModel.trace_hints`` (None outside a trace) is the model's declared tracing hook: with hints set, the teacher
logits take U, the number of distinct label rows, from the hints instead of ``torch.unique`` (a data-dependent
shape), and the sparse path (``memory.sparse_anchors``) takes its anchor sets from the hints instead of reading the
validity's values. Shapes and dtypes, hence memory, are those of the real step; values are not meaningful.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.model.chunked_loss import teacher_table
from recipe.model.sparse_anchors import AnchorSets


@dataclass(frozen=True)
class TraceHints:
    """``teacher_rows``: U, the distinct label rows of the traced batch (``torch.unique(target_row_KS).numel()`` of
    the real host batch); ``anchor_sets``: ``recipe.model.sparse_anchors.anchor_sets`` of the real host batch (None
    when the traced model is dense)."""

    teacher_rows: int
    anchor_sets: AnchorSets | None = None

    @torch.no_grad()
    def teacher_logits(self, target_hidden_BLH: torch.Tensor, target_row_KS: torch.Tensor,
                       target_head_VdH: torch.Tensor, target_softcap: float | None = None,
                       chunk_size: int | None = None):
        """``recipe.model.ttt_steps.teacher_logits``'s result shapes, built as it builds them (``chunk_size`` rows per
        head matmul): logits [B, U, Vd] of U rows (row 0 repeated) and an all-zero index [K, S] int64."""
        rows_U = torch.zeros(self.teacher_rows, dtype=torch.int64, device=target_row_KS.device)
        return (teacher_table(target_hidden_BLH, rows_U, target_head_VdH, target_softcap, chunk_size),
                torch.zeros_like(target_row_KS))
