"""Training-time test (TTT; docs/algorithm.md, "Training-time test"): the unrolled K-step batch and the model that
returns per-step loss sums.

All shifts are done by ``make_ttt_batch`` on the full sequence, before any context-parallel split, so no rank needs
its neighbour's tokens. Convention (docs/architecture.md): step k at anchor p reads token ``t[p+1+k]``, RoPE
position ``p+k``, and is trained on ``softmax(z[p+1+k][draft ids])``; valid iff ``p+2+k < S``, ``loss_mask[p+2+k]``
and ``argmax z[p+1+k]`` in the draft vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import torch
from torch import nn

from kernels.documents import packed_positions
from recipe.model.call_extent import CallExtent
from recipe.model.draft import Eagle3Draft
from recipe.model.loss import soft_ce
from recipe.model.sparse_anchors import check_sparse_mode, sparse_pays
from recipe.model.step_checkpoint import checkpointed_step
from recipe.model.ttt_steps import dense_steps, sparse_steps


@dataclass
class TTTBatch:
    """One micro-batch unrolled for K TTT steps (K TTT steps, B batch, S sequence, L target-hidden rows).

    Fields:
        input_ids_KBS: [K, B, S] int64, step k's input token at anchor p (``t[p+1+k]``, 0 beyond the sequence).
        valid_KBS: [K, B, S] bool, step k's label at p counts in the loss.
        position_ids_BS: [B, S] int64 anchor positions p (global under CP); step k's RoPE uses p + k.
        key_valid_BS: [B, S] bool, the step-0 key at p is not padding.
        aux_hidden_BSA: [B, S, 3·H_t] float, the target's concatenated aux hidden states at p.
        target_hidden_BLH: [B, L, H_t] float, rows of the target's last hidden state (lm_head input).
        target_row_KS: [K, S] int64, the row of ``target_hidden_BLH`` holding step k's label for local anchor p.
        call_extent: a ``recipe.model.call_extent.CallExtent`` (not a tensor): the largest local S and B·S of this
            micro-batch over the ZeRO group, from which the tiled MLP and the chunked loss count their calls (empty
            pieces after this batch's own), so every rank calls every module equally often under ZeRO-3; None (the
            default): this batch's own (S, B·S). ValueError if smaller than the batch's own.
    ``per_position_fields`` maps each field with a sequence axis to that axis (for the zigzag split);
    ``target_hidden_BLH`` is not among them: it is addressed through ``target_row_KS``. All fields live on one device;
    the training batch builder attaches CPU copies of ``position_ids_BS`` and ``key_valid_BS`` (every cp rank's) to
    them (``kernels.host_positions``) so the attention picks its tile pairs without a device sync.
    """

    input_ids_KBS: torch.Tensor
    valid_KBS: torch.Tensor
    position_ids_BS: torch.Tensor
    key_valid_BS: torch.Tensor
    aux_hidden_BSA: torch.Tensor
    target_hidden_BLH: torch.Tensor
    target_row_KS: torch.Tensor
    call_extent: CallExtent | None = None

    per_position_fields: ClassVar[dict[str, int]] = {
        "input_ids_KBS": 2, "valid_KBS": 2, "position_ids_BS": 1, "key_valid_BS": 1, "aux_hidden_BSA": 1,
        "target_row_KS": 1,
    }

    def __post_init__(self):
        k, b, s = self.input_ids_KBS.shape
        expected = {"valid_KBS": (k, b, s), "position_ids_BS": (b, s), "key_valid_BS": (b, s),
                    "aux_hidden_BSA": (b, s, None), "target_hidden_BLH": (b, None, None), "target_row_KS": (k, s)}
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
                raise ValueError(f"TTTBatch.{name} has shape {got}, expected {shape} (None: any) "
                                 f"for K={k}, B={b}, S={s}")
        if self.call_extent is not None:
            self.call_extent.check_covers(b, s)

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """The names of the tensor fields (all but ``call_extent``), in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "call_extent")

    def extent(self) -> CallExtent:
        """``call_extent``, or this batch's own (S, B·S) when it is None."""
        _, b, s = self.input_ids_KBS.shape
        return self.call_extent if self.call_extent is not None else CallExtent(s, b * s)

    @property
    def num_steps(self) -> int:
        """K, the number of TTT steps."""
        return self.input_ids_KBS.shape[0]

    def to(self, device: torch.device | str) -> "TTTBatch":
        """A copy with every tensor moved to ``device`` (dtypes unchanged)."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in self.tensor_fields()})


def _shift_left(x_BS: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """``out[:, p] = x[:, p + by]``, ``fill`` (0 / False) beyond the end."""
    pad = torch.full((x_BS.shape[0], by), fill, dtype=x_BS.dtype, device=x_BS.device)
    return torch.cat([x_BS, pad], dim=1)[:, by:]


def make_ttt_batch(input_ids_BS, loss_mask_BS, attention_mask_BS, aux_hidden_BSA, last_hidden_BSH, in_vocab_BS,
                   K: int, document_ids_BS: torch.Tensor | None = None) -> TTTBatch:
    """Build the K-step TTT batch on the full (unsplit) sequence.

    Args:
        input_ids_BS: [B, S] int64 tokens t.  loss_mask_BS: [B, S] (0/1 or bool), 1 on assistant tokens.
        attention_mask_BS: [B, S] (0/1 or bool), 0 on padding.  aux_hidden_BSA: [B, S, 3·H_t].
        last_hidden_BSH: [B, S, H_t] target last hidden states (lm_head input).  in_vocab_BS: [B, S] bool,
        ``t2d[argmax z[p]]`` (see ``target_in_draft_vocab``).  K: number of TTT steps (>= 1).
        document_ids_BS: [B, S] int64 (non-negative), the packed document of each position (runs of equal ids;
        docs/algorithm.md, "Packing"); None: one document per row.
    Returns a TTTBatch with ``input_ids[k, :, p] = t[p+1+k]`` (0 beyond S), ``valid[k, :, p] = (p+2+k < S) &
    loss_mask[p+2+k] & in_vocab[p+1+k] & attention_mask[p]`` (the last term drops padding anchors, which only
    matters for left padding), positions ``0..S-1``, ``key_valid = attention_mask``, ``target_row[k, p] =
    min(p+1+k, S-1)`` and ``target_hidden = last_hidden`` (L = S). With documents every shift stays inside its
    document: the token is 0 and the label invalid where p+1+k (p+2+k) lies in another document, as beyond the end
    of an unpacked row, and the positions are attention positions (``kernels.documents.packed_positions``);
    ``target_row`` is unchanged: rows past an anchor's document are read only where its label is invalid, which adds
    exact zeros. Raises ValueError on K < 1 or mismatched shapes.
    """
    if K < 1:
        raise ValueError(f"TTT steps K={K} must be >= 1")
    b, s = input_ids_BS.shape
    for name, t in (("loss_mask_BS", loss_mask_BS), ("attention_mask_BS", attention_mask_BS),
                    ("in_vocab_BS", in_vocab_BS), ("aux_hidden_BSA", aux_hidden_BSA),
                    ("last_hidden_BSH", last_hidden_BSH), ("document_ids_BS", document_ids_BS)):
        if t is not None and tuple(t.shape[:2]) != (b, s):
            raise ValueError(f"make_ttt_batch: {name} has shape {tuple(t.shape)}, expected leading [B={b}, S={s}]")
    device = input_ids_BS.device
    ids = input_ids_BS.to(torch.int64)
    loss_mask, in_vocab = loss_mask_BS.bool(), in_vocab_BS.bool()
    anchor_real = attention_mask_BS.bool()
    positions = torch.arange(s, device=device, dtype=torch.int64)
    target_row_KS = torch.stack([(positions + k + 1).clamp(max=s - 1) for k in range(K)])
    if document_ids_BS is None:
        input_ids_KBS = torch.stack([_shift_left(ids, k + 1) for k in range(K)])
        valid_KBS = torch.stack([_shift_left(loss_mask, k + 2) & _shift_left(in_vocab, k + 1) & anchor_real
                                 for k in range(K)])
        position_ids_BS = positions.expand(b, s).clone()
    else:
        docs = document_ids_BS.to(device=device, dtype=torch.int64)

        def same(by):  # p + by lies in p's document
            return _shift_left(docs, by, -1) == docs
        input_ids_KBS = torch.stack([_shift_left(ids, k + 1) * same(k + 1) for k in range(K)])
        valid_KBS = torch.stack([_shift_left(loss_mask, k + 2) & same(k + 2) & _shift_left(in_vocab, k + 1)
                                 & anchor_real for k in range(K)])
        position_ids_BS = packed_positions(docs)
    return TTTBatch(input_ids_KBS=input_ids_KBS, valid_KBS=valid_KBS, position_ids_BS=position_ids_BS,
                    key_valid_BS=anchor_real.clone(), aux_hidden_BSA=aux_hidden_BSA,
                    target_hidden_BLH=last_hidden_BSH, target_row_KS=target_row_KS)


def target_in_draft_vocab(argmax_BS: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """``t2d[argmax z]`` per position: [B, S] bool on ``argmax_BS``'s device, whether the target's greedy token is in
    the draft vocabulary. ``argmax_BS`` [B, S] int: the target's argmax over its FULL vocabulary, computed once (the
    store's ``target_argmax`` offline, ``TargetCapture.argmax_BS`` online; ``recipe.target.head.lm_head_argmax``).
    ``t2d`` [V] bool, best already on that device (a lookup, no host sync: ids are not range-checked; they come from
    the same target as ``t2d``, which ``HiddenStateStore.check_compatible`` ensures offline).
    """
    return t2d.to(argmax_BS.device)[argmax_BS.long()]


class TTTOutput(NamedTuple):
    """Per-step sums of one forward: ``loss_sum_K`` [K] float32 (with grad), ``correct_K`` and ``valid_K`` [K] int64.

    A NamedTuple so DeepSpeed ZeRO-3 sees the output tensors and attaches its backward hooks to them.
    """

    loss_sum_K: torch.Tensor
    correct_K: torch.Tensor
    valid_K: torch.Tensor


class TTTModel(nn.Module):
    """The draft unrolled K steps against the frozen target head.

    ``target_head_d`` [Vd, H_t] is a non-persistent buffer: the target lm_head rows of the draft ids (a function of the
    target and the vocab map; refresh it with ``set_target_head`` after changing the map), kept in the dtype of the
    draft's lm_head weight (converted at the first forward after a cast, see ``_match_head_dtype``).
    ``target_softcap``: the target's final logit soft-cap (``recipe.target.registry.final_logit_softcap``; None:
    none); the teacher logits are ``target_logits(last_hidden, target_head_d, target_softcap)``, the target's own
    output logits on the draft vocabulary. ``loss_fn`` has the signature of ``loss.soft_ce`` (TP swaps in a
    vocab-parallel one).

    Memory switches (plain attributes, changeable after construction; neither changes the numbers beyond float
    summation order):
        loss_chunk_size: None computes each step's logits for all B·S positions at once; an int computes the loss
            ``loss_chunk_size`` flattened positions at a time and recomputes the chunk's draft logits (lm_head)
            in backward (``chunked_loss.chunked_soft_ce``), so one chunk's [c, Vd] logits live instead of
            K·[B·S, Vd]; the teacher rows as ``teacher_logits_once`` says.
        checkpoint_steps: True runs each TTT step's decoder layer under ``torch.utils.checkpoint`` (non-reentrant);
            only the step's inputs and its new K/V are kept, the layer's intermediates (attention scores, MLP
            activations) are recomputed in backward. Under CP the recomputation re-runs the ring's forward
            communication, identically on every rank.
        teacher_logits_once: True (default; ``memory.teacher_logits_once``) computes the target logits of every
            label row once per micro-batch (``teacher_logits``, one [B, U, Vd] no-grad tensor in the head's dtype,
            U ~ S + K distinct rows, kept until the backward) and indexes them per step; with the chunked loss it is
            built ``loss_chunk_size`` rows at a time and every chunk, in every step and in its backward recompute,
            reads its rows from it: the target head runs ⌈B·U / loss_chunk_size⌉ times per micro-batch instead of
            2·K·⌈B·S / loss_chunk_size⌉. The price is that [B, U, Vd] tensor beside the chunked loss's one chunk:
            for an 8B target's Vd = 32000 in bf16, 0.24 GiB at S = 4k, 1.95 GiB at 32k, 7.8 GiB at 128k (per cp
            rank: U ~ S/cp; the planner's chunked, checkpointed 8B step at 128k: 72.9 GiB with it, 65.1 without;
            docs/algorithm.md, "Loss, step weights and accuracy").
            False: the unchunked path recomputes each step's [B, S, Vd] target logits, the chunked loss streams
            them per chunk and step and again in the backward recompute (one chunk's logits alive at a time).
            Both give the same numbers up to float summation order (a BLAS may block a matmul by its row count,
            so the rows of one big matmul and of K smaller ones can differ in the last bits).
        sparse_anchors (keyword, required: its one default is the memory section's "auto",
            ``recipe.config_memory.MemoryOptions``, which ``build_training_model`` hands over; a test names the path
            it measures): True computes each step only at its needed anchors (``recipe.model.sparse_anchors``;
            docs/algorithm.md, "Sparse anchors"): step 0's keys/values at every position, everything else (queries,
            attention output, o_proj, MLP, norms, lm_head, teacher logits) only where some step's loss reads it.
            Same loss sums, counts and gradients as False (the dense path, the reference) up to float rounding.
            "auto" / "auto:KIND": per micro-batch, the sparse path where it pays in memory and in the time measured
            on that kind of device at that length (``recipe.model.sparse_anchors.sparse_pays``), else the dense one.
    ``trace_hints``: the tracing hook, a ``recipe.model.trace_hints.TraceHints`` in the planner's trace, else None.
    Raises ValueError on a loss_chunk_size that is not None or a positive integer, or a sparse_anchors that is not
    one of ``recipe.model.sparse_anchors.SPARSE_ANCHORS_MODES``.
    """

    def __init__(self, draft: Eagle3Draft, target_lm_head_weight: torch.Tensor, loss_fn: Callable = soft_ce,
                 loss_chunk_size: int | None = None, checkpoint_steps: bool = False,
                 target_softcap: float | None = None, *, sparse_anchors: bool | str, teacher_logits_once: bool = True):
        super().__init__()
        self.draft = draft
        self.loss_fn = loss_fn
        self.target_softcap = target_softcap
        if loss_chunk_size is not None and (isinstance(loss_chunk_size, bool) or not isinstance(loss_chunk_size, int)
                                            or loss_chunk_size < 1):
            raise ValueError(f"loss_chunk_size={loss_chunk_size!r} must be None or a positive integer")
        self.loss_chunk_size = loss_chunk_size
        self.checkpoint_steps = bool(checkpoint_steps)
        self.teacher_logits_once = bool(teacher_logits_once)
        self.sparse_anchors = check_sparse_mode(sparse_anchors)
        self.trace_hints = None  # recipe.model.trace_hints.TraceHints during a fake-tensor trace (recipe.plan.trace)
        self.register_buffer("target_head_d", torch.empty(0), persistent=False)
        self.set_target_head(target_lm_head_weight)

    @torch.no_grad()
    def set_target_head(self, target_lm_head_weight: torch.Tensor) -> None:
        """Set ``target_head_d`` [Vd, H_t] from the target lm_head weight.

        Accepts the full weight [V, H_t] (rows of ``draft.draft_token_ids()`` are taken) or the rows already taken
        [Vd, H_t] (used as is; with V == Vd both readings agree, the draft ids being all ids). ValueError otherwise.
        """
        cfg = self.draft.config
        shape = tuple(target_lm_head_weight.shape)
        if shape == (cfg.vocab_size, cfg.target_hidden_size):
            ids = self.draft.draft_token_ids().to(target_lm_head_weight.device)
            head_d = target_lm_head_weight[ids]
        elif shape == (cfg.draft_vocab_size, cfg.target_hidden_size):
            head_d = target_lm_head_weight
        else:
            raise ValueError(f"target lm_head weight shape {shape} is neither (vocab_size={cfg.vocab_size}, "
                             f"target_hidden_size={cfg.target_hidden_size}) nor (draft_vocab_size="
                             f"{cfg.draft_vocab_size}, target_hidden_size={cfg.target_hidden_size})")
        self.target_head_d = head_d.detach().clone().to(self.draft.d2t.device)

    def _match_head_dtype(self) -> None:
        """Keep ``target_head_d`` in the dtype of the draft's lm_head: DeepSpeed's bf16 casts parameters, not buffers,
        so after ``deepspeed.initialize`` the buffer would stay float32 and every teacher-logit matmul would run in
        float32 on bf16 hidden rows. Converted once, in place of the buffer (tensor attributes such as the TP mark
        carried over); the target's own lm_head runs in its bf16 the same way, and the soft CE then works in float32
        (``loss.soft_ce``)."""
        dtype = self.draft.lm_head.weight.dtype
        head = self.target_head_d
        if head.dtype != dtype and head.is_floating_point() and dtype.is_floating_point:
            converted = head.to(dtype)
            converted.__dict__.update(head.__dict__)
            self.target_head_d = converted

    def forward(self, batch: TTTBatch) -> TTTOutput:
        """Unroll the draft ``batch.num_steps`` times; sums per step (the loop normalises by global counts). The
        steps run dense or sparse (``recipe.model.ttt_steps``) as ``sparse_anchors`` decides for this batch."""
        self._match_head_dtype()
        if isinstance(self.sparse_anchors, str) and self.trace_hints is not None:  # the planner's trace: as planned
            sparse = self.trace_hints.anchor_sets is not None
        else:
            sparse = sparse_pays(self.sparse_anchors, batch.valid_KBS)
        losses, corrects = (sparse_steps if sparse else dense_steps)(self, batch)
        valid_K = batch.valid_KBS.sum(dim=(1, 2)).to(torch.int64)
        return TTTOutput(loss_sum_K=torch.stack(losses), correct_K=torch.stack(corrects), valid_K=valid_K)

    def step_function(self) -> Callable:
        """The callable of one TTT step, ``draft.step``'s signature and result: under ``torch.utils.checkpoint``
        (``recipe.model.step_checkpoint.checkpointed_step``) when ``checkpoint_steps`` is on and grad is enabled,
        else ``draft.step`` itself."""
        if self.checkpoint_steps and torch.is_grad_enabled():
            return functools.partial(checkpointed_step, self.draft)
        return self.draft.step


STEP_DECAY = 0.8  # EAGLE-3's weight of TTT step k is STEP_DECAY ** k


def step_weights(num_steps: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[K] the per-step loss weights ``STEP_DECAY ** k`` (k = 0 .. K-1)."""
    return STEP_DECAY ** torch.arange(num_steps, dtype=dtype, device=device)


def ttt_objective(out: TTTOutput, n_valid_K) -> torch.Tensor:
    """``Σ_k STEP_DECAY^k · loss_sum_k / max(N_k, 1)`` (docs/algorithm.md, "Training-time test"), N_k the global
    valid count of step k; a 0-d tensor in the loss sums' dtype."""
    n_valid_K = torch.as_tensor(n_valid_K, device=out.loss_sum_K.device).to(out.loss_sum_K.dtype)
    weights_K = step_weights(out.loss_sum_K.shape[0], out.loss_sum_K.dtype, out.loss_sum_K.device)
    return (weights_K * out.loss_sum_K / n_valid_K.clamp(min=1)).sum()
