"""The anchors each TTT step must compute (the ``memory.sparse_anchors`` switch; docs/algorithm.md, "Sparse anchors").

What reads what: anchor p's hidden state at step k is read only by its own step-k loss, its own step-k+1 input and
its own step-k+1 diagonal key/value; other anchors read p only through step 0's keys and values (the causal block).
So step 0's K/V are needed at every position, and everything else (queries, attention output, ``o_proj``, MLP,
norms, ``lm_head``, teacher logits) only at the anchors that are **needed**: needed at step k = valid at step k or
at any later step, ``needed_k[p] = ∨_{j ≥ k} valid_KBS[j, p]``. The sets are monotone (needed_k ⊇ needed_{k+1}), so
step k's rows are a subset of step k-1's and one gather carries the hidden state and the diagonal keys over.

:func:`anchor_sets` decides them once per micro-batch on the host (from the host copy of ``valid_KBS`` that the batch
builder attaches, else one device→host copy), and hands the device per step: ``index`` [B, N_k] (positions in the
local sequence), ``select`` [B, N_k] (rows of step k-1's compacted tensors), ``positions`` [B, N_k] (anchor
positions, with their host copy attached for the attention's tile decision: ``kernels.host_positions``) and ``valid``
[B, N_k]. Rows are padded to ``N_k = max(1, max_b |needed_k[b]|)`` by repeating the row's last needed anchor (or
position 0 when the row has none): padded rows have ``valid`` False, so they add exactly zero to every loss, count and
gradient, and ``N_k ≥ 1`` keeps every module called (ZeRO-3's hooks fire for every parameter on every rank even when a
rank has no needed anchor). Positions stay non-decreasing along each row.

``"auto"`` takes the sparse path for a micro-batch only where it pays in memory and in time (:func:`sparse_pays`):
step 0's compacted rows (B·N_0, N_0 = the longest row's needed count) under :data:`AUTO_SPARSE_SHARE` of the dense
rows (B·S), and the sparse/dense step time measured on this kind of device at this length, interpolated at this
share (:func:`sparse_time_ratio`, the table :data:`SPARSE_TIME_RATIOS`), under 1. Memory (docs/benchmarks.md, tiled
kernel, fp32, K = 7): at 8k positions on an H200 the sparse step's peak is 1.07× dense fully supervised, 0.77× at
ShareGPT's 69 % and 0.17× at 10 %; a line through those points crosses 1.0 near a share of 0.9, so below 0.85 the
sparse path never raises the peak, and a fully supervised batch keeps the dense path's smaller one (the planner
plans that dense step for "auto"). Time: the CPU's sparse step is faster at every measured share (0.86× even fully
supervised), but a 2k step on an H200 is launch-bound (0.1 s) and the compaction's extra kernels cost more than the
rows they save (1.12× at ShareGPT's share, 0.98× at 10 %); from 8k the GPU's time follows the share (0.72× at 69 %).
The device kind is fixed once at start (``recipe.config_memory.MemoryOptions.resolve``: ``"auto"`` becomes
``"auto:cpu"`` or ``"auto:h200"``, :func:`sparse_timing_kind`); the length and share are the micro-batch's. Each
rank decides on its own rows: the two paths call every module equally often (ZeRO-3 gathers per call) and exchange
the same K/V blocks in the ring, so ranks of one step may differ (tests/test_sparse_anchors.py runs such mixes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.host_positions import attach_host_copies, host_copy


AUTO_SPARSE_SHARE = 0.85
"""The needed share (:func:`needed_share`) at and above which "auto" keeps the dense path (its smaller peak)."""

SPARSE_TIME_RATIOS = {
    "cpu": {2048: ((0.103, 0.13), (0.71, 0.56), (0.999, 0.86)), 8192: ((0.101, 0.15),)},
    "h200": {2048: ((0.103, 0.98), (0.71, 1.12), (0.999, 1.36)), 8192: ((0.101, 0.36), (0.723, 0.72), (1.0, 0.99))},
}
"""Measured sparse / dense step time by device kind and sequence length: ``{kind: {S: ((needed share, ratio),
...)}}``, the shares those of the ``long10``, ``sharegpt`` and ``full`` masks (``recipe.plan.spec.MASKS``; K = 7),
the ratios the ``sparse_vs_dense`` of ``python -m recipe.bench step --masks full,sharegpt,long10 --sparse both``
(the issue-38 geometry, fp32, tiled kernel): ``cpu`` from docs/results/step_sparse_cpu_2k.json and
step_sparse_cpu_8k.json (2 cores), ``h200`` from docs/results/gpu/step_sparse_gpu_2026-12-04.json (one H200).
tests/test_memory_auto.py checks the table against those files."""

SPARSE_ANCHORS_MODES = (False, True, "auto", *(f"auto:{kind}" for kind in SPARSE_TIME_RATIOS))


def check_sparse_mode(mode) -> bool | str:
    """``mode`` if it is a ``memory.sparse_anchors`` value (:data:`SPARSE_ANCHORS_MODES`: true, false, ``"auto"`` or
    ``"auto:KIND"`` of a measured device kind); ValueError naming it and the choices otherwise."""
    if mode is True or mode is False or (isinstance(mode, str) and mode in SPARSE_ANCHORS_MODES):
        return mode
    raise ValueError(f"sparse_anchors={mode!r}: choose from {list(SPARSE_ANCHORS_MODES)}")


def sparse_timing_kind(device_name: str | None) -> str:
    """The :data:`SPARSE_TIME_RATIOS` row set that decides ``"auto"`` on a device: ``"cpu"`` for None or a name
    starting with "cpu"; every CUDA device uses the H200's rows (``"h200"``, the one GPU measured so far)."""
    return "cpu" if device_name is None or str(device_name).lower().startswith("cpu") else "h200"


def _interpolate(points, x: float) -> float:
    """Piecewise-linear through ``points`` ((x, y), ... sorted by x), constant beyond the first and last."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def sparse_time_ratio(kind: str, seq_len: int, share: float) -> float:
    """The sparse / dense step time :data:`SPARSE_TIME_RATIOS` predicts for device ``kind`` at ``seq_len`` positions
    (a rank's S) and needed ``share``: linear in the share between the measured masks at each measured length, then
    linear in log2(S) between measured lengths (constant outside both ranges). KeyError for an unknown kind."""
    rows = sorted(SPARSE_TIME_RATIOS[kind].items())
    at = [(math.log2(length), _interpolate(points, share)) for length, points in rows]
    return _interpolate(at, math.log2(max(seq_len, 1)))


def needed_share(valid_KBS: torch.Tensor) -> float:
    """B·N_0 / (B·S): step 0's compacted rows over the dense path's rows for one micro-batch's ``valid_KBS``
    [K, B, S] (host copy used when attached, else one device→host copy); N_0 = max over rows of the needed anchors
    (``needed_steps(valid)[0]``), at least 1. A float in (0, 1]."""
    host = host_copy(valid_KBS)
    valid = (host if host is not None else valid_KBS.cpu()).bool()
    width = max(1, int(valid.any(dim=0).sum(dim=1).max())) if valid.numel() else 1
    return width / max(1, valid.shape[2])


def sparse_pays(mode, valid_KBS: torch.Tensor) -> bool:
    """Whether ``memory.sparse_anchors`` = ``mode`` runs this micro-batch on the needed anchors: ``mode`` itself when
    a bool; for ``"auto:KIND"`` (``"auto"``: the kind of ``valid_KBS``'s device, :func:`sparse_timing_kind`), the
    :func:`needed_share` under :data:`AUTO_SPARSE_SHARE` and :func:`sparse_time_ratio` at this S (``valid_KBS``'s
    last dim) and share under 1 (module docstring). Raises ValueError for another mode."""
    mode = check_sparse_mode(mode)
    if isinstance(mode, bool):
        return mode
    kind = mode.partition(":")[2] or sparse_timing_kind(valid_KBS.device.type)
    share = needed_share(valid_KBS)
    return share < AUTO_SPARSE_SHARE and sparse_time_ratio(kind, valid_KBS.shape[2], share) < 1.0


class QueryRows(NamedTuple):
    """What one sparse TTT step computes, handed to the draft layer (``Eagle3Draft.step(..., queries=)``).

    index_BN: [B, N] int64 rows of the step's input whose queries (and everything after) are computed, keys and
    values still at every row (step 0); None: every row of the input (steps ≥ 1, whose input is already compacted).
    positions_BN: [B, N] int64 anchor positions of those rows (None with ``index_BN`` None). seq_len: the dense path's
    sequence length S, the longest of the ZeRO group's ranks (``TTTBatch.call_extent``): per-row work that is split
    into tiles (``memory.mlp_tile_size``) is split into as many pieces as the dense path of that length would make,
    so every rank calls every module equally often whatever its anchor count and its own S (ZeRO-3 gathers
    parameters per module call, collectively). dense: False (compacted rows): exactly that many near-equal tiles;
    True (the dense path, every row of a rank shorter than the longest): tiles of the tile size as without the hint,
    then empty ones up to that many.
    """

    index_BN: torch.Tensor | None
    positions_BN: torch.Tensor | None
    seq_len: int
    dense: bool = False


@dataclass
class AnchorSets:
    """Per-step compacted anchors of one micro-batch (K steps; B rows; N_k compacted rows at step k).

    index_K[k]: [B, N_k] int64 local sequence positions of step k's rows (device). select_K[k]: [B, N_k] int64 rows of
    step k-1's compacted tensors (``index_K[k] = index_K[k-1].gather(1, select_K[k])``; ``select_K[0]`` is
    ``index_K[0]``). positions_K[k]: [B, N_k] int64 anchor positions (``position_ids_BS`` at ``index_K[k]``, host copy
    attached). valid_K[k]: [B, N_k] bool, ``valid_KBS[k]`` at the row (False on padded rows). counts_KB: [K, B] int64
    (host) the number of needed anchors per step and row. teacher_rows_BU / teacher_index_K: the distinct target rows
    [B, U] (``target_row_KS`` values) that some step's compacted rows read, and per step [B, N_k] the column of
    ``teacher_rows_BU`` each row reads (see :meth:`teacher`).
    """

    index_K: list[torch.Tensor]
    select_K: list[torch.Tensor]
    positions_K: list[torch.Tensor]
    valid_K: list[torch.Tensor]
    counts_KB: torch.Tensor
    teacher_rows_BU: torch.Tensor
    teacher_index_K: list[torch.Tensor]

    @property
    def num_steps(self) -> int:
        return len(self.index_K)

    def target_rows(self, target_row_KS: torch.Tensor, k: int) -> torch.Tensor:
        """[B, N_k] int64 rows of ``target_hidden_BLH`` holding step k's labels at the compacted anchors."""
        return target_row_KS[k].to(self.index_K[k].device)[self.index_K[k]]


def needed_steps(valid_KBS: torch.Tensor) -> torch.Tensor:
    """[K, B, S] bool ``needed[k] = valid[k] | valid[k+1] | ... | valid[K-1]`` (a reverse cumulative OR)."""
    return valid_KBS.bool().flip(0).cummax(dim=0).values.flip(0)


def gather_rows(x_BS_: torch.Tensor, index_BN: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, n]]``: [B, S, ...] gathered along dim 1 by ``index_BN`` [B, N] → [B, N, ...] (differentiable)."""
    idx = index_BN.reshape(*index_BN.shape, *([1] * (x_BS_.dim() - 2))).expand(*index_BN.shape, *x_BS_.shape[2:])
    return torch.gather(x_BS_, 1, idx)


def _pad_rows(rows: list[torch.Tensor], width: int, fill_empty: int = 0) -> torch.Tensor:
    """[B, width] int64: each row's values, then its last value repeated (``fill_empty`` for an empty row)."""
    out = torch.full((len(rows), width), fill_empty, dtype=torch.int64)
    for b, r in enumerate(rows):
        if r.numel():
            out[b, : r.numel()] = r
            out[b, r.numel():] = r[-1]
    return out


def anchor_sets(valid_KBS: torch.Tensor, position_ids_BS: torch.Tensor, target_row_KS: torch.Tensor) -> AnchorSets:
    """The needed anchors of every TTT step of one micro-batch (module docstring), decided on the host.

    Args: valid_KBS [K, B, S] bool (``TTTBatch.valid_KBS``; its host copy is used when attached, else one
    device→host copy); position_ids_BS [B, S] int64 anchor positions (global under CP; host copy used likewise);
    target_row_KS [K, S] int64 label rows (``TTTBatch.target_row_KS``).
    Returns an :class:`AnchorSets` whose tensors live on ``valid_KBS``'s device.
    """
    device = valid_KBS.device
    host_valid = host_copy(valid_KBS)
    valid = (host_valid if host_valid is not None else valid_KBS.cpu()).bool()
    host_pos = host_copy(position_ids_BS)
    pos = host_pos if host_pos is not None else position_ids_BS.cpu()
    rows_KS = target_row_KS.cpu()
    needed = needed_steps(valid)
    k_steps, b, _ = valid.shape
    counts = needed.sum(dim=2)
    index_K, select_K, positions_K, valid_K, rows_host = [], [], [], [], []
    prev = None
    for k in range(k_steps):
        width = max(1, int(counts[k].max()))
        live = [torch.nonzero(needed[k, row]).flatten() for row in range(b)]
        index = _pad_rows(live, width)
        if prev is None:
            select = index
        else:  # step k's anchors are a subset of step k-1's (monotone): their columns there
            select = _pad_rows([torch.searchsorted(prev[row, : int(counts[k - 1, row])], live[row])
                                for row in range(b)], width)
            index = prev.gather(1, select)
        mask = torch.arange(width)[None, :] < counts[k][:, None]
        valid_rows = valid[k].gather(1, index) & mask
        positions = pos.gather(1, index)
        index_K.append(index.to(device, non_blocking=True))
        select_K.append(select.to(device, non_blocking=True))
        dev_pos = positions.to(device, non_blocking=True)
        positions_K.append(attach_host_copies(dev_pos, positions) if dev_pos is not positions else dev_pos)
        valid_K.append(valid_rows.to(device, non_blocking=True))
        rows_host.append(rows_KS[k][index])
        prev = index
    teacher_rows, teacher_index = _teacher_rows(rows_host, counts)
    return AnchorSets(index_K=index_K, select_K=select_K, positions_K=positions_K, valid_K=valid_K, counts_KB=counts,
                      teacher_rows_BU=teacher_rows.to(device, non_blocking=True),
                      teacher_index_K=[t.to(device, non_blocking=True) for t in teacher_index])


def _teacher_rows(rows_host: list[torch.Tensor], counts_KB: torch.Tensor):
    """Per batch row the sorted distinct label rows read by some step's live anchors, padded ([B, U], U ≥ 1), and per
    step [B, N_k] each compacted row's column in it (padded rows read column 0... or any column: they are invalid)."""
    b = counts_KB.shape[1]
    union = []
    for row in range(b):
        parts = [r[row, : int(counts_KB[k, row])] for k, r in enumerate(rows_host)]
        union.append(torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64))
    width = max(1, max(u.numel() for u in union))
    rows_BU = _pad_rows(union, width)
    index_K = []
    for r in rows_host:
        cols = torch.stack([torch.searchsorted(union[row], r[row]).clamp(max=max(union[row].numel() - 1, 0))
                            for row in range(b)])
        index_K.append(cols)
    return rows_BU, index_K
