"""Local multi-process launch on one machine: ``fn`` run on N spawned gloo ranks (tooling, not training).

Used by the benchmarks (a fresh process per layout, so peak memory is per measurement) and by the multi-rank tests.
Training itself is launched by ``deepspeed``/``torchrun``, not from here.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipe.lifecycle.distributed import free_port


# What a forkserver imports once so that each rank it forks starts with them loaded (a spawned rank imports them
# anew: seconds a rank on a small CPU); the project modules last, so their imports come warm.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers", "safetensors.torch",
                      "recipe.train.loop", "recipe.train.setup"]


def _worker(rank, world, port, fn, args, queue, seed, env):
    os.environ.clear()  # a forkserver's children would otherwise have the server's environment, not the caller's
    os.environ.update(env)
    # LOCAL_SIZE is left unset on purpose: with LOCAL_SIZE == world, DeepSpeed's CPU backend maps a 66 MiB
    # /dev/shm buffer per rank for its shared-memory all-reduce and never removes it.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if seed is not None:
            torch.manual_seed(seed)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_gloo_ranks(world: int, fn, *args, timeout: float = 900.0, seed: int | None = None,
                     start_method: str = "spawn") -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes with a gloo group; results by rank.

    ``start_method``: ``"spawn"`` (a new interpreter a rank: its peak memory is its own, as the benchmarks need) or
    ``"forkserver"`` (ranks forked from one server per calling process that has :data:`FORKSERVER_PRELOAD` imported:
    no import cost a rank, for the tests). Either way a rank gets the caller's current environment.

    ``fn`` must be a module-level function; results travel as ``torch.save`` bytes (tensors sent as shared-memory
    handles would die with the worker). ``seed``: ``torch.manual_seed`` on every rank after the group is up.
    Raises RuntimeError with the failing rank's traceback, or on a rank that dies without a result (e.g. killed for
    memory) or a timeout.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once this process's server runs
    results_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results_q, seed, dict(os.environ)))
             for r in range(world)]
    for proc in procs:
        proc.start()
    results, error = {}, None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and error is None:
            try:
                rank, status, value = results_q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = f"a rank exited with code {dead[0].exitcode} without a result (out of memory?)"
                elif time.monotonic() > deadline:
                    error = f"no result within {timeout:.0f} s"
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                error = f"rank {rank}:\n{value}"
    finally:
        for proc in procs:
            proc.join(timeout=30 if error is None else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if error is not None:
        raise RuntimeError(error)
    return [results[r] for r in range(world)]
