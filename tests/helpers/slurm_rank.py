"""One rank of a real-Slurm test job (``PYTHON`` of ``scripts/slurm/train.sbatch`` is a shell that runs this file
with the test's interpreter, :func:`write_python`).

``slurm_rank.py run.py FLAGS...`` runs ``run.main(FLAGS)`` and exits with its code. With ``HOLD_AFTER_STEP=K``, on a
job's first run only (``SLURM_RESTART_COUNT`` unset or 0), every rank waits before step K+1 until it has a stop
request (a TERM or INT), at most ``HOLD_S`` seconds (default 300): the signal then finds the ranks past step K
whenever Slurm sends it, and ``metrics.jsonl`` holding K records says the ranks are waiting.

``slurm_rank.py -m MODULE ARGS...`` runs that module as ``python -m`` does (the launchers of ``--launcher torchrun``
and ``--launcher deepspeed``).
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_python(path: Path, script: Path = Path(__file__)) -> Path:
    """An executable shell at ``path`` that runs ``script`` (default: this file) with this interpreter; return it
    (for ``PYTHON``)."""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(script).resolve()}" "$@"\n')
    path.chmod(0o755)
    return path


def hold_before_step(step: int, limit_s: float) -> None:
    """Patch the training loop: before step ``step`` + 1, wait (polling every 50 ms) until a stop is requested."""
    from recipe.lifecycle import signals
    from recipe.train import loop

    train_step = loop.Trainer.train_step

    def held(self):
        if self.step == step:
            deadline = time.monotonic() + limit_s
            while not any(stop.requested for stop in signals._ACTIVE) and time.monotonic() < deadline:
                time.sleep(0.05)
        return train_step(self)
    loop.Trainer.train_step = held


def main(argv: list[str]) -> int:
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.path[:0] = [str(ROOT)]
    from run import main as run_main  # import cost: the recipe, as run.py itself

    if os.environ.get("HOLD_AFTER_STEP") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        hold_before_step(int(os.environ["HOLD_AFTER_STEP"]), float(os.environ.get("HOLD_S", "300")))
    return run_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
