"""Ring attention over a context-parallel group: the causal step-0 block of TTT attention under CP (the ``ring``
sequence-split strategy of ``kernels.sequence_parallel``, registered here).

Every cp rank holds a LOCAL shard of queries and keys (zigzag layout, ``recipe.parallel.cp_shard``) with their
GLOBAL positions. The result for the local queries equals ``block_attention`` of those queries against the
concatenation of all ranks' keys (causal by position, padding keys masked), returned as ``(out, lse)`` so the caller
can merge further keys with ``merge_lse``.

Forward: the K/V block (and its positions/validity) travels around the ring with asynchronous send/recv while the
block in hand is computed; per-block ``(out, lse)`` are merged in fp32 (blockwise softmax, as in flash/ring attention).
Backward: the K/V blocks travel around the ring again; per block the attention is recomputed from the saved final
LSE; dQ stays local and the dK/dV accumulators (fp32) travel the ring back to their owners.

Work skipping and memory: the local shard and each received block are cut into ``num_chunks`` chunks (2 = the two
zigzag chunks), each into tiles of at most ``tile_size`` positions; the per-block work is the tile loop of
``kernels.tiled_attention`` (score memory bounded by tile², no S² matrix saved for the backward). A (query tile,
key tile) pair in which no query can read any key (all keys later than all queries, or all padding) is skipped.
Which pairs those are is decided per hop in the forward, on the host: from the host copies of every cp rank's
positions/validity that the batch builder attaches to the local tensors (``kernels.host_positions``; zigzag
arithmetic and the padding, known on every rank), so no hop syncs the device; without them from the received block's
tensors (one device sync per hop). The backward reuses the forward's pair matrices and tilings. Packed documents
(``kernels.documents``): with ``cut_documents`` and the host copies, when any rank's block holds a document boundary,
every chunk is cut at its documents' boundaries instead (``chunk_document_tiles``; fixed tiles in a chunk without
one), so a pair lies in one document or is skipped, never paying a dense mask over two documents' rectangle.
Each pair is computed by a ``BlockKernel``: the pure-PyTorch reference, the fused CPU kernel (its backward takes the
final LSE directly) or flex attention (whose backward recomputes the pair under autograd and pulls the final
merge's gradient through the pair's own (out, lse): ``recompute_block_backward``).

Exact communication per rank per call, for a group of size cp (``RingCounts``; 0 when cp = 1):
  forward : cp-1 K/V hops, each 2 tensors (stacked K/V, stacked positions/validity): 2(cp-1) sends, 2(cp-1) recvs.
  backward: cp-1 K/V hops (1 tensor each: positions are saved from the forward, not re-sent) and cp-1 dK/dV hops
            (1 tensor each): 2(cp-1) sends, 2(cp-1) recvs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.documents import chunk_document_tiles
from kernels.host_positions import host_copies, host_copy
from kernels.registry import AttentionBackend, BlockKernel, SequenceSplit, register_sequence_parallel
from kernels.tiled_attention import (DENSE_KERNEL, backward_queries, block_pairs, check_block_shapes, check_tile_size,
                                     forward_accumulators, forward_tiles, key_block_gradients, key_tiles, keys_valid)


@dataclass
class RingCounts:
    """Cumulative counters of one ``RingExchange``: point-to-point ops, ring hops by kind, and block pairs computed."""

    sends: int = 0
    recvs: int = 0
    kv_hops: int = 0
    grad_hops: int = 0
    forward_pairs: int = 0
    backward_pairs: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


class _Hop:
    """Pending async send/recv of one ring hop; ``wait()`` returns the received tensors."""

    def __init__(self, requests, sent, received):
        self._requests, self._sent, self._received = requests, sent, received  # buffers live until wait()

    def wait(self) -> list[torch.Tensor]:
        for req in self._requests:
            req.wait()
        return self._received


class RingExchange:
    """Ring neighbours of this rank in ``group`` (as GLOBAL ranks, which torch's P2P ops take) and hop counters.

    ``group=None`` uses the default group when torch.distributed is initialised, else a single-rank ring (no
    communication), so one code path serves 1 and N ranks. Rank r sends to r+1 and receives from r-1 (group ranks).
    """

    _TAGS = {"kv": 11, "grad": 12}

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.counts = RingCounts()
        if group is None and not dist.is_initialized():
            self.group, self.rank, self.size = None, 0, 1
            self.send_peer = self.recv_peer = 0
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.send_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.recv_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor], kind: str) -> _Hop:
        """Start sending ``tensors`` to the next rank and receiving same-shaped ones from the previous rank.

        ``kind`` is "kv" or "grad" (counted separately, distinct tags). Raises RuntimeError on a single-rank ring.
        """
        if self.size == 1:
            raise RuntimeError("RingExchange.start called on a single-rank ring (nothing to exchange)")
        tag = self._TAGS[kind]
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.send_peer, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.recv_peer, self.group, tag) for r in received]
        requests = dist.batch_isend_irecv(ops)
        self.counts.sends += len(tensors)
        self.counts.recvs += len(tensors)
        if kind == "kv":
            self.counts.kv_hops += 1
        else:
            self.counts.grad_hops += 1
        return _Hop(requests, sent, received)


def _pack_keys_meta(k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor | None) -> torch.Tensor:
    """[2, B, S] int64: row 0 the key positions, row 1 the validity (1/0), so one tensor travels per hop."""
    return torch.stack([k_pos_BS.long(), keys_valid(k_pos_BS, k_valid_BS).long()])


def _ring_host_keys(q_pos_BS, k_pos_BS, k_valid_BS, exchange: RingExchange) -> bool:
    """Whether the local tensors carry host copies of every cp rank's key positions/validity, attached for this
    ring (same size, this rank's entry), and of the query positions."""
    ok = host_copy(q_pos_BS) is not None
    for t in (k_pos_BS, k_valid_BS):
        copies = host_copies(t) if t is not None else None
        ok = ok and (t is None or (copies is not None and len(copies.per_rank) == exchange.size
                                   and copies.rank == exchange.rank))
    return ok


@dataclass(frozen=True)
class RingTiling:
    """How one call cuts its blocks: ``queries`` the local queries' tiling and ``keys[s]`` that of the block of group
    rank (r - s) mod cp, each a tile size (None: one tile per chunk) cut per chunk of ``groups``, or tile lengths
    (``groups`` 1)."""

    queries: int | tuple[int, ...] | None
    keys: tuple
    groups: int

    @classmethod
    def fixed(cls, tile_size: int | None, cp: int, num_chunks: int) -> "RingTiling":
        """``tile_size`` per chunk of ``num_chunks`` for the queries and every one of the ``cp`` key blocks."""
        return cls(tile_size, (tile_size,) * cp, num_chunks)


def ring_tiling(q_pos_BS, k_pos_BS, exchange: RingExchange, tile_size: int | None, num_chunks: int,
                cut_documents: bool, host: bool) -> RingTiling:
    """The fixed tiling (``tile_size`` per chunk of ``num_chunks``) unless ``cut_documents``, the host copies of every
    rank's positions are attached (``host``) and some rank's block holds a document boundary: then every block's
    ``chunk_document_tiles`` lengths (module docstring). Host arithmetic only."""
    fixed = RingTiling.fixed(tile_size, exchange.size, num_chunks)
    if not (cut_documents and host):
        return fixed
    query, packed = chunk_document_tiles(host_copy(q_pos_BS), tile_size, num_chunks)
    keys = []
    for step in range(exchange.size):
        cut, documents = chunk_document_tiles(host_copy(k_pos_BS, (exchange.rank - step) % exchange.size), tile_size,
                                              num_chunks)
        keys.append(cut)
        packed = packed or documents
    return RingTiling(query, tuple(keys), 1) if packed else fixed


def ring_attention_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, exchange: RingExchange,
                           scale: float | None = None, num_chunks: int = 2, tile_size: int | None = None,
                           kernel: BlockKernel = DENSE_KERNEL, cut_documents: bool = True):
    """Causal attention of the local queries over all ranks' keys, passing K/V blocks around the ring.

    Args: local shards q [B, H, Sq, D]; k, v [B, Hkv, Sk, D]; q_pos [B, Sq], k_pos [B, Sk] int64 global positions;
    k_valid [B, Sk] bool or None (all valid); ``exchange`` the ring; ``scale`` default 1/sqrt(D); the local shard and
    each received block are cut into ``num_chunks`` equal chunks (2 = the two zigzag chunks), each into tiles of at
    most ``tile_size`` positions (None: one tile per chunk), for work skipping and bounded score memory
    (``kernels.tiled_attention``); ``kernel`` computes each (query tile, key tile) pair. Every rank must have the
    same Sk, B, Hkv, D. ``cut_documents``: tiles cut at packed documents' boundaries (module docstring; False for a
    kernel with its own blocking, which takes each hop as one pair).
    Returns (out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in accum dtype (-inf where no key is readable),
    key_meta, needed, tiling): key_meta[s] is the [2, B, Sk] int64 positions/validity of the block of group rank
    (r - s) mod cp, which the backward reuses instead of re-sending it, needed[s] that block's pair matrix
    (``block_pairs``: from the host copies of the local tensors when they carry every rank's, else from key_meta[s],
    one sync) and ``tiling`` the ``RingTiling`` the backward cuts the same way.
    """
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    host = _ring_host_keys(q_pos_BS, k_pos_BS, k_valid_BS, exchange)
    tiling = ring_tiling(q_pos_BS, k_pos_BS, exchange, tile_size, num_chunks, cut_documents, host)
    queries, outs, lses = forward_accumulators(q_BHSD, q_pos_BS, tiling.queries, tiling.groups, kernel)
    kv = torch.stack([k_BHkvSD, v_BHkvSD])  # [2, B, Hkv, Sk, D]
    compute = kernel.compute_dtype(kv.dtype)
    meta = _pack_keys_meta(k_pos_BS, k_valid_BS)
    key_meta, needed = [], []
    for step in range(exchange.size):
        hop = exchange.start([kv, meta], "kv") if step + 1 < exchange.size else None  # overlaps the compute below
        key_meta.append(meta)
        cut = tiling.keys[step]
        if host:  # the block of group rank (r - step) mod cp, from the local tensors' host copies
            needed.append(block_pairs(q_pos_BS, k_pos_BS, k_valid_BS, tiling.queries, tiling.groups,
                                      key_rank=(exchange.rank - step) % exchange.size, key_tile_size=cut))
        else:
            needed.append(block_pairs(q_pos_BS, meta[0], meta[1].bool(), tiling.queries, tiling.groups))
        keys = key_tiles(kv[0].to(compute), kv[1].to(compute), meta[0], meta[1].bool(), cut, tiling.groups)
        exchange.counts.forward_pairs += forward_tiles(queries, keys, outs, lses, scale, kernel, needed[-1])
        if hop is not None:
            kv, meta = hop.wait()
    return torch.cat(outs, dim=2).to(q_BHSD.dtype), torch.cat(lses, dim=2), key_meta, needed, tiling


def _backward_one_block(kv, meta, needed, cut, queries, dq_tiles, exchange, scale, groups, kernel):
    """dK/dV [2, B, Hkv, Sk, D] (fp32+) of one key block (tiled as ``cut``) from the local queries; adds into
    dq_tiles in place."""
    dkv, pairs = key_block_gradients(queries, dq_tiles, kv[0], kv[1], meta[0], meta[1].bool(), scale, cut, groups,
                                     kernel, needed)
    exchange.counts.backward_pairs += pairs
    return dkv


def ring_attention_backward(dout_BHSD, dlse_BHS, q_BHSD, k_BHkvSD, v_BHkvSD, out_BHSD, lse_BHS, q_pos_BS,
                            key_meta, exchange: RingExchange, scale: float | None = None, num_chunks: int = 2,
                            tile_size: int | None = None, kernel: BlockKernel = DENSE_KERNEL, needed=None,
                            tiling: RingTiling | None = None):
    """Gradients (dq, dk, dv) of the local shards for the loss gradients ``dout`` [B, H, Sq, D] and ``dlse`` [B, H, Sq].

    ``out``, ``lse``, ``key_meta``, ``needed`` and ``tiling`` are what ``ring_attention_forward`` returned;
    ``dlse=None`` means zero; ``needed=None`` decides each block's pairs again from key_meta (one sync per block on a
    device); ``tiling=None``: the fixed tiling of ``tile_size`` and ``num_chunks``.
    Order per rank r: the own block first (overlapping the first K/V hop), then blocks r-1, r-2, ... A block's dK/dV
    accumulator is created by rank owner+1, grows at each rank it visits and reaches its owner after cp-1 hops.
    Returns dq in q's dtype, dk/dv in k's/v's dtype (accumulated in fp32 or wider).
    """
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    tiling = RingTiling.fixed(tile_size, exchange.size, num_chunks) if tiling is None else tiling
    queries, dq, dq_tiles = backward_queries(dout_BHSD, dlse_BHS, q_BHSD, q_pos_BS, out_BHSD, lse_BHS,
                                             tiling.queries, tiling.groups, kernel)
    args = (queries, dq_tiles, exchange, scale, tiling.groups, kernel)
    needed = [None] * exchange.size if needed is None else needed
    kv = torch.stack([k_BHkvSD, v_BHkvSD])
    kv_hop = exchange.start([kv], "kv") if exchange.size > 1 else None
    dkv_own = _backward_one_block(kv, key_meta[0], needed[0], tiling.keys[0], *args)
    grad_hop = None
    for step in range(1, exchange.size):
        (kv,) = kv_hop.wait()  # block of rank (r - step)
        kv_hop = exchange.start([kv], "kv") if step + 1 < exchange.size else None
        dkv = _backward_one_block(kv, key_meta[step], needed[step], tiling.keys[step], *args)
        if grad_hop is not None:  # the accumulator of the same block, from rank r-1
            dkv += grad_hop.wait()[0]
        grad_hop = exchange.start([dkv], "grad")  # on the last step this goes to the block's owner
    if grad_hop is not None:
        dkv_own += grad_hop.wait()[0]
    return dq.to(q_BHSD.dtype), dkv_own[0].to(k_BHkvSD.dtype), dkv_own[1].to(v_BHkvSD.dtype)


class RingAttention(torch.autograd.Function):
    """Thin autograd wrapper: ``RingAttention.apply(q, k, v, q_pos, k_pos, k_valid, exchange, scale, num_chunks,
    tile_size, kernel, cut_documents)`` -> (out, lse). Gradients flow to q, k, v (lse's gradient included)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, k_valid, exchange, scale, num_chunks, tile_size, kernel, cut_documents):
        out, lse, key_meta, needed, tiling = ring_attention_forward(q, k, v, q_pos, k_pos, k_valid, exchange, scale,
                                                                    num_chunks, tile_size, kernel, cut_documents)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, *key_meta)
        ctx.exchange, ctx.scale, ctx.num_chunks = exchange, scale, num_chunks
        ctx.tile_size, ctx.kernel = tile_size, kernel
        ctx.needed, ctx.tiling = needed, tiling
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, *key_meta = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, dlse, q, k, v, out, lse, q_pos, key_meta, ctx.exchange,
                                             ctx.scale, ctx.num_chunks, ctx.tile_size, ctx.kernel, ctx.needed,
                                             ctx.tiling)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def ring_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None, group=None, *,
                         scale: float | None = None, exchange: RingExchange | None = None, num_chunks: int = 2,
                         tile_size: int | None = None, kernel: BlockKernel = DENSE_KERNEL, cut_documents: bool = True):
    """Drop-in for ``block_attention`` under CP: local zigzag shards in, local (out, lse) out.

    Same shapes as ``block_attention``; ``group`` the cp group (or pass a ``exchange`` to read its counters);
    ``num_chunks``/``tile_size``/``kernel``/``cut_documents`` as ``ring_attention_forward``. Raises ValueError when
    shard shapes disagree within the rank (naming them) or ``tile_size`` is not a positive integer or None.
    """
    check_block_shapes(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, "ring_block_attention")
    check_tile_size(tile_size)
    exchange = RingExchange(group) if exchange is None else exchange
    return RingAttention.apply(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, exchange, scale, num_chunks,
                               tile_size, kernel, cut_documents)


class RingCausalAttention:
    """Callable with the draft's causal-block signature ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)``.

    Owns one ``RingExchange`` (``.exchange.counts`` accumulate over calls; ``reset()`` them per step if wanted).
    """

    def __init__(self, group=None, num_chunks: int = 2, tile_size: int | None = None,
                 kernel: BlockKernel = DENSE_KERNEL, cut_documents: bool = True):
        self.exchange = RingExchange(group)
        self.num_chunks, self.tile_size, self.kernel = num_chunks, tile_size, kernel
        self.cut_documents = cut_documents

    def __call__(self, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None):
        return ring_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS,
                                    exchange=self.exchange, num_chunks=self.num_chunks, tile_size=self.tile_size,
                                    kernel=self.kernel, cut_documents=self.cut_documents)

    def __repr__(self) -> str:
        return (f"RingCausalAttention(cp={self.exchange.size}, num_chunks={self.num_chunks}, "
                f"tile_size={self.tile_size}, kernel={self.kernel.name!r})")


def make_ring_causal_attention(group=None, num_chunks: int = 2, tile_size: int | None = None,
                               kernel: BlockKernel = DENSE_KERNEL, cut_documents: bool = True) -> RingCausalAttention:
    """Factory for the draft attention's ``causal_attention`` attribute under CP (``group`` = the cp group;
    ``tile_size`` bounds each score block to tile_size² per head, None = one tile per zigzag chunk; ``kernel``
    computes each pair, default the pure-PyTorch reference; ``cut_documents``: packed blocks tiled at their
    documents' boundaries)."""
    return RingCausalAttention(group, num_chunks, tile_size, kernel, cut_documents)


def _build_ring(backend: AttentionBackend, tile_size: int | None, device, group) -> RingCausalAttention:
    """The ``ring`` strategy: the backend's pair kernel on every hop; tiled backends cut the two zigzag chunks
    into tiles of ``tile_size`` (cut at packed documents' boundaries), one with its own blocking (flex) takes each
    hop's block as one pair."""
    if backend.uses_tiles:
        return make_ring_causal_attention(group, tile_size=tile_size, kernel=backend.kernel())
    return make_ring_causal_attention(group, num_chunks=1, tile_size=None, kernel=backend.kernel(),
                                      cut_documents=False)


register_sequence_parallel(SequenceSplit("ring", _build_ring))
