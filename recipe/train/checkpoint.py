"""Checkpoints: DeepSpeed engine state plus what the run needs to continue exactly, written atomically.

Layout under ``OUTPUT/checkpoints/``::

    step-00000010/           DeepSpeed's files (model, optimizer, scheduler, per-rank ZeRO shards) and ours:
        draft.safetensors        the full draft (ZeRO-gathered, TP-consolidated) -> `python -m recipe.export`
        draft_config.json        the export config.json
        vocab_map.safetensors    d2t / t2d, reused on resume (never regenerated)
        run_state.json           step, data position, seed, layout, data fingerprint
        rng-rank00000.pt         every rank's RNG states
    latest                   name of the newest complete checkpoint

A checkpoint is written into ``.partial/<tag>`` by all ranks, completed (barrier), renamed into place, and only then
is ``latest`` replaced (write-to-temp + ``os.replace``); older ones beyond ``keep`` are pruned. A crash mid-save
leaves ``.partial`` debris and the previous checkpoint untouched.
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
from safetensors.torch import save_file

from recipe.export import CHECKPOINT_CONFIG, CHECKPOINT_DRAFT

PARTIAL = ".partial"
LATEST = "latest"
RUN_STATE = "run_state.json"
VOCAB_FILE = "vocab_map.safetensors"


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


def save(engine, root: Path, step: int, run_state: dict, draft_state: dict[str, torch.Tensor] | None,
         draft_config: dict, vocab_files: dict[str, torch.Tensor], keep: int) -> Path:
    """Collective: every rank calls it. ``draft_state`` (full tensors) is only needed on global rank 0."""
    root = Path(root)
    tag = tag_for(step)
    partial, final = root / PARTIAL, root / tag
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial / tag, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    engine.save_checkpoint(str(partial), tag=tag, client_state={"run_state": run_state}, save_latest=False)
    torch.save(rng_state(), partial / tag / f"rng-rank{rank:05d}.pt")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in draft_state.items()}, str(partial / tag / CHECKPOINT_DRAFT))
        (partial / tag / CHECKPOINT_CONFIG).write_text(json.dumps(draft_config, indent=2, sort_keys=True) + "\n")
        save_file(vocab_files, str(partial / tag / VOCAB_FILE))
        (partial / tag / RUN_STATE).write_text(json.dumps(run_state, indent=2, sort_keys=True) + "\n")
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial / tag, final)
        _write_text_atomic(root / LATEST, tag + "\n")
        prune(root, keep)
    dist.barrier()
    return final


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


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    """Refuse to resume when the layout, world size, data or key settings differ; the message lists each one."""
    keys = ("world_size", "tp", "cp", "dp", "global_batch", "data_fingerprint", "ttt_steps", "draft_vocab_size",
            "max_length", "seed")
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpoint in\n  " + "\n  ".join(diffs)
                         + "\n(resharding to another layout is not supported; start a new run or match these)")


def load(engine, path: Path) -> dict:
    """Load engine state (model, optimizer, scheduler) and this rank's RNG; return the saved run state."""
    path = Path(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load the checkpoint in {path}")
    rng_file = path / f"rng-rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / RUN_STATE).read_text())
