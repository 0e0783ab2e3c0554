"""A private single-node Slurm cluster on this machine for the tests (Debian's ``slurm-wlm`` 22.05 and ``munge``, the
packages ``.ci/run`` installs): :func:`start` brings up ``munged``, ``slurmctld`` and ``slurmd`` with their own
configuration, key, socket, spool, state and log folders under one temporary folder and ports of their own, and
:meth:`Cluster.stop` cancels every job, ends every daemon and every process a job left, and removes the folder.

Only the commands the tests run see the cluster: :attr:`Cluster.env` carries ``SLURM_CONF`` (the pytest process's
own environment is never changed), and jobs inherit it from ``sbatch`` (``--export=ALL``, the default), so the
``scontrol``/``scancel`` of a batch script reach this cluster too.

The configuration (:func:`slurm_conf`) is a small real one: one node (this host, :data:`CPUS` CPUs whatever the
hardware has, ``SlurmdParameters=config_overrides``: the tests run at most one two-rank training job at a time, the
other CPUs hold jobs that only wait for a signal), ``proctrack/linuxproc`` and ``task/none`` (no cgroups, no
systemd), no accounting database, ``select/cons_tres``. Set deliberately, as a site would: ``KillWait=30`` (Slurm's
default: the seconds between the TERM and the KILL of a cancelled, timed-out or preempted job), preemption by
partition priority with ``PreemptMode=REQUEUE``: partition ``main`` (the default, ``GraceTime`` :data:`GRACE_S`)
and ``nograce`` (no grace time) yield to ``urgent``. ``cred_expire`` is 20 s instead of 120 s: it is also how long a
requeued job waits before it may start again (slurm.conf(5), ``AuthInfo``).

Root only: slurmd starts every job as its user. :class:`SlurmUnavailable` carries the reason when the daemons are
missing, the user is not root, or the cluster does not come up.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
CPUS = 4  # the node's CPUs: a training job's two ranks, and two idle one-CPU jobs beside it (config_overrides)
GRACE_S = 60  # GraceTime of partition "main": a preempted job's ranks have this long to save before the kill
KILL_WAIT_S = 30  # KillWait: TERM, then KILL this long after (cancel, time limit, preemption without grace time)
CRED_EXPIRE_S = 20  # AuthInfo cred_expire: also the wait of a requeued job before it may start again
START_TIMEOUT_S = 120.0  # the daemons up and the node idle (about 5 s here; slow disks and loaded machines wait longer)


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here; the message says why (the tests skip with it)."""


def missing_reason() -> str | None:
    """Why a private cluster cannot start here (a missing program, not root), or None."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=_sbin_path()) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): as root, `apt-get install slurm-wlm munge` "
                "(Debian 12, Slurm 22.05), which .ci/run does before the tests")
    if os.geteuid() != 0:
        return "the private Slurm cluster needs root (slurmd starts each job as its user); run the tests as root"
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this machine right now."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def slurm_conf(root: Path, node: str, ports: tuple[int, int], cpus: int = CPUS) -> str:
    """The cluster's slurm.conf: everything under ``root``, slurmctld and slurmd on ``ports``, one node ``node``
    (address 127.0.0.1) with ``cpus`` CPUs, the partitions of the module docstring. Job ids start at a random
    number below 9000: ``train.sbatch`` derives ``MASTER_PORT`` from the job id, and two clusters on one machine
    should not hand out the same ports."""
    return f"""\
ClusterName=eagle3test
FirstJobId={random.randint(1, 9000)}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
TmpFS={root}/tmp
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=30
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=600
KillWait={KILL_WAIT_S}
OverTimeLimit=0
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes={node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_S}
PartitionName=nograce Nodes={node} MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def job_fields(text: str) -> dict[str, str]:
    """``scontrol -o show job`` output as a dict (``JobState``, ``Reason``, ``Restarts``, ``ExitCode``, ...)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)", text))


@dataclass
class Cluster:
    """A running private cluster (see :func:`start`)."""

    root: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60.0, env: dict | None = None) -> str:
        """Run a Slurm command against this cluster; its stdout. ``check``: raise on a non-zero exit (the message
        has stderr)."""
        done = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> int:
        """Submit (``sbatch --parsable ARGS``) from ``cwd``; the job id."""
        done = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env, cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's fields (:func:`job_fields`); ``{}`` once slurmctld forgot it."""
        return job_fields(self.run("scontrol", "-o", "show", "job", str(job_id), check=False))

    def wait_job(self, job_id: int, done, timeout: float, what: str) -> dict[str, str]:
        """Poll the job every 0.5 s until ``done(fields)``; its fields. Raises AssertionError naming ``what`` and the
        last fields after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields and done(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: not {what} within {timeout:.0f} s: {fields}")
            time.sleep(0.5)

    def wait_ended(self, job_id: int, timeout: float = 300.0) -> dict[str, str]:
        """Wait until the job is over for good (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...: nothing pending,
        running or completing); its fields."""
        return self.wait_job(job_id, lambda f: f["JobState"] not in ("PENDING", "RUNNING", "COMPLETING",
                                                                      "CONFIGURING", "REQUEUED", "SUSPENDED"),
                             timeout, "over")

    def queue(self) -> list[str]:
        """Ids of the jobs slurmctld still runs, holds or completes."""
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> list[str]:
        """Cancel every job, end the daemons (TERM, KILL after 20 s) and every process that still carries this
        cluster's ``SLURM_CONF`` (step daemons, job tasks), then remove :attr:`root`. Returns what had to be killed
        after the daemons were gone (``"pid cmdline"``), for the caller to report."""
        try:
            for job in self.queue():
                self.run("scancel", job, check=False)
            deadline = time.monotonic() + KILL_WAIT_S + 30
            while self.queue() and time.monotonic() < deadline:
                time.sleep(0.5)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=20)
        killed = leftovers(self.root)
        for pid, _ in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        return [f"{pid} {cmd}" for pid, cmd in killed]


def leftovers(root: Path) -> list[tuple[int, str]]:
    """Processes whose environment or command line names ``root`` (this cluster's daemons, step daemons and job
    tasks all carry its ``SLURM_CONF``), other than this one: ``(pid, command line)``."""
    found, mark = [], str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if mark in cmdline or mark in environ:
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


def _prepare(root: Path, node: str) -> Path:
    """Folders, munge key (1 KiB random, mode 0400) and configuration under ``root``; the slurm.conf path."""
    root.chmod(0o755)  # munged wants every folder of its socket's path searchable by all
    for sub in ("munge", "key", "state", "spool", "run", "log", "tmp"):
        (root / sub).mkdir(mode=0o755)
    (root / "key").chmod(0o700)
    key = root / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node, tuple(free_ports(2))))
    return conf


def _die_with_parent() -> None:
    """In the child before exec: TERM when the test process dies (Linux ``PR_SET_PDEATHSIG``), so a killed pytest
    leaves no daemon running."""
    import ctypes  # import cost: only in the daemons' children

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _spawn(root: Path, name: str, argv: list[str], env: dict) -> subprocess.Popen:
    """A daemon in the foreground, in its own session (no terminal signal reaches it), its output in
    ``root/log/NAME.out``."""
    out = open(root / "log" / f"{name}.out", "wb")
    with out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)


def start(timeout: float = START_TIMEOUT_S) -> Cluster:
    """Start a private cluster (module docstring) and wait until its node is idle. Raises
    :class:`SlurmUnavailable` with the reason (:func:`missing_reason`, or a daemon that exited or a node that did not
    come up, with the end of its log); nothing is left running or on disk then."""
    reason = missing_reason()
    if reason:
        raise SlurmUnavailable(reason)
    node = socket.gethostname().split(".")[0]
    root = Path(tempfile.mkdtemp(prefix="eagle3-slurm-"))
    conf = _prepare(root, node)
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": _sbin_path()}
    cluster = Cluster(root, node, env)
    try:
        cluster.procs["munged"] = _spawn(root, "munged", [
            "munged", "--foreground", f"--socket={root}/munge/munge.socket", f"--key-file={root}/key/munge.key",
            f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
            f"--seed-file={root}/run/munged.seed"], env)
        _wait_for(lambda: (root / "munge" / "munge.socket").exists(), cluster, "munged", timeout)
        cluster.procs["slurmctld"] = _spawn(root, "slurmctld", ["slurmctld", "-D", "-i"], env)
        cluster.procs["slurmd"] = _spawn(root, "slurmd", ["slurmd", "-D", "-N", node], env)
        _wait_for(lambda: cluster.run("sinfo", "-h", "-o", "%T", "-n", node, check=False).strip() == "idle",
                  cluster, "the node idle", timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(ready, cluster: Cluster, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                tail = (cluster.root / "log" / f"{name}.out").read_text(errors="replace")[-2000:]
                raise SlurmUnavailable(f"{name} exited with {proc.returncode} while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"the private Slurm cluster: no {what} after {timeout:.0f} s:\n"
                                   + cluster.log("slurmctld")[-1500:] + cluster.log("slurmd")[-1500:])
        time.sleep(0.2)
