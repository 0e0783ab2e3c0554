"""A ``run_ranks`` worker that runs several ``run.main`` jobs in one process group, each optionally with a fault: a
SIGTERM to rank 0 after a given step, NaN hidden states for one sample, ENOSPC on rank 0's checkpoint write, write
failures of a given kind, path and count on a given rank (:class:`WriteFault`: DeepSpeed's ``torch.save`` failing like
on a full disk, safetensors' ``save_file`` of the checkpoint or the export), a CUDA out-of-memory error from the
engine's forward at a given step, a rank that blocks in a collective the others never join (a hang), a checkpoint
by wall time due on some ranks only, environment variables (e.g. ``RECIPE_CHECKPOINT_FAULT``), or a function run on
rank 0 before the job (e.g. damaging a checkpoint). Returns per job: exit code (or the exception's class name), the
captured stderr and, on rank 0, the metrics.jsonl records."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from helpers.training import ROOT
from recipe.train.metrics import TIMED_FIELDS


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # torch.save, disk full
SAFETENSORS_FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"


@dataclass(frozen=True)
class WriteFault:
    """Writes of ``where`` whose path contains ``match`` fail on ``rank``: the first ``times`` of them (None: all).
    ``where``: ``"deepspeed"`` (``torch.save``, which DeepSpeed's checkpoint engine calls: a few bytes are written,
    then torch's full-disk RuntimeError), ``"checkpoint"`` (safetensors' ``save_file`` of our checkpoint files),
    ``"export"`` (``save_file`` of the export); both safetensors ones raise its full-disk SafetensorError;
    ``"metrics"`` (``MetricsLog``'s append to metrics.jsonl: ENOSPC)."""
    where: str
    match: str = ""
    times: int | None = None
    rank: int = 0


@dataclass
class Job:
    argv: list[str]
    sigterm_after: int | None = None    # rank 0 sends itself SIGTERM when this step has finished
    nan_sample: int | None = None       # aux hidden states of this dataset index become NaN
    enospc: bool = False                # rank 0's checkpoint writes fail with ENOSPC
    oom_at_step: int | None = None      # the engine's forward raises torch.OutOfMemoryError at this (1-based) call
    env: dict = field(default_factory=dict)
    write_faults: list[WriteFault] = field(default_factory=list)
    before: tuple | None = None         # (module-level function, *args): run on rank 0 before the job, then barrier
    hang_at: tuple[int, int] | None = None  # (rank, step): that rank blocks in a collective before the step
    save_due: dict[int, set[int]] | None = None  # rank -> steps after which its SaveClock is due (no other)


@dataclass
class Outcome:
    rc: int | str
    stderr: str
    metrics: list[dict]


def _metrics(argv: list[str]) -> list[dict]:
    path = Path(argv[argv.index("--output") + 1]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@contextlib.contextmanager
def _faults(job: Job, rank: int):
    from recipe.lifecycle import checkpoint
    from recipe.train import batches, loop

    saved = {}

    def patch(obj, name, value):
        saved.setdefault((obj, name), getattr(obj, name))  # the original, even when patched twice
        setattr(obj, name, value)

    if job.sigterm_after is not None:
        train_step = loop.Trainer.train_step

        def step_then_signal(self):
            out = train_step(self)
            if rank == 0 and self.step + 1 == job.sigterm_after:
                os.kill(os.getpid(), signal.SIGTERM)
            return out
        patch(loop.Trainer, "train_step", step_then_signal)
    if job.hang_at is not None:
        import torch
        import torch.distributed as dist

        hang_rank, hang_step = job.hang_at
        hang_group, step_once = [], loop.Trainer.train_step

        def step_or_hang(self):
            if not hang_group:  # every rank, at its first step: a group of the whole world
                hang_group.append(dist.new_group(list(range(dist.get_world_size()))))
            if rank == hang_rank and self.step + 1 == hang_step:
                dist.all_reduce(torch.ones(1), group=hang_group[0])  # no other rank joins: blocks
            return step_once(self)
        patch(loop.Trainer, "train_step", step_or_hang)
    if job.save_due is not None:
        from recipe.lifecycle import watch

        steps = job.save_due.get(rank, set())
        trainers = []

        def init(self, settings, parts, console, _init=loop.Trainer.__init__):
            trainers.append(self)
            _init(self, settings, parts, console)
        patch(loop.Trainer, "__init__", init)
        patch(watch.SaveClock, "due", lambda self: trainers[-1].step in steps)
    if job.nan_sample is not None:
        build = batches.BatchBuilder.build

        def build_nan(self, indices, *args, **kwargs):
            micro = build(self, indices, *args, **kwargs)
            if job.nan_sample in indices:
                micro.ttt.aux_hidden_BSA[indices.index(job.nan_sample)] = float("nan")
            return micro
        patch(batches.BatchBuilder, "build", build_nan)
    if job.enospc and rank == 0:
        def full_disk(tensors, filename, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        from recipe.lifecycle import rng_state

        patch(checkpoint, "save_file", full_disk)
        patch(rng_state, "save_file", full_disk)  # the RNG files are written by recipe.lifecycle.rng_state
    for fault in job.write_faults:
        if fault.rank != rank:
            continue
        count = [0]

        def hit(path, fault=fault, count=count) -> bool:
            if fault.match not in str(path) or (fault.times is not None and count[0] >= fault.times):
                return False
            count[0] += 1
            return True
        if fault.where == "metrics":
            from recipe.train import metrics

            def append(self, data, _append=metrics.MetricsLog._append, _hit=hit):
                if _hit(self.path):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name
                return _append(self, data)
            patch(metrics.MetricsLog, "_append", append)
        elif fault.where == "deepspeed":
            import torch

            def torch_save(obj, f, *args, _save=torch.save, _hit=hit, **kwargs):
                if isinstance(f, (str, os.PathLike)) and _hit(f):
                    Path(f).write_bytes(b"PK\x03\x04partial")  # a short file, as a full disk leaves it
                    raise RuntimeError(TORCH_FULL_DISK)
                return _save(obj, f, *args, **kwargs)
            patch(torch, "save", torch_save)
        else:
            from safetensors import SafetensorError

            import recipe.export as export_module
            from recipe.lifecycle import rng_state
            modules = (checkpoint, rng_state) if fault.where == "checkpoint" else (export_module,)

            def st_save(tensors, filename, *args, _save=getattr(modules[0], "save_file"), _hit=hit, **kwargs):
                if _hit(filename):
                    raise SafetensorError(SAFETENSORS_FULL_DISK)
                return _save(tensors, filename, *args, **kwargs)
            for module in modules:
                patch(module, "save_file", st_save)
    if job.oom_at_step is not None:
        import torch
        from deepspeed.runtime.engine import DeepSpeedEngine

        forward, calls = DeepSpeedEngine.forward, []

        def forward_oom(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == job.oom_at_step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
            return forward(self, *args, **kwargs)
        patch(DeepSpeedEngine, "forward", forward_oom)
    old_env = {k: os.environ.get(k) for k in job.env}
    os.environ.update(job.env)
    try:
        yield
    finally:
        for (obj, name), value in saved.items():
            setattr(obj, name, value)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_jobs(rank: int, world_size: int, jobs: list[Job]) -> list[Outcome]:
    """``run_ranks`` worker: run each job's ``run.main`` in turn on every rank; see the module docstring."""
    import sys

    sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = "400"  # rich wraps error lines at 80 columns otherwise
    from recipe.lifecycle.checkpoint import InjectedFault
    from run import main

    out = []
    for job in jobs:
        if job.before is not None:
            import torch.distributed as dist

            if rank == 0:
                job.before[0](*job.before[1:])
            dist.barrier()
        err = io.StringIO()
        with _faults(job, rank), contextlib.redirect_stderr(err):
            try:
                rc = main(job.argv)
            except InjectedFault:
                rc = "InjectedFault"
            except SystemExit as exc:
                rc = f"SystemExit({exc.code})"
        out.append(Outcome(rc, err.getvalue(), _metrics(job.argv) if rank == 0 else []))
    return out


def same_curve(a: list[dict], b: list[dict]) -> None:
    """Assert two metrics.jsonl record lists are identical except for wall time and the rates from it
    (``recipe.train.metrics.TIMED_FIELDS``; bit-identical floats)."""
    strip = [{k: v for k, v in r.items() if k not in TIMED_FIELDS} for r in a]
    other = [{k: v for k, v in r.items() if k not in TIMED_FIELDS} for r in b]
    assert [r["step"] for r in other] == [r["step"] for r in strip]
    for x, y in zip(strip, other):
        assert x == y, f"step {x['step']}: {y} != {x}"
