"""Interruption through the real DeepSpeed launcher on 2 gloo ranks: ``deepspeed`` (the runner) starts
``python -m deepspeed.launcher.launch``, which starts the two ``run.py`` ranks. Each way of stopping a job ends with
both ranks saving the step reached, ``OUTPUT/INTERRUPTED`` naming it, each rank's /dev/shm buffer removed, and a
``--resume`` that continues bit for bit like an uninterrupted run (one shared reference, all resumes in one
``run_ranks`` call); the exit codes are the ones docs/training.md's "Interruption, resume and exit codes" lists:

- Ctrl-C (SIGINT to the process group): the runner dies of its KeyboardInterrupt at once (-SIGINT); ``launch.py``
  relays SIGTERM (ignored by the ranks as a copy within the grace period) and exits 1 once the ranks are done;
- SIGTERM to the runner: it exits at once (-SIGTERM, it does not forward the signal); the ranks' launcher watch sees
  their launcher gone and stops them; the orphaned ``launch.py`` exits with the ranks' 75;
- SIGTERM to ``launch.py``: it relays SIGTERM to rank 0, exits 1, and so does the runner;
- SIGTERM to a rank (rank 1): both ranks agree on the step and exit 75; ``launch.py`` and the runner pass 75 on.

The four jobs run at the same time (distinct ports and folders). This process is made a child subreaper for the
duration, so the orphaned ``launch.py`` is re-parented here and its exit code can be read.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
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
from recipe.lifecycle.signals import EXIT_INTERRUPTED, INTERRUPTED_FILE

psutil = pytest.importorskip("psutil")

SCENARIOS = ("ctrl_c", "term_runner", "term_launch", "term_rank")
TOTAL = 30  # the resumed and the reference runs' length; every interrupted run must stop before it
PR_SET_CHILD_SUBREAPER = 36


def _subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _steps(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


class Launch:
    """One ``deepspeed --num_gpus 2`` job in its own session (so a killpg is the terminal's Ctrl-C)."""

    def __init__(self, name: str, argv: list[str], tmp: Path):
        self.name, self.output = name, Path(argv[argv.index("--output") + 1])
        self.port = free_port()
        self.log_path = tmp / f"{name}.log"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "COLUMNS": "400"}
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(self.port),
               "run.py", *argv, "--max-steps", "1000"]
        with open(self.log_path, "w") as log:
            # SIGINT at its default in the runner, as under a terminal's Ctrl-C: a pytest started in the background
            # of a non-interactive shell inherits SIGINT ignored, and the runner would then outlive the ctrl_c case
            self.runner = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True,
                                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.launch_pid = self.rank_pids = None
        self.runner_rc = self.launch_rc = None
        self.finished = False
        self.signalled_at = None

    def started(self) -> bool:
        """Training has started (metrics.jsonl has a step); records the launch.py and rank pids."""
        if self.runner.poll() is not None:
            raise AssertionError(f"{self.name}: runner exited early with {self.runner.returncode}:\n{self.log()}")
        if _steps(self.output / "metrics.jsonl") < 1:
            return False
        (launch,) = psutil.Process(self.runner.pid).children()
        ranks = sorted(launch.children(), key=lambda p: "--local_rank=1" in " ".join(p.cmdline()))
        assert "deepspeed.launcher.launch" in launch.cmdline() and len(ranks) == 2, (launch.cmdline(), ranks)
        self.launch_pid, self.rank_pids = launch.pid, [p.pid for p in ranks]
        return True

    def interrupt(self) -> None:
        self.signalled_at = time.monotonic()
        if self.name == "ctrl_c":
            os.killpg(self.runner.pid, signal.SIGINT)
        elif self.name == "term_runner":
            self.runner.send_signal(signal.SIGTERM)
        elif self.name == "term_launch":
            os.kill(self.launch_pid, signal.SIGTERM)
        else:
            os.kill(self.rank_pids[1], signal.SIGTERM)

    def finish(self, timeout: float = 180.0) -> None:
        """Wait for the runner, then (if it left it orphaned, re-parented to this subreaper) for launch.py."""
        self.runner_rc = self.runner.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(self.launch_pid, os.WNOHANG)
            except ChildProcessError:  # not ours: the runner waited for it
                break
            if pid:
                self.launch_rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.2)
        else:
            self.kill()
            raise AssertionError(f"{self.name}: launch.py still running {timeout} s after the runner:\n{self.log()}")
        # what the interrupted run left (the resume appends to metrics.jsonl, moves latest, removes the marker)
        self.steps = _steps(self.output / "metrics.jsonl")
        self.latest = (self.output / "checkpoints" / LATEST).read_text().strip()
        marker = self.output / INTERRUPTED_FILE
        self.marker = json.loads(marker.read_text()) if marker.is_file() else None
        for pid in self.rank_pids:  # the ranks exited (launch.py waited for them), none trains on orphaned
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        self.finished = True

    def kill(self) -> None:
        """SIGKILL what is left of this job (a failed test): only processes whose command line names its output."""
        for pid in [self.runner.pid, self.launch_pid, *(self.rank_pids or [])]:
            try:
                if pid and str(self.output) in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, psutil.Error):
                pass
        if self.runner.poll() is None:
            self.runner.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def interrupted_runs(tiny_target_and_store, tmp_path_factory):
    """The four interrupted jobs, then the reference run and the four resumes (``run_ranks``): a dict of
    scenario -> (Launch, resumed Outcome) and the reference Outcome."""
    if not _subreaper(True):
        pytest.skip("needs prctl(PR_SET_CHILD_SUBREAPER) (Linux)")
    target, store = tiny_target_and_store
    tmp = tmp_path_factory.mktemp("launcher_signals")
    # constant LR (no scheduler): the interrupted runs' planned length (1000 steps) may differ from the resumed one
    cfg = write_ds_config(tmp / "z3.json", base="zero3.json", train_batch_size=4, scheduler=None)

    def argv(name):
        return train_argv(cfg, target, store, tmp / name, "--epochs", "1000", "--no-export")

    launches = {}
    try:
        for name in SCENARIOS:
            launches[name] = Launch(name, argv(name), tmp)
        waiting, deadline = set(SCENARIOS), time.monotonic() + 240
        while waiting and time.monotonic() < deadline:
            for name in sorted(waiting):
                if launches[name].started():
                    launches[name].interrupt()
                    waiting.discard(name)
            time.sleep(0.1)
        assert not waiting, f"no training step within 240 s: {sorted(waiting)}"
        for launch in launches.values():
            launch.finish()
    finally:
        for launch in launches.values():
            if not launch.finished:
                launch.kill()
        _subreaper(False)
    for name, launch in launches.items():
        assert 1 <= launch.steps < TOTAL, (name, launch.log())

    jobs = [Job(train_argv(cfg, target, store, tmp / "straight", "--epochs", "1000", "--no-export",
                           "--max-steps", str(TOTAL)))]
    jobs += [Job([*argv(name), "--max-steps", str(TOTAL), "--resume"]) for name in SCENARIOS]
    straight, *resumed = run_ranks(2, run_jobs, jobs)[0]
    assert straight.rc == 0, straight.stderr
    return {name: (launches[name], out) for name, out in zip(SCENARIOS, resumed)}, straight


# runner's exit code (what `deepspeed ...` returns to the job script), launch.py's when the runner left it orphaned
EXPECTED_CODES = {
    "ctrl_c": (-signal.SIGINT, 1),
    "term_runner": (-signal.SIGTERM, EXIT_INTERRUPTED),
    "term_launch": (1, None),
    "term_rank": (EXIT_INTERRUPTED, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_every_way_of_stopping_the_deepspeed_launcher_saves_and_resumes_exactly(interrupted_runs, name):
    runs, straight = interrupted_runs
    launch, resumed = runs[name]
    log = launch.log()
    steps = launch.steps

    assert (launch.runner_rc, launch.launch_rc) == EXPECTED_CODES[name], log
    assert f"interrupted: checkpoint of step {steps} saved" in log, log
    assert "second signal" not in log, log  # no rank took a relayed copy for a deliberate second signal
    assert launch.latest == f"step-{steps:08d}"
    marker = launch.marker
    assert marker is not None and marker["checkpoint"] == f"step-{steps:08d}" and marker["step"] == steps
    assert marker["exit_code"] == EXIT_INTERRUPTED
    leaked = [p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{launch.port}_*")]
    assert not leaked, leaked
    if name == "ctrl_c":
        # the terminal's SIGINT and launch.py's relayed SIGTERM arrive together: each rank stops on the first it
        # handles (under load a rank can handle the SIGTERM first) and ignores the other as a copy
        first = [log.count(f"{sig} received: stopping after this step") for sig in ("SIGINT", "SIGTERM")]
        assert sum(first) == 2 and first[0] >= 1, log
        assert log.count("taken as a relayed copy") >= 1, log
        assert marker["cause"] in ("SIGINT", "SIGTERM")
    elif name == "term_runner":
        assert f"launcher deepspeed (pid {launch.runner.pid}) is gone" in log, log
        assert "SIGTERM received: stopping" not in log, log  # nobody forwarded it: the launcher watch stopped the ranks
        # rank 0 writes the marker: the watch's reason, or "another rank" when rank 1's watch saw it first
        assert marker["cause"] in (f"launcher deepspeed (pid {launch.runner.pid}) is gone", "another rank")
    elif name == "term_launch":
        assert log.count("SIGTERM received: stopping after this step") == 1, log  # rank 0; rank 1 agreed
        assert marker["cause"] == "SIGTERM"
    else:
        assert log.count("SIGTERM received: stopping after this step") == 1, log  # rank 1; rank 0 agreed
        assert marker["cause"] == "another rank"

    assert resumed.rc == 0, resumed.stderr
    assert f"at step {steps}" in resumed.stderr
    assert not (launch.output / INTERRUPTED_FILE).exists()  # a new run clears the marker
    same_curve(straight.metrics, resumed.metrics)  # steps 1..TOTAL once each, bit-identical losses
