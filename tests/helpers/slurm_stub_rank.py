"""A stand-in for one rank of ``$PYTHON run.py FLAGS... --resume auto`` under ``scripts/slurm/train.sbatch``, for the
real-Slurm tests about the job script and Slurm's signals rather than training (``PYTHON`` is a shell that runs this
file, ``helpers.slurm_rank.write_python``):

- ``STUB_EXIT="C0 C1 ..."``: rank R exits with code CR at once (ranks that disagree, a hang on every rank);
- otherwise it waits for SIGTERM (at most 300 s), then rank 0 writes ``OUTPUT/INTERRUPTED`` as ``run.py`` does after
  the checkpoint of an interrupted run, and every rank exits 75 (``EXIT_INTERRUPTED``).

Rank R (``RANK``, else ``SLURM_PROCID``) appends what happened to ``OUTPUT/stub-rank-R.log``: ``start``, ``SIGTERM
ignored at start`` when it inherited SIGTERM ignored, ``TERM <epoch s>`` per signal, ``exit <code>``. Like
``run.py`` it puts the inherited SIGTERM handling back before it exits (a job's kill sends TERM twice: a copy that
finds Python's handler gone during the interpreter's shutdown would end the rank with 143).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    output = Path(argv[argv.index("--output") + 1])
    output.mkdir(parents=True, exist_ok=True)
    log = open(output / f"stub-rank-{rank}.log", "a", buffering=1)
    log.write("start\n")
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        log.write("SIGTERM ignored at start\n")
    if rank == 0:
        (output / "INTERRUPTED").unlink(missing_ok=True)
    if os.environ.get("STUB_EXIT"):
        code = int(os.environ["STUB_EXIT"].split()[rank])
        log.write(f"exit {code}\n")
        return code
    signals: list[float] = []
    previous = signal.signal(signal.SIGTERM,
                             lambda *_: (signals.append(time.time()), log.write(f"TERM {time.time():.1f}\n")))
    deadline = time.monotonic() + 300
    while not signals and time.monotonic() < deadline:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, previous)  # as run.py's StopRequest does: a later copy finds it ignored again
    if not signals:
        log.write("exit 0 (no TERM)\n")
        return 0
    if rank == 0:
        (output / "INTERRUPTED").write_text(json.dumps({"checkpoint": "step-00000001", "step": 1, "cause": "SIGTERM",
                                                         "exit_code": 75}) + "\n")
    log.write("exit 75\n")
    return 75


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:]))  # argv[1] is run.py
