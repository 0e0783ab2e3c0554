"""Apply tensor parallelism to a single-device TTT model from the outside (the way back to full tensors is
``recipe.parallel.parallelize.gather_full_tensors``).

Module names relied on (recipe.model.ttt / recipe.model.draft): ``draft.midlayer.self_attn.{q,k,v,o}_proj``,
``draft.midlayer.mlp.{gate,up,down}_proj``, ``draft.lm_head``, the frozen buffer ``target_head_d`` [Vd, H_t] and the
attribute ``loss_fn`` (``soft_ce(logits_BSV, target_logits_BSV, valid_BS) -> (loss_sum, correct)``) on the TTT
wrapper. Head counts come from ``draft.config`` (``num_attention_heads``, ``num_key_value_heads``) when present,
otherwise from ``self_attn.num_heads`` / ``self_attn.num_key_value_heads``.
"""
from __future__ import annotations

import functools

from torch import nn

from recipe.parallel.dims import check_tp_divides
from recipe.parallel.mappings import group_size
from recipe.parallel.tp_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead, mark_tp,
                                       shard_tensor, vocab_parallel_soft_ce)

COLUMN = ("midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
          "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj")
ROW = ("midlayer.self_attn.o_proj", "midlayer.mlp.down_proj")
LM_HEAD = "lm_head"
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads")


def _head_counts(draft: nn.Module) -> tuple[int, int]:
    config = getattr(draft, "config", None)
    attn = draft.get_submodule("midlayer.self_attn")
    for source in (config, attn):
        heads = getattr(source, "num_attention_heads", None) or getattr(source, "num_heads", None)
        kv_heads = getattr(source, "num_key_value_heads", None)
        if heads and kv_heads:
            return int(heads), int(kv_heads)
    raise ValueError("cannot find the draft's head counts: expected draft.config.num_attention_heads and "
                     "num_key_value_heads (or self_attn.num_heads and num_key_value_heads)")


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def apply_tensor_parallel(ttt_model: nn.Module, group) -> nn.Module:
    """Shard ``ttt_model`` in place over the tensor-parallel ``group`` and return it.

    q/k/v and gate/up become :class:`ColumnParallelLinear` (heads, KV heads and intermediate split), o_proj and
    down :class:`RowParallelLinear`, lm_head :class:`VocabParallelLMHead`; the buffer ``target_head_d`` is split
    along Vd like lm_head (and marked ``tensor_model_parallel``); ``loss_fn`` becomes
    :func:`vocab_parallel_soft_ce` bound to ``group``. Integer head-count attributes on ``self_attn``
    (``num_heads``, ``num_attention_heads``, ``num_key_value_heads``) are divided by tp. The weights present before
    the call must be the full single-device weights (identical on every rank). A group of size 1 leaves the model
    unchanged. Raises ValueError when tp does not divide the heads, KV heads, intermediate size or draft vocab.
    """
    tp = group_size(group)
    if tp == 1:
        return ttt_model
    draft = ttt_model.draft
    heads, kv_heads = _head_counts(draft)
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": draft.get_submodule("midlayer.mlp.gate_proj").out_features,
             "draft_vocab_size": draft.get_submodule(LM_HEAD).out_features}
    check_tp_divides(tp, sizes)
    for name in COLUMN:
        _replace(draft, name, ColumnParallelLinear.from_linear(draft.get_submodule(name), group))
    for name in ROW:
        _replace(draft, name, RowParallelLinear.from_linear(draft.get_submodule(name), group))
    _replace(draft, LM_HEAD, VocabParallelLMHead.from_linear(draft.get_submodule(LM_HEAD), group))
    attn = draft.get_submodule("midlayer.self_attn")
    for attr in _HEAD_ATTRS:
        if isinstance(getattr(attn, attr, None), int):
            setattr(attn, attr, getattr(attn, attr) // tp)
    head_d = getattr(ttt_model, "target_head_d", None)
    if head_d is not None:
        ttt_model.target_head_d = mark_tp(shard_tensor(head_d, 0, group), 0)  # re-registers the buffer
    ttt_model.loss_fn = functools.partial(vocab_parallel_soft_ce, group=group)
    return ttt_model
