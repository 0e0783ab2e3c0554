"""Graceful interruption: SIGTERM/SIGINT stop every rank after the same step, which then saves a checkpoint.

The first signal only sets a flag. After each optimizer step the loop calls :meth:`StopRequest.agreed`, an
all-reduce (MAX) of that flag over the whole world, so every rank sees the same answer at the same step even when
only some ranks were signalled; the loop then saves a checkpoint and ``run.py`` exits with :data:`EXIT_INTERRUPTED`.
A second signal while the first is pending exits at once with ``128 + signum`` (no checkpoint).

Launchers: ``torchrun`` relays SIGTERM/SIGINT to its workers (they run in their own session, so a terminal Ctrl-C
reaches them once, through the launcher) and SIGKILLs them 30 s later; a step plus a checkpoint must fit in that
window, otherwise signal the workers directly (``kill -TERM <worker pids>``) or use a longer grace period (SLURM
``--signal``).
"""
from __future__ import annotations

import os
import signal
import threading

EXIT_INTERRUPTED = 75  # sysexits EX_TEMPFAIL: interrupted, checkpoint saved, resume with --resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT into a stop request (see module docstring).

    Handlers are installed only in the main thread (Python delivers signals there) and the previous handlers are
    restored on exit. ``signum`` is the first signal received (None: none yet).
    """

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            os.write(2, f"\nsecond signal {signal.Signals(signum).name}: exiting now, no checkpoint\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\n{signal.Signals(signum).name} received: stopping after this step and saving a checkpoint "
                    "(send it again to exit at once)\n".encode())

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal."""
        return self.signum is not None

    def agreed(self, comm=None, group=None) -> bool:
        """Collective over ``group`` (default: the world) through ``comm`` (the run's
        ``recipe.parallel.collectives.Collectives``): True on every rank iff any rank received a signal.
        ``comm=None``: a process without a process group, which answers for itself."""
        return self.requested if comm is None else comm.any(self.requested, group)

