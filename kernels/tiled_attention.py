"""Tiled causal block attention (flash-attention style, pure PyTorch): O(S·T) memory instead of O(S²).

The dense ``block_attention`` builds [B, H, Sq, Sk] scores and autograd keeps them (and the probabilities) for the
backward, which is what runs a single device out of memory at long context. Here queries and keys are cut into tiles
of at most ``tile_size`` positions; the forward visits (query tile, key tile) pairs, merging each pair's
``(out, lse)`` with ``merge_lse``, and keeps only q, k, v, the output and the final LSE. The backward recomputes each
pair's probabilities from the final LSE (the flash-attention backward: Dao et al. 2022, "FlashAttention", Alg. 4).
Pairs in which no query can read any key (every key later than every query, in an earlier packed document, or
padding) are skipped, so a causal block costs about half the pairs; they are decided on the host once per forward
(``block_pairs``) from CPU copies of the positions/validity when the batch builder attached them
(``kernels.host_positions``; no device sync), else from the tensors (one sync), and the backward reuses them. On one
device a block of packed documents is cut at the documents' boundaries first (``document_cuts``): every computed pair
is one document's causal or full block, as unpacked, with no tile straddling two documents under a dense mask.

The same tile loops serve the ring attention (``kernels.ring_attention``) on every K/V block that arrives around the
context-parallel ring. What one (query tile, key tile) pair computes is a ``BlockKernel`` (``kernels.registry``): the
pure-PyTorch ``DENSE_KERNEL`` here (the reference, the ``tiled`` backend), the fused CPU kernel of
``kernels.sdpa_attention``, or flex attention (``kernels.flex_attention``); loops, skipping and fp32 merges are shared.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from kernels.block_attention import accum_dtype, block_attention, expand_kv, merge_lse
from kernels.documents import document_start, document_tiles, readable
from kernels.host_positions import host_block_meta
from kernels.registry import AttentionBackend, BlockKernel, register_attention_backend
from kernels.tracing import unreadable


def check_tile_size(tile_size, allow_none: bool = True) -> None:
    """Raise ValueError unless ``tile_size`` is a positive int (or None when ``allow_none``)."""
    if tile_size is None and allow_none:
        return
    if not isinstance(tile_size, int) or isinstance(tile_size, bool) or tile_size <= 0:
        raise ValueError(f"tile_size must be a positive integer number of positions{' or None' if allow_none else ''}"
                         f", got {tile_size!r}")


def check_block_shapes(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, where: str) -> None:
    """Raise ValueError (naming ``where`` and every shape) unless q [B, H, Sq, D], k = v [B, Hkv, Sk, D],
    q_pos [B, Sq], k_pos [B, Sk], k_valid None or [B, Sk], and H is a multiple of Hkv."""
    b, h, sq, d = q_BHSD.shape
    hkv, sk = k_BHkvSD.shape[1], k_BHkvSD.shape[2]
    ok = (k_BHkvSD.dim() == 4 and v_BHkvSD.shape == k_BHkvSD.shape and k_BHkvSD.shape[0] == b
          and k_BHkvSD.shape[3] == d and tuple(q_pos_BS.shape) == (b, sq) and tuple(k_pos_BS.shape) == (b, sk)
          and (k_valid_BS is None or tuple(k_valid_BS.shape) == (b, sk)))
    if not ok:
        valid = None if k_valid_BS is None else tuple(k_valid_BS.shape)
        raise ValueError(f"{where}: shapes disagree: q {tuple(q_BHSD.shape)}, k {tuple(k_BHkvSD.shape)}, "
                         f"v {tuple(v_BHkvSD.shape)}, q_pos {tuple(q_pos_BS.shape)}, k_pos {tuple(k_pos_BS.shape)}, "
                         f"k_valid {valid} (expected q [B, H, Sq, D], k = v [B, Hkv, Sk, D], q_pos [B, Sq], "
                         "k_pos and k_valid [B, Sk])")
    if hkv == 0 or h % hkv:
        raise ValueError(f"{where}: num_heads={h} is not a multiple of num_key_value_heads={hkv}")


def split_tiles(x: torch.Tensor, dim: int, tile_size: int | tuple[int, ...] | None = None,
                groups: int = 1) -> list[torch.Tensor]:
    """Views of ``x`` along ``dim``: ``groups`` equal parts (``torch.tensor_split``), each cut into
    ``ceil(len / tile_size)`` near-equal tiles (one tile per part when ``tile_size`` is None); a tuple ``tile_size``
    gives the tile lengths themselves (``kernels.documents.document_tiles``; one group).

    ``groups=2`` keeps the two zigzag chunks of a context-parallel shard in separate tiles, so causal skipping works
    per chunk. Raises ValueError when ``tile_size`` is not a positive integer or None, or ``groups`` < 1, or a tuple
    that does not sum to the length of ``dim`` (or comes with ``groups`` > 1).
    """
    if isinstance(tile_size, tuple):
        if groups != 1 or sum(tile_size) != x.shape[dim] or not all(n > 0 for n in tile_size):
            raise ValueError(f"tile lengths {tile_size} do not cut a dimension of {x.shape[dim]} (groups={groups})")
        return list(torch.split(x, list(tile_size), dim=dim))
    check_tile_size(tile_size)
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"the number of chunks must be a positive integer, got {groups!r}")
    tiles: list[torch.Tensor] = []
    for part in torch.tensor_split(x, groups, dim=dim):
        n = 1 if tile_size is None else max(1, -(-part.shape[dim] // tile_size))
        tiles += list(torch.tensor_split(part, n, dim=dim))
    return tiles


def readable_pairs(q_pos_tiles, k_pos_tiles, k_valid_tiles) -> list[list[bool]]:
    """[query tile][key tile] -> True when some query of the tile may read some key of the tile, per batch row: a
    valid key at or before the tile's latest query and at or after the start of its earliest query's document
    (``kernels.documents``: the keys a query reads lie in [document_start(q), q]; a tile wholly in earlier documents
    or wholly later is skipped). Conservative: True may still hold no readable (query, key), which the kernel's own
    mask settles. Decided on the host: no sync for CPU tiles, ONE device sync per call for device tiles (the
    training path hands CPU tiles: ``block_pairs``).

    Tiles are [B, T] int64 positions / bool validity; empty tiles read and are read by nothing. In the tracing
    mode (``kernels.tracing``) fake tiles have no values: every pair is computed.
    """
    if unreadable(*q_pos_tiles, *k_pos_tiles, *k_valid_tiles):
        return [[True] * len(k_pos_tiles) for _ in q_pos_tiles]
    big, small = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min

    def extreme(t, last: bool, valid=None):
        """Per row the latest (``last``) or earliest position of the tile's (valid) entries; small / big when none."""
        empty = small if last else big
        if not t.shape[1]:
            return torch.full(t.shape[:1], empty, dtype=torch.int64, device=t.device)
        t = t if valid is None else t.masked_fill(~valid, empty)
        return t.amax(dim=1) if last else t.amin(dim=1)

    if not q_pos_tiles or not k_pos_tiles:
        return [[False] * len(k_pos_tiles) for _ in q_pos_tiles]
    last_QB = torch.stack([extreme(t.long(), True) for t in q_pos_tiles])
    start_QB = document_start(torch.stack([extreme(t.long(), False) for t in q_pos_tiles]))
    first_KB = torch.stack([extreme(p.long(), False, v) for p, v in zip(k_pos_tiles, k_valid_tiles)])
    latest_KB = torch.stack([extreme(p.long(), True, v) for p, v in zip(k_pos_tiles, k_valid_tiles)])
    return ((first_KB[None, :, :] <= last_QB[:, None, :])
            & (latest_KB[None, :, :] >= start_QB[:, None, :])).any(dim=-1).tolist()


def block_pairs(q_pos_BS, k_pos_BS, k_valid_BS, tile_size: int | tuple[int, ...] | None, groups: int = 1,
                key_rank: int | None = None, key_tile_size: int | tuple[int, ...] | None = None) -> list[list[bool]]:
    """``readable_pairs`` of the tiles ``split_tiles`` cuts from a block's q_pos [B, Sq], k_pos [B, Sk] and k_valid
    [B, Sk] (None: all valid), decided on their host copies (``kernels.host_positions``; the keys of cp rank
    ``key_rank`` when given) when every one has one, without a sync; otherwise on the tensors themselves (one device
    sync for device tensors, none on the CPU). Callers pass ``key_rank`` only with the LOCAL key tensors.
    ``key_tile_size``: the keys' tile lengths when they differ from the queries' (a tuple, ``document_cuts``)."""
    meta = host_block_meta(q_pos_BS, k_pos_BS, k_valid_BS, key_rank)
    if meta is None:
        if key_rank is not None:
            raise ValueError(f"block_pairs: no host copies of cp rank {key_rank}'s keys")
        meta = (q_pos_BS, k_pos_BS, k_valid_BS)
    q_pos, k_pos, k_valid = meta

    def cut(x, size=tile_size):
        return split_tiles(x, 1, size, groups)
    k_size = tile_size if key_tile_size is None else key_tile_size
    return readable_pairs(cut(q_pos.long()), cut(k_pos.long(), k_size), cut(keys_valid(k_pos, k_valid), k_size))


def document_cuts(q_pos_BS, k_pos_BS, k_valid_BS, tile_size: int | None):
    """(query tiling, key tiling) of a one-device block: ``tile_size`` for both, except where the host-known positions
    (``kernels.host_positions``; a CPU tensor is its own copy) hold packed documents: there the tile lengths of
    ``kernels.documents.document_tiles``, cut at the documents' boundaries (each pair one document's causal or full
    block, or skipped). No host copy (a sync would be needed) or fake tensors: ``tile_size``."""
    meta = None if unreadable(q_pos_BS, k_pos_BS) else host_block_meta(q_pos_BS, k_pos_BS, k_valid_BS)
    if meta is None:
        return tile_size, tile_size
    q_cut, k_cut = document_tiles(meta[0], tile_size), document_tiles(meta[1], tile_size)
    return tile_size if q_cut is None else q_cut, tile_size if k_cut is None else k_cut


def attention_block_backward(dout_BHSD, dlse_BHS, delta_BHS, lse_BHS, q_BHSD, k_BHkvSD, v_BHkvSD,
                             q_pos_BS, k_pos_BS, k_valid_BS, scale: float):
    """Gradients of one (query, key) block of a softmax attention whose FINAL lse (over all blocks) is known.

    With P = exp(S - lse) (S the scaled, masked scores; P = 0 on masked entries and on rows with lse = -inf):
      dV = P^T dO;  dP = dO V^T;  dS = P * (dP - delta + dlse);  dQ = scale * dS K;  dK = scale * dS^T Q,
    where delta = rowsum(dO * O) over the final output O (the flash-attention softmax backward) and the dlse term
    is d(lse)/dS = P. All inputs in the accumulation dtype; q/dout/lse [B, H, Sq, ...], k/v [B, Hkv, Sk, D].
    Returns (dq [B, H, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, D]); dK/dV are summed over each GQA group.
    """
    b, h, sq, d = q_BHSD.shape
    hkv, sk = k_BHkvSD.shape[1], k_BHkvSD.shape[2]
    k, v = expand_kv(k_BHkvSD, h), expand_kv(v_BHkvSD, h)
    s_BHQK = torch.matmul(q_BHSD, k.transpose(-1, -2)) * scale
    allowed_BQK = readable(q_pos_BS[:, :, None], k_pos_BS[:, None, :]) & k_valid_BS[:, None, :]
    finite = torch.isfinite(lse_BHS)
    safe_lse = torch.where(finite, lse_BHS, torch.zeros_like(lse_BHS))
    p_BHQK = torch.exp(s_BHQK - safe_lse[..., None])
    p_BHQK = p_BHQK.masked_fill(~(allowed_BQK[:, None] & finite[..., None]), 0.0)
    dv = torch.matmul(p_BHQK.transpose(-1, -2), dout_BHSD)
    dp_BHQK = torch.matmul(dout_BHSD, v.transpose(-1, -2))
    ds_BHQK = p_BHQK * (dp_BHQK - delta_BHS[..., None] + dlse_BHS[..., None])
    dq = torch.matmul(ds_BHQK, k) * scale
    dk = torch.matmul(ds_BHQK.transpose(-1, -2), q_BHSD) * scale
    # GQA: query head j reads KV head j // rep (repeat_interleave), so heads group as [Hkv, rep].
    dk = dk.view(b, hkv, h // hkv, sk, d).sum(2)
    dv = dv.view(b, hkv, h // hkv, sk, d).sum(2)
    return dq, dk, dv


def _dense_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale):
    return block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale=scale)


DENSE_KERNEL = BlockKernel("dense", _dense_forward, attention_block_backward)
"""The reference kernel: dense scores of one pair in the accumulation dtype (``block_attention``), backward by the
flash-attention formulas (``attention_block_backward``). Any device, any float dtype (fp64 included)."""


def recompute_block_backward(forward: Callable) -> Callable:
    """A ``BlockKernel.backward`` for a kernel whose per-block ``forward`` is differentiable (through out AND lse)
    but whose backward cannot be handed the final LSE (flex attention): it recomputes the block under autograd and
    pulls back the gradient that the final merge sends to this block's ``(out_b, lse_b)``.

    With the final ``out = Σ_b w_b out_b``, ``lse = logsumexp_b lse_b`` and ``w_b = exp(lse_b - lse)``
    (``merge_lse``): ``dL/dout_b = w_b·dout`` and ``dL/dlse_b = w_b·(dlse + rowsum(dout·out_b) - delta)`` with
    ``delta = rowsum(dout·out)``; pulled through the block's own softmax this gives exactly
    ``attention_block_backward``'s ``dS = P·(dP - delta + dlse)``. Costs one extra block forward per pair.
    """

    def backward(dout_BHSD, dlse_BHS, delta_BHS, lse_BHS, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS,
                 k_valid_BS, scale):
        leaves = [t.detach().requires_grad_() for t in (q_BHSD, k_BHkvSD, v_BHkvSD)]
        with torch.enable_grad():
            out_b, lse_b = forward(*leaves, q_pos_BS, k_pos_BS, k_valid_BS, scale)
        lse_b_acc = lse_b.detach().to(lse_BHS.dtype)
        live = torch.isfinite(lse_b_acc) & torch.isfinite(lse_BHS)
        w = torch.where(live, torch.exp(lse_b_acc - torch.where(live, lse_BHS, torch.zeros_like(lse_BHS))),
                        torch.zeros_like(lse_BHS))
        g_out = (w[..., None] * dout_BHSD).to(out_b.dtype)
        g_lse = w * (dlse_BHS + (dout_BHSD * out_b.detach().to(dout_BHSD.dtype)).sum(-1) - delta_BHS)
        grads = torch.autograd.grad((out_b, lse_b), leaves, (g_out, g_lse.to(lse_b.dtype)), allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))

    return backward


def forward_tiles(queries, keys, outs: list[torch.Tensor], lses: list[torch.Tensor], scale: float,
                  kernel: BlockKernel = DENSE_KERNEL, needed: list[list[bool]] | None = None) -> int:
    """Attend every query tile over every key tile it can read, merging into ``outs``/``lses`` (replaced in place).

    ``queries``: (q tiles [B, H, Tq, D] in the kernel's compute dtype, q_pos tiles [B, Tq]); ``keys``: (k tiles,
    v tiles [B, Hkv, Tk, D], k_pos tiles [B, Tk], k_valid tiles [B, Tk] bool); ``kernel`` computes each pair.
    ``needed``: the pair matrix (``block_pairs``, decided on the host); None decides it here from the tiles (one
    device sync for device tiles). Returns the number of pairs computed.
    """
    q_tiles, qpos_tiles = queries
    needed = readable_pairs(qpos_tiles, keys[2], keys[3]) if needed is None else needed
    pairs = 0
    for i, (q_t, qpos_t) in enumerate(zip(q_tiles, qpos_tiles)):
        for j, (k_t, v_t, kpos_t, kvalid_t) in enumerate(zip(*keys)):
            if not needed[i][j]:
                continue
            pairs += 1
            out_t, lse_t = kernel.forward(q_t, k_t, v_t, qpos_t, kpos_t, kvalid_t, scale)
            outs[i], lses[i] = merge_lse(outs[i], lses[i], out_t, lse_t)
    return pairs


def backward_tiles(queries, keys, dq_tiles, dk_tiles, dv_tiles, scale: float,
                   kernel: BlockKernel = DENSE_KERNEL, needed: list[list[bool]] | None = None) -> int:
    """Accumulate the gradients of every readable (query tile, key tile) pair into the given views.

    ``queries``: (q, q_pos, dout, dlse, delta, lse) tiles; ``keys``: (k, v, k_pos, k_valid) tiles; q/k/v in the
    kernel's compute dtype, dout/dlse/delta/lse in the accumulation dtype. ``dq_tiles``/``dk_tiles``/``dv_tiles``
    are views of the (accumulation dtype) gradient buffers, added to in place. ``needed``: the forward's pair
    matrix (None: decided here, as ``forward_tiles``). Returns the number of pairs computed.
    """
    needed = readable_pairs(queries[1], keys[2], keys[3]) if needed is None else needed
    pairs = 0
    for i, (q_t, qpos_t, dout_t, dlse_t, delta_t, lse_t) in enumerate(zip(*queries)):
        for j, (k_t, v_t, kpos_t, kvalid_t) in enumerate(zip(*keys)):
            if not needed[i][j]:
                continue
            pairs += 1
            dq, dk, dv = kernel.backward(dout_t, dlse_t, delta_t, lse_t, q_t, k_t, v_t, qpos_t, kpos_t, kvalid_t,
                                         scale)
            dq_tiles[i] += dq
            dk_tiles[j] += dk
            dv_tiles[j] += dv
    return pairs


def lse_gradient(dlse_BHS: torch.Tensor | None, lse_BHS: torch.Tensor) -> torch.Tensor:
    """The incoming LSE gradient in the LSE's dtype, zero where there is none (None) and on rows whose lse is -inf:
    such a row reads no key, so its lse does not depend on any score (a NaN arriving there must not spread)."""
    if dlse_BHS is None:
        return torch.zeros_like(lse_BHS)
    return torch.where(torch.isfinite(lse_BHS), dlse_BHS.to(lse_BHS.dtype), torch.zeros_like(lse_BHS))


def keys_valid(k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor | None) -> torch.Tensor:
    """``k_valid_BS`` as a bool tensor, all True when None."""
    return torch.ones_like(k_pos_BS, dtype=torch.bool) if k_valid_BS is None else k_valid_BS.bool()


def key_tiles(k_BHkvSD, v_BHkvSD, k_pos_BS, k_valid_BS, tile_size: int | None, groups: int = 1):
    """The ``keys`` argument of ``forward_tiles``/``backward_tiles``: (k, v, k_pos, k_valid) tile lists."""
    return (split_tiles(k_BHkvSD, 2, tile_size, groups), split_tiles(v_BHkvSD, 2, tile_size, groups),
            split_tiles(k_pos_BS, 1, tile_size, groups), split_tiles(k_valid_BS, 1, tile_size, groups))


def forward_accumulators(q_BHSD, q_pos_BS, tile_size: int | None, groups: int = 1,
                         kernel: BlockKernel = DENSE_KERNEL):
    """(queries, outs, lses) for ``forward_tiles``: the query tiles in the kernel's compute dtype with their int64
    positions, and per tile an output of zeros and an LSE of -inf (nothing read yet), both in the accumulation
    dtype. ``torch.cat(outs/lses, 2)`` gives the result."""
    acc = accum_dtype(q_BHSD.dtype)
    queries = (split_tiles(q_BHSD.to(kernel.compute_dtype(q_BHSD.dtype)), 2, tile_size, groups),
               split_tiles(q_pos_BS.long(), 1, tile_size, groups))
    outs = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in queries[0]]
    lses = [torch.full(t.shape[:-1], float("-inf"), dtype=acc, device=t.device) for t in queries[0]]
    return queries, outs, lses


def backward_queries(dout_BHSD, dlse_BHS, q_BHSD, q_pos_BS, out_BHSD, lse_BHS, tile_size: int | None,
                     groups: int = 1, kernel: BlockKernel = DENSE_KERNEL):
    """(queries, dq, dq_tiles) for ``backward_tiles``: per query tile (q, q_pos, dout, dlse, delta, lse), q in the
    kernel's compute dtype and the rest in the accumulation dtype, with delta = rowsum(dout · out) and dlse from
    ``lse_gradient``; dq a zero buffer in the accumulation dtype and ``dq_tiles`` its tile views."""
    acc = accum_dtype(q_BHSD.dtype)
    dout, lse = dout_BHSD.to(acc), lse_BHS.to(acc)
    delta = (dout * out_BHSD.to(acc)).sum(-1)
    dq = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)

    def cut(x, dim):
        return split_tiles(x, dim, tile_size, groups)
    queries = (cut(q_BHSD.to(kernel.compute_dtype(q_BHSD.dtype)), 2), cut(q_pos_BS.long(), 1), cut(dout, 2),
               cut(lse_gradient(dlse_BHS, lse), 2),
               cut(delta, 2), cut(lse, 2))
    return queries, dq, cut(dq, 2)


def key_block_gradients(queries, dq_tiles, k_BHkvSD, v_BHkvSD, k_pos_BS, k_valid_BS, scale: float,
                        tile_size: int | None, groups: int = 1, kernel: BlockKernel = DENSE_KERNEL,
                        needed: list[list[bool]] | None = None) -> tuple[torch.Tensor, int]:
    """(dkv [2, B, Hkv, Sk, D] in the accumulation dtype, pairs computed) of one key block from the query tiles of
    ``backward_queries``; adds the block's dq contribution into ``dq_tiles`` in place. ``needed``: the block's
    pair matrix from the forward (None: decided again from the tiles)."""
    acc = queries[2][0].dtype  # dout's: the accumulation dtype
    compute = kernel.compute_dtype(k_BHkvSD.dtype)
    dkv = torch.zeros((2, *k_BHkvSD.shape), dtype=acc, device=k_BHkvSD.device)
    keys = key_tiles(k_BHkvSD.to(compute), v_BHkvSD.to(compute), k_pos_BS, k_valid_BS, tile_size, groups)
    pairs = backward_tiles(queries, keys, dq_tiles, split_tiles(dkv[0], 2, tile_size, groups),
                           split_tiles(dkv[1], 2, tile_size, groups), scale, kernel, needed)
    return dkv, pairs


class TiledAttention(torch.autograd.Function):
    """``TiledAttention.apply(q, k, v, q_pos, k_pos, k_valid, scale, tile_size, kernel) -> (out, lse)``; gradients
    flow to q, k, v, including the LSE's. Saves q, k, v, out, lse and the positions only (no score matrices); the
    backward recomputes each pair from the final LSE through ``kernel.backward``. The pair matrix is decided once,
    in the forward (``block_pairs``: on host copies of the positions/validity when attached, else one sync), and
    reused by the backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, k_valid, scale, tile_size, kernel):
        q_cut, k_cut = document_cuts(q_pos, k_pos, k_valid, tile_size)
        needed = block_pairs(q_pos, k_pos, k_valid, q_cut, key_tile_size=k_cut)
        q_pos, k_pos, k_valid = q_pos.long(), k_pos.long(), keys_valid(k_pos, k_valid)
        queries, outs, lses = forward_accumulators(q, q_pos, q_cut, kernel=kernel)
        compute = kernel.compute_dtype(k.dtype)
        forward_tiles(queries, key_tiles(k.to(compute), v.to(compute), k_pos, k_valid, k_cut), outs, lses, scale,
                      kernel, needed)
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, k_valid)
        ctx.scale, ctx.cuts, ctx.kernel, ctx.needed = scale, (q_cut, k_cut), kernel, needed
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, k_pos, k_valid = ctx.saved_tensors
        queries, dq, dq_tiles = backward_queries(dout, dlse, q, q_pos, out, lse, ctx.cuts[0], kernel=ctx.kernel)
        dkv, _ = key_block_gradients(queries, dq_tiles, k, v, k_pos, k_valid, ctx.scale, ctx.cuts[1],
                                     kernel=ctx.kernel, needed=ctx.needed)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def tiled_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None, *,
                          tile_size: int | None = 1024, scale: float | None = None,
                          kernel: BlockKernel = DENSE_KERNEL):
    """Drop-in for ``block_attention`` with memory O(B·H·(Sq + Sk)·D + B·H·tile²) instead of O(B·H·Sq·Sk).

    Args and returns as ``block_attention`` (q [B, H, Sq, D], k/v [B, Hkv, Sk, D], int64 positions [B, Sq]/[B, Sk],
    k_valid [B, Sk] bool or None; out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in the accumulation dtype, -inf
    and out 0 on rows with no readable key). ``tile_size``: positions per query/key tile (None: one tile, i.e. the
    whole block in one pair). ``kernel``: what each pair computes (``DENSE_KERNEL``: the pure-PyTorch reference).
    Raises ValueError when ``tile_size`` is not a positive integer or None, the shapes disagree (naming them), or H
    is not a multiple of Hkv.
    """
    check_tile_size(tile_size)
    check_block_shapes(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, "tiled_block_attention")
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    return TiledAttention.apply(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale, tile_size, kernel)


class TiledCausalAttention:
    """Callable with the draft's causal-block signature ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)``, tiled
    at ``tile_size`` positions (None: one tile), each pair computed by ``kernel`` (see ``tiled_block_attention``).
    Raises ValueError when ``tile_size`` is not a positive integer or None."""

    def __init__(self, tile_size: int | None = 1024, kernel: BlockKernel = DENSE_KERNEL):
        check_tile_size(tile_size)
        self.tile_size, self.kernel = tile_size, kernel

    def __call__(self, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None):
        return tiled_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS,
                                     tile_size=self.tile_size, kernel=self.kernel)

    def __repr__(self) -> str:
        return f"TiledCausalAttention(tile_size={self.tile_size}, kernel={self.kernel.name!r})"


def _tiled_single_device(tile_size: int | None, device):
    return block_attention if tile_size is None else TiledCausalAttention(tile_size, DENSE_KERNEL)


register_attention_backend(AttentionBackend("tiled", lambda: DENSE_KERNEL, _tiled_single_device, fallback=True,
                                            order=0))
"""``tiled``: the pure-PyTorch reference (any device and float dtype; ``tile_size`` None on one device: the dense
``block_attention``); ``auto``'s choice where no fused kernel runs."""
