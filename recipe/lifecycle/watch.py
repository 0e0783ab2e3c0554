"""Time in the training loop: periodic checkpoints by wall time (:class:`SaveClock`) and the hang watchdog
(:class:`HangWatchdog`).

Periodic checkpoints. ``--save-every-minutes M`` checkpoints after the first optimizer step that ends M minutes or
more after the previous checkpoint (or the start of the loop). Each rank reads its own clock, so the ranks could
disagree by a step; the loop agrees the flag over the world with the stop request in the same all-reduce
(``Collectives.any_each``, an int32 MAX on the run's device): every rank saves after the same step when any rank's
clock is due. ``--save-every N`` (steps) still works beside it; either resets the clock.

Hangs. A collective that one rank never joins (a dead link, a rank stuck in I/O or in a driver call) blocks every
rank until the process group's timeout, then NCCL aborts without a checkpoint or a stack. The watchdog is a daemon
thread per rank that expects a beat (:meth:`HangWatchdog.beat`) after every step, checkpoint and validation; when
none comes for ``--hang-timeout-minutes``, it writes every thread's Python stack (``faulthandler.dump_traceback``)
with a header naming the rank, host, pid and what the rank was doing to ``OUTPUT/hang-rank-R.txt``, prints one line
and ends the process with :data:`EXIT_HUNG` (no checkpoint: the state of a hung step is not trusted, and
``checkpoints/latest`` still names the last complete one, the resume point). The ranks that wait for the stuck one
have no beat either, so every rank writes its file: the stuck rank's stack is the one not in the same collective as
the others. The thread needs the GIL to fire; torch releases it while a collective or a device copy waits, and file
reads do, so the watchdog fires in every hang seen in practice (a C extension that blocks holding the GIL is left to
the process group's timeout). The process group's timeout is set above the watchdog's (:func:`group_timeout`), so the
watchdog always fires first.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import threading
import time
from pathlib import Path

EXIT_HUNG = 76  # sysexits EX_PROTOCOL: no step finished within --hang-timeout-minutes; stacks in OUTPUT/hang-rank-R.txt
HANG_FILE = "hang-rank-{rank}.txt"
GROUP_TIMEOUT_MIN = 30.0  # minutes: the process group's timeout at least (DeepSpeed's default)


def group_timeout(hang_timeout_minutes: float) -> datetime.timedelta:
    """The timeout given to ``torch.distributed.init_process_group``: twice the watchdog's and at least
    :data:`GROUP_TIMEOUT_MIN` minutes, so a hung collective reaches the watchdog (stacks, :data:`EXIT_HUNG`) before
    the backend's own abort."""
    return datetime.timedelta(minutes=max(GROUP_TIMEOUT_MIN, 2 * hang_timeout_minutes))


class SaveClock:
    """Whether a checkpoint by wall time is due: ``minutes`` (0: never) since the last :meth:`reset` (or creation).
    ``clock``: seconds, injectable for tests."""

    def __init__(self, minutes: float, clock=time.monotonic):
        self.interval_s, self.clock = minutes * 60.0, clock
        self.last = clock()

    def due(self) -> bool:
        return self.interval_s > 0 and self.clock() - self.last >= self.interval_s

    def reset(self) -> None:
        self.last = self.clock()


class HangWatchdog:
    """The hang watchdog of one rank (module docstring), a context manager: entering starts the thread (nothing with
    ``timeout_minutes`` 0), leaving stops it. :meth:`beat` after everything that finished (a step, a checkpoint, a
    validation) with what comes next, e.g. ``beat("step 13")``.

    Args:
        output: the run folder; the stacks go to ``output/hang-rank-R.txt``.
        rank: this process's global rank.
        timeout_minutes: how long without a beat is a hang.
        on_exit: called before the exit (``run.py`` passes the /dev/shm clean-up).
        clock, exit: injectable for tests (``time.monotonic``, ``os._exit``).
    """

    def __init__(self, output: Path, rank: int, timeout_minutes: float, on_exit=None, clock=time.monotonic,
                 exit=os._exit):
        self.path = Path(output) / HANG_FILE.format(rank=rank)
        self.rank, self.timeout_s = rank, timeout_minutes * 60.0
        self.on_exit, self.clock, self.exit = on_exit, clock, exit
        self.poll_s = min(10.0, max(0.05, self.timeout_s / 20))
        # after writing its stacks a rank waits this long before it exits: the other ranks, which beat within a
        # collective's skew of it, fire meanwhile (a rank that exits first could break their collectives with an
        # error, under gloo at once, before their watchdogs write anything)
        self.grace_s = min(self.timeout_s, 2 * self.poll_s + 2.0)
        self.sleep = time.sleep
        self.doing, self.finished = "the first step", "nothing yet"
        self.last = clock()
        self._done: threading.Event | None = None

    def __enter__(self) -> "HangWatchdog":
        self.last = self.clock()
        if self.timeout_s > 0:
            self._done = threading.Event()
            threading.Thread(target=self._watch, args=(self._done,), name="hang-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._done is not None:
            self._done.set()
            self._done = None

    def beat(self, doing: str) -> None:
        """Something finished (what :attr:`doing` named); ``doing`` is what the rank does next."""
        self.finished, self.doing, self.last = self.doing, doing, self.clock()

    def _watch(self, done: threading.Event) -> None:
        while not done.wait(self.poll_s):
            idle = self.clock() - self.last
            if idle >= self.timeout_s and not done.is_set():
                self.fire(idle)
                return

    def fire(self, idle: float) -> None:
        """Write this rank's stacks to :attr:`path`, say so on stderr, wait :attr:`grace_s`, run ``on_exit`` and exit
        with :data:`EXIT_HUNG`."""
        header = (f"hang watchdog: rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): nothing "
                  f"finished for {idle:.0f} s (--hang-timeout-minutes {self.timeout_s / 60:g}) while in "
                  f"{self.doing}; last finished: {self.finished}\n")
        try:
            with open(self.path, "w") as f:
                f.write(header + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"stacks in {self.path}"
        except OSError as exc:
            where = f"could not write {self.path} ({exc.strerror or exc}); stacks on stderr"
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.write(2, f"\nerror (rank {self.rank}): {header.strip()}; {where}; exiting with {EXIT_HUNG} in "
                    f"{self.grace_s:.0f} s (checkpoints/latest is the resume point)\n".encode())
        self.sleep(self.grace_s)
        if self.on_exit is not None:
            try:
                self.on_exit()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        self.exit(EXIT_HUNG)
