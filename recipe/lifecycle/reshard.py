"""Layout-free training state: what lets a checkpoint resume on another world size, dp, tp, cp, ZeRO stage or dtype.

DeepSpeed's own checkpoint files are cut by the layout that wrote them (one optimizer shard per ZeRO partition of
each tp rank's parameters). Every checkpoint therefore also holds :data:`TRAIN_STATE_FILE`, the training state in
the layout of one process: for every trainable draft parameter, under its module name (``draft.lm_head.weight``),

- ``master/<name>``: the fp32 master weight,
- ``exp_avg/<name>``, ``exp_avg_sq/<name>``: Adam's first and second moments,

each full: ZeRO-gathered by DeepSpeed's per-parameter API (``deepspeed.utils.safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``, which serve ZeRO stages 1-3 and the BF16 optimizer alike; without a ZeRO wrapper
the optimizer holds the module parameter itself) and TP-concatenated along each shard's ``partition_dim`` (this
project's slicing, ``recipe.parallel.tp_layers``). Its metadata (``train_state``, JSON) holds Adam's step, the
optimizer's learning rates, the LR scheduler's ``state_dict`` and DeepSpeed's step counters.

Resuming on another layout (``recipe.lifecycle.resume_checks.describe_change`` says which) runs in two phases:

1. before ``parallelize`` and ``deepspeed.initialize``: :func:`load_master_weights` writes the master weights into
   the single-device model, so the layout (TP shards, then ZeRO partitions) is cut from them exactly as a fresh run
   is cut from its initial weights;
2. after ``deepspeed.initialize``: :func:`restore` creates Adam's state (torch's ``Adam``/``AdamW`` format: it is
   created lazily at the first step otherwise) with the saved step, sets the fp32 masters and both moments through
   ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (each rank passes its TP slice; DeepSpeed keeps
   its ZeRO-1/2 fragment) or, at ZeRO-3, ``safe_set_local_*`` with this rank's padded partition, and restores
   learning rates, scheduler and counters. The masters are set again in phase 2
   because under bf16 DeepSpeed builds them from the bf16-cast module weights.

Why not DeepSpeed's Universal Checkpointing: it needs an offline ``ds_to_universal`` conversion per checkpoint and
``universal_checkpoint_info`` patterns for the TP slicing, and in 0.19.8 a universal checkpoint does not load into
another ZeRO stage; the per-parameter API works at every stage, inside the run. The state is Adam's
(:data:`ADAM_CLASSES`); with another optimizer no file is written and checkpoints resume on their own layout only.

The data position carries over through the step (same global batch: ``recipe.train.sampler``); the sampler and the
held-out split draw from their own seeded generators, so no rank's global RNG stream decides anything in training;
on another layout every rank restores rank 0's CPU RNG states (python, numpy, torch) and no device RNG state.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from recipe.parallel.tp_layers import gather_tensor, shard_tensor

TRAIN_STATE_FILE = "train_state.safetensors"
FORMAT, VERSION = "recipe-train-state", 1
MASTER = "master"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state keys (torch.optim.Adam / AdamW, DeepSpeed's FusedAdam / CPU Adam)
# the optimizers whose per-tensor state is {step, exp_avg, exp_avg_sq}: torch's keep the step as a tensor, DeepSpeed's
# (what "type": "Adam"/"AdamW" builds without torch_adam, and ZeRO-Offload's) as an int
ADAM_CLASSES = {"Adam": "tensor", "AdamW": "tensor", "FusedAdam": "int", "DeepSpeedCPUAdam": "int"}


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer doing the update: the one DeepSpeed's ZeRO/BF16 wrapper holds, or the engine's own."""
    inner = getattr(engine.optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else engine.optimizer


def unsupported(engine) -> str | None:
    """None when the engine's optimizer is one of :data:`ADAM_CLASSES` (without amsgrad), else why the layout-free
    training state cannot hold its state."""
    optimizer, wrapper = base_optimizer(engine), engine.optimizer
    name = type(optimizer).__name__
    if name not in ADAM_CLASSES or any(g.get("amsgrad") for g in optimizer.param_groups):
        return (f"the optimizer is {name}{' with amsgrad' if name in ADAM_CLASSES else ''}; the layout-free training "
                f"state holds Adam's step, exp_avg and exp_avg_sq ({', '.join(ADAM_CLASSES)} without amsgrad)")
    # ZeRO-3 keeps Adam's state out of the optimizer's reach in these modes: on NVMe (swapped in per sub-group at
    # the step) and with a partial CPU offload (the sub-groups left on the GPU step with a second optimizer)
    if getattr(wrapper, "swap_optimizer", False):
        return "ZeRO-3 keeps the optimizer state on NVMe (offload_optimizer.device nvme)"
    if getattr(wrapper, "offload_optimizer", False) and getattr(wrapper, "partial_offload", 1.0) != 1.0:
        return "ZeRO-3 offloads only part of the optimizer (offload_optimizer.ratio < 1)"
    return None


def _trainable(engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def _own_tensor(engine, param, key: str | None) -> torch.Tensor | None:
    """The fp32 master of ``param`` (``key`` None) or its Adam state ``key``, as a tensor shaped like ``param``,
    where DeepSpeed's per-parameter API does not serve it; None under ZeRO-1/2/3 and the BF16 optimizer (``ds_id`` /
    ``_hp_mapping``: use the API). Without ZeRO, bf16 runs under DeepSpeed's fp16/bf16 wrapper, which pairs each
    module parameter of ``fp16_groups[i]`` with an fp32 copy: its own tensor in ``fp32_groups[i]`` (the unfused
    wrapper, with torch's Adam) or a slice of the flat ``fp32_groups_flat[i]``, in order (the fused one, with
    DeepSpeed's FusedAdam); without a wrapper the module parameter is its own master."""
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):
        return None
    wrapper, state = engine.optimizer, base_optimizer(engine).state
    for i, low in enumerate(getattr(wrapper, "fp16_groups", None) or []):
        for j, lp in enumerate(low):
            if lp is not param:
                continue
            if getattr(wrapper, "fp32_groups", None):
                high = wrapper.fp32_groups[i][j]
                return high if key is None else state[high][key]
            flat = wrapper.fp32_groups_flat[i]
            flat = flat if key is None else state[flat][key]
            offset = sum(p.numel() for p in low[:j])
            return flat.narrow(0, offset, param.numel()).view_as(param)
    return param if key is None else state[param][key]


def _zero3_partition(param, full: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``full`` (``param``'s whole value): the flattened value, zero-padded to the
    partition size times the partition group's size, cut at this rank's share. DeepSpeed's own
    ``safe_set_full_*`` cut without the padding and fail on the last ranks when the group size does not divide the
    parameter's size."""
    size = param.ds_tensor.numel()
    start = size * dist.get_rank(group=param.ds_process_group)
    flat = full.flatten()
    local = flat.new_zeros(size)
    take = max(0, min(size, flat.numel() - start))
    local[:take] = flat[start:start + take]
    return local


def _full(engine, param, key: str | None, tp_group) -> torch.Tensor:
    """Collective (ZeRO and tp groups): the full fp32 value of ``param``'s master (``key`` None) or Adam state, on
    the parameter's device."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # import cost: deepspeed

    value = _own_tensor(engine, param, key)
    if value is None:
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    value = value.detach().float()
    if getattr(param, "tensor_model_parallel", False):
        value = gather_tensor(value, param.partition_dim, tp_group)
    return value


def _adam_step(optimizer) -> int:
    steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's parameters are at different Adam steps ({sorted(steps)}); the layout-free "
                         "training state needs one")
    return int(steps.pop()) if steps else 0


def gather(engine, tp_group) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Collective over the world (call it on every rank): (tensors, metadata) of :data:`TRAIN_STATE_FILE` for the
    engine's current state, or None when the optimizer is not Adam (:func:`unsupported`; the checkpoint then
    resumes only on its own layout). Global rank 0 gets the tensors on the CPU (three fp32 copies of the trainable
    draft: 12 bytes a parameter of host memory while the checkpoint is written); the other ranks get no tensors, and
    hold at most one full parameter on the device at a time. Raises ValueError when the optimizer's tensors disagree
    on Adam's step."""
    if unsupported(engine) is not None:
        return None
    optimizer = base_optimizer(engine)
    _create_adam_state(engine, 0, missing_only=True)  # no step taken yet: what Adam would start from
    _link_state(engine)
    keep = dist.get_rank() == 0
    tensors = {}
    for name, param in _trainable(engine):
        for key in (None, *MOMENTS):
            value = _full(engine, param, key, tp_group)
            if keep:
                tensors[f"{key or MASTER}/{name}"] = value.cpu()
    scheduler = engine.lr_scheduler
    meta = {"format": FORMAT, "version": VERSION, "adam_step": _adam_step(optimizer),
            "lr": [float(g["lr"]) for g in optimizer.param_groups],
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "global_steps": int(engine.global_steps), "skipped_steps": int(engine.skipped_steps)}
    json.dumps(meta)  # a scheduler whose state is not JSON fails here, at the first save, not at resume
    return tensors, meta


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write :data:`TRAIN_STATE_FILE` at ``path`` (safetensors; ``meta`` as JSON under the key ``train_state``)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"train_state": json.dumps(meta)})


def read(folder: Path, select=None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of the checkpoint folder's :data:`TRAIN_STATE_FILE`; ``select`` (a predicate on the
    tensor names) reads only those tensors. Raises FileNotFoundError when the checkpoint has none (written before
    layout-free state existed), ValueError naming the file when it is not one."""
    file = Path(folder) / TRAIN_STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["train_state"])
            tensors = {k: f.get_tensor(k) for k in f.keys() if select is None or select(k)}
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"--resume: {file} is not a training-state file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"--resume: {file}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {FORMAT!r} version {VERSION}")
    return tensors, meta


def load_master_weights(model: torch.nn.Module, folder: Path) -> None:
    """Phase 1: copy every ``master/<name>`` of the checkpoint ``folder``'s :data:`TRAIN_STATE_FILE` into the
    parameter ``name`` of the single-device ``model`` (before any layer is sharded). Raises what :func:`read` raises,
    and ValueError naming the file and the parameter when a name is not one of the model's parameters or its shape
    differs."""
    file = Path(folder) / TRAIN_STATE_FILE
    tensors, _ = read(folder, select=lambda key: key.startswith(MASTER + "/"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in tensors.items():
            name = key[len(MASTER) + 1:]
            if name not in params or params[name].shape != value.shape:
                have = tuple(params[name].shape) if name in params else "no such parameter"
                raise ValueError(f"--resume: {file}: {name} {tuple(value.shape)} does not fit the draft ({have})")
            params[name].copy_(value)


def _stepped_tensors(engine) -> list[tuple[torch.Tensor, dict]]:
    """(tensor Adam updates, its param group) for every tensor of the base optimizer: ZeRO-3 hands its fp32
    partitions (``fp32_partitioned_groups_flat``) to the optimizer one sub-group at a time, at the step; the other
    wrappers, and no wrapper, list them in the optimizer's param groups."""
    optimizer, wrapper = base_optimizer(engine), engine.optimizer
    flats = getattr(wrapper, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        to_group = getattr(wrapper, "sub_group_to_group_id", {})
        return [(flat, optimizer.param_groups[to_group.get(i, 0)]) for i, flat in enumerate(flats)]
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


def _create_adam_state(engine, step: int, missing_only: bool = False) -> None:
    """Adam's per-tensor state as ``torch.optim.Adam`` creates it at the first step (zero moments), at ``step``
    (``missing_only``: only for tensors without state)."""
    optimizer = base_optimizer(engine)
    for p, group in _stepped_tensors(engine):
        state = optimizer.state[p]
        if missing_only and state:
            continue
        if ADAM_CLASSES[type(optimizer).__name__] == "int":
            state["step"] = int(step)
        else:
            on_device = group.get("capturable") or group.get("fused")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else None)
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(p, memory_format=torch.preserve_format))


def _link_state(engine) -> None:
    """ZeRO-1/2 and the BF16 optimizer: point each parameter's fragment at Adam's state (what DeepSpeed does after
    its first step; a no-op once done)."""
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def restore(engine, tp_group, folder: Path) -> None:
    """Phase 2 (after ``deepspeed.initialize``, module docstring): Adam's state, the fp32 masters, learning rates,
    scheduler and counters from the checkpoint ``folder``'s :data:`TRAIN_STATE_FILE`, read one parameter at a time.
    Call it on every rank; each sets its own slices. Raises what :func:`read` raises, and ValueError naming the file
    when a trainable parameter has no entry or the optimizer is not Adam (:func:`unsupported`)."""
    # import cost: deepspeed
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    file = Path(folder) / TRAIN_STATE_FILE
    _, meta = read(folder, select=lambda key: False)
    optimizer = base_optimizer(engine)
    if unsupported(engine) is not None:
        raise ValueError(f"--resume: cannot reshard {file} into this run: {unsupported(engine)}")
    _create_adam_state(engine, int(meta["adam_step"]))
    _link_state(engine)
    for name, param in _trainable(engine):
        entries = {f"{key or MASTER}/{name}" for key in (None, *MOMENTS)}
        tensors, _ = read(folder, select=entries.__contains__)
        for key in (None, *MOMENTS):
            entry = f"{key or MASTER}/{name}"
            if entry not in tensors:
                raise ValueError(f"--resume: {file} has no {entry} (the checkpoint trained other parameters: "
                                 "--freeze-lm-head differs?)")
            full = tensors[entry]
            local = shard_tensor(full, param.partition_dim, tp_group) if getattr(
                param, "tensor_model_parallel", False) else full
            local = local.to(param.device)
            own = _own_tensor(engine, param, key)
            if own is not None:
                with torch.no_grad():
                    own.copy_(local)
            elif hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition
                part = _zero3_partition(param, local)
                (safe_set_local_fp32_param(param, part) if key is None
                 else safe_set_local_optimizer_state(param, part, key))
            else:
                (safe_set_full_fp32_param(param, local) if key is None
                 else safe_set_full_optimizer_state(param, local, key))
    if engine.lr_scheduler is not None and meta.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    if len(meta["lr"]) == len(optimizer.param_groups):
        for group, lr in zip(optimizer.param_groups, meta["lr"]):
            group["lr"] = lr
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_steps"] * engine.train_batch_size()
    engine.skipped_steps = meta["skipped_steps"]
