"""The TTT steps on the needed anchors only (``memory.sparse_anchors``; ``recipe.model.sparse_anchors`` decides the
sets, docs/algorithm.md "Sparse anchors"): ``TTTModel.forward`` calls :func:`sparse_steps` when the switch (or its
``"auto"`` rule) takes the sparse path. Kept apart from ``recipe.model.ttt`` so the dense path, the reference, reads
alone."""
from __future__ import annotations

import torch

from recipe.model.call_extent import piece_count
from recipe.model.chunked_loss import chunked_soft_ce, teacher_table
from recipe.model.loss import target_logits
from recipe.model.sparse_anchors import AnchorSets, QueryRows, anchor_sets, gather_rows


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
        step = model._checkpointed_step if model.checkpoint_steps and torch.is_grad_enabled() else model.draft.step
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
