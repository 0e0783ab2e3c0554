"""One TTT step's soft cross-entropy without materialising the [B·S, Vd] logits.

The flattened B·S positions are cut into chunks of ``chunk_size``. Per chunk: draft logits ``logits_fn(h_chunk)``
(``Eagle3Draft.logits`` = lm_head(norm(h))), the chunk's teacher (target) logits, no grad, and ``loss_fn(logits,
target_logits, valid)`` → (loss sum, correct count). Each chunk runs under ``torch.utils.checkpoint``
(non-reentrant): autograd keeps only the chunk's inputs (a view of the hidden state and [c] position indices) and
recomputes the chunk's logits during backward, so at most one chunk's [c, Vd] logits (and their softmax
temporaries) are alive at a time instead of K·[B·S, Vd].

The teacher logits come from one of two places (``TTTModel.teacher_logits_once``, ``memory.teacher_logits_once``):
- a table computed once per micro-batch (:func:`teacher_table`: the target head over every distinct label row,
  ``chunk_size`` rows at a time, kept as one [B, U, Vd] tensor in the head's dtype until the backward); each chunk
  reads its rows from it, in forward and in the backward recompute: the target head runs once per row and
  micro-batch, not 2·K times;
- or, streamed, ``loss.target_logits(rows_chunk, target_head_d, softcap)`` inside the chunk (the rows gathered
  there), in every TTT step and again in the backward recompute: nothing of size [B, U, Vd] is kept.

Tensor parallelism needs nothing special: ``logits_fn`` may return this rank's vocab shard (``VocabParallelLMHead``),
``target_head_d`` (and so the table) is then the matching shard and ``loss_fn`` the vocab-parallel soft CE; the
recomputation re-runs the loss's all-reduces in backward, in the same chunk order on every rank of the TP group (which
holds identical data). Every chunk is computed, even one without valid positions, so every rank produces gradients
for the same parameters.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from recipe.model.loss import target_logits


def target_rows(target_hidden_BLH: torch.Tensor, target_row_S: torch.Tensor, flat_index_N: torch.Tensor,
                seq_len: int) -> torch.Tensor:
    """Target hidden rows of flattened positions: ``target_hidden[n // S, target_row[n % S]]`` → [N, H_t];
    ``target_row_S`` may also be [B, S] (a row per batch row: the sparse path's compacted anchors), read at ``n``."""
    b_idx = torch.div(flat_index_N, seq_len, rounding_mode="floor")
    if target_row_S.dim() == 2:
        return target_hidden_BLH[b_idx, target_row_S.reshape(-1)[flat_index_N]]
    return target_hidden_BLH[b_idx, target_row_S[flat_index_N % seq_len]]


def chunked_soft_ce(logits_fn: Callable[[torch.Tensor], torch.Tensor], loss_fn: Callable,
                    hidden_BSH: torch.Tensor, target_hidden_BLH: torch.Tensor, target_row_S: torch.Tensor,
                    target_head_VdH: torch.Tensor, valid_BS: torch.Tensor,
                    chunk_size: int, target_softcap: float | None = None,
                    num_chunks: int | None = None, min_chunks: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE sum and argmax-match count of one TTT step, ``chunk_size`` flattened positions at a time.

    Args:
        logits_fn: hidden [1, c, H] → draft logits [1, c, Vd or Vd/tp] (differentiable in its parameters).
        loss_fn: ``soft_ce(logits, target_logits, valid) -> (loss_sum, correct)`` or its vocab-parallel version.
        hidden_BSH: [B, S, H] the step's draft output (before the final norm).
        target_hidden_BLH: [B, L, H_t] target last hidden rows; target_row_S: [S] int64, the row of each anchor's
            label (``TTTBatch.target_row_KS[k]``), or [B, S] when each batch row has its own (compacted anchors).
        target_head_VdH: [Vd (or Vd/tp), H_t] target head rows; or None: ``target_hidden_BLH`` is then the teacher
            table [B, U, Vd (or Vd/tp)] of :func:`teacher_table` (logits, not hidden rows) and ``target_row_S``
            indexes its rows; the chunks read their rows from it, and the target head is not run here at all.
        valid_BS: [B, S] bool.  chunk_size: positions per chunk (>= 1).
        target_softcap: the target's final logit soft-cap (None: none), see ``recipe.model.loss.target_logits``.
        num_chunks: cut the B·S positions into exactly that many near-equal chunks (some possibly empty) instead of
            chunks of ``chunk_size``: the sparse anchors' path makes as many chunks as the dense path would, so every
            rank calls lm_head equally often (ZeRO-3; ``recipe.model.sparse_anchors.QueryRows``).
        min_chunks: with ``num_chunks`` None, make at least that many chunks of ``chunk_size``, the ones past B·S
            empty: the dense path's count for the ZeRO group's largest B·S (``recipe.model.call_extent``); the
            non-empty chunks, and so every number, are those without it.
    Returns:
        (loss_sum 0-d float32 (float64 for float64 inputs) with grad, correct 0-d int64): the same values as
        ``loss_fn`` over all positions at once, up to float summation order.
    Raises ValueError on a chunk size < 1 or shapes that disagree.
    """
    _check_inputs(chunk_size, hidden_BSH, target_hidden_BLH, target_row_S, valid_BS)
    b, s, h = hidden_BSH.shape
    hidden_NH = hidden_BSH.reshape(b * s, h)
    valid_N = valid_BS.reshape(b * s).bool()
    head = None if target_head_VdH is None else target_head_VdH.detach()

    row_S = target_row_S.to(hidden_BSH.device)

    def chunk_loss(hidden_CH: torch.Tensor, flat_C: torch.Tensor, valid_C: torch.Tensor):
        logits_1CV = logits_fn(hidden_CH.unsqueeze(0))
        with torch.no_grad():  # gathered here, not passed in: checkpoint keeps its inputs alive until backward
            rows_C = target_rows(target_hidden_BLH, row_S, flat_C, s)  # teacher logits, or hidden rows to project
            target_1CV = (rows_C if head is None else target_logits(rows_C, head, target_softcap)).unsqueeze(0)
        return loss_fn(logits_1CV, target_1CV, valid_C.unsqueeze(0))

    losses, corrects = [], []
    for start, stop in _chunk_bounds(b * s, chunk_size, num_chunks, min_chunks):
        flat_C = torch.arange(start, stop, device=hidden_BSH.device)
        # preserve_rng_state=False: the draft has no dropout, and skipping the RNG stash avoids device syncs.
        loss_sum, correct = checkpoint(chunk_loss, hidden_NH[start:stop], flat_C, valid_N[start:stop],
                                       use_reentrant=False, preserve_rng_state=False)
        losses.append(loss_sum)
        corrects.append(correct.to(torch.int64))
    return _fold_sum(losses), torch.stack(corrects).sum()


def _check_inputs(chunk_size, hidden_BSH, target_hidden_BLH, target_row_S, valid_BS) -> None:
    """ValueError for a chunk size that is not a positive integer or shapes that disagree (:func:`chunked_soft_ce`)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"loss chunk size {chunk_size!r} must be a positive integer")
    b, s, _ = hidden_BSH.shape
    if tuple(valid_BS.shape) != (b, s) or tuple(target_row_S.shape) not in ((s,), (b, s)) \
            or target_hidden_BLH.shape[0] != b:
        raise ValueError(f"chunked_soft_ce: hidden {tuple(hidden_BSH.shape)}, valid {tuple(valid_BS.shape)}, "
                         f"target_row {tuple(target_row_S.shape)}, target hidden {tuple(target_hidden_BLH.shape)} "
                         "disagree (expected [B, S, H], [B, S], [S] or [B, S], [B, L, H_t])")


def _chunk_bounds(n: int, chunk_size: int, num_chunks: int | None, min_chunks: int | None) -> list[tuple[int, int]]:
    """(start, stop) of each chunk of ``n`` flattened positions: chunks of ``chunk_size``, at least ``min_chunks``
    of them (the ones past ``n`` empty), or with ``num_chunks`` exactly that many near-equal ones."""
    if num_chunks is None:
        return [(min(start, n), min(start + chunk_size, n))
                for start in range(0, max(n, (min_chunks or 0) * chunk_size), chunk_size)]
    edges = [n * i // num_chunks for i in range(num_chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _fold_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """``((t_0 + t_1) + t_2) + ...``, a left fold in chunk order. Not ``torch.stack(terms).sum()``: a vectorised
    reduction groups the terms by the SIMD width, so appending the empty chunks' exact zeros (``min_chunks``) would
    regroup the non-zero ones and change the last bit on some CPUs; a fold adds each zero as ``x + 0 = x``."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


@torch.no_grad()
def teacher_table(target_hidden_BLH: torch.Tensor, rows_U: torch.Tensor, target_head_VdH: torch.Tensor,
                  target_softcap: float | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """The teacher logits of the label rows ``rows_U`` of every batch row, computed once: [B, U, Vd] in the head's
    dtype, ``out[b, u] = target_logits(target_hidden[b, rows_U[u]], head, softcap)`` (``loss.target_logits``).

    ``rows_U``: [U] int64 rows of ``target_hidden_BLH`` [B, L, H_t], or [B, U] (a row list per batch row, the sparse
    path's ``AnchorSets.teacher_rows_BU``). ``target_head_VdH``: [Vd (or Vd/tp), H_t]. ``chunk_size``: None runs one
    head matmul over all B·U rows (its temporaries, [B, U, Vd] each, at once); an int runs it ``chunk_size``
    flattened rows at a time into one preallocated output, so only one chunk's temporaries (the soft-cap's) exist
    beside it: ⌈B·U / chunk_size⌉ head matmuls. Row for row the same numbers either way, up to the BLAS's row
    blocking (a BLAS may block a matmul by its row count: the last bits can differ).
    """
    b, u = target_hidden_BLH.shape[0], rows_U.shape[-1]
    if chunk_size is None or b * u <= chunk_size:
        flat = torch.arange(b * u, device=target_hidden_BLH.device)
        rows_NH = target_rows(target_hidden_BLH, rows_U, flat, u) if rows_U.dim() == 2 else \
            target_hidden_BLH[:, rows_U]
        return target_logits(rows_NH, target_head_VdH, target_softcap).reshape(b, u, -1)
    out_NV = torch.empty(b * u, target_head_VdH.shape[0], dtype=target_head_VdH.dtype, device=target_head_VdH.device)
    for start in range(0, b * u, chunk_size):
        flat_C = torch.arange(start, min(start + chunk_size, b * u), device=target_hidden_BLH.device)
        out_NV[start:start + flat_C.numel()] = target_logits(target_rows(target_hidden_BLH, rows_U, flat_C, u),
                                                             target_head_VdH, target_softcap)
    return out_NV.view(b, u, -1)
