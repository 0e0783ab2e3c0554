"""Soft cross-entropy of the draft against the target's distribution over the draft vocabulary
(docs/algorithm.md, "Loss, step weights and accuracy")."""
from __future__ import annotations

import torch


def soft_ce(logits_BSV: torch.Tensor, target_logits_BSV: torch.Tensor,
            valid_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy and argmax-match count over the valid positions.

    ``loss_sum = Σ_{valid (b,s)} −Σ_v softmax(target)_v · log_softmax(logits)_v`` and
    ``correct = #{valid (b,s) : argmax logits == argmax target}``, computed in float32 (float64 stays float64).

    Args:
        logits_BSV: [B, S, Vd] draft logits.  target_logits_BSV: [B, S, Vd] target logits restricted to the draft
        vocabulary (not probabilities; renormalised here by the softmax).  valid_BS: [B, S] bool.
    Returns:
        (loss_sum: 0-d float tensor with grad, correct: 0-d int64 tensor). Sums, not means: the training loop
        divides by the global valid count. Invalid positions contribute neither value nor gradient.
    Raises ValueError on mismatched shapes.
    """
    check_soft_ce_shapes(logits_BSV, target_logits_BSV, valid_BS)
    return soft_ce_sums(logits_BSV, target_logits_BSV, valid_BS)


def check_soft_ce_shapes(logits_BSV: torch.Tensor, target_logits_BSV: torch.Tensor, valid_BS: torch.Tensor) -> None:
    """ValueError naming the three shapes unless logits and target logits are both [B, S, Vd] and valid is [B, S]."""
    if logits_BSV.shape != target_logits_BSV.shape or logits_BSV.shape[:-1] != valid_BS.shape:
        raise ValueError(f"soft_ce shapes disagree: logits {tuple(logits_BSV.shape)}, target "
                         f"{tuple(target_logits_BSV.shape)}, valid {tuple(valid_BS.shape)}")


def soft_ce_sums(logits_BSV: torch.Tensor, target_logits_BSV: torch.Tensor,
                 valid_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`soft_ce` without its shape check: the arithmetic alone, the function ``recipe.model.small_ops``
    compiles (shapes as :func:`soft_ce`'s, assumed to agree)."""
    acc = torch.promote_types(logits_BSV.dtype, torch.float32)
    log_q = torch.log_softmax(logits_BSV.to(acc), dim=-1)
    p = torch.softmax(target_logits_BSV.detach().to(acc), dim=-1)
    loss_BS = -(p * log_q).sum(dim=-1)
    valid_BS = valid_BS.bool()
    loss_sum = torch.where(valid_BS, loss_BS, torch.zeros_like(loss_BS)).sum()
    match_BS = logits_BSV.detach().argmax(dim=-1) == target_logits_BSV.argmax(dim=-1)
    correct = (match_BS & valid_BS).sum()
    return loss_sum, correct


def target_logits(hidden_NH: torch.Tensor, head_VH: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """The target's output logits over the rows of ``head_VH``: ``z = hidden @ head.T``, then ``c · tanh(z / c)``
    with a soft-cap ``c`` (as transformers' Gemma-2 ``Gemma2ForCausalLM.forward`` applies it).

    hidden_NH: [..., H_t] final-norm hidden states (``TargetCapture.last_hidden_BSH`` or rows of it), cast to the
    head's dtype. head_VH: [V', H_t] lm_head rows: all V rows, the draft vocabulary's Vd, or a TP shard of those (the
    soft-cap is elementwise). Returns [..., V'] in the head's dtype: ``ForCausalLM(...).logits[..., rows]`` (bit for
    bit with the model's whole lm_head weight in its dtype; with a subset of rows up to float summation order).
    """
    logits = torch.nn.functional.linear(hidden_NH.to(head_VH.dtype), head_VH)
    return torch.tanh(logits / softcap) * softcap if softcap else logits
