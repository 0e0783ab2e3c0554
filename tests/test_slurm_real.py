"""``scripts/slurm/train.sbatch`` under a real Slurm 22.05 (``helpers.real_slurm``: a private one-node cluster, root
only; the tests skip with the reason elsewhere, and fail instead under ``REQUIRE_REAL_SLURM=1``, which ``.ci/run``
sets once it installed Slurm). What docs/cluster.md "Slurm" says, as the real slurmctld/slurmd/srun do it:

- the time-limit warning reaches the batch script (``--signal=B:USR1@N``), which sends TERM to the ranks (``scancel
  --signal=TERM``, not to srun); they save, exit 75, the job is requeued and resumes with ``--resume auto``, and the
  concatenated ``metrics.jsonl`` equals one uninterrupted run's bit for bit (2 CPU ranks of the tiny target);
- ``scancel`` (here with ``--launcher torchrun``): the ranks save within KillWait, the job stays cancelled, its
  checkpoints intact; ``scancel --signal=TERM`` (here with ``--launcher deepspeed``): saved, not requeued;
- preemption (``PreemptMode=REQUEUE``): with a grace time the script requeues, without one Slurm does;
- ranks that disagree (one exits 2, the other 76) end the job with 2; a hang on every rank is requeued at most
  ``MAX_RESTARTS`` times.

The training jobs hold their ranks before step 4 until a stop is requested (``helpers.slurm_rank``), so a signal
always finds them past step 3 however loaded the machine; the stand-in ranks of ``helpers.slurm_stub_rank`` serve
the tests about the script's decisions. Every wait polls Slurm's state with a generous limit.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.slurm_rank import write_python
from helpers.training import ROOT, train_argv, write_ds_config
from recipe.export import LATEST
from recipe.lifecycle.manifest import verify
from recipe.lifecycle.signals import INTERRUPTED_FILE

pytestmark = pytest.mark.slow
SCRIPT = "scripts/slurm/train.sbatch"
TOTAL = 8  # steps of the training jobs: held before step 4, stopped after it, resumed for 5..8
HELD = 3   # metrics.jsonl has this many records while the ranks wait
READY_S = 600.0  # the ranks started and past step 3 (20 s on an idle 2-core machine; far longer when it is loaded)


@pytest.fixture(scope="session")
def slurm_cluster():
    from helpers import real_slurm

    try:
        cluster = real_slurm.start()
    except real_slurm.SlurmUnavailable as exc:
        if os.environ.get("REQUIRE_REAL_SLURM") == "1":
            pytest.fail(f"REQUIRE_REAL_SLURM=1 but {exc}")
        pytest.skip(str(exc))
    yield cluster
    killed = cluster.stop()
    left = real_slurm.leftovers(cluster.root)
    assert not left and not cluster.root.exists(), f"the private cluster left {left} in {cluster.root}"
    assert not killed, f"processes still running after the daemons stopped (killed): {killed}"


def _job_env(cluster, python: Path, **extra) -> dict:
    return {**cluster.env, "PYTHON": str(python), "OMP_NUM_THREADS": "1", "COLUMNS": "400",
            "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in extra.items()}}


def _submit(cluster, tmp: Path, env: dict, *flags: str, sbatch=(), launcher=()) -> int:
    """``sbatch`` the script as docs/cluster.md prints it, the allocation shrunk to one node of two CPU ranks."""
    return cluster.sbatch("--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                          f"--output={tmp}/slurm-%j.out", *sbatch, SCRIPT, *launcher, *flags, env=env, cwd=ROOT)


def _log(tmp: Path, job: int, cluster=None) -> str:
    """The job's output; with ``cluster``, also the lines of the daemons' logs that name the job."""
    path = tmp / f"slurm-{job}.out"
    text = path.read_text(errors="replace") if path.exists() else "(no log yet)"
    if cluster is not None:
        mark = re.compile(rf"\b(JobId=|job_?id[ =:]|StepId=|job |Job )?{job}\b")
        text += "\n--- slurmctld/slurmd on this job:\n" + "\n".join(
            line for name in ("slurmctld", "slurmd") for line in cluster.log(name).splitlines() if mark.search(line))
    return text


def _wait_held(cluster, tmp: Path, job: int, out: Path) -> None:
    """Wait until the job's ranks wait before step 4 (``metrics.jsonl`` has :data:`HELD` records)."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + READY_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= HELD):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} {state}:\n{_log(tmp, job)}"
        assert time.monotonic() < deadline, f"job {job}: no step {HELD} within {READY_S:.0f} s:\n{_log(tmp, job)}"
        time.sleep(0.5)


def _seconds(text: str) -> int:
    """Slurm's ``[D-]HH:MM:SS`` as seconds."""
    days, _, clock = text.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _cut_time_limit(cluster, job: int, seconds: int) -> None:
    """Set the job's time limit to the first whole minute at least ``seconds`` past its run time (``scontrol update
    TimeLimit``, as an administrator can; Slurm keeps time limits in minutes)."""
    limit = -(-(_seconds(cluster.job(job)["RunTime"]) + seconds) // 60)
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={limit}")


RAW_JOB = """#!/bin/bash
trap 'echo "batch got TERM"; got_term=1' TERM
trap 'echo "batch got USR1"' USR1
srun --ntasks=1 bash -c 'trap "echo task got TERM; exit 75" TERM; touch "$0"; while :; do sleep 0.1; done' "$1" &
pid=$!
if [ "${KILL_SRUN:-0}" = 1 ]; then until [ -f "$1" ]; do sleep 0.1; done; kill -TERM "$pid"; fi
while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
echo "srun exited $rc"
if [ "${REQUEUE:-0}" = 1 ]; then
  for _ in $(seq 300); do [ -n "${got_term:-}" ] && break; sleep 0.1; done
  scontrol requeue "$SLURM_JOB_ID"; echo "requeue exited $?"
fi
"""
"""The batch script of the raw-Slurm tests. With ``REQUEUE=1`` it requeues only once its own TERM has come (at most
30 s): scancel signals the step's task and the batch shell separately, and under load the task can exit and the
script reach ``scontrol requeue`` before the batch shell's TERM arrives, which then kills scontrol (exit 143)."""


def _raw_job(cluster, tmp: Path, *sbatch: str, **env) -> int:
    """A plain batch script (:data:`RAW_JOB`): one srun task that traps TERM (after it touched ``tmp/started``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.sh").write_text(RAW_JOB)
    return cluster.sbatch("--ntasks=1", f"--output={tmp}/slurm-%j.out", *sbatch, str(tmp / "job.sh"),
                          str(tmp / "started"), env={**cluster.env, **env})


def _stub_job(cluster, tmp: Path, partition: str = "main", sbatch=(), **env):
    """``train.sbatch`` with the stand-in ranks of ``helpers.slurm_stub_rank`` (two unless ``sbatch`` says else);
    (the job id, its --output)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "run"
    job_env = _job_env(cluster, write_python(tmp / "python", ROOT / "tests" / "helpers" / "slurm_stub_rank.py"),
                       **env)
    return _submit(cluster, tmp, job_env, "--output", str(out), sbatch=(f"--partition={partition}", *sbatch)), out


def _stub_log(out: Path, rank: int) -> str:
    path = out / f"stub-rank-{rank}.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def limit_jobs(slurm_cluster, tmp_path_factory):
    """Two one-CPU jobs that take Slurm's one-minute time limits and so run beside the first training test: a plain
    script under ``--time=2 --signal=TERM@60`` (no ``B:``), and ``train.sbatch`` with one stand-in rank under
    ``--time=1`` (its warning turned into a harmless ``B:CONT``) that reaches its limit, is requeued, and the second
    time not (``MAX_RESTARTS=1``), however late its test looks. Returns {name: (job id, folder, stand-in --output or
    None)}."""
    tmp = tmp_path_factory.mktemp("limit_jobs")
    warned = _raw_job(slurm_cluster, tmp / "warning", "--time=2", "--signal=TERM@60")
    limited, out = _stub_job(slurm_cluster, tmp / "limit", sbatch=("--ntasks-per-node=1", "--time=1",
                                                                   "--signal=B:CONT@600"), MAX_RESTARTS=1)
    return {"warning": (warned, tmp / "warning", None), "limit": (limited, tmp / "limit", out)}


@pytest.fixture(scope="module")
def training(tiny_target_and_store, tmp_path_factory):
    """(tmp folder, the DeepSpeed JSON, ``run.py`` flags without ``--output``) of the training jobs."""
    target, store = tiny_target_and_store
    tmp = tmp_path_factory.mktemp("slurm_real")
    cfg = write_ds_config(tmp / "z3.json", base="zero3.json", train_batch_size=4)
    flags = train_argv(cfg, target, store, Path("OUT"), "--epochs", "1000", "--max-steps", str(TOTAL), "--no-export")
    at = flags.index("--output")
    return tmp, flags[:at] + flags[at + 2:]


def test_the_time_limit_warning_saves_requeues_and_the_resumed_curve_is_one_run(slurm_cluster, training, limit_jobs,
                                                                                  tmp_path):
    """The job is submitted with 30 minutes and ``--signal=B:USR1@60``; once its ranks wait past step 3, its limit is
    cut to the next whole minute at least 65 s away (:func:`_cut_time_limit`), so Slurm's own warning comes within
    about a minute and never during a slow start. Meanwhile the uninterrupted reference trains in this process (and
    the jobs of :func:`limit_jobs` run beside it). After the requeue the limit goes back to 30 minutes."""
    cluster, (_, flags) = slurm_cluster, training
    out = tmp_path / "run"
    env = _job_env(cluster, write_python(tmp_path / "python"), HOLD_AFTER_STEP=HELD)
    job = _submit(cluster, tmp_path, env, *flags, "--output", str(out), sbatch=("--time=30", "--signal=B:USR1@60"))
    _wait_held(cluster, tmp_path, job, out)
    _cut_time_limit(cluster, job, 65)
    straight = run_ranks(2, run_jobs, [Job([*flags, "--output", str(tmp_path / "straight")])])[0][0]
    assert straight.rc == 0, straight.stderr
    cluster.wait_job(job, lambda f: f["Restarts"] != "0" or f["JobState"] not in ("RUNNING", "COMPLETING"), 300,
                     "requeued")
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")
    fields = cluster.wait_ended(job, READY_S)
    text = _log(tmp_path, job, cluster)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    port = 20000 + job % 10000  # MASTER_PORT from the job id: two jobs on one node differ
    assert f"job {job} (restart 0): 1 node(s), 2 rank(s) by srun, rendezvous" in text and f":{port}," in text, text
    assert "time limit near: TERM to the ranks" in text and "exit codes: rank 0: 75, rank 1: 75" in text, text
    assert f"requeueing job {job} after the time limit warning" in text, text
    assert f"job {job} (restart 1)" in text and "exit codes: rank 0: 0, rank 1: 0" in text, text
    assert "at step 4" in text and f"--resume auto: resuming the run in {out}" in " ".join(text.split()), text
    assert not (out / INTERRUPTED_FILE).exists()
    assert (out / "checkpoints" / LATEST).read_text().strip() == f"step-{TOTAL:08d}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    same_curve(straight.metrics, records)  # steps 1..8 once each, bit-identical across the requeue


def _held_job_stopped(cluster, training, tmp: Path, launcher: str, scancel: tuple[str, ...]):
    """A training job by ``--launcher launcher`` (checkpoints every 2 steps), stopped by ``scancel *scancel`` while
    its ranks wait past step 3; (its final fields, its log, its --output)."""
    _, flags = training
    out = tmp / "run"
    env = _job_env(cluster, write_python(tmp / "python"), HOLD_AFTER_STEP=HELD)
    job = _submit(cluster, tmp, env, *flags, "--save-every", "2", "--output", str(out), sbatch=("--time=30",),
                  launcher=("--launcher", launcher))
    _wait_held(cluster, tmp, job, out)
    cluster.run("scancel", *scancel, str(job))
    return job, cluster.wait_ended(job, 300), _log(tmp, job, cluster), out


def _assert_saved_step_4(out: Path, text: str) -> None:
    assert "exit codes: rank 0: 75, rank 1: 75" in text, text
    assert json.loads((out / INTERRUPTED_FILE).read_text())["step"] == 4
    assert (out / "checkpoints" / LATEST).read_text().strip() == "step-00000004"
    for step in (2, 4):  # the periodic checkpoint and the one of the stop, both complete
        assert verify(out / "checkpoints" / f"step-{step:08d}") is None
    assert not list((out / "checkpoints").glob(".partial/*"))


def test_scancel_under_torchrun_saves_within_killwait_and_stays_cancelled(slurm_cluster, training, tmp_path):
    job, fields, text, out = _held_job_stopped(slurm_cluster, training, tmp_path, "torchrun", ())
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), (fields, text)
    assert "2 rank(s) by torchrun" in text and "TERM: the job is being cancelled" in text, text
    assert "srun: forcing job termination" in text and "srun exited with 1;" in text, text  # torchrun's own code
    assert "not requeued: the job was cancelled" in text and "requeueing" not in text, text
    _assert_saved_step_4(out, text)


def test_scancel_signal_term_under_deepspeed_saves_and_is_not_requeued(slurm_cluster, training, tmp_path):
    job, fields, text, out = _held_job_stopped(slurm_cluster, training, tmp_path, "deepspeed", ("--signal=TERM",))
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "75:0", "0"), (fields, text)
    assert "2 rank(s) by deepspeed" in text and "requeueing" not in text, text
    assert "TERM: the job is being" not in text and "forcing job termination" not in text, text  # the steps only
    assert "not requeued: the ranks were stopped by a signal that was neither the time limit nor a" in text, text
    _assert_saved_step_4(out, text)


def test_the_time_limit_without_b_reaches_the_tasks_and_the_limit_itself_is_requeued(slurm_cluster, limit_jobs):
    """``--signal=TERM@60`` (no ``B:``) reaches the task only: srun returns its 75, the batch script hears nothing.
    The time limit itself TERMs the batch script, srun and every rank: the stand-in rank saves within KillWait and
    the script requeues (Reason TimeLimit)."""
    cluster = slurm_cluster
    warned, folder, _ = limit_jobs["warning"]
    fields, text = cluster.wait_ended(warned, 300), _log(folder, warned)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, text)
    assert "task got TERM" in text and "srun exited 75" in text, text
    assert "batch got" not in text and "forcing job termination" not in text, text
    limited, folder, out = limit_jobs["limit"]
    try:
        fields = cluster.wait_job(limited, lambda f: f["Restarts"] != "0" or f["JobState"] not in (
            "PENDING", "RUNNING", "COMPLETING"), 300, "requeued")
    finally:
        cluster.run("scancel", str(limited), check=False)  # before its second run reaches the limit again
    text = _log(folder, limited)
    assert fields["Restarts"] == "1" and text.count("requeueing job") == 1, (fields, text)
    assert "TERM: the job is being cancelled, timed out or preempted" in text, text
    assert "srun: forcing job termination" in text and "DUE TO TIME LIMIT" in text, text
    assert f"requeueing job {limited} after the time limit (the ranks saved within KillWait)" in text, text
    assert "TERM " in _stub_log(out, 0) and "exit 75" in _stub_log(out, 0)


def test_srun_turns_a_term_into_a_kill_and_a_cancelled_job_can_still_be_requeued(slurm_cluster, tmp_path):
    """Why the script never signals srun (its task's TERM trap never runs), and why it reads the job's state before
    it requeues: a cancelled job's own ``scontrol requeue`` is not refused."""
    cluster = slurm_cluster
    job = _raw_job(cluster, tmp_path / "kill", KILL_SRUN="1")
    cluster.wait_ended(job, 120)
    text = _log(tmp_path / "kill", job)
    assert "srun: forcing job termination" in text and "srun exited 137" in text, text
    assert "task got TERM" not in text and "batch got" not in text, text
    job = _raw_job(cluster, tmp_path / "cancel", REQUEUE="1")
    cluster.wait_job(job, lambda f: (tmp_path / "cancel" / "started").exists(), 120, "started")
    cluster.run("scancel", str(job))
    try:
        cluster.wait_job(job, lambda f: "requeue exited" in _log(tmp_path / "cancel", job), 120,
                         "requeued by its script")
        fields = cluster.job(job)  # scontrol requeue answers once slurmctld has requeued the job
    finally:
        cluster.run("scancel", str(job), check=False)
    text = _log(tmp_path / "cancel", job)
    assert "batch got TERM" in text and "task got TERM" in text and "requeue exited 0" in text, text
    assert fields["Restarts"] == "1" and fields["JobState"] in ("PENDING", "REQUEUED", "COMPLETING"), (fields, text)


@pytest.mark.parametrize("partition, requeued_by", [("main", "the script"), ("nograce", "Slurm")])
def test_preemption_reaches_the_ranks_and_requeues_once(slurm_cluster, tmp_path, partition, requeued_by):
    """An ``urgent`` job that wants the whole node preempts ours (PreemptMode=REQUEUE): the ranks get TERM; with
    GraceTime the job would end COMPLETED, so the script requeues it; without, Slurm cancels and requeues it itself."""
    cluster = slurm_cluster
    job, out = _stub_job(cluster, tmp_path, partition)
    cluster.wait_job(job, lambda f: f["JobState"] == "RUNNING" and "start" in _stub_log(out, 1), 120, "running")
    urgent = cluster.sbatch("--partition=urgent", "--exclusive", f"--output={tmp_path}/urgent.out", "--wrap=true")
    try:
        fields = cluster.wait_job(job, lambda f: f["JobState"] == "PENDING" and f["Restarts"] == "1", 120,
                                  "requeued")
        assert cluster.wait_ended(urgent, 120)["JobState"] == "COMPLETED"
    finally:
        cluster.run("scancel", str(job), check=False)
    text = _log(tmp_path, job)
    assert fields["Restarts"] == "1" and "exit codes: rank 0: 75, rank 1: 75" in text, text
    for rank in (0, 1):
        assert "SIGTERM ignored at start" in _stub_log(out, rank) and "TERM " in _stub_log(out, rank)
    if requeued_by == "the script":
        assert "requeueing job" in text and "after a preemption (PreemptTime" in text, text
        assert "TERM: the job is being" not in text, text  # GraceTime signals the steps only
    else:
        assert "Slurm has requeued the job itself" in text and "requeueing job" not in text, text
        assert "TERM: the job is being" in text and "srun: forcing job termination" in text, text


def test_ranks_that_disagree_end_the_job_and_a_hang_is_requeued_at_most_max_restarts(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    oom, _ = _stub_job(cluster, tmp_path / "oom", STUB_EXIT="2 76")
    hang, _ = _stub_job(cluster, tmp_path / "hang", STUB_EXIT="76 76", MAX_RESTARTS=1)
    fields, text = cluster.wait_ended(oom), _log(tmp_path / "oom", oom)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0"), (fields, text)
    assert "exit codes: rank 0: 2, rank 1: 76" in text and "not requeued: the ranks did not all stop" in text, text
    fields, text = cluster.wait_ended(hang), _log(tmp_path / "hang", hang)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "76:0", "1"), (fields, text)
    assert f"requeueing job {hang} after a hang" in text, text
    assert "not requeued after a hang" in text and "1 restarts already (MAX_RESTARTS=1)" in text, text
    wait = datetime.fromisoformat(fields["EligibleTime"]) - datetime.fromisoformat(fields["SubmitTime"])
    assert 20 <= wait.total_seconds() <= 25, fields  # a requeued job waits cred_expire (20 s here) to start again


@pytest.mark.parametrize("args, message", [
    (["--output", "o", "--resume", "auto"], "do not pass --resume"),
    (["--launcher", "mpirun", "--output", "o"], "--launcher 'mpirun': choose srun"),
    (["--ds_config", "x.json"], "usage: sbatch scripts/slurm/train.sbatch"),
])
def test_the_script_refuses_bad_arguments_before_anything_starts(tmp_path, args, message):
    done = subprocess.run(["bash", str(ROOT / SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())
    assert re.search(r"#SBATCH --nodes=1\n", (ROOT / SCRIPT).read_text())  # the shipped recipes are one node
