"""Apply tensor parallelism to a single-device TTT model from the outside (the way back to full tensors is
``recipe.parallel.parallelize.gather_full_tensors``).

The plan names these modules of ``recipe.model.draft.Eagle3Draft`` (``ttt_model.draft``):
``midlayer.self_attn.{q,k,v,o}_proj``, ``midlayer.mlp.{gate,up,down}_proj`` and ``lm_head``; and of the TTT
wrapper (``recipe.model.ttt.TTTModel``) the frozen buffer ``target_head_d`` [Vd, H_t] and the attribute ``loss_fn``
(``soft_ce(logits_BSV, target_logits_BSV, valid_BS) -> (loss_sum, correct)``). Head counts come from
``draft.config`` (the attention reshapes with ``-1`` heads, so no attribute of it changes with tp).
"""
from __future__ import annotations

import functools

from torch import nn

from recipe.model.tiled_mlp import MLPTiling
from recipe.parallel.dims import check_tp_divides
from recipe.parallel.mappings import copy_to_tp_region, group_size, reduce_from_tp_region
from recipe.parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelLMHead,
    mark_tp,
    shard_tensor,
    vocab_parallel_soft_ce,
)

COLUMN = ("midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
          "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj")
ROW = ("midlayer.self_attn.o_proj", "midlayer.mlp.down_proj")
LM_HEAD = "lm_head"


def _check_plan(ttt_model: nn.Module) -> None:
    """ValueError naming every module or attribute of the TP plan that ``ttt_model`` lacks."""
    draft = getattr(ttt_model, "draft", None)
    names = (*COLUMN, *ROW, LM_HEAD)
    missing = ["draft"] if draft is None else [n for n in names if not isinstance(_find(draft, n), nn.Linear)]
    missing += [f"draft.config.{a}" for a in ("num_attention_heads", "num_key_value_heads")
                if draft is not None and not isinstance(getattr(getattr(draft, "config", None), a, None), int)]
    missing += [a for a in ("target_head_d", "loss_fn") if not hasattr(ttt_model, a)]
    if missing:
        raise ValueError(f"the tensor-parallel plan needs {', '.join(missing)}, which {type(ttt_model).__name__} "
                         "lacks (nn.Linear modules of an Eagle3Draft inside a TTTModel)")


def _find(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def apply_tensor_parallel(ttt_model: nn.Module, group) -> nn.Module:
    """Shard ``ttt_model`` in place over the tensor-parallel ``group`` and return it.

    q/k/v and gate/up become :class:`ColumnParallelLinear` (heads, KV heads and intermediate split), o_proj and
    down :class:`RowParallelLinear`, lm_head :class:`VocabParallelLMHead`; the buffer ``target_head_d`` is split
    along Vd like lm_head (and marked ``tensor_model_parallel``); ``loss_fn`` becomes
    :func:`vocab_parallel_soft_ce` bound to ``group``. The weights present before the call must be the full
    single-device weights (identical on every rank). A group of size 1 leaves the model unchanged. Raises
    ValueError when the model lacks a module or attribute of the plan (all named), or tp does not divide the heads,
    KV heads, intermediate size or draft vocab.
    """
    tp = group_size(group)
    if tp == 1:
        return ttt_model
    _check_plan(ttt_model)
    draft = ttt_model.draft
    heads, kv_heads = draft.config.num_attention_heads, draft.config.num_key_value_heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": draft.get_submodule("midlayer.mlp.gate_proj").out_features,
             "draft_vocab_size": draft.get_submodule(LM_HEAD).out_features}
    check_tp_divides(tp, sizes)
    for name in COLUMN:
        _replace(draft, name, ColumnParallelLinear.from_linear(draft.get_submodule(name), group))
    for name in ROW:
        _replace(draft, name, RowParallelLinear.from_linear(draft.get_submodule(name), group))
    _replace(draft, LM_HEAD, VocabParallelLMHead.from_linear(draft.get_submodule(LM_HEAD), group))
    ttt_model.target_head_d = mark_tp(shard_tensor(ttt_model.target_head_d, 0, group), 0)  # re-registers the buffer
    ttt_model.loss_fn = functools.partial(vocab_parallel_soft_ce, group=group)
    return ttt_model


def _local_tp_mlp(mlp: nn.Module, x_BTH):
    """This rank's partial SwiGLU output of one tile, [B, T, H], with no forward communication: the replicated input
    enters the TP region once for gate and up (backward: one all-reduce of dx, so the norm before it gets the full
    gradient), and ``down_proj`` skips its all-reduce (``MLPTiling.reduce`` sums the whole sequence once)."""
    x_BTH = copy_to_tp_region(x_BTH, mlp.gate_proj.group)
    gate_BTI, up_BTI = mlp.gate_proj(x_BTH, enter_region=False), mlp.up_proj(x_BTH, enter_region=False)
    inner = mlp.ops.act_mul(gate_BTI, up_BTI, mlp.act_fn)
    return mlp.down_proj(inner, reduce=False)


def mlp_tiling(tile_size: int, group=None) -> MLPTiling:
    """The ``MLPTiling`` of ``memory.mlp_tile_size`` = ``tile_size`` for the tensor-parallel ``group`` (None or
    size 1: the single-device tiling). Under tp > 1 (``apply_tensor_parallel`` done: gate/up column-, down
    row-parallel; the MLP is ``Eagle3MLP``'s SwiGLU ``down(act(gate(x)) * up(x))``): tiles compute local partial sums
    (``_local_tp_mlp``) and one ``reduce_from_tp_region`` over the concatenated [B, S, H] output all-reduces them in
    forward, outside the recomputed tiles. Per layer call: forward one all-reduce of [B, S, H] (as untiled);
    backward one all-reduce of [B, T, H] per tile (untiled: two of [B, S, H], gate's and up's). ValueError for a bad
    tile size."""
    if group is None or group_size(group) == 1:
        return MLPTiling(tile_size)
    return MLPTiling(tile_size, local_mlp=_local_tp_mlp, reduce=functools.partial(reduce_from_tp_region, group=group))
