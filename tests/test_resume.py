"""Exact resume on 2 CPU ranks, fp32: 20 steps straight == 10 steps + SIGTERM (checkpoint) + resume for 10, with
ZeRO-3 dp=2 and with tp=2, bit for bit in metrics.jsonl; a crash injected mid-save (before the rename, and after
the rename but before ``latest``) leaves the previous checkpoint loadable and the resumed run again matches; a run
of another layout or data is refused with a message naming what differs."""
from __future__ import annotations

import json

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import train_argv, write_ds_config
from recipe.train.checkpoint import FAULT_ENV, LATEST, PARTIAL, check_compatible, verify
from recipe.train.signals import EXIT_INTERRUPTED

STEPS, STOP = 20, 10


@pytest.mark.slow
def test_interrupt_resume_and_crash_mid_save_are_exact(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    # global batch 4 = micro 1 x accum 2 x dp 2 (or accum 4 x dp 1 under tp=2); warmup-cosine LR over 20 steps;
    # 24 samples -> 6 steps per epoch, so the runs cross three epoch boundaries
    z3 = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4)
    tp2 = write_ds_config(tmp_path / "tp2.json", base="zero3_tp2.json", train_batch_size=4)

    def argv(cfg, name, *extra):
        return train_argv(cfg, target, store, tmp_path / name, "--max-steps", str(STEPS), "--epochs", "4",
                          "--no-export", *extra)

    every4 = ("--save-every", "4", "--keep-checkpoints", "2")
    jobs = [
        Job(argv(z3, "z3")),
        Job(argv(z3, "z3_cut", *every4), sigterm_after=STOP),
        Job(argv(z3, "z3_cut", *every4, "--resume")),
        Job(argv(tp2, "tp2")),
        Job(argv(tp2, "tp2_cut"), sigterm_after=STOP),
        Job(argv(tp2, "tp2_cut", "--resume")),
        # crash at step 8's save before the rename; resume (from 4), crash at step 12's save after the rename
        # but before 'latest' moves; resume (from 8, re-saving over the orphaned step-12 folder) to the end
        Job(argv(z3, "crash", *every4), env={FAULT_ENV: "written@8"}),
        Job(argv(z3, "crash", *every4, "--resume"), env={FAULT_ENV: "renamed@12"}),
        Job(argv(z3, "crash", *every4, "--resume")),
        # refused: other layout (tp=2 over the dp=2 checkpoint) and other data (--limit)
        Job(argv(z3, "z3_cut", "--resume", "--tp-size", "2")),
        Job(argv(z3, "z3_cut", "--resume", "--limit", "20")),
    ]
    out = run_ranks(2, run_jobs, jobs)[0]
    (z3_ref, z3_cut, z3_res, tp_ref, tp_cut, tp_res, crash8, crash12, crash_res, bad_layout, bad_data) = out

    assert [o.rc for o in (z3_ref, z3_res, tp_ref, tp_res, crash_res)] == [0] * 5
    assert len(z3_ref.metrics) == STEPS and z3_ref.metrics[-1]["loss"] < z3_ref.metrics[0]["loss"]
    # the interrupted runs stopped after step 10 on both ranks and said so
    for cut, ref, res, name in ((z3_cut, z3_ref, z3_res, "z3"), (tp_cut, tp_ref, tp_res, "tp2")):
        assert cut.rc == EXIT_INTERRUPTED, cut.stderr
        assert "interrupted: checkpoint of step 10 saved" in cut.stderr
        assert [r["step"] for r in cut.metrics] == list(range(1, STOP + 1))
        assert (tmp_path / f"{name}_cut" / "checkpoints" / LATEST).read_text().strip() == "step-00000020"
        same_curve(ref.metrics, res.metrics)  # 1..20 once each, bit-identical
    ckpts = sorted(p.name for p in (tmp_path / "z3_cut" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000016", "step-00000020"]  # keep 2
    saved = tmp_path / "z3_cut" / "checkpoints" / "step-00000020"
    for name in ("draft.safetensors", "vocab_map.safetensors", "run_state.json", "run_config.json",
                 "rng-rank00000.safetensors", "rng-rank00001.safetensors", "manifest.json"):
        assert (saved / name).is_file(), name
    assert not list(saved.glob("rng-rank*.pt"))  # RNG states without pickle
    manifest = json.loads((saved / "manifest.json").read_text())["files"]  # every file but itself, DeepSpeed's too
    assert sorted(manifest) == sorted(p.name for p in saved.iterdir() if p.name != "manifest.json")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest and verify(saved) is None
    assert json.loads((saved / "run_state.json").read_text())["step"] == STEPS

    # crash mid-save: the previous checkpoint stays 'latest' and loads; the resumed curve is the straight one
    assert crash8.rc == "InjectedFault" and crash12.rc == "InjectedFault"
    assert [r["step"] for r in crash8.metrics] == list(range(1, 9))
    assert "step-00000004 at step 4" in crash12.stderr and "step-00000008 at step 8" in crash_res.stderr
    same_curve(z3_ref.metrics, crash_res.metrics)
    ckpt = tmp_path / "crash" / "checkpoints"
    assert (ckpt / LATEST).read_text().strip() == "step-00000020"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000016", "step-00000020"]
    assert not (ckpt / PARTIAL / "step-00000008").exists()  # debris of the first crash cleared by the next save

    for bad in (bad_layout, bad_data):
        assert bad.rc == 2 and "error (rank 0): cannot resume from" in bad.stderr
    assert "tp: checkpoint 1, now 2" in bad_layout.stderr and "dp: checkpoint 2, now 1" in bad_layout.stderr
    assert "data_fingerprint: checkpoint" in bad_data.stderr and "tp:" not in bad_data.stderr


def test_check_compatible_lists_every_difference(tmp_path):
    saved = {"world_size": 4, "tp": 2, "cp": 1, "dp": 2, "global_batch": 8, "zero_stage": 3, "seed": 0}
    check_compatible(saved, dict(saved), tmp_path)
    with pytest.raises(ValueError) as err:
        check_compatible(saved, {**saved, "world_size": 2, "dp": 1, "zero_stage": 2}, tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message
    assert "world_size: checkpoint 4, now 2" in message and "dp: checkpoint 2, now 1" in message
    assert "zero_stage: checkpoint 3, now 2" in message and "tp:" not in message
