"""Never lose a run: checkpoints carry a manifest that resume checks, RNG files hold no pickle, write failures
inside a run become one message and exit code (the write-error wrapper itself: ``tests/test_write_errors.py``).

Fast: the RNG file format (safetensors + JSON metadata), ``verify``/``resolve`` on fake checkpoint folders
(truncated, empty, missing and swapped files, fallback, nothing intact, no manifest: an older version's checkpoint
refused by name).

Slow, 2 gloo ranks (ZeRO-3 dp=2, fp32, the tiny target): DeepSpeed's own ``torch.save`` failing like on a full disk
on rank 1 mid-run (exit 74, one message naming the file, ``latest`` unchanged, the resume bitwise equal to a straight
run); the final save failing once (retried, exit 0, export written) and twice (exit 74, the previous checkpoint
intact); the export failing twice (exit 74, the final checkpoint saved); a metrics.jsonl append failing once (no
record lost) and always (the first save refused, exit 74); a truncated ZeRO shard in ``latest``, an empty RNG file
in an explicit ``--resume DIR`` and a checkpoint without a manifest (an older version's: named, the previous
checkpoint used, curves bitwise equal). And a real full disk: a small tmpfs (skipped where it cannot be mounted).
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from helpers.faults import TORCH_FULL_DISK, Job, WriteFault, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import train_argv, write_ds_config
from recipe.export import LATEST
from recipe.io_errors import EXIT_WRITE_FAILED
from recipe.lifecycle import checkpoint as ckpt
from recipe.lifecycle.manifest import MANIFEST, manifest_dict, verify
from recipe.lifecycle.rng_state import RNG_FORMAT, load_rng_file, rng_file, rng_state, save_rng_file, set_rng_state
from recipe.lifecycle.signals import EXIT_INTERRUPTED

STEPS = 12
WIDE = {"COLUMNS": "4000"}  # rich wraps the error line at the terminal width; these paths are long


# ---------------------------------------------------------------------------------------------------------- fast


def _draw():
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.normal()), torch.rand(3)


def _same_draws(a, b):
    assert a[:4] == b[:4] and torch.equal(a[4], b[4])


def test_rng_file_is_safetensors_without_pickle_and_round_trips(tmp_path):
    random.gauss(0, 1), np.random.normal()  # python's gauss_next and numpy's cached gaussian are set
    state = rng_state()
    file = tmp_path / rng_file(0)
    save_rng_file(state, file)
    data = file.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])  # a safetensors file: u64 header length, JSON header, raw bytes
    assert data[:1] != b"\x80" and data[:2] != b"PK"  # no pickle protocol marker, no torch zip archive
    assert header["__metadata__"]["format"] == RNG_FORMAT
    assert json.loads(header["__metadata__"]["python"])[0] == 3
    assert {"torch", "numpy.keys"} <= set(header)
    expected = _draw()
    _draw()
    set_rng_state(load_rng_file(file))
    _same_draws(_draw(), expected)



def _fake_checkpoint(root, step, manifest=True):
    """A checkpoint-shaped folder: run state, a ZeRO shard of 100 bytes, an RNG file, and its manifest."""
    folder = root / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    (folder / ckpt.RUN_STATE).write_text(json.dumps({"step": step}))
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(bytes(range(100)))
    save_rng_file(rng_state(), folder / rng_file(0))
    if manifest:
        (folder / MANIFEST).write_text(json.dumps(manifest_dict(folder.name, folder=folder)))
    (root / LATEST).write_text(folder.name + "\n")
    return folder


def test_verify_names_the_damaged_file(tmp_path):
    folder = _fake_checkpoint(tmp_path, 6)
    assert verify(folder) is None
    shard, rng = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt", folder / rng_file(0)
    rng_size = rng.stat().st_size
    shard.write_bytes(bytes(range(60)))
    assert verify(folder) == "zero_pp_rank_1_mp_rank_00_optim_states.pt: size 60 != 100"
    shard.write_bytes(bytes(reversed(range(100))))  # same size, other contents (a swapped file)
    assert verify(folder).startswith("zero_pp_rank_1_mp_rank_00_optim_states.pt: sha256 ")
    shard.write_bytes(bytes(range(100)))
    rng.write_bytes(b"")
    assert verify(folder) == f"rng-rank00000.safetensors: size 0 != {rng_size}"
    rng.unlink()
    assert verify(folder) == "rng-rank00000.safetensors: missing"
    (folder / MANIFEST).write_text("{not json")
    assert verify(folder).startswith("manifest.json: unreadable")


def test_resolve_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    two, four, six = (_fake_checkpoint(root, s) for s in (2, 4, 6))
    (six / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(bytes(range(23)))
    for resume in ("latest", str(six), str(root)):
        assert ckpt.resolve(resume, root) == four
        assert capsys.readouterr().err.strip() == (
            "checkpoint step-00000006 is damaged (zero_pp_rank_1_mp_rank_00_optim_states.pt: size 23 != 100); "
            "resuming from step-00000004 instead")
    (four / rng_file(0)).write_bytes(b"")
    assert ckpt.resolve("latest", root) == two
    assert "step-00000004 is damaged (rng-rank00000.safetensors: size 0 != " in capsys.readouterr().err
    (two / MANIFEST).unlink()
    (two / ckpt.RUN_STATE).unlink()
    with pytest.raises(FileNotFoundError) as err:
        ckpt.resolve("latest", root)
    message = str(err.value)
    assert message.startswith(f"--resume: no intact checkpoint in {root}: step-00000006 is damaged (")
    assert "step-00000004 is damaged (rng-rank00000.safetensors: size 0" in message
    assert "step-00000002 is not a complete checkpoint (no manifest.json, no run_state.json)" in message
    shutil.rmtree(six)  # 'latest' names a folder that is gone
    (two / ckpt.RUN_STATE).write_text("{}")
    (two / MANIFEST).write_text(json.dumps(manifest_dict(two.name, folder=two)))
    assert ckpt.resolve("latest", root) == two
    err = capsys.readouterr().err
    assert "checkpoint step-00000006 is damaged (" in err and "step-00000006: missing" in err
    assert "resuming from step-00000002 instead" in err


def test_resolve_refuses_a_checkpoint_of_an_older_version_by_name(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    two = _fake_checkpoint(root, 2)
    old = _fake_checkpoint(root, 4, manifest=False)  # run state and files but no manifest: an older version's
    refusal = f"step-00000004 has no {old / MANIFEST}: written by an older version of this recipe: re-create it"
    assert ckpt.resolve("latest", root) == two
    expected = f"checkpoint {refusal} by training again; resuming from step-00000002 instead"
    assert capsys.readouterr().err.strip() == expected
    shutil.rmtree(two)
    with pytest.raises(FileNotFoundError) as err:
        ckpt.resolve(str(old), root)
    assert str(err.value) == f"--resume: no intact checkpoint in {root}: {refusal} by training again"


# ---------------------------------------------------------------------------------------------------------- slow


def _snapshot(root, out):
    """What a checkpoints folder holds (``latest``, the checkpoints, ``.partial``, each one intact), as JSON."""
    partial = root / ckpt.PARTIAL
    tags = sorted(p.name for p in root.glob("step-*"))
    out.write_text(json.dumps({"latest": ckpt.latest_tag(root), "checkpoints": tags,
                               "partial": sorted(p.name for p in partial.iterdir()) if partial.is_dir() else [],
                               "intact": {t: verify(root / t) is None for t in tags}}))


def _truncate_file(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def _make_old_format(folder):
    """Turn a checkpoint into one of an older version: no manifest.json."""
    (folder / MANIFEST).unlink()


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error (rank ")]


@pytest.mark.slow
def test_write_failures_and_damaged_checkpoints_lose_nothing(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    z3 = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4)

    def argv(name, *extra):
        return train_argv(z3, target, store, tmp_path / name, "--max-steps", str(STEPS), "--epochs", "4", *extra)

    every4, every2 = ("--save-every", "4", "--keep-checkpoints", "3"), ("--save-every", "2", "--keep-checkpoints", "3")
    short = ("--max-steps", "4", "--save-every", "2")
    cut, full_ckpt = tmp_path / "cut" / "checkpoints", tmp_path / "full" / "checkpoints"

    def job(name, *extra, **faults):
        return Job(argv(name, *extra), env=WIDE, **faults)

    jobs = [
        job("ref", "--no-export"),
        # DeepSpeed's torch.save of rank 1's files fails like on a full disk at step 8's save; resume from 4
        job("full", *every4, write_faults=[WriteFault("deepspeed", "step-00000008", rank=1)]),
        job("full", *every4, "--resume", before=(_snapshot, full_ckpt, tmp_path / "full_after_failure.json")),
        # the final save fails once (retried: done), always (exit 74); the export fails twice (exit 74)
        job("retry", *short, write_faults=[WriteFault("checkpoint", "step-00000004/draft", times=1)]),
        job("retry2", *short, write_faults=[WriteFault("checkpoint", "step-00000004/draft")]),
        job("export", *short, write_faults=[WriteFault("export")]),
        # metrics.jsonl: one failed append is written with the next record; always failing, the first save stops
        job("logs", *short, write_faults=[WriteFault("metrics", times=1)]),
        job("logs2", *short, write_faults=[WriteFault("metrics")]),
        # damaged checkpoints: a truncated ZeRO shard in 'latest', an empty RNG file in an explicit --resume DIR
        job("cut", *every2, sigterm_after=6),
        job("cut", *every2, "--resume",
            before=(_truncate_file, cut / "step-00000006" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 1000)),
        job("cut", *every2, "--resume", str(cut / "step-00000012"),
            before=(_truncate_file, cut / "step-00000012" / "rng-rank00001.safetensors", 0)),
        # an older version's checkpoint (no manifest) is refused by name; the one before it is used
        job("cut", *every2, "--resume", str(cut / "step-00000010"), before=(_make_old_format, cut / "step-00000010")),
    ]
    results = run_ranks(2, run_jobs, jobs)
    (ref, full, full_res, retry, retry2, export, logs, logs2, cut_run, trunc, empty, old) = results[0]
    rank1 = results[1]

    assert ref.rc == 0 and len(ref.metrics) == STEPS

    # a write failure inside DeepSpeed's save on rank 1: one message on every rank, exit 74, nothing lost
    assert full.rc == EXIT_WRITE_FAILED and rank1[1].rc == EXIT_WRITE_FAILED, full.stderr
    # rank 1's first file of the save (ZeRO-3: every rank writes its model states, then its optimizer shard)
    shard = tmp_path / "full" / "checkpoints" / ".partial" / "step-00000008" \
        / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    for out, rank in ((full, 0), (rank1[1], 1)):
        lines = _error_lines(out.stderr)
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert lines[0] == (f"error (rank {rank}): saving checkpoint {tmp_path / 'full' / 'checkpoints'}/step-00000008 "
                            f"failed (rank 1: {shard}: the file could not be written completely: disk full or I/O "
                            f"error ({TORCH_FULL_DISK})); the previous checkpoint step-00000004 is intact")
    after = json.loads((tmp_path / "full_after_failure.json").read_text())  # as the failed run left the folder
    assert after == {"latest": "step-00000004", "checkpoints": ["step-00000004"], "partial": [],
                     "intact": {"step-00000004": True}}
    assert [r["step"] for r in full.metrics] == list(range(1, 9))
    assert full_res.rc == 0 and "step-00000004 at step 4" in full_res.stderr
    same_curve(ref.metrics, full_res.metrics)

    # the final save: failing once is retried and the run completes, export written
    assert retry.rc == 0, retry.stderr
    assert "warning: saving checkpoint" in retry.stderr and "trying once more" in retry.stderr
    assert "step-00000004/draft.safetensors: Error while serializing: I/O error: No space left" in retry.stderr
    assert (tmp_path / "retry" / "export" / "model.safetensors").is_file()
    assert verify(tmp_path / "retry" / "checkpoints" / "step-00000004") is None
    # ... failing twice: exit 74, one message, the previous checkpoint intact and 'latest', no export
    assert retry2.rc == EXIT_WRITE_FAILED and rank1[4].rc == EXIT_WRITE_FAILED, retry2.stderr
    retry2_ckpt = tmp_path / "retry2" / "checkpoints"
    [line] = _error_lines(retry2.stderr)
    assert line.startswith(f"error (rank 0): saving checkpoint {retry2_ckpt}/step-00000004 failed (rank 0: "
                           f"{retry2_ckpt}/.partial/step-00000004/draft.safetensors: Error while serializing")
    assert line.endswith("the previous checkpoint step-00000002 is intact")
    assert (retry2_ckpt / LATEST).read_text().strip() == "step-00000002"  # nothing ran in this folder since
    assert verify(retry2_ckpt / "step-00000002") is None
    assert not (retry2_ckpt / "step-00000004").exists() and not (retry2_ckpt / ".partial" / "step-00000004").exists()
    assert not (tmp_path / "retry2" / "export").exists()
    # ... the export failing twice: exit 74, the final checkpoint saved
    assert export.rc == EXIT_WRITE_FAILED and rank1[5].rc == EXIT_WRITE_FAILED, export.stderr
    [line] = _error_lines(export.stderr)
    assert "writing the export failed twice (" in line and "export.tmp/model.safetensors: Error while" in line
    assert f"its final checkpoint {tmp_path / 'export' / 'checkpoints' / 'step-00000004'} is saved" in line
    assert verify(tmp_path / "export" / "checkpoints" / "step-00000004") is None
    assert not (tmp_path / "export" / "export").exists()

    # a failed metrics.jsonl write loses no record; one that keeps failing stops the run at the next save
    assert logs.rc == 0 and [r["step"] for r in logs.metrics] == [1, 2, 3, 4], logs.stderr
    same_curve(retry.metrics, logs.metrics)  # the same 4-step run
    assert logs2.rc == EXIT_WRITE_FAILED and rank1[7].rc == EXIT_WRITE_FAILED, logs2.stderr
    [line] = _error_lines(logs2.stderr)
    assert line == (f"error (rank 0): saving checkpoint {tmp_path / 'logs2' / 'checkpoints'}/step-00000002 failed "
                    f"(rank 0: {tmp_path / 'logs2' / 'metrics.jsonl'}: No space left on device (the records from "
                    "step 1 on are kept in memory)); no earlier checkpoint exists")
    assert not (tmp_path / "logs2" / "checkpoints" / "step-00000002").exists()

    # damaged checkpoints are named and the previous one is used; the curve is the straight one, bit for bit
    assert cut_run.rc == EXIT_INTERRUPTED
    assert trunc.rc == 0, trunc.stderr
    assert ("checkpoint step-00000006 is damaged (zero_pp_rank_1_mp_rank_00_optim_states.pt: size 1000 != "
            in trunc.stderr) and "); resuming from step-00000004 instead" in trunc.stderr
    assert "step-00000004 at step 4" in trunc.stderr
    same_curve(ref.metrics, trunc.metrics)
    assert empty.rc == 0, empty.stderr
    assert ("checkpoint step-00000012 is damaged (rng-rank00001.safetensors: size 0 != " in empty.stderr
            and "); resuming from step-00000010 instead" in empty.stderr)
    same_curve(ref.metrics, empty.metrics)
    # an older version's checkpoint is named and refused; the one before it resumes, bit for bit
    assert old.rc == 0, old.stderr
    assert (f"checkpoint step-00000010 has no {cut / 'step-00000010' / MANIFEST}: written by an older version of "
            "this recipe: re-create it by training again; resuming from step-00000008 instead") in old.stderr
    same_curve(ref.metrics, old.metrics)
    # every checkpoint written by this version has a manifest and RNG files without pickle
    for folder in sorted(cut.glob("step-*")):
        if (folder / MANIFEST).is_file():
            assert verify(folder) is None
            assert sorted(p.name for p in folder.glob("rng-rank*")) == ["rng-rank00000.safetensors",
                                                                        "rng-rank00001.safetensors"]


def _copy_and_snapshot(src, dst):
    shutil.copytree(src, dst)
    _snapshot(dst / "checkpoints", dst.parent / "after_failure.json")


@pytest.mark.slow
def test_a_real_full_disk_keeps_latest_and_the_resume_is_exact(tiny_target_and_store, tmp_path):
    mount = tmp_path / "small_disk"
    mount.mkdir()
    # about 110 KiB of logs and configs + 580 KiB per checkpoint of this run (200 KiB of it the layout-free
    # train_state.safetensors): step 4 fits, step 8 does not (here DeepSpeed's own torch.save of the ZeRO optimizer
    # shards, written first, is what fails, on both ranks)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        target, store = tiny_target_and_store
        z3 = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4)

        def argv(output, *extra):
            return train_argv(z3, target, store, output, "--max-steps", str(STEPS), "--epochs", "4", "--no-export",
                              *extra)

        jobs = [Job(argv(tmp_path / "ref"), env=WIDE),
                Job(argv(mount / "run", "--save-every", "4"), env=WIDE),
                Job(argv(tmp_path / "moved", "--save-every", "4", "--resume"), env=WIDE,
                    before=(_copy_and_snapshot, mount / "run", tmp_path / "moved"))]
        results = run_ranks(2, run_jobs, jobs)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    ref, full, resumed = results[0]
    assert full.rc == EXIT_WRITE_FAILED and results[1][1].rc == EXIT_WRITE_FAILED, full.stderr
    [line] = _error_lines(full.stderr)
    print(line)  # which write hit the full disk first (-s shows it)
    assert "Traceback" not in full.stderr
    assert str(mount / "run") in line and ("No space left on device" in line or "disk full or I/O error" in line)
    assert line.endswith("the previous checkpoint step-00000004 is intact"), line
    after = json.loads((tmp_path / "after_failure.json").read_text())
    assert after == {"latest": "step-00000004", "checkpoints": ["step-00000004"], "partial": [],
                     "intact": {"step-00000004": True}}
    moved = tmp_path / "moved" / "checkpoints"
    assert resumed.rc == 0 and "step-00000004 at step 4" in resumed.stderr, resumed.stderr
    assert verify(moved / "step-00000012") is None
    same_curve(ref.metrics, resumed.metrics)
