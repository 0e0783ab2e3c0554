"""Stand-ins for Slurm's ``sbatch``, ``srun`` and ``scontrol`` on one machine, for testing ``scripts/slurm/``: the
variables the real ones set and the way they deliver signals, nothing else. :func:`install` writes them into a
folder to put first on ``PATH``; they keep their state in ``$FAKE_SLURM_STATE``.

- ``sbatch [--nodes N] [--ntasks-per-node N] [--signal [B:]SIG@T] [--output PATTERN] [--wait] SCRIPT ARGS...``:
  reads the script's ``#SBATCH`` lines, the command line's options win; runs the script with bash as job 1000 (the
  controller too: it stays until the job is done, as ``--wait`` does) with ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``
  (``$FAKE_SLURM_NODELIST``, default ``localhost``), ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``,
  ``SLURM_NTASKS_PER_NODE``, ``SLURM_NTASKS``, ``SLURM_SUBMIT_DIR`` and, after a requeue, ``SLURM_RESTART_COUNT``;
  its output appended to ``--output`` (``%j``, ``%x`` replaced). SIGUSR2 to this stand-in stands for "the time
  limit is T seconds away": it sends the ``--signal`` signal to the batch shell (``B:``) or to every task of the
  running job step (without ``B:``), as slurmctld does. When the batch script exits after ``scontrol requeue``, the
  job runs again (``SLURM_RESTART_COUNT`` + 1); else sbatch exits with the script's code.
- ``srun [options] CMD...``: one task per ``SLURM_NNODES`` × ``SLURM_NTASKS_PER_NODE`` with ``SLURM_PROCID``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_ID``, ``SLURM_STEPID``; relays SIGTERM
  and SIGINT to every task, as srun does; exits with the highest task exit code (128 + N for a task killed by N).
- ``scontrol show hostnames [LIST]`` (``a,b`` and ``node[1-3]`` forms; default ``SLURM_JOB_NODELIST``),
  ``scontrol requeue JOBID``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

SBATCH = r'''
import os, re, shlex, signal, subprocess, sys, time
state = os.environ["FAKE_SLURM_STATE"]
os.makedirs(state, exist_ok=True)
argv = sys.argv[1:]
opts = {}
def take(args):
    rest = list(args)
    while rest and rest[0].startswith("-"):
        key = rest.pop(0)
        if "=" in key:
            key, value = key.split("=", 1)
        elif key in ("--wait", "--requeue", "-W", "--parsable"):
            value = "1"
        else:
            value = rest.pop(0)
        opts[{"-N": "--nodes", "-o": "--output"}.get(key, key)] = value
    return rest
rest = take(argv)
script, args = rest[0], rest[1:]
cli = dict(opts); opts.clear()
for line in open(script):
    if line.startswith("#SBATCH"):
        take(shlex.split(line[len("#SBATCH"):]))
opts.update(cli)
job, restart = "1000", 0
nodes, per_node = int(opts.get("--nodes", 1)), int(opts.get("--ntasks-per-node", 1))
sig = opts.get("--signal", "")
to_batch = sig.startswith("B:")
signame = (sig[2:] if to_batch else sig).split("@")[0] or "USR1"
signum = getattr(signal, "SIG" + signame) if not signame.isdigit() else int(signame)
out = opts.get("--output", "slurm-%j.out").replace("%j", job).replace("%x", opts.get("--job-name", "job"))
batch = None
def warn(_signum, _frame):  # the time limit is near: slurmctld sends --signal
    if batch is None:
        return
    if to_batch:
        os.kill(batch.pid, signum)
    else:
        step_pids = os.path.join(state, "step-pids")
        pids = open(step_pids).read().split() if os.path.exists(step_pids) else []
        for pid in pids:
            try:
                os.kill(int(pid), signum)
            except OSError:
                pass
signal.signal(signal.SIGUSR2, warn)
while True:
    env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOBID=job, SLURM_JOB_NAME=opts.get("--job-name", "job"),
               SLURM_JOB_NODELIST=os.environ.get("FAKE_SLURM_NODELIST", "localhost"), SLURM_NNODES=str(nodes),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NTASKS=str(nodes * per_node),
               SLURM_SUBMIT_DIR=os.getcwd(), SLURM_PROCID="0")
    if restart:
        env["SLURM_RESTART_COUNT"] = str(restart)
    with open(out, "a") as log:
        batch = subprocess.Popen(["bash", script, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        open(os.path.join(state, "batch.pid"), "w").write(str(batch.pid))
        while True:
            try:
                rc = batch.wait()
                break
            except InterruptedError:
                continue
    batch = None
    flag = os.path.join(state, "requeue-" + job)
    if os.path.exists(flag):
        os.unlink(flag)
        restart += 1
        open(os.path.join(state, "restarts"), "w").write(str(restart))
        continue
    sys.exit(rc if rc >= 0 else 128 - rc)
'''

SRUN = r'''
import os, signal, subprocess, sys
state = os.environ["FAKE_SLURM_STATE"]
args = sys.argv[1:]
while args and args[0].startswith("-"):
    key = args.pop(0)
    if "=" not in key and key in ("-n", "--ntasks", "-N", "--nodes", "--ntasks-per-node"):
        args.pop(0)
nodes, per_node = int(os.environ.get("SLURM_NNODES", "1")), int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
n = nodes * per_node
step_file = os.path.join(state, "steps")
step = int(open(step_file).read()) + 1 if os.path.exists(step_file) else 0
open(step_file, "w").write(str(step))
tasks = []
for rank in range(n):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
               SLURM_NODEID=str(rank // per_node),
               SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_ID=str(step), SLURM_STEPID=str(step),
               SLURM_STEP_NODELIST=os.environ.get("SLURM_JOB_NODELIST", "localhost"))
    tasks.append(subprocess.Popen(args, env=env))
open(os.path.join(state, "step-pids"), "w").write(" ".join(str(t.pid) for t in tasks))
def relay(signum, _frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signum)
signal.signal(signal.SIGTERM, relay)
signal.signal(signal.SIGINT, relay)
codes = []
for t in tasks:
    while True:
        try:
            rc = t.wait()
            break
        except InterruptedError:
            continue
    codes.append(rc if rc >= 0 else 128 - rc)
sys.exit(max(codes))
'''

SCONTROL = r'''
import os, re, sys
state = os.environ["FAKE_SLURM_STATE"]
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    text = args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"]
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            print(part)
            continue
        for r in m.group(2).split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                print(f"{m.group(1)}{i:0{len(lo)}d}")
elif args[:1] == ["requeue"]:
    open(os.path.join(state, "requeue-" + args[1]), "w").close()
else:
    sys.exit(f"scontrol stand-in: unsupported {args}")
'''


def install(folder: Path) -> Path:
    """Write ``sbatch``, ``srun`` and ``scontrol`` (this interpreter's scripts) into ``folder``; return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        path = folder / name
        path.write_text(f"#!{sys.executable}\n" + body)
        os.chmod(path, 0o755)
    return folder
