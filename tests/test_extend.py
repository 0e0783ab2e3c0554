"""Resuming with another run length: refused without --extend (the message names both lengths and the flag); with
--extend the LR schedule is re-planned for the new total from the saved step, so the extended steps run at exactly
the learning rates of a straight run of the new length (1 gloo rank, ZeRO-0 fp32, warmup-cosine over 'auto')."""
from __future__ import annotations

import pytest

from helpers.ranks import run_ranks
from recipe.train.flags import parse_args
from helpers.faults import Job, run_jobs
from helpers.training import train_argv, write_ds_config


@pytest.mark.slow
def test_resume_with_another_length_refuses_or_extends(tmp_path, tiny_target_and_store):
    target, store = tiny_target_and_store
    cfg = write_ds_config(tmp_path / "z0.json", train_batch_size=4)  # 24 samples: 6 steps per epoch

    def argv(name, steps, *extra):
        return train_argv(cfg, target, store, tmp_path / name, "--max-steps", str(steps), "--epochs", "4",
                          "--no-export", *extra)

    jobs = [Job(argv("run", 4)),
            Job(argv("run", 8, "--resume")),
            Job(train_argv(cfg, target, store, tmp_path / "run", "--epochs", "2", "--no-export", "--resume")),
            Job(argv("run", 8, "--resume", "--extend")),
            Job(argv("run", 3, "--resume", str(tmp_path / "run" / "checkpoints" / "step-00000004"), "--extend")),
            Job(argv("straight", 8))]
    short, refused, refused_epochs, extended, too_short, straight = run_ranks(1, run_jobs, jobs)[0]

    assert short.rc == 0 and [r["step"] for r in short.metrics] == [1, 2, 3, 4]
    for out, asked in ((refused, 8), (refused_epochs, 12)):
        assert out.rc == 2, out.stderr
        assert (f"the checkpoint (step 4) is planned for 4 optimizer steps, this run asks for {asked} "
                "(--max-steps/--epochs)") in out.stderr
        assert f"Pass --extend to re-plan the schedule for {asked} steps from step 4" in out.stderr
    assert too_short.rc == 2 and "it is at step 4 and --max-steps/--epochs ask for 3 steps" in too_short.stderr

    assert extended.rc == 0, extended.stderr
    assert "--extend: run re-planned from 4 to 8 steps at step 4" in extended.stderr
    assert [r["step"] for r in extended.metrics] == list(range(1, 9))
    assert extended.metrics[:4] == short.metrics  # the first four steps are the short run's
    lr = {r["step"]: r["lr"] for r in extended.metrics}
    ref = {r["step"]: r["lr"] for r in straight.metrics}
    # the rule: step s > 4 runs at the lr of a straight 8-step run at step s
    assert [lr[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]
    # ... which is not where the 4-step schedule left off (its floor): the schedules did not mix
    floor = short.metrics[-1]["lr"]
    assert ref[5] > 2 * floor and ref[6] > floor
    assert [r["lr"] for r in short.metrics] != [ref[s] for s in range(1, 5)]  # the two schedules differ


def test_extend_needs_resume(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ds_config", "x.json", "--target", "t", "--hidden-states", "s", "--output", "o", "--extend"])
    assert "--extend re-plans a resumed run: give it together with --resume" in capsys.readouterr().err
