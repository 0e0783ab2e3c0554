"""Training-time-test attention without dense masks (docs/algorithm.md, "Attention of step k").

At TTT step k a query at anchor position p reads the causal block of step 0's keys ``{K_0[j] : j <= p}`` and one
*diagonal* key per later step ``{K_i[p] : 1 <= i <= k}``. The causal block goes through a block-attention function
returning ``(out, lse)`` (``kernels.block_attention.block_attention`` on one device, a ring version under context
parallelism); the diagonal keys are per-position dot products (scores ``[B, H, S, k]``) merged by log-sum-exp.
Nothing of size ``S x S*(k+1)`` is ever built.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from kernels.block_attention import accum_dtype, merge_lse
from kernels.documents import token_positions

CausalAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def diagonal_attention(
    q_BHSD: torch.Tensor, k_BHkvSND: torch.Tensor, v_BHkvSND: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query position over the N keys stored at that same position (all readable).

    Args:
        q_BHSD: [B, H, S, D] queries.  k_BHkvSND, v_BHkvSND: [B, Hkv, S, N, D], N >= 1 keys/values per position;
        query head h reads KV head h // (H / Hkv) (as ``expand_kv``).  scale: default 1/sqrt(D).
    Returns:
        out_BHSD in q's dtype, lse_BHS in the accumulation dtype (float32 for half inputs).
    Raises ValueError when H is not a multiple of Hkv.
    """
    b, h, s, d = q_BHSD.shape
    hkv = k_BHkvSND.shape[1]
    if h % hkv:
        raise ValueError(f"num_heads={h} is not a multiple of num_key_value_heads={hkv}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = accum_dtype(q_BHSD.dtype)
    q_BGRSD = q_BHSD.to(acc).view(b, hkv, h // hkv, s, d)  # head h = g * (H/Hkv) + r
    s_BGRSN = torch.einsum("bgrsd,bgsnd->bgrsn", q_BGRSD, k_BHkvSND.to(acc)) * scale
    lse_BGRS = torch.logsumexp(s_BGRSN, dim=-1)
    p_BGRSN = torch.exp(s_BGRSN - lse_BGRS[..., None])
    out_BGRSD = torch.einsum("bgrsn,bgsnd->bgrsd", p_BGRSN, v_BHkvSND.to(acc))
    return out_BGRSD.reshape(b, h, s, d).to(q_BHSD.dtype), lse_BGRS.reshape(b, h, s)


def merge_diagonal(out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, q_BHSD: torch.Tensor, k_BHkvSND: torch.Tensor,
                   v_BHkvSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT merge: the causal block's attention (out [B, H, S, D] in q's dtype, lse [B, H, S] in the accumulation
    dtype, -inf on rows with no readable key) combined with the N diagonal keys of each position
    (:func:`diagonal_attention` of q over k/v [B, Hkv, S, N, D]) by log-sum-exp (``merge_lse``). Returns (out
    [B, H, S, D] in out's dtype, lse [B, H, S]): the attention over the union of both key sets. One function, so a
    compiler fuses the diagonal scores, their softmax and the merge (``recipe.model.small_ops``)."""
    out_d, lse_d = diagonal_attention(q_BHSD, k_BHkvSND, v_BHkvSND)
    return merge_lse(out_BHSD, lse_BHS, out_d, lse_d)


DiagonalMerge = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class TTTKVCache:
    """Keys and values of one TTT unroll: step 0's causal block plus the diagonal K/V of steps 1..k.

    The draft layer talks to a cache through two methods, so an inference cache can replace this one:
    ``rope_positions(position_ids_BS)`` gives the RoPE positions of the current step (anchor p + step k), and
    ``attend(causal_attention, q, k, v, position_ids_BS, key_valid_BS)`` stores the step's keys and returns the
    attention output. Step 0's keys become the causal block (with their anchor positions and validity); each later
    step appends one diagonal key per position. Causality compares anchor positions, not RoPE positions.
    """

    def __init__(self) -> None:
        self.block: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    @property
    def num_steps(self) -> int:
        """Number of TTT steps whose keys are stored (the index of the next step)."""
        return 0 if self.block is None else 1 + len(self.diag_k)

    def rope_positions(self, position_ids_BS: torch.Tensor) -> torch.Tensor:
        """RoPE positions of the next step: anchor positions within their document + step index ([B, S] int64;
        ``kernels.documents.token_positions``: a packed document's positions restart at 0, an unpacked row's are its
        positions)."""
        return token_positions(position_ids_BS) + self.num_steps

    def keep(self, select_BN: torch.Tensor) -> None:
        """Keep only the rows ``select_BN`` [B, N] int64 of the stored diagonal keys/values (the sparse path: the next
        step computes a subset of this step's anchors, ``recipe.model.sparse_anchors``); the causal block is kept
        whole. Differentiable (a gather)."""
        def pick(x_BHkvSD):
            b, hkv, _, d = x_BHkvSD.shape
            idx = select_BN[:, None, :, None].expand(b, hkv, select_BN.shape[1], d)
            return torch.gather(x_BHkvSD, 2, idx)
        self.diag_k = [pick(t) for t in self.diag_k]
        self.diag_v = [pick(t) for t in self.diag_v]

    def attend(
        self,
        causal_attention: CausalAttention,
        q_BHSD: torch.Tensor,
        k_BHkvSD: torch.Tensor,
        v_BHkvSD: torch.Tensor,
        position_ids_BS: torch.Tensor,
        key_valid_BS: torch.Tensor | None,
        query_positions_BS: torch.Tensor | None = None,
        merge: DiagonalMerge | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend over the causal block and the diagonal keys; returns out_BHSD.

        ``causal_attention(q, k0, v0, q_pos, k_pos, k_valid) -> (out, lse)`` is called on step 0's block with the
        anchor positions; ``key_valid_BS`` is read at step 0 only (later steps' diagonal keys are always readable).
        ``query_positions_BS`` [B, Sq]: the queries' anchor positions when they are not the keys' ``position_ids_BS``
        (step 0 of the sparse path: keys at every position, queries at the needed anchors only; None: the same).
        A query with no readable block key (padding row) is finite: at step 0 its output is 0.
        ``merge``: the function that adds the diagonal keys to the causal block's (out, lse), with the signature of
        :func:`merge_diagonal` (None: it; the draft passes its compiled one, ``recipe.model.small_ops``).
        """
        merge = merge_diagonal if merge is None else merge
        if self.block is None:
            self.block = (k_BHkvSD, v_BHkvSD, position_ids_BS, key_valid_BS)
        else:
            self.diag_k.append(k_BHkvSD)
            self.diag_v.append(v_BHkvSD)
        k0, v0, pos0, valid0 = self.block
        q_pos = position_ids_BS if query_positions_BS is None else query_positions_BS
        out_BHSD, lse_BHS = causal_attention(q_BHSD, k0, v0, q_pos, pos0, valid0)
        if self.diag_k:
            out_BHSD = merge(out_BHSD, lse_BHS, q_BHSD, torch.stack(self.diag_k, dim=3),
                             torch.stack(self.diag_v, dim=3))[0]
        return out_BHSD
