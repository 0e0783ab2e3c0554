"""Ring attention over a context-parallel group: the causal step-0 block of TTT attention under CP.

Every cp rank holds a LOCAL shard of queries and keys (zigzag layout, ``recipe.parallel.cp_shard``) with their
GLOBAL positions. The result for the local queries equals ``block_attention`` of those queries against the
concatenation of all ranks' keys (causal by position, padding keys masked), returned as ``(out, lse)`` so the caller
can merge further keys with ``merge_lse``.

Forward: the K/V block (and its positions/validity) travels around the ring with asynchronous send/recv while the
block in hand is computed; per-block ``(out, lse)`` are merged in fp32 (blockwise softmax, as in flash/ring attention).
Backward: the K/V blocks travel around the ring again; per block the attention is recomputed from the saved final
LSE; dQ stays local and the dK/dV accumulators (fp32) travel the ring back to their owners.

Work skipping: the local shard is cut into ``num_chunks`` chunks (2 = the two zigzag chunks). A (query-chunk,
key-chunk) pair in which no query can read any key (all keys later than all queries, or all padding) is skipped.

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

from kernels.block_attention import accum_dtype, block_attention, expand_kv, merge_lse


@dataclass
class RingCounts:
    """Cumulative counters of one ``RingComm``: point-to-point ops, ring hops by kind, and block pairs computed."""

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


class RingComm:
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
            raise RuntimeError("RingComm.start called on a single-rank ring (nothing to exchange)")
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
    valid = torch.ones_like(k_pos_BS, dtype=torch.bool) if k_valid_BS is None else k_valid_BS
    return torch.stack([k_pos_BS.long(), valid.long()])


def _pair_needed(q_pos_BS: torch.Tensor, k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor) -> bool:
    """True when some query of the chunk can read some key of the chunk (per batch row: a valid key at or before
    the latest query position). One host sync per pair (the skip decision is made on the host)."""
    big = torch.iinfo(torch.int64).max
    first_key_B = k_pos_BS.masked_fill(~k_valid_BS, big).min(dim=1).values
    return bool((first_key_B <= q_pos_BS.max(dim=1).values).any())


def _chunks(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(x, n, dim=dim))


def ring_attention_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, comm: RingComm,
                           scale: float | None = None, num_chunks: int = 2):
    """Causal attention of the local queries over all ranks' keys, passing K/V blocks around the ring.

    Args: local shards q [B, H, Sq, D]; k, v [B, Hkv, Sk, D]; q_pos [B, Sq], k_pos [B, Sk] int64 global positions;
    k_valid [B, Sk] bool or None (all valid); ``comm`` the ring; ``scale`` default 1/sqrt(D); ``num_chunks`` chunks
    of the local shard for work skipping. Every rank must have the same Sk, B, Hkv, D.
    Returns (out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in accum dtype (-inf where no key is readable),
    key_meta): key_meta[s] is the [2, B, Sk] int64 positions/validity of the block of group rank (r - s) mod cp,
    which the backward reuses instead of re-sending it.
    """
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    acc = accum_dtype(q_BHSD.dtype)
    q_chunks = _chunks(q_BHSD.to(acc), num_chunks, 2)
    qpos_chunks = _chunks(q_pos_BS.long(), num_chunks, 1)
    outs = [torch.zeros_like(c) for c in q_chunks]
    lses = [torch.full(c.shape[:-1], float("-inf"), dtype=acc, device=c.device) for c in q_chunks]
    kv = torch.stack([k_BHkvSD, v_BHkvSD])  # [2, B, Hkv, Sk, D]
    meta = _pack_keys_meta(k_pos_BS, k_valid_BS)
    key_meta = []
    for step in range(comm.size):
        hop = comm.start([kv, meta], "kv") if step + 1 < comm.size else None  # overlaps the compute below
        key_meta.append(meta)
        k_chunks, v_chunks = _chunks(kv[0], num_chunks, 2), _chunks(kv[1], num_chunks, 2)
        kpos_chunks, kvalid_chunks = _chunks(meta[0], num_chunks, 1), _chunks(meta[1].bool(), num_chunks, 1)
        for i, (q_c, qpos_c) in enumerate(zip(q_chunks, qpos_chunks)):
            for k_c, v_c, kpos_c, kvalid_c in zip(k_chunks, v_chunks, kpos_chunks, kvalid_chunks):
                if not _pair_needed(qpos_c, kpos_c, kvalid_c):
                    continue
                comm.counts.forward_pairs += 1
                out_c, lse_c = block_attention(q_c, k_c, v_c, qpos_c, kpos_c, kvalid_c, scale=scale)
                outs[i], lses[i] = merge_lse(outs[i], lses[i], out_c, lse_c)
        if hop is not None:
            kv, meta = hop.wait()
    return torch.cat(outs, dim=2).to(q_BHSD.dtype), torch.cat(lses, dim=2), key_meta


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
    allowed_BQK = (k_pos_BS[:, None, :] <= q_pos_BS[:, :, None]) & k_valid_BS[:, None, :]
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


def _backward_one_block(kv, meta, q_chunks, qpos_chunks, dout_chunks, dlse_chunks, delta_chunks, lse_chunks,
                        dq_chunks, comm, scale, num_chunks):
    """dK/dV [2, B, Hkv, Sk, D] (fp32+) of one key block from the local queries; adds into dq_chunks in place."""
    dkv = torch.zeros(kv.shape, dtype=q_chunks[0].dtype, device=kv.device)
    k_chunks, v_chunks = _chunks(kv[0].to(dkv.dtype), num_chunks, 2), _chunks(kv[1].to(dkv.dtype), num_chunks, 2)
    kpos_chunks, kvalid_chunks = _chunks(meta[0], num_chunks, 1), _chunks(meta[1].bool(), num_chunks, 1)
    dk_chunks, dv_chunks = _chunks(dkv[0], num_chunks, 2), _chunks(dkv[1], num_chunks, 2)  # views into dkv
    for i in range(len(q_chunks)):
        for j in range(len(k_chunks)):
            if not _pair_needed(qpos_chunks[i], kpos_chunks[j], kvalid_chunks[j]):
                continue
            comm.counts.backward_pairs += 1
            dq, dk, dv = attention_block_backward(
                dout_chunks[i], dlse_chunks[i], delta_chunks[i], lse_chunks[i], q_chunks[i], k_chunks[j],
                v_chunks[j], qpos_chunks[i], kpos_chunks[j], kvalid_chunks[j], scale)
            dq_chunks[i] += dq
            dk_chunks[j] += dk
            dv_chunks[j] += dv
    return dkv


def ring_attention_backward(dout_BHSD, dlse_BHS, q_BHSD, k_BHkvSD, v_BHkvSD, out_BHSD, lse_BHS, q_pos_BS,
                            key_meta, comm: RingComm, scale: float | None = None, num_chunks: int = 2):
    """Gradients (dq, dk, dv) of the local shards for the loss gradients ``dout`` [B, H, Sq, D] and ``dlse`` [B, H, Sq].

    ``out``, ``lse`` and ``key_meta`` are what ``ring_attention_forward`` returned; ``dlse=None`` means zero.
    Order per rank r: the own block first (overlapping the first K/V hop), then blocks r-1, r-2, ... A block's dK/dV
    accumulator is created by rank owner+1, grows at each rank it visits and reaches its owner after cp-1 hops.
    Returns dq in q's dtype, dk/dv in k's/v's dtype (accumulated in fp32 or wider).
    """
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    acc = accum_dtype(q_BHSD.dtype)
    dout = dout_BHSD.to(acc)
    dlse = torch.zeros_like(lse_BHS) if dlse_BHS is None else dlse_BHS.to(acc)
    delta_BHS = (dout * out_BHSD.to(acc)).sum(-1)
    dq = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
    args = (_chunks(q_BHSD.to(acc), num_chunks, 2), _chunks(q_pos_BS.long(), num_chunks, 1),
            _chunks(dout, num_chunks, 2), _chunks(dlse.to(acc), num_chunks, 2), _chunks(delta_BHS, num_chunks, 2),
            _chunks(lse_BHS.to(acc), num_chunks, 2), _chunks(dq, num_chunks, 2))
    kv = torch.stack([k_BHkvSD, v_BHkvSD])
    kv_hop = comm.start([kv], "kv") if comm.size > 1 else None
    dkv_own = _backward_one_block(kv, key_meta[0], *args, comm, scale, num_chunks)
    grad_hop = None
    for step in range(1, comm.size):
        (kv,) = kv_hop.wait()  # block of rank (r - step)
        kv_hop = comm.start([kv], "kv") if step + 1 < comm.size else None
        dkv = _backward_one_block(kv, key_meta[step], *args, comm, scale, num_chunks)
        if grad_hop is not None:  # the accumulator of the same block, from rank r-1
            dkv += grad_hop.wait()[0]
        grad_hop = comm.start([dkv], "grad")  # on the last step this goes to the block's owner
    if grad_hop is not None:
        dkv_own += grad_hop.wait()[0]
    return dq.to(q_BHSD.dtype), dkv_own[0].to(k_BHkvSD.dtype), dkv_own[1].to(v_BHkvSD.dtype)


class RingAttention(torch.autograd.Function):
    """Thin autograd wrapper: ``RingAttention.apply(q, k, v, q_pos, k_pos, k_valid, comm, scale, num_chunks)``
    -> (out, lse). Gradients flow to q, k, v (lse's gradient included)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, k_valid, comm, scale, num_chunks):
        out, lse, key_meta = ring_attention_forward(q, k, v, q_pos, k_pos, k_valid, comm, scale, num_chunks)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, *key_meta)
        ctx.comm, ctx.scale, ctx.num_chunks = comm, scale, num_chunks
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, *key_meta = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, dlse, q, k, v, out, lse, q_pos, key_meta, ctx.comm,
                                             ctx.scale, ctx.num_chunks)
        return dq, dk, dv, None, None, None, None, None, None


def ring_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None, group=None, *,
                         scale: float | None = None, comm: RingComm | None = None, num_chunks: int = 2):
    """Drop-in for ``block_attention`` (causal) under CP: local zigzag shards in, local (out, lse) out.

    Same shapes as ``block_attention``; ``group`` the cp group (or pass a ``comm`` to read its counters).
    Raises ValueError when shard shapes disagree within the rank.
    """
    b, _, sk, d = k_BHkvSD.shape
    if (v_BHkvSD.shape != k_BHkvSD.shape or tuple(k_pos_BS.shape) != (b, sk) or q_BHSD.shape[0] != b
            or q_BHSD.shape[-1] != d or tuple(q_pos_BS.shape) != (b, q_BHSD.shape[2])):
        raise ValueError(f"ring_block_attention: shapes disagree: q {tuple(q_BHSD.shape)}, k {tuple(k_BHkvSD.shape)}, "
                         f"v {tuple(v_BHkvSD.shape)}, q_pos {tuple(q_pos_BS.shape)}, k_pos {tuple(k_pos_BS.shape)} "
                         "(expected q [B, H, Sq, D], k = v [B, Hkv, Sk, D], q_pos [B, Sq], k_pos [B, Sk])")
    comm = RingComm(group) if comm is None else comm
    return RingAttention.apply(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, comm, scale, num_chunks)


class RingCausalAttention:
    """Callable with the draft's causal-block signature ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)``.

    Owns one ``RingComm`` (``.comm.counts`` accumulate over calls; ``reset()`` them per step if wanted).
    """

    def __init__(self, group=None, num_chunks: int = 2):
        self.comm = RingComm(group)
        self.num_chunks = num_chunks

    def __call__(self, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None):
        return ring_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS,
                                    comm=self.comm, num_chunks=self.num_chunks)


def make_ring_causal_attention(group=None, num_chunks: int = 2) -> RingCausalAttention:
    """Factory for the draft attention's ``causal_attention`` attribute under CP (``group`` = the cp group)."""
    return RingCausalAttention(group, num_chunks)
