"""Exact resume on 2 CPU ranks, fp32: 20 steps straight == 10 steps + SIGTERM (checkpoint) + resume for 10, with
ZeRO-3 dp=2 and with tp=2, bit for bit in metrics.jsonl; a crash injected mid-save (before the rename, and after
the rename but before ``latest``) leaves the previous checkpoint loadable and the resumed run again matches; a run
of another global batch or data is refused with a message naming what differs (another layout is resharded:
tests/test_reshard.py)."""
from __future__ import annotations

import json

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import train_argv, write_ds_config
from recipe.export import LATEST
from recipe.lifecycle.checkpoint import FAULT_ENV, PARTIAL
from recipe.lifecycle.manifest import verify
from recipe.lifecycle.resume_checks import check_compatible
from recipe.lifecycle.signals import EXIT_INTERRUPTED

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
        # refused: other global batch and other data (--limit)
        Job(argv(write_ds_config(tmp_path / "z3_b8.json", base="zero3.json", train_batch_size=8), "z3_cut",
                 "--resume")),
        Job(argv(z3, "z3_cut", "--resume", "--limit", "20")),
    ]
    out = run_ranks(2, run_jobs, jobs)[0]
    (z3_ref, z3_cut, z3_res, tp_ref, tp_cut, tp_res, crash8, crash12, crash_res, bad_batch, bad_data) = out

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

    for bad in (bad_batch, bad_data):
        assert bad.rc == 2 and "error (rank 0): cannot resume from" in bad.stderr
    assert "global_batch: checkpoint 4, now 8" in bad_batch.stderr and "data_fingerprint" not in bad_batch.stderr
    assert "data_fingerprint: checkpoint" in bad_data.stderr and "global_batch" not in bad_data.stderr


def test_check_compatible_lists_every_difference_and_lets_the_layout_change(tmp_path):
    saved = {"world_size": 4, "tp": 2, "cp": 1, "dp": 2, "global_batch": 8, "zero_stage": 3, "seed": 0,
             "max_length": 64}
    check_compatible(saved, dict(saved), tmp_path)
    check_compatible(saved, {**saved, "world_size": 2, "tp": 1, "dp": 2, "zero_stage": 1}, tmp_path)  # resharded
    with pytest.raises(ValueError) as err:
        check_compatible(saved, {**saved, "global_batch": 4, "seed": 1, "world_size": 2}, tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message
    assert "global_batch: checkpoint 8, now 4" in message and "seed: checkpoint 0, now 1" in message
    assert "world_size" not in message and "max_length" not in message


def test_describe_change_names_both_layouts_and_reads_older_checkpoints_as_unchanged_in_dtype():
    from recipe.lifecycle.resume_checks import describe_change

    now = {"world_size": 4, "tp": 2, "cp": 1, "dp": 2, "zero_stage": 3, "dtype": "bfloat16", "grad_accum_dtype": "fp32"}
    assert describe_change(dict(now), now) is None
    assert describe_change({**now, "seed": 1, "global_batch": 8}, now) is None  # not layout keys
    older = {k: v for k, v in now.items() if k not in ("dtype", "grad_accum_dtype")}  # written before they were kept
    assert describe_change(older, now) is None
    assert describe_change({**older, "zero_stage": 2}, now) == (
        "resuming a tp2 cp1 dp2 ZeRO-2 (4 ranks) checkpoint on tp2 cp1 dp2 ZeRO-3 bfloat16/fp32-accum (4 ranks): "
        "resharding")
    # the same layout in another dtype, or another gradient accumulation dtype (another optimizer wrapper), reshards
    assert describe_change({**now, "dtype": "float32", "grad_accum_dtype": None}, now).startswith(
        "resuming a tp2 cp1 dp2 ZeRO-3 float32 (4 ranks) checkpoint on")
    assert describe_change({**now, "grad_accum_dtype": None}, now) is not None
    assert describe_change({**now, "tp": 1, "dp": 1, "world_size": 1, "zero_stage": 0},
                           now).startswith("resuming a tp1 cp1 dp1 ZeRO-0 bfloat16/fp32-accum (1 rank) checkpoint")


def test_check_optimizer_refuses_another_optimizer_class_on_the_same_layout(tmp_path):
    from recipe.lifecycle.resume_checks import check_optimizer

    check_optimizer({"optimizer": "AdamW"}, {"optimizer": "AdamW"}, tmp_path)
    check_optimizer({}, {"optimizer": "FusedAdam"}, tmp_path)  # written before the key: not checked
    with pytest.raises(ValueError, match=r"optimizer: checkpoint 'AdamW', now 'FusedAdam'.*torch_adam"):
        check_optimizer({"optimizer": "AdamW"}, {"optimizer": "FusedAdam"}, tmp_path)
