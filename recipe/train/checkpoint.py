"""Checkpoints: DeepSpeed engine state plus what the run needs to continue exactly, written atomically.

Layout under ``OUTPUT/checkpoints/``::

    step-00000010/           DeepSpeed's files (model, optimizer, scheduler, per-rank ZeRO shards) and ours:
        draft.safetensors        the full draft (ZeRO-gathered, TP-consolidated) -> `python -m recipe.export`
        draft_config.json        the export config.json
        vocab_map.safetensors    d2t / t2d, reused on resume (never regenerated)
        run_state.json           step (= data position, see recipe.train.sampler), seed, layout, data fingerprint
        run_config.json          the resolved run configuration (flags, DeepSpeed JSON, layout)
        rng-rank00000.pt         every rank's RNG states
    latest                   name of the newest complete checkpoint

A checkpoint is written into ``.partial/<tag>`` by all ranks, completed (barrier), renamed into place, and only then
is ``latest`` replaced (write-to-temp + ``os.replace``); older ones beyond ``keep`` are pruned. A crash mid-save
leaves ``.partial`` debris and the previous checkpoint untouched. DeepSpeed's ZeRO/bf16 saves also copy its recovery
scripts (``zero_to_fp32.py``, ``zero_to_torch.py``) into the save folder (``.partial``); they are deleted with the
emptied ``.partial`` once the checkpoint is in place: ``draft.safetensors`` already is the consolidated fp32 draft.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

PARTIAL = ".partial"
LATEST = "latest"
RUN_STATE = "run_state.json"
VOCAB_FILE = "vocab_map.safetensors"
DRAFT_FILE = "draft.safetensors"  # the full draft (ZeRO-gathered, TP-consolidated), what the export is made from
DRAFT_CONFIG_FILE = "draft_config.json"  # the export config.json
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies into the save folder


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written on some rank; the previous checkpoint (``latest``) is untouched."""


class InjectedFault(RuntimeError):
    """Raised on every rank by :func:`fault_point` to test crash safety (never in normal runs)."""


FAULT_ENV = "RECIPE_CHECKPOINT_FAULT"


def fault_point(stage: str, step: int) -> None:
    """Crash injection for tests: raise :class:`InjectedFault` when ``$RECIPE_CHECKPOINT_FAULT`` is ``stage`` or
    ``stage@step``. Stages: ``written`` (all files in ``.partial``, nothing renamed) and ``renamed`` (the folder is in
    place, ``latest`` not yet updated). Every rank passes the same fault points, so all ranks raise together."""
    want = os.environ.get(FAULT_ENV)
    if want and (want == stage or want == f"{stage}@{step}"):
        raise InjectedFault(f"injected fault at checkpoint stage '{stage}' (step {step}, ${FAULT_ENV}={want})")


def _agree(comm, error: str | None, what: str, latest: str | None) -> None:
    """Collective through ``comm`` (``recipe.parallel.collectives.Collectives``): raise CheckpointError on every
    rank if any rank reports ``error`` (each failing rank named)."""
    errors = comm.all_gather_object(error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        kept = f"the previous checkpoint {latest} is intact" if latest else "no earlier checkpoint exists"
        raise CheckpointError(f"{what} failed ({'; '.join(failed)}); {kept}")


def _attempt(fn) -> str | None:
    try:
        fn()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc)
    return None


def latest_tag(root: Path) -> str | None:
    marker = Path(root) / LATEST
    return marker.read_text().strip() if marker.is_file() else None


def save(engine, comm, root: Path, step: int, run_state: dict, draft_state: dict[str, torch.Tensor] | None,
         draft_config: dict, vocab_files: dict[str, torch.Tensor], keep: int,
         extra_files: dict[str, Path] | None = None) -> Path:
    """Write checkpoint ``step-{step:08d}`` atomically; collective over the world (through ``comm``, the run's
    ``recipe.parallel.collectives.Collectives``), every rank calls it.

    ``draft_state`` (full tensors) is only needed on global rank 0; ``extra_files`` (name -> existing file, e.g. the
    resolved run config) are copied in by rank 0. Order: write into ``.partial/<tag>`` (DeepSpeed's files from every
    rank, our files from rank 0), agree, rename to ``<tag>``, agree, replace ``latest``, prune beyond ``keep``.
    Raises CheckpointError on every rank when any rank fails to write (e.g. ENOSPC), naming the rank and file;
    ``latest`` then still names the previous complete checkpoint.
    """
    root = Path(root)
    tag = tag_for(step)
    partial, final = root / PARTIAL, root / tag
    rank = dist.get_rank()
    previous = latest_tag(root)
    what = f"saving checkpoint {final}"

    def prepare():  # also clears debris of an earlier interrupted save
        shutil.rmtree(partial, ignore_errors=True)
        (partial / tag).mkdir(parents=True, exist_ok=True)

    _agree(comm, _attempt(prepare) if rank == 0 else None, what, previous)
    engine.save_checkpoint(str(partial), tag=tag, client_state={"run_state": run_state}, save_latest=False)

    def write_ours():
        torch.save(rng_state(), partial / tag / f"rng-rank{rank:05d}.pt")
        if rank != 0:
            return
        save_file({k: v.contiguous() for k, v in draft_state.items()}, str(partial / tag / DRAFT_FILE))
        (partial / tag / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
        save_file(vocab_files, str(partial / tag / VOCAB_FILE))
        for name, src in (extra_files or {}).items():
            if Path(src).is_file():
                shutil.copyfile(src, partial / tag / name)
        (partial / tag / RUN_STATE).write_text(json.dumps(run_state, indent=2, sort_keys=True) + "\n")

    error = _attempt(write_ours)
    try:
        _agree(comm, error, what, previous)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial / tag, ignore_errors=True)
        raise
    fault_point("written", step)

    def publish():
        if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint): swap, then delete
            old = partial / f"{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial / tag, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial / tag, final)

    _agree(comm, _attempt(publish) if rank == 0 else None, what, previous)
    fault_point("renamed", step)

    def update_latest():
        _write_text_atomic(root / LATEST, tag + "\n")
        prune(root, keep)
        for script in RECOVERY_SCRIPTS:
            (partial / script).unlink(missing_ok=True)
        if not any(partial.iterdir()):
            partial.rmdir()

    _agree(comm, _attempt(update_latest) if rank == 0 else None, what, previous)
    return final


def read_draft(checkpoint_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(full draft tensors, export config dict) of a checkpoint folder, or of the one a ``latest`` marker in it
    names. Raises ValueError naming the missing file when the folder is not a checkpoint written by run.py."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / LATEST).is_file():
        checkpoint_dir = checkpoint_dir / (checkpoint_dir / LATEST).read_text().strip()
    weights, cfg_file = checkpoint_dir / DRAFT_FILE, checkpoint_dir / DRAFT_CONFIG_FILE
    for f in (weights, cfg_file):
        if not f.is_file():
            raise ValueError(f"{f}: missing — is {checkpoint_dir} a checkpoint folder written by run.py?")
    with safe_open(str(weights), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    return state, json.loads(cfg_file.read_text())


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (never the one ``latest`` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    tags = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    for tag in tags[:-keep] if keep > 0 else []:
        if tag != latest:
            shutil.rmtree(root / tag, ignore_errors=True)


def resolve(resume: str, root: Path) -> Path:
    """The checkpoint folder ``--resume`` names: 'latest' (via ``root/latest``) or an explicit folder.

    Raises FileNotFoundError with the path when there is nothing to resume from.
    """
    if resume == "latest":
        marker = Path(root) / LATEST
        if not marker.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint to resume from ({marker} does not exist)")
        path = Path(root) / marker.read_text().strip()
    else:
        path = Path(resume)
        if (path / LATEST).is_file():
            path = path / (path / LATEST).read_text().strip()
    if not (path / RUN_STATE).is_file():
        raise FileNotFoundError(f"--resume: {path} is not a complete checkpoint (no {RUN_STATE})")
    return path


COMPAT_KEYS = ("world_size", "tp", "cp", "dp", "global_batch", "zero_stage", "data_fingerprint", "ttt_steps",
               "draft_vocab_size", "aux_layer_ids", "max_length", "seed", "freeze_lm_head")
# keys added after checkpoints were first written: the value a checkpoint (or state) without the key means
COMPAT_DEFAULTS = {"freeze_lm_head": False}


def read_run_state(path: Path) -> dict:
    """The ``run_state.json`` of checkpoint folder ``path``; ValueError naming the file when it is unreadable."""
    file = Path(path) / RUN_STATE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume: cannot read {file} ({exc})") from None


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    """Refuse to resume when the layout, world size, ZeRO stage, data or key settings differ.

    A key missing on either side reads as its :data:`COMPAT_DEFAULTS` value (older checkpoints predate it).
    Raises ValueError listing every differing key (checkpoint value, current value) of :data:`COMPAT_KEYS`.
    """
    saved, current = {**COMPAT_DEFAULTS, **saved}, {**COMPAT_DEFAULTS, **current}
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in COMPAT_KEYS
             if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpoint in\n  " + "\n  ".join(diffs)
                         + "\n(resharding to another layout is not supported; start a new run or match these)")


def check_length(saved: dict, total_steps: int, extend: bool, path: Path) -> bool:
    """Whether resuming the checkpoint ``path`` (its run state ``saved``) in a run of ``total_steps`` optimizer
    steps re-plans the LR schedule (``--extend``, ``recipe.train.loop.Trainer._replan_schedule``).

    False when the planned length is unchanged. Raises ValueError naming the planned and requested lengths when it
    differs without ``extend`` (the schedule would change under a resumed run), and with ``extend`` when the new
    length leaves no step to run after the saved one.
    """
    planned, step = saved.get("total_steps"), saved.get("step", 0)
    if planned == total_steps:
        return False
    was = f"planned for {planned} optimizer steps" if planned is not None else "of a run of unrecorded length"
    if not extend:
        raise ValueError(f"cannot resume from {path}: the checkpoint (step {step}) is {was}, this run asks for "
                         f"{total_steps} (--max-steps/--epochs); resuming would mix two learning-rate schedules. Pass "
                         f"--extend to re-plan the schedule for {total_steps} steps from step {step} (README, "
                         "'Extending a run'), or resume with the original --max-steps/--epochs")
    if total_steps <= step:
        raise ValueError(f"cannot extend the run in {path}: it is at step {step} and --max-steps/--epochs ask for "
                         f"{total_steps} steps in all; give a length above {step}")
    return True


def load(engine, path: Path) -> dict:
    """Load engine state (model, optimizer, scheduler, loss scaler) and this rank's RNG; return the saved run state.

    Call :func:`check_compatible` first: DeepSpeed fails deep inside on a checkpoint of another layout.
    Raises FileNotFoundError naming the folder when DeepSpeed finds nothing or this rank's RNG file is missing.
    """
    path = Path(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load the checkpoint in {path}")
    rng_file = path / f"rng-rank{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"--resume: {rng_file} is missing (checkpoint written by another world size?)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return read_run_state(path)
