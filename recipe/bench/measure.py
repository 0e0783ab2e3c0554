"""Measure one TTT training step (forward + backward on random aux states) in fresh processes, one per rank.

Memory per rank: on CUDA ``torch.cuda.max_memory_allocated`` (exact allocator peak); on CPU, where torch keeps no
allocator statistics, the resident-set high-water mark ``VmHWM`` of the process, reset to the current RSS just before
the step through ``/proc/self/clear_refs`` (Linux >= 4.0; without it, the lifetime peak ``ru_maxrss``). Every
measurement runs in fresh processes, so memory that the C allocator kept from an earlier measurement cannot hide
part of this one's peak, and on CPU the children run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (unless
already set): every tensor of 1 MiB or more is then its own mapping, returned to the system when freed, so the RSS
peak tracks the live tensors instead of heap fragmentation (without it, chunked layouts measured up to 4x their
live peak). Ranks (tp·cp > 1) run on gloo (nccl on CUDA) with the groups of ``ParallelState``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import resource
import time
import traceback
from contextlib import contextmanager

import torch

from recipe.lifecycle.distributed import free_port
from recipe.model.draft import Eagle3Draft
from recipe.parallel.parallelize import build_training_model
from recipe.plan.spec import DTYPES, BenchSpec, spec_draft_config, spec_kernels, spec_memory, supervised_mask

MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


# ---- memory probes ---------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE).group(1))


class CpuPeak:
    """RSS high-water mark of this process since ``reset()`` (bytes)."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "ru_maxrss"
        self.base = self.current()

    @staticmethod
    def current() -> int:
        try:
            return _status_kib("VmRSS") * 1024
        except (OSError, AttributeError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak(self) -> int:
        if self.method == "VmHWM":
            return _status_kib("VmHWM") * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CudaPeak:
    """``torch.cuda`` allocator peak since ``reset()`` (bytes)."""

    method = "max_memory_allocated"

    def reset(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


# ---- one step ----------------------------------------------------------------------------------------------------
def build_model(spec: BenchSpec, device: torch.device, pstate=None):
    """A random-weight TTTModel for ``spec`` (TP/CP applied when ``pstate`` has them), built as a run builds it
    (``recipe.parallel.parallelize.build_training_model`` with ``spec``'s memory and kernel sections)."""
    draft = Eagle3Draft(spec_draft_config(spec), seed=spec.seed)
    head = torch.randn(spec.draft_vocab, spec.target_hidden, generator=torch.Generator().manual_seed(spec.seed + 1))
    model = build_training_model(draft, head, spec_memory(spec), spec_kernels(spec), pstate, device)
    return model.to(device=device, dtype=DTYPES[spec.dtype])


def random_batch(spec: BenchSpec, device: torch.device, cp_rank: int = 0):
    """A TTT batch of random tokens and aux states, the labels of ``spec.mask`` valid (``supervised_mask``; every
    target argmax counted in the draft vocabulary); zigzag-split under CP.

    Without CP the batch is drawn on ``device`` itself (a CUDA generator: no host copy of the [B, S, 3·H_t] aux
    states, 3 GiB at 128k for an 8B target); under CP the full batch is drawn on the CPU, split, and the rank's part
    moved. The values depend on the seed and on where they are drawn."""
    from recipe.model.ttt import make_ttt_batch
    from recipe.parallel.cp_shard import shard_ttt_batch

    where = torch.device("cpu") if spec.dims.cp_enabled else torch.device(device)
    g = torch.Generator(device=where).manual_seed(spec.seed + 2)
    b, s, dt = spec.batch, spec.seq_len, DTYPES[spec.dtype]
    ones = torch.ones(b, s, dtype=torch.bool, device=where)
    batch = make_ttt_batch(torch.randint(0, spec.vocab, (b, s), generator=g, device=where),
                           supervised_mask(spec.mask, b, s).to(where), ones,
                           torch.randn(b, s, 3 * spec.target_hidden, generator=g, device=where).to(dt),
                           torch.randn(b, s, spec.target_hidden, generator=g, device=where).to(dt), ones,
                           spec.ttt_steps)
    if spec.dims.cp_enabled:
        batch = shard_ttt_batch(batch, spec.cp, cp_rank)
    return batch.to(device)


def time_step(model, batch, steps: int = 1) -> dict:
    """Peak memory (since just before the first step) and mean seconds of ``steps`` forward+backward steps of
    ``model`` on ``batch`` (the first step is excluded from the time when steps > 1). Memory on the model's device.
    Returns ``{"peak_bytes", "step_bytes" (peak minus memory in use before the step), "base_bytes", "seconds",
    "seconds_first" (the first step: with any compiles), "method"}``. Raises torch.OutOfMemoryError as torch does."""
    from recipe.model.ttt import ttt_objective

    device = next(model.parameters()).device
    probe = CudaPeak() if device.type == "cuda" else CpuPeak()
    probe.reset()
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(batch)
        ttt_objective(out, out.valid_K).backward()
        del out
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = probe.peak()
    timed = seconds[1:] or seconds
    model.zero_grad(set_to_none=True)
    return {"peak_bytes": int(peak), "step_bytes": int(peak - probe.base), "base_bytes": int(probe.base),
            "seconds": sum(timed) / len(timed), "seconds_first": seconds[0], "method": probe.method}


def measure_step(spec: BenchSpec, pstate=None) -> dict:
    """Build the model and batch of ``spec`` on this rank and ``time_step`` them (call inside the rank)."""
    device = torch.device(spec.device)
    model = build_model(spec, device, pstate)
    batch = random_batch(spec, device, 0 if pstate is None else pstate.cp_rank)
    return time_step(model, batch, spec.steps)


# ---- processes ---------------------------------------------------------------------------------------------------
def _rank_main(rank: int, spec_fields: dict, port: int, queue) -> None:
    spec = BenchSpec(**spec_fields)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    pstate = None
    try:
        if spec.world_size > 1:
            import torch.distributed as dist

            from recipe.parallel.topology import ParallelState

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank))
            if spec.device == "cuda":
                torch.cuda.set_device(rank)
                spec = dataclasses.replace(spec, device=f"cuda:{rank}")
            dist.init_process_group("nccl" if spec.device.startswith("cuda") else "gloo", rank=rank,
                                    world_size=spec.world_size)
            pstate = ParallelState(spec.dims)
        queue.put((rank, "ok", measure_step(spec, pstate)))
    except torch.OutOfMemoryError as exc:
        queue.put((rank, "oom", str(exc).splitlines()[0]))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()[-2000:]))


@contextmanager
def mmap_threshold_for_children(device: str):
    """On CPU, ``MALLOC_MMAP_THRESHOLD_`` = 1 MiB in the environment (unless already set) while the block starts
    child processes, whose glibc reads it at start-up (module docstring); restored on exit."""
    saved_env = os.environ.get(MALLOC_ENV)
    if device == "cpu" and saved_env is None:
        os.environ[MALLOC_ENV] = str(1 << 20)
    try:
        yield
    finally:
        if device == "cpu" and saved_env is None:
            os.environ.pop(MALLOC_ENV, None)


def run_measurement(spec: BenchSpec, timeout: float = 900.0) -> dict:
    """Run ``spec`` on ``tp·cp`` fresh spawned processes. Returns ``{"status": "ok" | "oom" | "killed" |
    "timeout" | "error", "ranks": [per-rank measure_step dicts], "detail": str}``; never raises for a failed run."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, dataclasses.asdict(spec), port, results_q))
             for r in range(spec.world_size)]
    with mmap_threshold_for_children(spec.device):
        for proc in procs:
            proc.start()
    ranks, status, detail = {}, "ok", ""
    deadline = time.monotonic() + timeout
    while len(ranks) < spec.world_size and status == "ok":
        try:
            rank, kind, value = results_q.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                status, detail = "killed", f"a rank exited with code {dead[0].exitcode} (out of memory?)"
            elif time.monotonic() > deadline:
                status, detail = "timeout", f"no result within {timeout:.0f} s"
            continue
        if kind == "ok":
            ranks[rank] = value
        else:
            status, detail = kind, value
    for proc in procs:
        proc.join(timeout=30 if status == "ok" else 1)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {"status": status, "ranks": [ranks[r] for r in sorted(ranks)] if status == "ok" else [],
            "detail": detail}
