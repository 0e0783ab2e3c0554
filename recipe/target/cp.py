"""The context-parallel target forward: each cp rank runs the frozen target on its own zigzag positions only.

The target's attention is routed through transformers' attention-function registry: ``CP_ATTENTION`` is registered
with ``transformers.AttentionInterface`` and selected for the duration of a capture with
``model.set_attn_implementation``. The registered function runs the project's causal block
(``kernels.attention_backends.make_causal_attention`` over the cp group: the ring, plain causal over GLOBAL positions,
padding keys masked). What the function needs to know about the current call (the block, the query/key positions and
the key validity) travels as the ``recipe_cp`` keyword argument of the decoder forward, which transformers hands
through every decoder layer to the attention function; no state is kept between calls. RoPE comes from the explicit
global ``position_ids``. A custom attention name has no mask function, so transformers builds no mask (the block does
the masking).

Per cp rank r (sequence S, a multiple of 2·cp; zigzag chunks r and 2·cp−1−r, ``recipe.parallel.cp_shard``) the
capture keeps the aux hidden states of its S/cp positions, the target's last hidden state at its TTT label rows
(``cp_shard.label_rows``: its positions plus up to K rows after each chunk, held by ranks r+1 and r−1) and the
[B, S] target argmax (token-sized, like the input ids every rank has). The label rows beyond its chunks arrive with
one sum over the cp group (``Collectives.sum``) of the few rows some rank needs and another holds (at most 2·K per
rank), every other entry zero, so the sum is exact. No rank holds the full sequence's target activations.

Tensor-parallel ranks of one cp rank each run this same forward (replicated, over their own cp group's ring): the
kept activations are the same size either way and no tp communication is needed (docs/results/target_cpu.json).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface

from recipe.parallel.cp_shard import label_rows, zigzag_indices
from recipe.target.capture import TargetModel, capture_layer_outputs
from recipe.target.head import lm_head_argmax
from recipe.target.registry import check_cp_target

CP_ATTENTION = "recipe_cp_ring"
"""The name of the ring attention in transformers' ``AttentionInterface`` (registered on import of this module)."""

@dataclass
class CPAttentionCall:
    """What ``cp_attention_forward`` needs for one decoder forward (passed as its ``recipe_cp`` keyword).

    block: the causal block ``(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS) -> (out, lse)``.
    position_ids_BS: [B, S/cp] int64 global positions of this rank's tokens (queries and keys alike).
    key_valid_BS: [B, S/cp] bool, False on padding.  seq_len: the global (padded) sequence length S.
    """

    block: Callable
    position_ids_BS: torch.Tensor
    key_valid_BS: torch.Tensor
    seq_len: int


def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, recipe_cp=None,
                         **kwargs):
    """transformers attention function (signature of ``integrations.sdpa_attention.sdpa_attention_forward``):
    query [B, H, s, D], key/value [B, Hkv, s, D] (RoPE applied) -> (out [B, s, H, D], None).

    Raises RuntimeError when called without ``recipe_cp`` (outside ``CPTarget.capture``) or with a mask, ValueError
    for a soft-capped attention, dropout, or a sliding window shorter than the sequence (not plain causal).
    """
    if recipe_cp is None:
        raise RuntimeError(f"attention {CP_ATTENTION!r} called without its recipe_cp argument; it runs only inside "
                           "recipe.target.cp.CPTarget.capture")
    if attention_mask is not None:
        raise RuntimeError(f"attention {CP_ATTENTION!r} got a {tuple(attention_mask.shape)} mask; the ring masks "
                           "by global positions and key validity itself")
    window = kwargs.get("sliding_window")
    if window is not None and window < recipe_cp.seq_len:
        raise ValueError(f"{type(module).__name__} uses a sliding window of {window} < sequence length "
                         f"{recipe_cp.seq_len}; the context-parallel target runs plain causal attention only")
    if kwargs.get("softcap") is not None or dropout:
        raise ValueError(f"{type(module).__name__}: soft-capped attention or dropout is not supported by the "
                         "context-parallel target")
    default = 1.0 / math.sqrt(query.shape[-1])
    if scaling is not None and not math.isclose(scaling, default, rel_tol=1e-12):
        query = query * (scaling / default)
    pos, valid = recipe_cp.position_ids_BS, recipe_cp.key_valid_BS
    out_BHSD, _ = recipe_cp.block(query, key, value, pos, pos, valid)
    return out_BHSD.transpose(1, 2).contiguous(), None


AttentionInterface.register(CP_ATTENTION, cp_attention_forward)


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
class CPTargetCapture:
    """One cp rank's part of a target forward (cp rank r of cp, padded sequence S, K TTT steps; target dtype/device).

    aux_hidden_BSA: [B, S/cp, 3·H_t] the aux states at ``zigzag_indices(S, cp, r)`` (in that order).
    label_hidden_BUH: [B, U, H_t] the last hidden states at ``label_rows(S, cp, r, K)`` (sorted global rows).
    argmax_BS: [B, S] int64 the target's greedy token at every position (gathered over the cp group).
    """

    aux_hidden_BSA: torch.Tensor
    label_hidden_BUH: torch.Tensor
    argmax_BS: torch.Tensor


class CPTarget:
    """A ``TargetModel`` run context-parallel over a cp group (module docstring).

    Args:
        target: the loaded ``TargetModel`` (its architecture's ``ring_attention`` must be true:
            ``recipe.target.registry``).
        comm: the run's ``recipe.parallel.collectives.Collectives`` (``ParallelState.comm``).
        cp_group, cp_size, cp_rank: the context-parallel group of this rank, its size and this rank's index in it.
        attention_backend, tile_size: the causal block's kernel and tile (``make_causal_attention``; the run's
            ``memory`` section).
        argmax_chunk_size: positions per lm_head matmul of the argmax (``lm_head_argmax``): at most this many
            [·, V] logits rows exist at once.
    Raises ValueError for an unsupported model type (``check_cp_target``) or backend.
    """

    def __init__(self, target: TargetModel, comm, cp_group, cp_size: int, cp_rank: int,
                 attention_backend: str = "auto", tile_size: int | None = None, argmax_chunk_size: int = 1024):
        from kernels.attention_backends import make_causal_attention

        check_cp_target(target.config)
        self.target, self.comm, self.cp_group = target, comm, cp_group
        self.cp_size, self.cp_rank, self.argmax_chunk_size = cp_size, cp_rank, argmax_chunk_size
        self.block = make_causal_attention(attention_backend, tile_size, target.device,
                                           cp_group if cp_size > 1 else None)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @torch.no_grad()
    def capture(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor, ttt_steps: int
                ) -> CPTargetCapture:
        """This rank's ``CPTargetCapture`` of the FULL padded micro-batch ``input_ids_BS`` [B, S] int64 with
        ``attention_mask_BS`` [B, S] (1 token, 0 padding; right padding), for K = ``ttt_steps``. A collective over
        the cp group. With the mask on the CPU (the batch builder's), the ring decides its tile pairs from host copies
        of every rank's positions/validity (``kernels.host_positions``), without a device sync per hop. Raises
        ValueError when S is not a multiple of 2·cp.
        """
        t = self.target
        b, s = input_ids_BS.shape
        pos = zigzag_indices(s, self.cp_size, self.cp_rank).to(t.device)
        ids = input_ids_BS.to(t.device)[:, pos]
        call = CPAttentionCall(self.block, pos.expand(b, -1).contiguous(),
                               attention_mask_BS.to(t.device)[:, pos].bool(), s)
        if attention_mask_BS.device.type == "cpu":  # every rank's positions/validity on the host: the ring's pairs
            from kernels.host_positions import attach_host_copies

            mine = [zigzag_indices(s, self.cp_size, r) for r in range(self.cp_size)]
            attach_host_copies(call.position_ids_BS, [m.expand(b, -1).contiguous() for m in mine], self.cp_rank)
            attach_host_copies(call.key_valid_BS, [attention_mask_BS[:, m].bool() for m in mine], self.cp_rank)
        with attention_implementation(t.model, CP_ATTENTION), \
                capture_layer_outputs(t.layers, t.aux_layer_ids) as captured:
            out = t.decoder(input_ids=ids, position_ids=call.position_ids_BS, use_cache=False, recipe_cp=call)
        aux = torch.cat([captured[i] for i in t.aux_layer_ids], dim=-1)
        last = out.last_hidden_state
        argmax = torch.zeros(b, s, dtype=torch.int64, device=t.device)
        with t.full_lm_head() as head_VH:
            argmax[:, pos] = lm_head_argmax(last, head_VH, self.argmax_chunk_size)
        argmax = self.comm.sum(argmax, group=self.cp_group) if self.cp_size > 1 else argmax
        return CPTargetCapture(aux_hidden_BSA=aux, label_hidden_BUH=self._label_hidden(last, s, ttt_steps),
                               argmax_BS=argmax)

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
        if halo.numel() and cp > 1:
            sent = last_BSH.new_zeros(last_BSH.shape[0], halo.numel(), last_BSH.shape[2])
            held = owner[halo] == r
            sent[:, held.to(dev)] = last_BSH[:, local[halo[held]].to(dev)]
            received = self.comm.sum(sent, group=self.cp_group)
            out[:, (~mine).to(dev)] = received[:, torch.searchsorted(halo, rows[~mine]).to(dev)]
        return out
