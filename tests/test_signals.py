"""Interruption: a SIGTERM sent to a real ``torchrun`` launcher mid-run makes both workers finish the step, save a
checkpoint and exit; resuming from it reproduces the uninterrupted run bit for bit. The grace period: a further
signal within ``GRACE_S`` of the first is a relayed copy and ignored, one after it exits at once with 128+signum
(the clean-up callback first); signals while the run is closing are ignored; nested stop requests share one state;
the launcher watch stops a rank whose launcher dies; handlers are restored afterwards. The real DeepSpeed launcher:
``tests/test_launcher_signals.py``."""
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
from recipe.export import LATEST
from recipe.lifecycle.signals import (EXIT_INTERRUPTED, GRACE_S, StopRequest, broken_link, launcher_chain,
                                  launcher_name)


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
        log, _ = proc.communicate(timeout=300)  # the save and the exit, on a loaded 2-core machine
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


@pytest.mark.slow
def test_second_signal_exits_at_once_after_the_grace_period():
    script = ("import os, signal, time\n"
              "from recipe.lifecycle.signals import StopRequest\n"
              "with StopRequest() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
              "    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
              "    print('first', stop.requested, stop.agreed(), flush=True)\n"
              "    time.sleep(2.2); os.kill(os.getpid(), signal.SIGINT); time.sleep(10)\n"
              "    print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stdout == "first True True\n"
    assert "SIGTERM received: stopping after this step" in done.stderr
    assert "SIGINT received 0.2 s after SIGTERM: taken as a relayed copy" in done.stderr
    assert "second signal SIGINT: exiting now" in done.stderr


class _Exit(Exception):
    pass


def _fake(clock_s: list[float], **kwargs) -> tuple[StopRequest, list]:
    """A StopRequest on a fake clock whose forced exit raises _Exit(code) after recording the on_abort call."""
    calls = []

    def exit_(code):
        raise _Exit(code)
    return StopRequest(clock=lambda: clock_s[0], exit=exit_, on_abort=lambda: calls.append("abort"), **kwargs), calls


def test_grace_period_ignores_a_relayed_copy_and_aborts_on_a_deliberate_second_signal(capfd):
    now = [100.0]
    stop, calls = _fake(now)
    stop._handle(signal.SIGINT, None)  # Ctrl-C
    assert stop.requested and stop.signum == signal.SIGINT and stop.reason == "SIGINT"
    now[0] += 0.3
    stop._handle(signal.SIGTERM, None)  # the launcher's relayed copy
    now[0] += GRACE_S - 0.4  # still within the grace period of the first signal
    stop._handle(signal.SIGINT, None)
    assert calls == [] and stop.signum == signal.SIGINT
    err = capfd.readouterr().err
    assert "SIGINT received: stopping after this step and saving a checkpoint" in err
    assert err.count("taken as a relayed copy") == 2 and "SIGTERM received 0.3 s after SIGINT" in err
    now[0] += 0.2  # 2.1 s after the first: deliberate
    with pytest.raises(_Exit) as exc:
        stop._handle(signal.SIGINT, None)
    assert exc.value.args == (128 + signal.SIGINT,) and calls == ["abort"]
    assert "second signal SIGINT: exiting now, no checkpoint" in capfd.readouterr().err


def test_signals_while_closing_are_ignored_within_the_grace_period(capfd):
    now = [0.0]
    stop, calls = _fake(now)
    stop._handle(signal.SIGINT, None)
    stop.closing()
    now[0] = 10.0  # long after the first signal: a relayed SIGTERM reaching a rank that already saved
    stop._handle(signal.SIGTERM, None)
    now[0] = 11.0
    stop._handle(signal.SIGTERM, None)
    assert calls == [] and capfd.readouterr().err.count("while the run is exiting: ignored") == 2
    now[0] = 12.5  # insisting: exits
    with pytest.raises(_Exit) as exc:
        stop._handle(signal.SIGTERM, None)
    assert exc.value.args == (128 + signal.SIGTERM,) and calls == ["abort"]


def test_a_stop_without_signal_never_counts_towards_a_forced_exit(capfd):
    now = [0.0]
    stop, calls = _fake(now)
    stop.request("launcher deepspeed (pid 1234) is gone")
    assert stop.requested and stop.signum is None and stop.reason == "launcher deepspeed (pid 1234) is gone"
    now[0] = 30.0  # a signal long after the watch stopped the run is a first signal
    stop._handle(signal.SIGTERM, None)
    assert calls == [] and stop.signum == signal.SIGTERM
    assert "already stopping after this step (launcher deepspeed (pid 1234) is gone)" in capfd.readouterr().err
    now[0] = 33.0
    with pytest.raises(_Exit):
        stop._handle(signal.SIGTERM, None)


def test_nested_requests_share_the_outer_state_and_restore_its_handlers():
    before = signal.getsignal(signal.SIGTERM)
    now = [0.0]
    outer, calls = _fake(now)
    with outer:
        outer._handle(signal.SIGTERM, None)  # e.g. during set-up
        with StopRequest() as inner:  # the training loop's
            assert signal.getsignal(signal.SIGTERM) == inner._handle
            assert inner.requested and inner.signum == signal.SIGTERM
            now[0] = 5.0
            with pytest.raises(_Exit):  # the outer's clock, grace period and clean-up apply
                inner._handle(signal.SIGINT, None)
            assert calls == ["abort"]
        assert signal.getsignal(signal.SIGTERM) == outer._handle
    assert signal.getsignal(signal.SIGTERM) is before
    with StopRequest() as fresh:
        assert not fresh.requested


def test_launcher_names_and_the_chain_of_this_process():
    assert launcher_name(["/v/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"]) \
        == "deepspeed.launcher.launch"
    assert launcher_name(["/v/bin/python3", "/v/bin/deepspeed", "--num_gpus", "2", "run.py"]) == "deepspeed"
    assert launcher_name(["/v/bin/python3", "/v/bin/torchrun", "--nproc_per_node", "2"]) == "torchrun"
    assert launcher_name(["python", "-m", "torch.distributed.run", "run.py"]) == "torch.distributed.run"
    assert launcher_name(["python", "run.py", "--output", "deepspeed"]) is None
    assert launcher_name([]) is None
    assert launcher_chain() == []  # pytest is started by no launcher
    assert broken_link([(os.getpid(), os.getppid(), "x")]) is None
    assert broken_link([(os.getpid(), 1, "x")]) == (os.getpid(), 1, "x")


@pytest.mark.slow
def test_the_launcher_watch_stops_a_rank_whose_launcher_dies(tmp_path):
    """A stand-in launcher (a script named ``deepspeed``) starts a "rank" that waits for a stop request, then dies
    of SIGKILL: the orphaned rank's launcher watch requests the stop (the rank shares the test's stderr pipe, so
    ``subprocess.run`` returns once it has exited too)."""
    rank = ("import sys, time\n"
            "from recipe.lifecycle.signals import StopRequest\n"
            "with StopRequest(watch_launcher=True) as stop:\n"
            "    print('ready', flush=True)\n"
            "    deadline = time.monotonic() + 30\n"
            "    while not stop.requested and time.monotonic() < deadline: time.sleep(0.05)\n"
            "    print('rank stopped:', stop.reason, file=sys.stderr, flush=True)\n")
    launcher = tmp_path / "deepspeed"
    launcher.write_text("import os, signal, subprocess, sys\n"
                        f"rank = subprocess.Popen([sys.executable, '-c', {rank!r}],\n"
                        "                        stdout=subprocess.PIPE, text=True)\n"
                        "print(rank.stdout.readline().strip(), rank.pid, flush=True)\n"
                        "os.kill(os.getpid(), signal.SIGKILL)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(launcher)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == -signal.SIGKILL and done.stdout.startswith("ready "), (done.stdout, done.stderr)
    assert "is gone: stopping after this step and saving a checkpoint" in done.stderr, done.stderr
    assert "rank stopped: launcher deepspeed (pid" in done.stderr, done.stderr
    assert time.monotonic() - t0 < 30


def test_handlers_are_restored_and_no_signal_means_no_stop():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert not stop.requested and not stop.agreed()
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupted_exit_code_differs_from_success_errors_and_signal_exits():
    assert EXIT_INTERRUPTED not in (0, 1, 2) and EXIT_INTERRUPTED < 128
