"""One way into parallelism and one way out, for every caller (the run set-up, the benchmarks, the tests).

In: :func:`parallelize` takes a single-device ``TTTModel`` holding the full weights (the same on every rank for the
same seed) and applies the layout from outside: the tensor-parallel plan (``recipe.parallel.apply_tp``) and the
causal-block attention (the ring under context parallelism, else the single-device block, each with the kernel
the ``kernels`` section's ``attention`` names), tiled as the ``memory`` section of the run config says, and the
draft's small ops, compiled or eager as its ``compile_small_ops`` says (``recipe.model.small_ops``).

The training model itself is built in one place, :func:`build_training_model` (``TTTModel`` with the memory
switches, then :func:`parallelize`), for the run, the step benchmark and the planner alike.

Out: :func:`gather_full_state` turns whatever the layout holds (ZeRO-3 partitions, TP shards) back into the full
draft tensors that checkpoints and the export write; :func:`gather_full_tensors` is the same for any module.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.attention_backends import make_causal_attention
from kernels.compile_policy import compile_on
from kernels.registry import DEFAULT_SEQUENCE_PARALLEL
from recipe.model.draft import Eagle3Draft, is_exported
from recipe.model.small_ops import EAGER_SMALL_OPS, install_small_ops, process_small_ops
from recipe.model.ttt import TTTModel
from recipe.parallel.apply_tp import apply_tensor_parallel, mlp_tiling
from recipe.parallel.tp_layers import gather_tensor


def parallelize(model: nn.Module, pstate, memory, device=None, kernel_options=None) -> nn.Module:
    """Apply the layout of ``pstate`` to the single-device TTT ``model`` in place and return it.

    ``pstate``: a ``recipe.parallel.topology.ParallelState`` (None: one process, tp = cp = 1). TP (tp > 1): q/k/v,
    gate/up column-parallel, o/down row-parallel, lm_head and the target head vocab-parallel
    (``apply_tensor_parallel``). Attention: ``draft.midlayer.self_attn.causal_attention`` (the function the draft's
    attention calls for the causal block, ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)``) becomes
    ``kernels.attention_backends.make_causal_attention(kernel_options.attention, memory.attention_tile_size,
    device, cp_group, kernel_options.sequence_parallel)``: the sequence-split strategy (the ring) over the cp group
    under context parallelism, else the single-device block.
    MLP: with ``memory.mlp_tile_size`` set, ``draft.midlayer.mlp_tiling`` becomes ``apply_tp.mlp_tiling(size,
    tp_group)``: ``post_attention_layernorm`` + MLP in sequence tiles of that many positions, recomputed in backward
    (``recipe.model.tiled_mlp``), the TP all-reduce kept out of the tiles; None leaves the layer untiled.
    Small ops: with ``kernel_options.compile_small_ops`` on for ``device`` (``kernels.compile_policy.compile_on``:
    "auto" is on for CUDA) the draft's norms, RoPE, SwiGLU, TTT merge and (tp = 1) soft CE are the process's
    compiled ones (``recipe.model.small_ops.process_small_ops``), else the eager ones (``install_small_ops``).
    ``memory``: the run's ``recipe.config_memory.MemoryOptions`` (read: ``attention_tile_size`` and
    ``mlp_tile_size``, None when the object lacks it); ``kernel_options``: its
    ``recipe.config.KernelOptions`` (read: ``attention``, ``sequence_parallel``, ``compile_small_ops``; None:
    "auto", resolved for ``device``, and ``kernels.registry.DEFAULT_SEQUENCE_PARALLEL``); ``device`` (where
    the model will run) defaults to ``pstate.device``, else the CPU. Raises ValueError when tp does not divide a
    split draft dimension (every one named), the tile size is invalid, or the kernel is unknown or cannot run on
    ``device``.
    """
    if device is None:
        device = getattr(pstate, "device", None) or "cpu"
    tp_group = pstate.tp_group if pstate is not None and pstate.tp_size > 1 else None
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group)
    tile = getattr(memory, "mlp_tile_size", None)
    model.draft.get_submodule("midlayer").mlp_tiling = None if tile is None else mlp_tiling(tile, tp_group)
    cp_group = pstate.cp_group if pstate is not None and pstate.dims.cp_enabled else None
    model.draft.get_submodule("midlayer.self_attn").causal_attention = make_causal_attention(
        getattr(kernel_options, "attention", "auto"), memory.attention_tile_size, device, cp_group,
        getattr(kernel_options, "sequence_parallel", DEFAULT_SEQUENCE_PARALLEL))
    compiled = compile_on(getattr(kernel_options, "compile_small_ops", "auto"), device)
    return install_small_ops(model, process_small_ops() if compiled else EAGER_SMALL_OPS)


def build_training_model(draft: Eagle3Draft, target_head: torch.Tensor, memory, kernel_options, pstate=None,
                         device=None, *, target_softcap: float | None = None,
                         before_split: Callable[[TTTModel], None] | None = None) -> TTTModel:
    """The training model of a run: ``TTTModel`` around ``draft`` with every memory switch of ``memory``, then
    :func:`parallelize` over ``pstate``. The one place the run set-up (``recipe.train.setup``), the step benchmark
    (``recipe.bench.measure``) and the planner's trace (``recipe.plan.trace``) build it, so a new memory switch is
    read here (and in ``parallelize``) only.

    Args:
        draft: the single-device ``Eagle3Draft`` with its full weights (seeded, embeddings and vocabulary map set).
        target_head: the target lm_head [V, H_t] or its draft rows [Vd, H_t] (``TTTModel.set_target_head``).
        memory: ``recipe.config_memory.MemoryOptions`` (read: ``loss_chunk_size``, ``checkpoint_ttt_steps``,
            ``sparse_anchors``, ``teacher_logits_once``, and what ``parallelize`` reads); kernel_options:
            ``recipe.config.KernelOptions`` (None: its defaults).
        pstate, device: as :func:`parallelize`.
        target_softcap: the target's final logit soft-cap (``recipe.target.registry.final_logit_softcap``).
        before_split: called with the single-device model before the layout is applied (weights loaded into it
            are cut by TP and ZeRO as a fresh run's initial weights are: ``--init-draft``, a resharded resume).
    Raises ValueError as ``TTTModel`` (a bad loss chunk) and :func:`parallelize` do, and for a switch still
    ``"auto"`` (``recipe.config_memory.MemoryOptions.resolve`` decides them first; ``sparse_anchors`` "auto" is
    decided per micro-batch by the model).
    """
    auto = getattr(memory, "auto_switches", ())
    if auto:
        raise ValueError(f"memory switches {list(auto)} are still \"auto\": resolve them first (MemoryOptions.resolve)")
    model = TTTModel(draft, target_head, loss_chunk_size=memory.loss_chunk_size,
                     checkpoint_steps=memory.checkpoint_ttt_steps, target_softcap=target_softcap,
                     sparse_anchors=memory.sparse_anchors, teacher_logits_once=memory.teacher_logits_once)
    if before_split is not None:
        before_split(model)
    return parallelize(model, pstate, memory, device, kernel_options)


def gather_full_tensors(module: nn.Module, tp_group=None, keep=None) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of ``module``'s state-dict tensors, on CPU, keyed like ``module.state_dict()``.

    Each tensor is gathered from its ZeRO-3 partitions (``deepspeed.zero.GatheredParameters``; a no-op for tensors
    ZeRO does not partition), and one marked ``tensor_model_parallel`` is then all-gathered over ``tp_group`` along its
    ``partition_dim``. ``keep(name) -> bool`` selects tensors (default: all); unselected ones are never gathered.
    Collective: every rank of the ZeRO and tp groups calls it with the same module structure.
    """
    import deepspeed  # import cost: deepspeed

    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if keep is not None and not keep(name):
            continue
        if isinstance(tensor, nn.Parameter):
            with deepspeed.zero.GatheredParameters([tensor]):
                local = tensor.detach().clone()
        else:
            local = tensor.detach().clone()
        if getattr(tensor, "tensor_model_parallel", False):
            local = gather_tensor(local, tensor.partition_dim, tp_group)
        out[name] = local.cpu()
    return out


def gather_full_state(engine, pstate=None) -> dict[str, torch.Tensor]:
    """The full draft tensors that checkpoints and the export write: every exported parameter and the ``d2t`` /
    ``t2d`` buffers, ZeRO-gathered and TP-concatenated, on CPU; the frozen embedding is left out
    (``recipe.model.draft.is_exported``). ``engine``: a DeepSpeed engine, a ``TTTModel`` or a draft;
    ``pstate`` None means tp = 1. Collective over all ranks."""
    module = getattr(engine, "module", engine)
    draft = getattr(module, "draft", module)
    return gather_full_tensors(draft, None if pstate is None else pstate.tp_group, keep=is_exported)
