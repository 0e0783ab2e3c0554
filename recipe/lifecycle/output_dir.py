"""The run's ``--output`` folder at start: one run per folder (a previous run is refused unless ``--resume``,
``--resume auto`` or ``--overwrite`` says what to do with it), writable by every rank and shared by every rank."""
from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from recipe.export import LATEST
from recipe.lifecycle import checkpoint

# What a run writes into --output that a new run (without --resume) would overwrite, and --overwrite deletes; the
# tokenised-data cache (OUTPUT/cache) is content-addressed and kept.
RUN_ARTEFACTS = ("checkpoints", "metrics.jsonl", "run_config.json", "export", "curves.png")


class OutputFlags(Protocol):
    """What this module reads of ``run.py``'s flags (``recipe.train.flags.TrainArgs`` has them)."""

    output: Path
    resume: str | None
    overwrite: bool


def existing_run(output: Path) -> list[str]:
    """What of a previous run ``output`` holds: a non-empty metrics.jsonl, ``checkpoints/step-*`` folders and the
    ``checkpoints/latest`` marker (an empty metrics.jsonl, left by a run that stopped before its first step, is no
    run). Reads only."""
    found = []
    metrics = output / "metrics.jsonl"
    try:
        if metrics.is_file() and metrics.stat().st_size:
            with metrics.open("rb") as f:
                if f.read(4096).strip():
                    found.append("metrics.jsonl")
    except OSError:
        found.append("metrics.jsonl")
    root = output / "checkpoints"
    steps = sorted(p.name for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    if steps:
        found.append(f"checkpoints/{steps[0]}" + (f" .. {steps[-1]} ({len(steps)} folders)" if len(steps) > 1 else ""))
    if (root / LATEST).is_file():
        found.append(f"checkpoints/{LATEST} -> {checkpoint.latest_tag(root)}")
    return found


def resume_mode(args: OutputFlags) -> tuple[str | None, str | None]:
    """Rank 0's decision for ``--output`` and ``--resume``: ``(what to resume, refusal)``. ``what to resume`` is the
    ``--resume`` value to resolve (``"latest"``, a folder) or None for a fresh run; ``refusal`` None when the run may
    go on, else the message naming the folder, what it holds and the choices. ``--resume auto`` resumes
    ``checkpoints/latest`` when there is one and starts afresh in a folder that holds no run; a folder with a run
    but no complete checkpoint is refused as without ``--resume``. Reads only."""
    root = args.output / "checkpoints"
    if args.resume == "auto":
        if (root / LATEST).is_file():
            return "latest", None
    elif args.resume == "latest" and not (root / LATEST).is_file():
        return None, (f"--resume: no checkpoint to resume from ({root / LATEST} does not exist); "
                      "--resume auto starts afresh in a folder that holds no run")
    if args.resume not in (None, "auto") or args.overwrite:
        return args.resume, None
    found = existing_run(args.output)
    if not found:
        return None, None
    latest = checkpoint.latest_tag(root) if root.is_dir() else None
    resume = (f"continue it with --resume (from {latest})" if latest else
              "--resume is not possible (no complete checkpoint)")
    flag = ("--resume auto found no complete checkpoint to resume, and" if args.resume == "auto"
            else "without --resume")
    return None, (f"--output {args.output} already holds a run ({', '.join(found)}); {flag} this run would "
                  f"overwrite it. Choose: {resume}; write to a new --output folder; or pass --overwrite to delete "
                  "the old run's checkpoints and metrics first")


def _probe_writable(output: Path) -> str | None:
    """None when ``output`` can be created and written (a temporary probe file, deleted), else why not."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write-probe-"):
            pass
    except OSError as exc:
        return f"--output {output}: not a writable folder ({exc.strerror or exc})"
    return None


def check_output(args: OutputFlags, comm) -> str | None:
    """Collective over the world (through ``comm``), before the run writes anything into ``--output`` or reads any
    data: refuse a run without ``--resume`` into a folder that holds a previous run (:func:`existing_run`; rank 0
    decides by :func:`resume_mode`, every rank raises its message) unless ``--overwrite`` is given, a ``--resume``
    without a checkpoint, and a folder some rank cannot write (each rank probes its own view). Returns the
    ``--resume`` value to resolve (``--resume auto`` decided: ``"latest"`` or None), the same on every rank. Raises
    ValueError naming the folder and the choices (``--resume``, a new ``--output``, ``--overwrite``), or naming the
    ranks that cannot write it or do not share it with rank 0 (:func:`check_shared`). The old run is deleted only once
    the run is built (:func:`write_resolved_config`)."""
    rank = dist.get_rank()
    mode, refusal = resume_mode(args) if rank == 0 else (None, None)
    reports = comm.all_gather_object((mode, refusal, _probe_writable(args.output)))
    if reports[0][1] is not None:
        raise ValueError(reports[0][1])
    failed = [(r, probe) for r, (_, _, probe) in enumerate(reports) if probe is not None]
    if failed:
        r, probe = failed[0]
        raise ValueError(probe + (f" on rank {r}" if len(reports) > 1 else ""))
    check_shared(args.output, comm)
    return reports[0][0]


def check_shared(output: Path, comm) -> None:
    """Collective over the world: every rank must see the files rank 0 writes into ``output``, i.e. ``--output`` is
    one folder on a filesystem every node mounts at the same path. Checkpoints need it: each rank writes its own
    DeepSpeed and RNG files into ``OUTPUT/checkpoints/.partial/<tag>``, the ranks hash the files rank 0 lists, rank 0
    renames the folder and moves ``latest``, and ``--resume`` reads every rank's files on every rank. Rank 0 writes
    a probe file (a random name, removed again), every rank looks for it. Raises ValueError naming the folder, the
    ranks and hosts that do not see it, and rank 0's host."""
    if dist.get_world_size() == 1:
        return
    probe, failure = None, None
    if dist.get_rank() == 0:
        probe = output / f".shared-probe-{uuid.uuid4().hex}"
        try:
            probe.write_text(socket.gethostname() + "\n")
        except OSError as exc:
            failure = f"--output {output}: rank 0 could not write {probe.name} ({exc.strerror or exc})"
    try:
        name, failure = comm.all_gather_object((None if probe is None else probe.name, failure))[0]
        if failure is not None:
            raise ValueError(failure)
        try:
            seen = (output / name).is_file()
        except OSError:  # a stale or unreachable mount: this rank does not see it either
            seen = False
        views = comm.all_gather_object((seen, socket.gethostname()))
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):  # a probe left behind is harmless; a raise here would desert the others
                probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ValueError(
            f"--output {output} is not one folder shared by every rank: rank(s) {', '.join(str(r) for r, _ in blind)} "
            f"(host {', '.join(hosts)}) do not see the file rank 0 (host {views[0][1]}) wrote there. Checkpoints are "
            "written by every rank and completed by rank 0, so --output must be on a filesystem every node mounts at "
            "the same path (NFS, Lustre, GPFS, ...); see docs/cluster.md")


def clear_previous_run(output: Path) -> list[str]:
    """Delete the :data:`RUN_ARTEFACTS` of a previous run in ``output`` (``--overwrite``); return what was there."""
    removed = []
    for name in RUN_ARTEFACTS:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
