"""The online target forward split over the model-parallel ranks: each of the cp·tp ranks of a dp replica runs the
frozen target on 1/(cp·tp) of the sequence, then the ranks exchange what the draft layout needs.

The target's attention is routed through transformers' attention-function registry: ``SPLIT_ATTENTION`` is registered
with ``transformers.AttentionInterface`` and selected for the duration of a capture with
``model.set_attn_implementation``. The registered function runs the project's causal block
(``kernels.attention_backends.make_causal_attention`` over the cp·tp group: the ring, plain causal over GLOBAL
positions, padding keys masked). What the function needs to know about the current call (the block, the query/key
positions and the key validity) travels as the ``recipe_split`` keyword argument of the decoder forward, which
transformers hands through every decoder layer to the attention function; no state is kept between calls. RoPE comes
from the explicit global ``position_ids``. A custom attention name has no mask function, so transformers builds no
mask (the block does the masking).

The split (N = cp·tp ranks, rank j = cp_rank·tp + tp_rank, the order of ``ParallelState.cp_tp_group``): the zigzag
over N (``recipe.parallel.cp_shard.zigzag_indices(S, N, j)``: fine chunks j and 2N−1−j of 2N). Fine chunk
cp_rank·tp + tp_rank lies in coarse chunk cp_rank of the draft's zigzag over cp, and fine chunk 2N−1−j =
(2·cp−1−cp_rank)·tp + (tp−1−tp_rank) in its coarse chunk 2·cp−1−cp_rank: the tp ranks of one cp rank together hold
exactly that cp rank's draft positions, and every rank's causal work is balanced (the zigzag over N). The exchange:

1. aux states and last hidden rows: one all-gather over the tp group (``Collectives.all_gather``), reordered into
   the cp rank's zigzag order (first halves by tp rank, then second halves in reverse): S/cp rows a rank, as the
   draft under cp uses, never the full sequence;
2. the label rows beyond the cp rank's chunks (its positions plus K rows after each chunk, ``cp_shard.label_rows``):
   one sum over the cp group of the few rows some cp rank needs and another holds (at most 2·K per rank), every
   other entry zero, so the sum is exact;
3. the [B, S] int64 argmax (token-sized, like the input ids every rank has): each rank's rows, summed over cp·tp.

Every byte received is counted in :class:`TargetExchangeCounts` (``SplitTarget.counts``). At tp = 1 step 1 is absent and
this is the plain context-parallel target; at cp = 1, tp > 1 the tp ranks share the forward instead of each running
it whole.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface

from kernels.attention_backends import make_causal_attention
from kernels.documents import token_positions
from kernels.host_positions import attach_host_copies
from kernels.registry import DEFAULT_SEQUENCE_PARALLEL
from recipe.parallel.cp_shard import label_rows, zigzag_indices
from recipe.target.capture import TargetModel, capture_layer_outputs
from recipe.target.head import lm_head_argmax
from recipe.target.registry import check_split_target

SPLIT_ATTENTION = "recipe_split"
"""The name of the split target's attention in transformers' ``AttentionInterface`` (registered on import of this
module)."""

@dataclass
class SplitAttentionCall:
    """What ``split_attention_forward`` needs for one decoder forward (passed as its ``recipe_split`` keyword).

    block: the causal block ``(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS) -> (out, lse)``.
    position_ids_BS: [B, S/cp] int64 global attention positions of this rank's tokens (queries and keys alike; a
        packed batch's carry the documents, ``kernels.documents``, which the block isolates).
    key_valid_BS: [B, S/cp] bool, False on padding.  seq_len: the global (padded) sequence length S.
    """

    block: Callable
    position_ids_BS: torch.Tensor
    key_valid_BS: torch.Tensor
    seq_len: int


def split_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, recipe_split=None,
                         **kwargs):
    """transformers attention function (signature of ``integrations.sdpa_attention.sdpa_attention_forward``):
    query [B, H, s, D], key/value [B, Hkv, s, D] (RoPE applied) -> (out [B, s, H, D], None).

    Raises RuntimeError when called without ``recipe_split`` (outside ``SplitTarget.capture``) or with a mask,
    ValueError for a soft-capped attention, dropout, or a sliding window shorter than the sequence (not plain causal).
    """
    if recipe_split is None:
        raise RuntimeError(f"attention {SPLIT_ATTENTION!r} called without its recipe_split argument; it runs only "
                           "inside recipe.target.split.SplitTarget.capture")
    if attention_mask is not None:
        raise RuntimeError(f"attention {SPLIT_ATTENTION!r} got a {tuple(attention_mask.shape)} mask; the ring masks "
                           "by global positions and key validity itself")
    window = kwargs.get("sliding_window")
    if window is not None and window < recipe_split.seq_len:
        raise ValueError(f"{type(module).__name__} uses a sliding window of {window} < sequence length "
                         f"{recipe_split.seq_len}; the context-parallel target runs plain causal attention only")
    if kwargs.get("softcap") is not None or dropout:
        raise ValueError(f"{type(module).__name__}: soft-capped attention or dropout is not supported by the "
                         "context-parallel target")
    default = 1.0 / math.sqrt(query.shape[-1])
    if scaling is not None and not math.isclose(scaling, default, rel_tol=1e-12):
        query = query * (scaling / default)
    pos, valid = recipe_split.position_ids_BS, recipe_split.key_valid_BS
    out_BHSD, _ = recipe_split.block(query, key, value, pos, pos, valid)
    return out_BHSD.transpose(1, 2).contiguous(), None


AttentionInterface.register(SPLIT_ATTENTION, split_attention_forward)


@contextmanager
def attention_implementation(model, name: str):
    """Select attention ``name`` on ``model`` (``set_attn_implementation``) inside the block; restore on exit."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@dataclass
class TargetExchangeCounts:
    """Cumulative counters of one ``SplitTarget`` (this rank): captures, positions its target forward ran on, and the
    bytes it received in each exchange (module docstring): ``gathered_bytes`` the aux + last hidden rows of its tp
    peers, ``halo_bytes`` the label-row sum over cp (the summed tensor's size), ``argmax_bytes`` the argmax sum."""

    captures: int = 0
    forward_positions: int = 0
    gathered_bytes: int = 0
    halo_bytes: int = 0
    argmax_bytes: int = 0


@dataclass
class SplitTargetCapture:
    """One cp rank's part of a target forward (cp rank r of cp, padded sequence S, K TTT steps; target dtype/device).

    aux_hidden_BSA: [B, S/cp, 3·H_t] the aux states at ``zigzag_indices(S, cp, r)`` (in that order).
    label_hidden_BUH: [B, U, H_t] the last hidden states at ``label_rows(S, cp, r, K)`` (sorted global rows).
    argmax_BS: [B, S] int64 the target's greedy token at every position (gathered over the cp group).
    """

    aux_hidden_BSA: torch.Tensor
    label_hidden_BUH: torch.Tensor
    argmax_BS: torch.Tensor


class SplitTarget:
    """A ``TargetModel`` run split over the cp·tp ranks of a dp replica (module docstring).

    Args:
        target: the loaded ``TargetModel`` or ``PartitionedTargetModel`` (its architecture's ``routable_attention``
            must be true: ``recipe.target.registry``).
        comm: the run's ``recipe.parallel.collectives.Collectives`` (``ParallelState.comm``).
        cp_group, cp_size, cp_rank: the context-parallel group of this rank, its size and this rank's index in it.
        attention_backend, tile_size: the causal block's kernel and tile (``make_causal_attention``; the run's
            ``kernels.attention`` and ``memory.attention_tile_size``).
        argmax_chunk_size: positions per lm_head matmul of the argmax (``lm_head_argmax``): at most this many
            [·, V] logits rows exist at once.
        tp_group, tp_size, tp_rank: the tensor-parallel group of this rank (tp_size 1: none).
        split_group: the cp·tp group (``ParallelState.cp_tp_group``: ranks ordered cp_rank·tp + tp_rank); needed
            when tp_size > 1 (at tp 1 the ring is the cp group).
        sequence_parallel: the strategy across the split sequence (the run's ``kernels.sequence_parallel``).
    Raises ValueError for an unsupported model type (``check_split_target``) or backend, or tp_size > 1 without a
    ring group. Use :meth:`from_state` with a ``ParallelState``.
    """

    def __init__(self, target: TargetModel, comm, cp_group, cp_size: int, cp_rank: int,
                 attention_backend: str = "auto", tile_size: int | None = None, argmax_chunk_size: int = 1024, *,
                 tp_group=None, tp_size: int = 1, tp_rank: int = 0, split_group=None,
                 sequence_parallel: str = DEFAULT_SEQUENCE_PARALLEL):
        check_split_target(target.config)
        if tp_size > 1 and split_group is None:
            raise ValueError(f"SplitTarget over tp_size={tp_size} needs the cp·tp split_group "
                             "(ParallelState.cp_tp_group)")
        self.target, self.comm, self.cp_group, self.tp_group = target, comm, cp_group, tp_group
        self.cp_size, self.cp_rank, self.tp_size, self.tp_rank = cp_size, cp_rank, tp_size, tp_rank
        self.argmax_chunk_size = argmax_chunk_size
        self.split_group = split_group if tp_size > 1 else cp_group
        self.split_size, self.split_rank = cp_size * tp_size, cp_rank * tp_size + tp_rank
        self.block = make_causal_attention(attention_backend, tile_size, target.device,
                                           self.split_group if self.split_size > 1 else None, sequence_parallel)
        self.counts = TargetExchangeCounts()

    @classmethod
    def from_state(cls, target: TargetModel, pstate, attention_backend: str = "auto", tile_size: int | None = None,
                   argmax_chunk_size: int = 1024, sequence_parallel: str = DEFAULT_SEQUENCE_PARALLEL) -> "SplitTarget":
        """The target split over ``pstate``'s (a ``recipe.parallel.topology.ParallelState``) cp·tp group."""
        return cls(target, pstate.comm, pstate.cp_group, pstate.cp_size, pstate.cp_rank, attention_backend,
                   tile_size, argmax_chunk_size, tp_group=pstate.tp_group, tp_size=pstate.tp_size,
                   tp_rank=pstate.tp_rank, split_group=pstate.cp_tp_group, sequence_parallel=sequence_parallel)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @torch.no_grad()
    def capture(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor, ttt_steps: int,
                argmax_rows_BS: torch.Tensor | None = None,
                positions_BS: torch.Tensor | None = None) -> SplitTargetCapture:
        """This rank's ``SplitTargetCapture`` of the FULL padded micro-batch ``input_ids_BS`` [B, S] int64 with
        ``attention_mask_BS`` [B, S] (1 token, 0 padding; right padding), for K = ``ttt_steps``. A collective over
        the cp·tp group (and its tp and cp groups). With the mask on the CPU (the batch builder's), the ring decides
        its tile pairs from host copies of every rank's positions/validity (``kernels.host_positions``), without a
        device sync per hop. ``argmax_rows_BS`` ([B, S] bool, None: all): the argmax only at these rows, 0 elsewhere
        (``recipe.target.head.validity_rows``). ``positions_BS`` ([B, S] int64 on the CPU, None: 0..S−1): a packed
        batch's attention positions (``kernels.documents.document_positions``; docs/algorithm.md, "Packing"): RoPE
        reads the position within the document, the block isolates the documents. Raises ValueError when S is not a
        multiple of 2·cp·tp.
        """
        t, n, j = self.target, self.split_size, self.split_rank
        b, s = input_ids_BS.shape
        pos_host = zigzag_indices(s, n, j)
        pos = pos_host.to(t.device)
        ids = input_ids_BS.to(t.device)[:, pos]
        full_host = torch.arange(s).expand(b, s) if positions_BS is None else positions_BS  # sliced per rank
        call = SplitAttentionCall(self.block, full_host[:, pos_host].to(t.device).contiguous(),
                                  attention_mask_BS.to(t.device)[:, pos].bool(), s)
        if attention_mask_BS.device.type == "cpu":  # every rank's positions/validity on the host: the ring's pairs
            mine = [zigzag_indices(s, n, r) for r in range(n)]
            attach_host_copies(call.position_ids_BS, [full_host[:, m].contiguous() for m in mine], j)
            attach_host_copies(call.key_valid_BS, [attention_mask_BS[:, m].bool() for m in mine], j)
        rope = call.position_ids_BS if positions_BS is None else token_positions(call.position_ids_BS)
        with attention_implementation(t.model, SPLIT_ATTENTION), \
                capture_layer_outputs(t.layers, t.aux_layer_ids) as captured:
            out = t.decoder(input_ids=ids, position_ids=rope, use_cache=False, recipe_split=call)
        aux = torch.cat([captured[i] for i in t.aux_layer_ids], dim=-1)
        del captured
        last = out.last_hidden_state
        argmax = torch.zeros(b, s, dtype=torch.int64, device=t.device)
        with t.full_lm_head() as head_VH:
            rows = None if argmax_rows_BS is None else argmax_rows_BS[:, pos_host.to(argmax_rows_BS.device)]
            argmax[:, pos] = lm_head_argmax(last, head_VH, self.argmax_chunk_size, rows)
        self.counts.captures += 1
        self.counts.forward_positions += b * pos.numel()
        if n > 1:
            argmax = self.comm.sum(argmax, group=self.split_group)
            self.counts.argmax_bytes += argmax.numel() * argmax.element_size()
        if self.tp_size > 1:
            aux, last = self._gather_tp(aux), self._gather_tp(last)
        return SplitTargetCapture(aux_hidden_BSA=aux, label_hidden_BUH=self._label_hidden(last, s, ttt_steps),
                               argmax_BS=argmax)

    def _gather_tp(self, rows_BNX: torch.Tensor) -> torch.Tensor:
        """[B, S/(cp·tp), X] this rank's rows -> [B, S/cp, X] its cp rank's rows in ``zigzag_indices(S, cp,
        cp_rank)`` order: tp rank t holds fine chunk t of the cp rank's first chunk and fine chunk tp−1−t of its
        second (module docstring). Two all-gathers (first halves, second halves) land every piece in its place of a
        [2, tp, B, S/(2·cp·tp), X] buffer, which is the result's memory for B = 1 (no reordering copy)."""
        b, n, x = rows_BNX.shape
        half, tp = n // 2, self.tp_size
        buf = rows_BNX.new_empty(2, tp, b, half, x)
        self.comm.all_gather(rows_BNX[:, :half], group=self.tp_group, out=list(buf[0]))
        self.comm.all_gather(rows_BNX[:, half:], group=self.tp_group, out=list(buf[1])[::-1])
        self.counts.gathered_bytes += (tp - 1) * rows_BNX.numel() * rows_BNX.element_size()
        return buf.permute(2, 0, 1, 3, 4).reshape(b, 2 * tp * half, x)

    def _label_hidden(self, last_BSH: torch.Tensor, seq_len: int, ttt_steps: int) -> torch.Tensor:
        """[B, U, H_t] this rank's label rows: its own from ``last_BSH`` (its zigzag positions), the others from
        one sum over the cp group of every rank's rows that some other rank needs (``halo``)."""
        cp, r = self.cp_size, self.cp_rank
        owner = torch.empty(seq_len, dtype=torch.int64)
        local = torch.empty(seq_len, dtype=torch.int64)
        for rank in range(cp):
            own = zigzag_indices(seq_len, cp, rank)
            owner[own], local[own] = rank, torch.arange(own.numel())
        needed = [label_rows(seq_len, cp, rank, ttt_steps) for rank in range(cp)]
        halo = torch.unique(torch.cat([rows[owner[rows] != rank] for rank, rows in enumerate(needed)]))
        rows = needed[r]
        dev = last_BSH.device
        out = last_BSH.new_empty(last_BSH.shape[0], rows.numel(), last_BSH.shape[2])
        mine = owner[rows] == r
        out[:, mine.to(dev)] = last_BSH[:, local[rows[mine]].to(dev)]
        if halo.numel():  # empty at cp = 1 (every row its own), so no collective there
            sent = last_BSH.new_zeros(last_BSH.shape[0], halo.numel(), last_BSH.shape[2])
            held = owner[halo] == r
            sent[:, held.to(dev)] = last_BSH[:, local[halo[held]].to(dev)]
            received = self.comm.sum(sent, group=self.cp_group)
            self.counts.halo_bytes += received.numel() * received.element_size()
            out[:, (~mine).to(dev)] = received[:, torch.searchsorted(halo, rows[~mine]).to(dev)]
        return out
