"""One rank of a job the test starts itself (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` in the environment): ``run.main`` with the hang fault of ``helpers.faults.Job.hang_at``, exiting with
its code (the hang watchdog ends the process itself)::

    python tests/helpers/hang_rank.py HANG_RANK HANG_STEP run.py-flags...
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

if __name__ == "__main__":
    from helpers.faults import Job, _faults
    from run import main

    hang_rank, hang_step, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    with _faults(Job(argv, hang_at=(hang_rank, hang_step)), int(os.environ["RANK"])):
        sys.exit(main(argv))
