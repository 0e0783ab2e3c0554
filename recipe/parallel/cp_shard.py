"""Zigzag sharding of sequences (and of a whole TTT batch) over context-parallel ranks.

The sequence (length a multiple of 2·cp: the batch builder pads to it) is cut into 2·cp equal chunks; rank r holds
chunks r and 2·cp−1−r, in that order. Under causal attention the early chunk's cheap rows and the late chunk's
expensive rows balance, so every rank does the same work (docs/algorithm.md, "Context parallelism (zigzag) and the
LSE merge"; the layout of Megatron-LM/ring-flash-attention's zigzag CP). All TTT shifts are done on the full
sequence before sharding, so no rank needs a neighbour's tokens.
"""
from __future__ import annotations

import dataclasses

import torch


def _check(seq_len: int, cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not in [0, cp_size={cp_size})")
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp_size={2 * cp_size}; "
                         "pad it to a multiple first")


def zigzag_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank``: [seq_len / cp_size] int64, chunk r then chunk 2·cp−1−r.

    Example: seq_len=8, cp_size=2 → rank 0 [0, 1, 6, 7], rank 1 [2, 3, 4, 5].
    Raises ValueError if seq_len is not a multiple of 2·cp_size or the rank is out of range.
    """
    _check(seq_len, cp_size, cp_rank)
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def label_rows(seq_len: int, cp_size: int, cp_rank: int, ttt_steps: int) -> torch.Tensor:
    """The target last-hidden rows a cp rank's TTT steps read: [U] int64, sorted, ``unique(min(p + 1 + k, S − 1))``
    over its zigzag positions p and k < K (``recipe.model.ttt.make_ttt_batch``'s ``target_row_KS``). These are the
    rank's own positions plus up to K rows after each of its two chunks: the first rows of chunk r+1 (held by rank
    r+1, or by the rank itself when r = cp−1) and of chunk 2·cp−r (held by rank r−1; none for r = 0, whose second
    chunk ends the sequence). Same errors as ``zigzag_indices``; ValueError for K < 1.
    """
    if ttt_steps < 1:
        raise ValueError(f"TTT steps K={ttt_steps} must be >= 1")
    pos = zigzag_indices(seq_len, cp_size, cp_rank)
    rows = (pos[None, :] + 1 + torch.arange(ttt_steps)[:, None]).clamp(max=seq_len - 1)
    return torch.unique(rows)


def contiguous_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of a plain contiguous split (rank r holds [r·S/cp, (r+1)·S/cp)); the baseline that zigzag
    balances. Same length rule and errors as ``zigzag_indices``."""
    _check(seq_len, cp_size, cp_rank)
    n = seq_len // cp_size
    return torch.arange(cp_rank * n, (cp_rank + 1) * n)


def zigzag_split(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's zigzag shard of ``tensor`` along ``dim`` (an exact ``index_select``; length S → S/cp)."""
    idx = zigzag_indices(tensor.shape[dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, idx)


_TARGET_FIELDS = ("target_hidden_BLH", "target_row_KS")


def shard_ttt_batch(batch, cp_size: int, cp_rank: int):
    """This cp rank's part of a TTT batch (``TTTBatch`` or a dataclass subclass of it), as a new instance of its type.

    Sequence fields (the class's ``per_position_fields`` {name: seq dim}) are zigzag-split. Target rows: the rank
    keeps only the rows of ``target_hidden_BLH`` [B, L, H_t] that its anchors use, ``rows = unique(target_row_KS[:,
    mine])`` (sorted), and ``target_row_KS`` [K, S/cp] is remapped to indices into those rows — exact, no
    communication. ``call_extent`` (whole-sequence sizes) becomes its ``shard(cp_size)``. Fields that are None stay
    None. Raises ValueError for a field it does not know how to split
    (naming it), target rows out of range, or a bad sequence length.
    """
    if not dataclasses.is_dataclass(batch) or not hasattr(type(batch), "per_position_fields"):
        raise TypeError(f"shard_ttt_batch expects a TTTBatch dataclass, got {type(batch).__name__}")
    seq_dims = {n: d for n, d in type(batch).per_position_fields.items() if n not in _TARGET_FIELDS}
    updates = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if field.name in seq_dims:
            updates[field.name] = None if value is None else zigzag_split(value, cp_size, cp_rank,
                                                                           seq_dims[field.name])
        elif field.name == "call_extent" and value is not None:  # a CallExtent of the whole sequence
            updates[field.name] = value.shard(cp_size)
        elif field.name not in _TARGET_FIELDS and isinstance(value, torch.Tensor):
            raise ValueError(f"shard_ttt_batch: no CP split rule for tensor field {type(batch).__name__}."
                             f"{field.name}; add it to the class's per_position_fields")
    rows_KS = batch.target_row_KS
    if rows_KS is not None:
        mine_KS = zigzag_split(rows_KS, cp_size, cp_rank, 1)
        rows = torch.unique(mine_KS)  # sorted
        num_rows = None if batch.target_hidden_BLH is None else batch.target_hidden_BLH.shape[1]
        if rows.numel() and (rows[0] < 0 or (num_rows is not None and rows[-1] >= num_rows)):
            raise ValueError(f"shard_ttt_batch: target_row_KS values span [{int(rows[0])}, {int(rows[-1])}], "
                             f"outside target_hidden_BLH's {num_rows} rows")
        updates["target_row_KS"] = torch.searchsorted(rows, mine_KS)
        if batch.target_hidden_BLH is not None:
            updates["target_hidden_BLH"] = batch.target_hidden_BLH.index_select(1, rows.to(
                batch.target_hidden_BLH.device))
    return dataclasses.replace(batch, **updates)
