"""Checkpoints: DeepSpeed engine state plus what the run needs to continue exactly, written atomically.

Layout under ``OUTPUT/checkpoints/``::

    step-00000010/           DeepSpeed's files (model, optimizer, scheduler, per-rank ZeRO shards) and ours:
        draft.safetensors        the full draft (ZeRO-gathered, TP-consolidated) -> `python -m recipe.export`
        draft_config.json        the export config.json
        vocab_map.safetensors    d2t / t2d, reused on resume (never regenerated)
        run_state.json           step (= data position, see recipe.train.sampler), seed, layout, data fingerprint
        train_state.safetensors  fp32 masters, Adam moments and step, LR schedule in one process's layout: what a
                                 resume on another layout reads (recipe.lifecycle.reshard)
        run_config.json          the resolved run configuration (flags, DeepSpeed JSON, layout)
        rng-rank00000.safetensors  every rank's RNG states, no pickle (:func:`save_rng_file`)
        manifest.json            size and sha256 of every other file of the folder, written last (:func:`verify`)
    latest                   name of the newest complete checkpoint

A checkpoint is written into ``.partial/<tag>`` by all ranks, completed (barrier), renamed into place, and only then
is ``latest`` replaced (write-to-temp + ``os.replace``); older ones beyond ``keep`` are pruned. A crash mid-save
leaves ``.partial`` debris and the previous checkpoint untouched. DeepSpeed's ZeRO/bf16 saves also copy its recovery
scripts (``zero_to_fp32.py``, ``zero_to_torch.py``) into the save folder (``.partial``); they are deleted with the
emptied ``.partial`` once the checkpoint is in place: ``draft.safetensors`` already is the consolidated fp32 draft.

Write failures. Every write of a save (DeepSpeed's ``engine.save_checkpoint`` included: its checkpoint engine's
``save`` is guarded for the call, so a rank that fails still passes DeepSpeed's own barriers) is caught per rank and
agreed over the world; a failure on any rank raises :class:`CheckpointError` (a ``recipe.io_errors.WriteError``) on
every rank naming each failing rank, the path and the cause, the staged folder is deleted and ``latest`` keeps
naming the previous checkpoint.

Integrity. After every rank's files are in ``.partial/<tag>`` the ranks hash the folder's files between them
(sha256 streamed by ``hashlib.file_digest``, rank r the r-th of every world-size files of rank 0's listing) and rank 0
writes ``manifest.json`` (:data:`MANIFEST`, ``{"format", "version", "tag", "algorithm", "files": {name: {"size",
"sha256"}}}``) last, before the rename. :func:`resolve` checks it on every rank before anything of the checkpoint is
read (DeepSpeed unpickles its ``*.pt`` files with ``weights_only=False``, so the check is also what stands between a
swapped file and ``torch.load``); a damaged checkpoint (a file missing, of another size or hash) is named and the
newest intact older one is used instead; so is a folder without a manifest (written by an older version of this
recipe, or not completely), named as such. RNG files are safetensors (byte tensors, numpy's key array) with the rest
as JSON in its metadata, never a pickle (``recipe.lifecycle.rng_state``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from recipe.export import DRAFT_CONFIG_FILE, DRAFT_FILE, LATEST
from recipe.io_errors import WriteError, writing
from recipe.lifecycle import reshard
from recipe.lifecycle.manifest import MANIFEST, file_sha256, manifest_dict, manifest_listing, verify
from recipe.lifecycle.rng_state import load_rng_file, rng_file, rng_state, save_rng_file, set_rng_state

PARTIAL = ".partial"
RUN_STATE = "run_state.json"
VOCAB_FILE = "vocab_map.safetensors"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies into the save folder


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointError(WriteError):
    """A checkpoint could not be written on some rank; the previous checkpoint (``latest``) is untouched. A
    ``recipe.io_errors.WriteError``: ``run.py`` exits with ``EXIT_WRITE_FAILED``."""


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
    """None when ``fn()`` returns, else its failure in words (the path and the cause; any exception: a failing rank
    must still reach the agreement that follows, or the other ranks would wait for it forever)."""
    try:
        fn()
    except WriteError as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _guard_engine_writes(engine, errors: list[str]):
    """For the duration of ``engine.save_checkpoint``: the engine's file writes (its checkpoint engine's ``save``,
    the recovery-script copy) record their failure in ``errors`` instead of raising, and are skipped after one, so a
    failing rank still passes DeepSpeed's barriers and the failure is agreed afterwards."""
    targets = [(engine.checkpoint_engine, "save"), (engine, "_copy_recovery_script")]
    originals = []
    for obj, name in targets:
        fn = getattr(obj, name, None)
        if fn is None:
            continue
        originals.append((obj, name, name in vars(obj), vars(obj).get(name)))

        def guarded(*args, _fn=fn, _name=name, **kwargs):
            if errors:
                return None
            path = kwargs.get("path", args[1] if len(args) > 1 else args[0] if args else "?")
            if _name == "_copy_recovery_script":
                path = f"{path}/{{{','.join(RECOVERY_SCRIPTS)}}}"
            try:
                with writing(path):
                    return _fn(*args, **kwargs)
            except WriteError as exc:
                errors.append(str(exc))
            return None
        setattr(obj, name, guarded)
    try:
        yield
    finally:
        for obj, name, had, value in originals:
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)


def latest_tag(root: Path) -> str | None:
    marker = Path(root) / LATEST
    return marker.read_text().strip() if marker.is_file() else None


def _write_manifest(comm, folder: Path, tag: str, what: str, previous: str | None) -> None:
    """Collective: rank 0 lists ``folder``, every rank hashes its share of the files (shared filesystem), rank 0
    writes ``manifest.json`` (temp + ``os.replace``). CheckpointError on every rank when any of it fails."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names: list[str] = []
    error = _attempt(lambda: names.extend(manifest_listing(folder))) if rank == 0 else None
    _agree(comm, error, what, previous)
    names = comm.all_gather_object(names if rank == 0 else None)[0]
    entries: dict[str, dict] = {}

    def hash_share():
        for name in names[rank::world]:
            with writing(folder / name):  # a file another rank wrote but this one cannot read (EIO, not shared)
                entries[name] = {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}

    error = _attempt(hash_share)
    gathered = comm.all_gather_object((entries, error))
    _agree(comm, error, what, previous)
    if rank != 0:
        _agree(comm, None, what, previous)
        return
    files = {}
    for part, _ in gathered:
        files.update(part)
    manifest = manifest_dict(tag, files)

    def write():
        with writing(folder / MANIFEST):
            _write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _agree(comm, _attempt(write), what, previous)


def _write_files(engine, folder: Path, tag: str, rank: int, run_state: dict, draft_state, draft_config: dict,
                 vocab_files: dict, train_state, extra_files: dict | None) -> None:
    """This rank's part of a checkpoint into ``folder`` (the staged ``.partial``): DeepSpeed's files and its rng
    state; on rank 0 also the draft, its config, the vocabulary map, the layout-free train state, ``extra_files``
    and ``run_state.json``. Raises WriteError naming the file."""
    engine_errors: list[str] = []
    with _guard_engine_writes(engine, engine_errors):
        engine.save_checkpoint(str(folder), tag=tag, client_state={"run_state": run_state}, save_latest=False)
    if engine_errors:
        raise WriteError(engine_errors[0])
    out = folder / tag
    with writing(out / rng_file(rank)):
        save_rng_file(rng_state(), out / rng_file(rank))
    if rank != 0:
        return
    with writing(out / DRAFT_FILE):
        save_file({k: v.contiguous() for k, v in draft_state.items()}, str(out / DRAFT_FILE))
    with writing(out / DRAFT_CONFIG_FILE):
        (out / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
    with writing(out / VOCAB_FILE):
        save_file(vocab_files, str(out / VOCAB_FILE))
    if train_state is not None:
        with writing(out / reshard.TRAIN_STATE_FILE):
            reshard.save(out / reshard.TRAIN_STATE_FILE, *train_state)
    for name, src in (extra_files or {}).items():
        if Path(src).is_file():
            with writing(out / name):
                shutil.copyfile(src, out / name)
    with writing(out / RUN_STATE):
        (out / RUN_STATE).write_text(json.dumps(run_state, indent=2, sort_keys=True) + "\n")


def _publish(partial: Path, tag: str, final: Path) -> None:
    """Rename the staged ``partial/tag`` to ``final``; re-saving a step (after resuming from an older checkpoint)
    swaps the folders, then deletes the old one."""
    if final.exists():
        old = partial / f"{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial / tag, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial / tag, final)


def _update_latest(root: Path, partial: Path, tag: str, keep: int) -> None:
    """Point ``latest`` at ``tag`` (atomically), prune beyond ``keep``, remove DeepSpeed's recovery scripts and the
    emptied staging folder."""
    with writing(root / LATEST):
        _write_text_atomic(root / LATEST, tag + "\n")
    prune(root, keep)
    for script in RECOVERY_SCRIPTS:
        (partial / script).unlink(missing_ok=True)
    if not any(partial.iterdir()):
        partial.rmdir()


def save(engine, comm, root: Path, step: int, run_state: dict, draft_state: dict[str, torch.Tensor] | None,
         draft_config: dict, vocab_files: dict[str, torch.Tensor], keep: int,
         extra_files: dict[str, Path] | None = None, pending_error: str | None = None,
         train_state: tuple[dict[str, torch.Tensor], dict] | None = None) -> Path:
    """Write checkpoint ``step-{step:08d}`` atomically; collective over the world (through ``comm``, the run's
    ``recipe.parallel.collectives.Collectives``), every rank calls it.

    ``draft_state`` (full tensors) and ``train_state`` (``recipe.lifecycle.reshard.gather``: the layout-free training
    state, written when given) are only needed on global rank 0; ``extra_files`` (name -> existing file, e.g. the
    resolved run config) are copied in by rank 0. Order: write into ``.partial/<tag>`` (DeepSpeed's files from every
    rank, our files from rank 0), agree, hash and write ``manifest.json`` (last), rename to ``<tag>``, agree,
    replace ``latest``, prune beyond ``keep``. ``pending_error``: a failure of this rank to write the run's logs
    (``metrics.jsonl``, monitor files) since the last checkpoint; the checkpoint is then not written (it would
    follow a gap in the logs) and the error is reported like a write failure.
    Raises CheckpointError on every rank when any rank fails to write (e.g. ENOSPC, EIO, permission), naming the
    rank, the file and the cause; ``latest`` then still names the previous complete checkpoint.
    """
    root = Path(root)
    tag = tag_for(step)
    partial, final = root / PARTIAL, root / tag
    rank = dist.get_rank()
    previous = latest_tag(root)
    what = f"saving checkpoint {final}"

    def prepare():  # also clears debris of an earlier interrupted save
        shutil.rmtree(partial, ignore_errors=True)
        with writing(partial / tag):
            (partial / tag).mkdir(parents=True, exist_ok=True)

    _agree(comm, pending_error or (_attempt(prepare) if rank == 0 else None), what, previous)
    error = _attempt(lambda: _write_files(engine, partial, tag, rank, run_state, draft_state, draft_config,
                                          vocab_files, train_state, extra_files))
    try:
        _agree(comm, error, what, previous)
        _write_manifest(comm, partial / tag, tag, what, previous)
    except CheckpointError:
        if rank == 0:  # free the space: the staged folder and DeepSpeed's recovery scripts
            shutil.rmtree(partial, ignore_errors=True)
        raise
    fault_point("written", step)
    _agree(comm, _attempt(lambda: _publish(partial, tag, final)) if rank == 0 else None, what, previous)
    fault_point("renamed", step)
    _agree(comm, _attempt(lambda: _update_latest(root, partial, tag, keep)) if rank == 0 else None, what, previous)
    return final


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (never the one ``latest`` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    tags = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    for tag in tags[:-keep] if keep > 0 else []:
        if tag != latest:
            shutil.rmtree(root / tag, ignore_errors=True)


def _note(text: str) -> None:
    """A line on stderr from global rank 0 (every rank resolves the same checkpoint; one says so)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def _older(path: Path) -> list[Path]:
    """The checkpoint folders next to ``path`` with a lower step, newest first."""
    return sorted((p for p in path.parent.glob("step-*") if p.is_dir() and p.name < path.name), reverse=True)


def resolve(resume: str, root: Path) -> Path:
    """The checkpoint folder ``--resume`` names: 'latest' (via ``root/latest``), a checkpoints folder (its
    ``latest``) or an explicit checkpoint folder — verified against its manifest (:func:`verify`) before anything in
    it is read. Called on every rank; each verifies on its own and all reach the same answer.

    A damaged checkpoint (or a ``latest`` naming a missing folder) falls back to the newest intact older one next to
    it, with the line ``checkpoint step-… is damaged (…); resuming from step-… instead``; so does a checkpoint
    without a manifest (written by an older version of this recipe: re-create it by training again).
    Raises FileNotFoundError with the path when there is nothing to resume from, when an explicit folder is not a
    checkpoint, and when no candidate is intact (each one's damage named).
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
        elif not path.is_dir():
            raise FileNotFoundError(f"--resume: {path} does not exist")
        elif not (path / MANIFEST).is_file() and not (path / RUN_STATE).is_file():
            raise FileNotFoundError(f"--resume: {path} is not a complete checkpoint (no {RUN_STATE})")
    damaged = []
    for candidate in [path] + _older(path):
        try:
            problem = verify(candidate)
        except FileNotFoundError:  # no manifest: an older version's checkpoint, or an incomplete folder
            if not (candidate / RUN_STATE).is_file():
                damaged.append(f"{candidate.name} is not a complete checkpoint (no {MANIFEST}, no {RUN_STATE})")
            else:
                damaged.append(f"{candidate.name} has no {candidate / MANIFEST}: written by an older version of this "
                               "recipe: re-create it by training again")
            continue
        if problem is None:
            if candidate != path:
                _note(f"checkpoint {'; '.join(damaged)}; resuming from {candidate.name} instead")
            return candidate
        damaged.append(f"{candidate.name} is damaged ({problem})")
    raise FileNotFoundError(f"--resume: no intact checkpoint in {path.parent}: " + "; ".join(damaged))


def read_run_state(path: Path) -> dict:
    """The ``run_state.json`` of checkpoint folder ``path``; ValueError naming the file when it is unreadable."""
    file = Path(path) / RUN_STATE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume: cannot read {file} ({exc})") from None


def load(engine, path: Path, tp_group=None, resharding: bool = False) -> dict:
    """Load engine state (model, optimizer, scheduler, loss scaler) and this rank's RNG; return the saved run state.

    Call ``recipe.lifecycle.resume_checks.check_compatible`` first; ``path`` comes from :func:`resolve`, which verified
    it (DeepSpeed unpickles its files). The RNG file is read without pickle (:func:`load_rng_file`). ``resharding``
    (the checkpoint is of another layout, ``recipe.lifecycle.resume_checks.describe_change``): DeepSpeed's files are not
    read; the optimizer, scheduler and counters come from the layout-free training state
    (``recipe.lifecycle.reshard.restore``, the master weights were loaded into the model before it was built) and every
    rank takes rank 0's CPU RNG states.
    Raises FileNotFoundError naming the folder when DeepSpeed finds nothing or this rank's RNG file is missing,
    ValueError naming an RNG or training-state file that is not one.
    """
    path = Path(path)
    rank = dist.get_rank()
    if resharding:
        reshard.restore(engine, tp_group, path)
        rank = 0
    else:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed could not load the checkpoint in {path}")
    file = path / rng_file(rank)
    if not file.is_file():
        raise FileNotFoundError(f"--resume: {path / rng_file(rank)} is missing")
    state = load_rng_file(file)
    if resharding:
        state.pop("cuda", None)  # device RNG states belong to the writing rank's devices
    set_rng_state(state)
    return read_run_state(path)
