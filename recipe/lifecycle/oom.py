"""A training step out of accelerator memory: what ran out, where, and which switches trade memory for compute.

``Trainer.train`` turns ``torch.OutOfMemoryError`` from a step into :class:`StepOutOfMemory`, which ``run.py`` reports
as ``error (rank N): ...`` with exit code 2 instead of a trace from deep inside the allocator. The other ranks are
left waiting in their next collective; the launcher (``torchrun``, ``deepspeed``) ends them when this rank exits.
"""
from __future__ import annotations

import torch

from recipe.config_memory import MemoryOptions
from recipe.parallel.dims import ParallelDims

GIB = 1024 ** 3


class StepOutOfMemory(RuntimeError):
    """A training step ran out of accelerator memory; the message names the step, the length, this rank's memory and
    the switches to try (``out_of_memory_message``)."""


def device_memory(device: torch.device) -> str:
    """``peak allocated / reserved / total`` GiB of ``device`` (CUDA), or a note that the CPU has no such counters."""
    if device.type != "cuda":
        return f"{device}: no allocator statistics"
    total = torch.cuda.get_device_properties(device).total_memory
    return (f"{device}: peak allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB, total {total / GIB:.2f} GiB")


def out_of_memory_message(error: BaseException, *, step: int, rank: int, device: torch.device,
                          shape: tuple[int, int, int] | None, memory: MemoryOptions, dims: ParallelDims,
                          max_length: int) -> str:
    """The message of :class:`StepOutOfMemory`: one line naming what ran out, then one line per switch to try.

    ``step``: the 1-based optimizer step that failed; ``shape``: (samples, rows, tokens a row) of this rank's
    micro-batch (fewer rows than samples: packed, ``data.packing``)
    (None: the step failed while building it, i.e. in the online target's forward); ``memory``: the run's ``memory``
    section; ``dims``: the run's layout (with ``dims.cp_enabled`` each cp rank holds tokens / cp positions).
    """
    if shape is None:
        where = "while building its micro-batches (target forward)"
    else:
        samples, rows, tokens = shape
        per_rank = f" ({tokens // dims.cp} per cp rank)" if dims.cp_enabled else ""
        laid = f"padded to {tokens} tokens" if rows == samples else f"packed into {rows} row(s) of {tokens} tokens"
        where = f"on a micro-batch of {samples} sample(s) {laid}{per_rank}"
    switches = []
    if memory.loss_chunk_size is None:
        switches.append('"memory": {"loss_chunk_size": 4096} (now null: the whole [K·S, V_d] logits are kept)')
    else:
        switches.append(f'a smaller "memory.loss_chunk_size" (now {memory.loss_chunk_size})')
        if memory.teacher_logits_once:
            switches.append('"memory": {"teacher_logits_once": false} (the chunked loss then keeps no [B, U, V_d] '
                            "teacher logits: 2·K target-head passes instead of one)")
    if not memory.checkpoint_ttt_steps:
        switches.append('"memory": {"checkpoint_ttt_steps": true} (recompute each TTT step in backward)')
    if memory.attention_tile_size is None:
        switches.append('"memory": {"attention_tile_size": 1024} (now null: dense [S, S] attention scores)')
    else:
        switches.append(f'a smaller "memory.attention_tile_size" (now {memory.attention_tile_size})')
    switches.append(f'a larger cp_size (now {dims.cp}; "parallelism" section or --cp-size), each rank then holds '
                    "1/cp of the sequence")
    switches.append(f"a shorter --max-length (now {max_length}) or a smaller train_micro_batch_size_per_gpu")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"out of memory at step {step} {where} on rank {rank}; {device_memory(device)} ({first_line}). Try "
            "(DeepSpeed JSON or flags):\n" + "\n".join(f"  - {s}" for s in switches))
