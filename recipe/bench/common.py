"""Helpers shared by the TP and CP benchmarks: fresh gloo process groups, byte formatting, int-list flags, JSON."""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch

MIB, GIB = 1024 ** 2, 1024 ** 3


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; argparse error naming the text for anything else (or a value < 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(world: int, fn, *args, timeout: float = 900.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh spawned processes with a gloo group; results by rank.

    ``fn`` must be a module-level function. Raises RuntimeError with the failing rank's traceback, or on a rank
    that dies without a result (e.g. killed for memory) or a timeout.
    """
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results_q)) for r in range(world)]
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


def tensor_bytes(tensors) -> int:
    """Sum of ``numel · element_size`` over tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_json(path: Path | None, payload: dict) -> None:
    """Write ``payload`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
