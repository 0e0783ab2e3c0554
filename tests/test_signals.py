"""Interruption: a SIGTERM sent to a real ``torchrun`` launcher mid-run makes both workers finish the step, save a
checkpoint and exit; resuming from it reproduces the uninterrupted run bit for bit. A second
signal exits at once; handlers are restored afterwards."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config
from recipe.train.checkpoint import LATEST
from recipe.train.signals import EXIT_INTERRUPTED, StopRequest


def _wait_for_steps(metrics, proc, steps: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            raise AssertionError(f"torchrun exited early with {proc.returncode}:\n{proc.stdout.read()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no {steps} steps within {timeout} s")


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_a_checkpoint_that_resumes_exactly(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    # constant LR (no scheduler): the step budget of the interrupted run may differ from the resumed one
    cfg = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4, scheduler=None)
    cut = tmp_path / "cut"
    argv = train_argv(cfg, target, store, cut, "--epochs", "1000", "--no-export")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.Popen([*torchrun, str(ROOT / "run.py"), *argv, "--max-steps", "1000"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_steps(cut / "metrics.jsonl", proc, 3)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = len((cut / "metrics.jsonl").read_text().splitlines())
    assert 3 <= steps < 1000, log
    # both workers got the relayed SIGTERM, agreed on the step and saved it (exit code: see test_resume)
    assert log.count("SIGTERM received") == 2, log
    assert f"interrupted: checkpoint of step {steps} saved" in log, log
    assert (cut / "checkpoints" / LATEST).read_text().strip() == f"step-{steps:08d}"

    total = str(steps + 2)
    resumed, straight = run_ranks(2, run_jobs, [
        Job([*argv, "--max-steps", total, "--resume"]),
        Job(train_argv(cfg, target, store, tmp_path / "straight", "--epochs", "1000", "--no-export",
                       "--max-steps", total)),
    ])[0]
    assert resumed.rc == 0 and straight.rc == 0, resumed.stderr + straight.stderr
    assert f"at step {steps}" in resumed.stderr
    same_curve(straight.metrics, resumed.metrics)


def test_second_signal_exits_at_once():
    script = ("import os, signal, time\n"
              "from recipe.train.signals import StopRequest\n"
              "with StopRequest() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
              "    print('first', stop.requested, stop.agreed(), flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGINT); time.sleep(10)\n"
              "    print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stdout == "first True True\n"
    assert "SIGTERM received" in done.stderr and "second signal SIGINT: exiting now" in done.stderr


def test_handlers_are_restored_and_no_signal_means_no_stop():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert not stop.requested and not stop.agreed()
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupted_exit_code_differs_from_success_errors_and_signal_exits():
    assert EXIT_INTERRUPTED not in (0, 1, 2) and EXIT_INTERRUPTED < 128
