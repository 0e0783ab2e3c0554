"""The two ways ``recipe.model.ttt.TTTModel`` unrolls the TTT steps, selected per micro-batch by the model
(``memory.sparse_anchors`` and its ``"auto"`` rule, ``recipe.model.sparse_anchors.sparse_pays``):

- :func:`dense_steps`, the reference: every step at every position;
- :func:`sparse_steps`: every step at its needed anchors only (docs/algorithm.md, "Sparse anchors"), the same loss
  sums, counts and gradients up to float rounding.

Both have the signature ``(model, batch) -> (losses, corrects)``, per step a 0-d float32 loss sum and a 0-d int64
count of correct argmaxes, and read only the model's public attributes (``draft``, ``loss_fn``, the memory switches,
``target_head_d``, ``target_softcap``, ``trace_hints``, ``step_function()``).
"""
from __future__ import annotations

import torch

from recipe.model.call_extent import piece_count
from recipe.model.chunked_loss import chunked_soft_ce, teacher_table
from recipe.model.loss import target_logits
from recipe.model.sparse_anchors import AnchorSets, QueryRows, anchor_sets, gather_rows


@torch.no_grad()
def teacher_logits(target_hidden_BLH: torch.Tensor, target_row_KS: torch.Tensor, target_head_VdH: torch.Tensor,
                   target_softcap: float | None = None, chunk_size: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target logits over the draft vocabulary of every row some TTT step reads, each row computed once.

    Args: target_hidden_BLH [B, L, H_t] target last hidden rows; target_row_KS [K, S] int64, step k's label row of
    anchor p (``TTTBatch.target_row_KS``); target_head_VdH [Vd (or the TP shard Vd/tp), H_t] target head rows;
    target_softcap: the target's final logit soft-cap (``recipe.target.head.target_logits``); chunk_size: rows per
    head matmul (``chunked_loss.teacher_table``; None: all at once).
    Returns ``(logits_BUV, index_KS)``: logits_BUV [B, U, Vd] in the head's dtype for the U distinct rows (sorted;
    about S + K of them, since step k reads rows p + 1 + k), and index_KS [K, S] int64 such that step k's target
    logits are ``logits_BUV[:, index_KS[k]]`` — the same rows ``target_hidden[:, target_row_KS[k]] @ head.T``
    gives, K times less head matmul work.
    """
    rows_U, index_KS = torch.unique(target_row_KS, sorted=True, return_inverse=True)
    return teacher_table(target_hidden_BLH, rows_U, target_head_VdH, target_softcap, chunk_size), index_KS


def dense_steps(model, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The TTT steps of ``model`` (a ``recipe.model.ttt.TTTModel``) on ``batch`` (its ``TTTBatch``) at every
    position: step k's tensors are [B, S, ...]. Returns per step (loss_sum 0-d float32, correct 0-d int64)."""
    hidden_BSH = model.draft.project_aux(batch.aux_hidden_BSA)
    kv_cache = None
    teacher = None
    if model.teacher_logits_once:
        teacher = (model.trace_hints.teacher_logits if model.trace_hints else teacher_logits)(
            batch.target_hidden_BLH, batch.target_row_KS, model.target_head_d, model.target_softcap,
            model.loss_chunk_size)
    losses, corrects = [], []
    seq_len = batch.extent().seq_len  # a longer rank of the ZeRO group: as many MLP tiles as it makes
    queries = QueryRows(None, None, seq_len, dense=True) if seq_len > batch.position_ids_BS.shape[1] else None
    step = model.step_function()
    for k in range(batch.num_steps):
        hidden_BSH, kv_cache = step(hidden_BSH, batch.input_ids_KBS[k], batch.position_ids_BS,
                                    batch.key_valid_BS, kv_cache, queries)
        loss_sum, correct = dense_step_loss(model, hidden_BSH, batch, k, teacher)
        losses.append(loss_sum.float())
        corrects.append(correct.to(torch.int64))
    return losses, corrects


def dense_step_loss(model, hidden_BSH: torch.Tensor, batch, k: int,
                    teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, correct) of step k, all positions at once or in chunks of ``model.loss_chunk_size``; ``teacher``
    is ``teacher_logits`` of the batch (None: step k's target logits are computed here)."""
    if model.loss_chunk_size is not None:  # empty chunks after its own up to the group's largest B·S
        source = (teacher[0], teacher[1][k], None) if teacher is not None else \
            (batch.target_hidden_BLH, batch.target_row_KS[k], model.target_head_d)
        return chunked_soft_ce(model.draft.logits, model.loss_fn, hidden_BSH, *source, batch.valid_KBS[k],
                               model.loss_chunk_size, target_softcap=model.target_softcap,
                               min_chunks=piece_count(batch.extent().positions, model.loss_chunk_size))
    logits_BSV = model.draft.logits(hidden_BSH)
    with torch.no_grad():
        if teacher is not None:
            logits_BUV, index_KS = teacher
            target_logits_BSV = logits_BUV[:, index_KS[k]]
        else:
            rows_BSH = batch.target_hidden_BLH[:, batch.target_row_KS[k]]
            target_logits_BSV = target_logits(rows_BSH, model.target_head_d, model.target_softcap)
    return model.loss_fn(logits_BSV, target_logits_BSV, batch.valid_KBS[k])


def sparse_steps(model, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The TTT steps of ``model`` (a ``recipe.model.ttt.TTTModel``) on ``batch`` (its ``TTTBatch``) at the needed
    anchors only: step k's tensors are [B, N_k, ...], the compacted rows of ``anchor_sets``; step 0 keeps its keys
    and values at every position (the causal block). Returns per step (loss_sum 0-d float32, correct 0-d int64)."""
    sets = getattr(model.trace_hints, "anchor_sets", None)
    if sets is None:
        sets = anchor_sets(batch.valid_KBS, batch.position_ids_BS, batch.target_row_KS)
    hidden_BNH = model.draft.project_aux(batch.aux_hidden_BSA)
    teacher = None
    if model.teacher_logits_once:  # [B, U, Vd] of the rows some step reads (chunked: loss_chunk_size rows a matmul)
        teacher = teacher_table(batch.target_hidden_BLH, sets.teacher_rows_BU, model.target_head_d,
                                model.target_softcap, model.loss_chunk_size)
    kv_cache = None
    losses, corrects = [], []
    for k in range(batch.num_steps):
        step = model.step_function()
        seq_len = batch.extent().seq_len  # the dense path's S (the group's longest): as many MLP tiles
        if k == 0:  # keys/values at every position, queries at the needed anchors
            ids_BN, positions_BN = batch.input_ids_KBS[0], batch.position_ids_BS
            queries = QueryRows(sets.index_K[0], sets.positions_K[0], seq_len)
        else:  # a subset of step k-1's rows: carry the hidden state and the diagonal keys over
            kv_cache.keep(sets.select_K[k])
            hidden_BNH = gather_rows(hidden_BNH, sets.select_K[k])
            ids_BN = torch.gather(batch.input_ids_KBS[k], 1, sets.index_K[k])
            positions_BN, queries = sets.positions_K[k], QueryRows(None, None, seq_len)
        hidden_BNH, kv_cache = step(hidden_BNH, ids_BN, positions_BN, batch.key_valid_BS, kv_cache, queries)
        loss_sum, correct = sparse_step_loss(model, hidden_BNH, batch, sets, k, teacher)
        losses.append(loss_sum.float())
        corrects.append(correct.to(torch.int64))
    return losses, corrects


def sparse_step_loss(model, hidden_BNH, batch, sets: AnchorSets, k: int, teacher):
    """(loss_sum, correct) of step k on its compacted rows; ``teacher``: [B, U, Vd] logits of
    ``sets.teacher_rows_BU`` (None: computed here, or per chunk)."""
    valid_BN = sets.valid_K[k]
    if model.loss_chunk_size is not None:
        source = (teacher, sets.teacher_index_K[k], None) if teacher is not None else \
            (batch.target_hidden_BLH, sets.target_rows(batch.target_row_KS, k), model.target_head_d)
        # as many chunks as the dense path of the group's largest B·S (QueryRows, CallExtent)
        return chunked_soft_ce(model.draft.logits, model.loss_fn, hidden_BNH, *source, valid_BN,
                               model.loss_chunk_size, target_softcap=model.target_softcap,
                               num_chunks=piece_count(batch.extent().positions, model.loss_chunk_size))
    logits_BNV = model.draft.logits(hidden_BNH)
    with torch.no_grad():
        if teacher is not None:
            target_BNV = gather_rows(teacher, sets.teacher_index_K[k])
        else:
            rows_BNH = gather_rows(batch.target_hidden_BLH, sets.target_rows(batch.target_row_KS, k))
            target_BNV = target_logits(rows_BNH, model.target_head_d, model.target_softcap)
    return model.loss_fn(logits_BNV, target_BNV, valid_BN)
