"""A run left alone on a cluster (docs/training.md "Periodic checkpoints", "Hangs"; docs/cluster.md "Slurm"):
``--resume auto`` starts afresh in an empty folder and resumes a run's folder bit for bit; checkpoints by wall time
are agreed by every rank; the hang watchdog writes every rank's stacks and exits with ``EXIT_HUNG``, the last
checkpoint staying the resume point (``scripts/slurm/train.sbatch`` under a real Slurm: tests/test_slurm_real.py).
Also the flag fixes: ``--max-length 32k``, defaults in ``--help``, a missing ``--ds_config`` found at parse time, a
JSONL without the conversation field naming its keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config
from recipe.export import LATEST
from recipe.lifecycle.distributed import free_port
from recipe.lifecycle.manifest import verify
from recipe.lifecycle.output_dir import resume_mode
from recipe.lifecycle.signals import EXIT_INTERRUPTED
from recipe.lifecycle.watch import EXIT_HUNG, HangWatchdog, SaveClock, group_timeout
from recipe.train.flags import build_parser, parse_args

DS = str(ROOT / "ds_configs" / "zero0.json")


def _args(output: Path, *extra: str):
    return parse_args(["--ds_config", DS, "--target", "t", "--data", "d.jsonl", "--output", str(output), *extra])


def test_max_length_takes_the_planners_lengths(capsys):
    assert _args(Path("o"), "--max-length", "32k").max_length == 32768
    assert _args(Path("o"), "--max-length", "1.5k").max_length == 1536
    assert _args(Path("o"), "--max-length", "4096").max_length == 4096
    with pytest.raises(SystemExit) as exc:
        _args(Path("o"), "--max-length", "32q")
    assert exc.value.code == 2 and "bad length '32q'" in capsys.readouterr().err


def test_help_shows_the_defaults():
    entries, current = {}, None  # option -> its help text (the entry's lines after "  --flag METAVAR")
    for line in build_parser().format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
    for flag, default in (("--max-length", "2048"), ("--ttt-steps", "7"), ("--save-every-minutes", "30.0"),
                          ("--hang-timeout-minutes", "10.0"), ("--keep-checkpoints", "2"), ("--save-every", "0"),
                          ("--lm-head-init", "target")):
        assert " ".join(entries[flag].split()).endswith(f"(default: {default})"), entries[flag]
    assert not any("(default: None)" in e or "(default: False)" in e for e in entries.values())


def test_a_missing_ds_config_is_refused_before_the_process_group_is_up(tmp_path, capsys, monkeypatch):
    import torch.distributed as dist

    from run import main

    def no_group(*args, **kwargs):
        raise AssertionError("the process group was started")
    monkeypatch.setattr("recipe.lifecycle.distributed.init_distributed", no_group)
    assert not dist.is_initialized()
    code = main(["--ds_config", str(tmp_path / "nope.json"), "--target", "t", "--data", "d", "--output", "o"])
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the width its console was made with
    assert code == 2 and f"error (rank 0): {tmp_path / 'nope.json'}: cannot read DeepSpeed config" in err, err


def test_resume_auto_decides_by_what_the_folder_holds(tmp_path):
    empty = tmp_path / "empty"
    assert resume_mode(_args(empty, "--resume", "auto")) == (None, None)  # no folder yet: a fresh run
    empty.mkdir()
    assert resume_mode(_args(empty, "--resume", "auto")) == (None, None)
    mode, refusal = resume_mode(_args(empty, "--resume"))  # plain --resume keeps its meaning: there must be one
    assert mode is None and "no checkpoint to resume from" in refusal and "--resume auto" in refusal

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "checkpoints" / LATEST).write_text("step-00000004\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert resume_mode(_args(run, "--resume", "auto")) == ("latest", None)
    assert resume_mode(_args(run, "--resume")) == ("latest", None)
    assert resume_mode(_args(run, "--resume", str(run / "checkpoints" / "step-00000004")))[1] is None
    mode, refusal = resume_mode(_args(run))  # without --resume: refused as before
    assert mode is None and "already holds a run" in refusal and "from step-00000004" in refusal

    crashed = tmp_path / "crashed"  # a run that logged steps but never completed a checkpoint
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text('{"step": 1}\n')
    mode, refusal = resume_mode(_args(crashed, "--resume", "auto"))
    assert mode is None and "--resume auto found no complete checkpoint" in refusal and "--overwrite" in refusal
    assert resume_mode(_args(crashed, "--overwrite")) == (None, None)


def test_save_clock_is_due_after_its_minutes_and_resets():
    now = [100.0]
    clock = SaveClock(0.5, clock=lambda: now[0])
    assert not clock.due()
    now[0] += 29.9
    assert not clock.due()
    now[0] += 0.1
    assert clock.due()
    clock.reset()
    assert not clock.due()
    now[0] += 1e6
    assert not SaveClock(0, clock=lambda: now[0]).due()  # 0: never by time


def test_group_timeout_stays_above_the_watchdog():
    assert group_timeout(10).total_seconds() == 30 * 60  # DeepSpeed's default at least
    assert group_timeout(25).total_seconds() == 50 * 60
    assert group_timeout(0).total_seconds() == 30 * 60


def test_hang_watchdog_fires_without_beats_and_not_while_beaten(tmp_path):
    now, exits, calls = [0.0], [], []
    dog = HangWatchdog(tmp_path, 3, 1.0, on_exit=lambda: calls.append("on_exit"), clock=lambda: now[0],
                       exit=exits.append)
    dog.poll_s, dog.sleep = 0.01, calls.append
    with dog:
        for step in range(1, 4):  # beaten every 59 s: never fires
            now[0] += 59
            dog.beat(f"step {step + 1}")
            time.sleep(0.05)
        assert not exits and not (tmp_path / "hang-rank-3.txt").exists()
        now[0] += 60
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert exits == [EXIT_HUNG] and calls == [dog.grace_s, "on_exit"]
    text = (tmp_path / "hang-rank-3.txt").read_text()
    assert "rank 3" in text and "nothing finished for 60 s" in text and "while in step 4" in text
    assert "last finished: step 3" in text
    assert 'File "' in text and "test_hang_watchdog_fires_without_beats" in text  # the main thread's stack


def test_a_jsonl_without_the_conversation_field_names_its_keys(tmp_path):
    from recipe.data.sources import DataFile, load_rows

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": i, "dialog": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "yo"}]}) + "\n"
                            for i in range(3)))
    with pytest.raises(ValueError) as exc:
        load_rows(DataFile(str(path), "json"), cache_dir=str(tmp_path / "cache"))
    message = str(exc.value)
    assert str(path) in message and "['dialog', 'id']" in message and "--data-column messages=dialog" in message
    rows = load_rows(DataFile(str(path), "json"), columns={"messages": "dialog"}, cache_dir=str(tmp_path / "cache"))
    assert len(rows) == 3 and set(rows["reason"]) == {""}


def _listing(root: Path, out: Path) -> None:
    out.write_text(json.dumps(sorted(p.name for p in root.glob("step-*"))))


TOTAL = 16  # steps of the auto-resumed and the straight runs (one LR schedule for both)


@pytest.fixture(scope="module")
def auto_runs(tiny_target_and_store, tmp_path_factory):
    """In one ``run_ranks(2)`` call: a ``--resume auto`` run into an empty folder, interrupted after step 3 with a
    checkpoint by wall time due on rank 1 only after step 2; its ``--resume auto`` rerun; a straight run of
    :data:`TOTAL` steps. Returns (folder, DeepSpeed JSON, outcomes)."""
    target, store = tiny_target_and_store
    tmp = tmp_path_factory.mktemp("unattended")
    cfg = write_ds_config(tmp / "z3.json", base="zero3.json", train_batch_size=4)
    run = tmp / "run"

    def argv(output, *extra):
        return train_argv(cfg, target, store, output, "--epochs", "1000", "--max-steps", str(TOTAL), "--no-export",
                          *extra)
    outcomes = run_ranks(2, run_jobs, [
        Job(argv(run, "--resume", "auto"), sigterm_after=3, save_due={1: {2}}),
        Job(argv(run, "--resume", "auto"), before=(_listing, run / "checkpoints", tmp / "after.json")),
        Job(argv(tmp / "straight")),
    ])[0]
    return tmp, cfg, outcomes


@pytest.mark.slow
def test_resume_auto_starts_then_resumes_bitwise_and_time_saves_are_agreed(auto_runs):
    tmp, _, (first, resumed, straight) = auto_runs
    run = tmp / "run"
    assert first.rc == EXIT_INTERRUPTED, first.stderr
    assert f"--resume auto: no run in {run}; starting afresh" in " ".join(first.stderr.split())
    # only rank 1's clock was due after step 2, yet both ranks saved it (a one-rank save would have hung)
    assert json.loads((tmp / "after.json").read_text()) == ["step-00000002", "step-00000003"]
    assert resumed.rc == 0 and straight.rc == 0, resumed.stderr + straight.stderr
    assert f"--resume auto: resuming the run in {run}" in " ".join(resumed.stderr.split())
    assert "at step 3" in resumed.stderr
    same_curve(straight.metrics, resumed.metrics)  # steps 1..TOTAL once each, bit-identical


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_leaves_every_ranks_stacks_and_exit_76(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    cfg = write_ds_config(tmp_path / "z0.json", base="zero0.json", train_batch_size=4)
    out = tmp_path / "run"
    argv = train_argv(cfg, target, store, out, "--epochs", "1000", "--max-steps", "50", "--no-export",
                      "--save-every", "2", "--hang-timeout-minutes", "0.1")
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "hang_rank.py"), "1", "5",
                                       *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [EXIT_HUNG, EXIT_HUNG], logs
    stacks = [(out / f"hang-rank-{r}.txt").read_text() for r in range(2)]
    for r, text in enumerate(stacks):
        assert f"rank {r}" in text and "while in step 5" in text and "last finished: what follows step 4" in text
        assert "loop.py" in text and " in train\n" in text, text  # the main thread, inside the training loop
        assert f"error (rank {r}): hang watchdog" in logs[r], logs[r]
    assert "step_or_hang" in stacks[1] and "all_reduce" in stacks[1]  # the stuck rank, in its extra collective
    assert "step_or_hang" in stacks[0] and " in train_step\n" in stacks[0]  # rank 0: in the step, waiting for 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert (out / "checkpoints" / LATEST).read_text().strip() == "step-00000004"  # the resume point
    assert verify(out / "checkpoints" / "step-00000004") is None
    assert not list((out / "checkpoints").glob(".partial/*"))
