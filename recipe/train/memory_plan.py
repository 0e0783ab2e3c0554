"""The run's ``memory`` switches resolved once at start, before the model is built (``build_run``): one call of
``recipe.config_memory.MemoryOptions.resolve`` for the longest training sample and this device's free memory, with
the planner's facts (``recipe.plan.PlanFacts``: the trace's per-rank total and the FLOP model's cost of each
candidate). The resolved section then reaches ``build_training_model``, the online target, the run plan and
``run_config.json`` (with its report, ``"memory_auto"``).

Budget (:func:`device_budget`): on CUDA ``torch.cuda.mem_get_info``'s free bytes, plus what this process already
holds (the allocator's reserved bytes and the CUDA context, which the planner's total counts again:
``recipe.plan.states.CUDA_CONTEXT_BYTES``), the smallest over the world's ranks; ``--memory-budget GIB`` replaces it
(on any device, the CPU included, which otherwise has no device memory to plan against and takes
``recipe.config_memory.CPU_AUTO``). The switches must agree on every rank (ZeRO-3 gathers per module call), so rank
0 decides and the others take its choice. The planner traces on fake process groups, which cannot be made while the
run's own process group exists, so at tp·cp > 1 rank 0 plans in a spawned child process.
"""
from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist

from recipe.config import RunConfig
from recipe.config_memory import MemoryOptions, MemoryReport
from recipe.plan import PlanInputs, resolve_inputs, run_inputs
from recipe.plan.states import CUDA_CONTEXT_BYTES, GIB
from recipe.train.batches import round_up
from recipe.train.positions import longest_of


def device_budget(device: torch.device, budget_gib: float | None = None) -> tuple[str, int | None]:
    """``(device name, bytes to plan against)`` for ``device``: ``budget_gib`` GiB when given (``--memory-budget``);
    on CUDA the free bytes plus this process's reserved bytes and CUDA context (module docstring); on the CPU
    ``("cpu", None)``: nothing to plan against."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if budget_gib is not None:
        return name, int(budget_gib * GIB)
    if device.type != "cuda":
        return name, None
    free, _ = torch.cuda.mem_get_info(device)
    return name, int(free + torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES)


def planned_length(examples, store, seq_divisor: int) -> int:
    """The tokens of the longest training sample, padded as the batch builder pads it (a multiple of
    ``seq_divisor`` = 2·cp·tp, ``recipe.train.batches.round_up``)."""
    return round_up(max(longest_of(examples, store), 1), seq_divisor)


def resolve_run_memory(config: RunConfig, pstate, device: torch.device, budget_gib: float | None,
                       inputs_of) -> RunConfig:
    """``config`` with its memory section resolved for this run (module docstring) and the report attached
    (``RunConfig.with_memory``). ``inputs_of(device_name, budget_bytes) -> (PlanInputs, length)``: the run's
    planner inputs and the length to plan, called on rank 0 only and only when something is planned. Collective
    over the world when a switch is "auto" (every rank calls it)."""
    memory = config.memory
    name, budget = device_budget(device, budget_gib)
    if not memory.auto_switches:
        return config.with_memory(*memory.resolve(None, name, None))
    budgets = pstate.comm.all_gather_object(budget)
    budget = None if None in budgets else min(budgets)
    if budget is None:
        return config.with_memory(*memory.resolve(None, name, None))
    result = None
    if dist.get_rank() == 0:
        inputs, length = inputs_of(name, budget)
        result = plan_memory(inputs, length, name, budget, in_child=config.dims.tp * config.dims.cp > 1)
    memory, report = pstate.comm.all_gather_object(result)[0]
    return config.with_memory(memory, report)


def plan_memory(inputs: PlanInputs, length: int, device_name: str, budget: int,
                in_child: bool = False) -> tuple[MemoryOptions, MemoryReport]:
    """``recipe.plan.resolve_inputs`` of ``inputs`` at ``length`` tokens against ``budget`` bytes, here or (``in_child``:
    a process group exists and the trace needs its own fake one) in a spawned child process."""
    if not in_child:
        resolved, report = resolve_inputs(inputs, length, device_name, budget)
        return resolved.memory, report
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(plan_memory, (inputs, length, device_name, budget))


def run_plan_inputs(config: RunConfig, args, hf_config, draft_config, examples, store):
    """``inputs_of`` for :func:`resolve_run_memory` from a run's pieces: its ``RunConfig`` (kernels resolved for the
    device), run.py's ``args`` (``--ttt-steps``, ``--freeze-lm-head``), the target's and the draft's configs and its
    training data (online ``examples`` or an offline ``store``)."""
    def inputs_of(device_name: str, budget: int) -> tuple[PlanInputs, int]:
        inputs = run_inputs(config, hf_config, draft_config, ttt_steps=args.ttt_steps, offline=store is not None,
                            freeze_lm_head=args.freeze_lm_head, gpu=device_name, gpu_size=budget)
        return inputs, planned_length(examples, store, config.dims.seq_divisor)

    return inputs_of
