"""Checkpoint folder helpers without training: resolve (--resume), prune (keep-N, never `latest`), run-state reading,
fault injection parsing, RNG round trip, and the collective error agreement on one gloo rank."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from helpers.ranks import run_ranks
from recipe.export import LATEST
from recipe.lifecycle import checkpoint as ckpt
from recipe.lifecycle.manifest import MANIFEST, manifest_dict
from recipe.lifecycle.rng_state import rng_state, set_rng_state


def _complete(root, step):
    folder = root / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    (folder / ckpt.RUN_STATE).write_text(json.dumps({"step": step}))
    (folder / MANIFEST).write_text(json.dumps(manifest_dict(folder.name, folder=folder)))
    return folder


def test_resolve_latest_explicit_and_incomplete(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from .*checkpoints/latest"):
        ckpt.resolve("latest", root)
    _complete(root, 4)
    eight = _complete(root, 8)
    (root / LATEST).write_text("step-00000008\n")
    assert ckpt.resolve("latest", root) == eight
    assert ckpt.resolve(str(root), tmp_path / "elsewhere") == eight          # a checkpoints folder: its latest
    assert ckpt.resolve(str(root / "step-00000004"), root) == root / "step-00000004"
    (root / "step-00000012").mkdir()
    with pytest.raises(FileNotFoundError, match="step-00000012 is not a complete checkpoint"):
        ckpt.resolve(str(root / "step-00000012"), root)


def test_prune_keeps_newest_and_latest(tmp_path):
    for step in (2, 4, 6, 8):
        _complete(tmp_path, step)
    (tmp_path / LATEST).write_text("step-00000002\n")  # e.g. resumed from an old one
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000006", "step-00000008"]


def test_read_run_state_names_a_broken_file(tmp_path):
    folder = _complete(tmp_path, 3)
    assert ckpt.read_run_state(folder) == {"step": 3}
    (folder / ckpt.RUN_STATE).write_text("{broken")
    with pytest.raises(ValueError, match="cannot read .*run_state.json"):
        ckpt.read_run_state(folder)


def test_fault_point_matches_stage_and_step(monkeypatch):
    ckpt.fault_point("written", 4)  # unset: nothing
    monkeypatch.setenv(ckpt.FAULT_ENV, "renamed@8")
    ckpt.fault_point("written", 8)
    ckpt.fault_point("renamed", 4)
    with pytest.raises(ckpt.InjectedFault, match="stage 'renamed' \\(step 8"):
        ckpt.fault_point("renamed", 8)
    monkeypatch.setenv(ckpt.FAULT_ENV, "written")
    with pytest.raises(ckpt.InjectedFault):
        ckpt.fault_point("written", 1)


def test_rng_state_round_trip():
    state = rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move on
    set_rng_state(state)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def _agree_worker(rank, world_size):
    from recipe.parallel.collectives import Collectives

    comm, outcomes = Collectives("cpu"), []
    ckpt._agree(comm, None, "saving x", "step-1")  # nobody failed: no error
    for error in ("disk full (f)" if rank == 1 else None, None):
        try:
            ckpt._agree(comm, error if error else ("boom" if rank == 0 else None), "saving checkpoint X", None)
        except ckpt.CheckpointError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.slow
def test_agree_raises_on_every_rank_naming_the_failing_ones():
    results = run_ranks(2, _agree_worker)
    assert results[0] == results[1]
    first, second = results[0]
    assert first == ("saving checkpoint X failed (rank 0: boom; rank 1: disk full (f)); "
                     "no earlier checkpoint exists")
    assert second == "saving checkpoint X failed (rank 0: boom); no earlier checkpoint exists"
