"""Graceful interruption: SIGTERM/SIGINT, or the death of the launcher, stop every rank after the same step, which
then saves a checkpoint.

The first signal only sets a flag. After each optimizer step the loop calls :meth:`StopRequest.agreed`, an
all-reduce (MAX) of that flag over the whole world, so every rank sees the same answer at the same step even when
only some ranks were signalled; the loop then saves a checkpoint, ``run.py`` writes ``OUTPUT/INTERRUPTED``
(:data:`INTERRUPTED_FILE`, rank 0) and exits with :data:`EXIT_INTERRUPTED`.

Grace period. One interruption often reaches a rank twice: a terminal's Ctrl-C goes to the whole foreground process
group (the ranks get SIGINT) and the launcher relays it (DeepSpeed's ``launch.py`` then sends SIGTERM to each rank), a
scheduler signals every process of the job. A further signal within :data:`GRACE_S` seconds of the first is taken
as such a copy and ignored with a note; one after the grace period is a deliberate second signal and exits at once
with ``128 + signum`` (no checkpoint; the ``on_abort`` callback runs first, ``run.py`` passes the /dev/shm clean-up).
Once the run is closing (:meth:`StopRequest.closing`: training returned, the checkpoint is saved, the process group
is being torn down) signals are ignored with a note, except one sent more than :data:`GRACE_S` after the first such.

The launcher's death. DeepSpeed's ``deepspeed`` runner does not forward SIGTERM/SIGINT to its ``launch.py`` child
on one node; killed, it exits at once and leaves ``launch.py`` and the ranks running. With ``watch_launcher`` (set
by ``run.py``) a daemon thread records the chain of launcher processes above the rank (``deepspeed.launcher.launch``,
the ``deepspeed`` runner, ``torchrun``; :func:`launcher_chain`) and checks every :data:`WATCH_INTERVAL_S` that each
still has the same parent; when one is gone (the rank or ``launch.py`` was orphaned) it requests a stop, as a first
signal would (it never aborts: only real signals count towards a forced exit).

Nesting: a ``StopRequest`` entered while another is active in the process (``run.py``'s, around the whole run, and
the training loop's) shares the outer one's state, so a signal received during set-up is still seen by the loop.

Launchers: ``torchrun`` relays SIGTERM/SIGINT to its workers (they run in their own session, so a terminal Ctrl-C
reaches them once, through the launcher) and SIGKILLs them 30 s later; DeepSpeed's ``launch.py`` sends SIGTERM to
one rank at a time and SIGKILLs each 30 s later. A step plus a checkpoint must fit in that window, otherwise signal
the ranks directly (``kill -TERM <rank pids>``). docs/training.md, "Interruption, resume and exit codes", lists
what each launcher and the job script see.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil

EXIT_INTERRUPTED = 75  # sysexits EX_TEMPFAIL: interrupted, checkpoint saved, resume with --resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 2.0  # a further signal sooner than this after the first is a relayed copy, ignored
WATCH_INTERVAL_S = 0.5  # how often the launcher watch checks the parent chain
INTERRUPTED_FILE = "INTERRUPTED"  # OUTPUT/INTERRUPTED: written by rank 0 after an interrupted run's checkpoint

# python -m <module> / script names of the launchers whose death stops the run (see launcher_chain)
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("deepspeed", "torchrun")

_ACTIVE: list["StopRequest"] = []  # entered StopRequests of this process, outermost first


def _note(text: str) -> None:
    os.write(2, f"\n{text}\n".encode())


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def launcher_name(cmdline: list[str]) -> str | None:
    """The launcher a command line runs (a :data:`LAUNCHER_MODULES` module or :data:`LAUNCHER_SCRIPTS` script, e.g.
    ``python -u -m deepspeed.launcher.launch ...`` or ``python .venv/bin/deepspeed ...``), else None. Only the
    program is looked at (the interpreter's options skipped), never its arguments."""
    if not cmdline:
        return None
    if os.path.basename(cmdline[0]) in LAUNCHER_SCRIPTS:
        return os.path.basename(cmdline[0])
    for i, arg in enumerate(cmdline[1:], start=1):
        if arg == "-m":
            module = cmdline[i + 1] if i + 1 < len(cmdline) else ""
            return module if module in LAUNCHER_MODULES else None
        if not arg.startswith("-"):
            return os.path.basename(arg) if os.path.basename(arg) in LAUNCHER_SCRIPTS else None
    return None


def _parent_of(pid: int) -> int | None:
    """Parent pid of ``pid`` (None: gone or unreadable)."""
    if pid == os.getpid():
        return os.getppid()
    try:
        return psutil.Process(pid).ppid()
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess, AccessDenied, ...
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except Exception:  # noqa: BLE001
        return []


def launcher_chain(pid: int | None = None) -> list[tuple[int, int, str]]:
    """``(child, parent, launcher)`` links from ``pid`` (default: this process) upwards while the parent is a
    launcher: for a rank of ``deepspeed``, ``[(rank, launch.py, "deepspeed.launcher.launch"), (launch.py, runner,
    "deepspeed")]``; for ``torchrun``, one link; for ``python run.py`` or a test's spawned rank, none."""
    child = os.getpid() if pid is None else pid
    links: list[tuple[int, int, str]] = []
    parent = _parent_of(child)
    while parent and parent > 1 and len(links) < 4:
        name = launcher_name(_cmdline(parent))
        if name is None:
            break
        links.append((child, parent, name))
        child, parent = parent, _parent_of(parent)
    return links


def broken_link(links: list[tuple[int, int, str]]) -> tuple[int, int, str] | None:
    """The first link whose child no longer has that parent (the launcher died, the child was re-parented)."""
    for link in links:
        child, parent, _ = link
        if _parent_of(child) != parent:
            return link
    return None


class _State:
    """What nested StopRequests of one process share."""

    def __init__(self):
        self.signum: int | None = None      # first signal received
        self.first_at: float | None = None  # clock() at the first signal
        self.reason: str | None = None      # a stop requested without a signal (the launcher watch)
        self.closing_at: float | None = None  # clock() at the first signal while closing
        self.closing = False


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT (and, with ``watch_launcher``, the launcher's death) into a stop
    request (see module docstring).

    Handlers are installed only in the main thread (Python delivers signals there) and the previous handlers are
    restored on exit. ``signum`` is the first signal received (None: none yet). ``grace_s``: the grace period;
    ``on_abort``: called before a forced exit; ``clock``/``exit``: injectable for tests.
    """

    def __init__(self, signals=STOP_SIGNALS, grace_s: float = GRACE_S, watch_launcher: bool = False,
                 on_abort=None, clock=time.monotonic, exit=os._exit):
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.watch_launcher = watch_launcher
        self.on_abort = on_abort
        self.clock = clock
        self.exit = exit
        self._state = _State()
        self._root: StopRequest = self
        self._previous: dict[int, object] = {}
        self._watch_stop: threading.Event | None = None

    def __enter__(self) -> "StopRequest":
        if _ACTIVE:
            self._root = _ACTIVE[0]
            self._state = self._root._state
        _ACTIVE.append(self)
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        if self.watch_launcher and self._root is self:
            links = launcher_chain()
            if links:
                self._watch_stop = threading.Event()
                threading.Thread(target=self._watch, args=(links, self._watch_stop), name="launcher-watch",
                                 daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watch_stop is not None:
            self._watch_stop.set()
            self._watch_stop = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _handle(self, signum, _frame) -> None:
        root, st = self._root, self._state
        now, name = root.clock(), _name(signum)
        if st.closing:
            if st.closing_at is None or now - st.closing_at < root.grace_s:
                if st.closing_at is None:
                    st.closing_at = now
                _note(f"{name} received while the run is exiting: ignored (again after {root.grace_s:g} s to "
                      "exit at once)")
                return
        elif st.signum is None:
            st.signum, st.first_at = signum, now
            if st.reason is not None:
                _note(f"{name} received: already stopping after this step ({st.reason}); send it again after "
                      f"{root.grace_s:g} s to exit at once without a checkpoint")
            else:
                _note(f"{name} received: stopping after this step and saving a checkpoint (send it again after "
                      f"{root.grace_s:g} s to exit at once)")
            return
        elif now - st.first_at < root.grace_s:
            _note(f"{name} received {now - st.first_at:.1f} s after {_name(st.signum)}: taken as a relayed copy "
                  f"(launcher, process group) and ignored; send it again after {root.grace_s:g} s to exit at once")
            return
        _note(f"second signal {name}: exiting now, no checkpoint")
        if root.on_abort is not None:
            try:
                root.on_abort()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        root.exit(128 + signum)

    def _watch(self, links, done: threading.Event) -> None:
        while not done.wait(WATCH_INTERVAL_S):
            link = broken_link(links)
            if link is not None:
                self.request(f"launcher {link[2]} (pid {link[1]}) is gone")
                return

    def request(self, reason: str) -> None:
        """Request a stop without a signal (the launcher watch); notes it unless a stop was already requested.
        Never forces an exit."""
        st = self._state
        if st.reason is None and st.signum is None and not st.closing:
            _note(f"{reason}: stopping after this step and saving a checkpoint")
        if st.reason is None:
            st.reason = reason

    def closing(self) -> None:
        """The run is over (trained, saved or failed) and the process is exiting: from now on signals are noted and
        ignored (a relayed copy reaching a rank that already saved must not turn its exit into a forced one)."""
        self._state.closing = True

    @property
    def signum(self) -> int | None:
        """The first signal received (None: none yet)."""
        return self._state.signum

    @property
    def reason(self) -> str | None:
        """Why a stop was requested: the first signal's name, the launcher watch's reason, or None."""
        st = self._state
        return _name(st.signum) if st.signum is not None else st.reason

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal (or its launcher died)."""
        return self._state.signum is not None or self._state.reason is not None

    def agreed(self, comm=None, group=None) -> bool:
        """Collective over ``group`` (default: the world) through ``comm`` (the run's
        ``recipe.parallel.collectives.Collectives``): True on every rank iff any rank received a signal.
        ``comm=None``: a process without a process group, which answers for itself."""
        return self.requested if comm is None else comm.any(self.requested, group)


def clear_interrupted(output: Path) -> None:
    """Remove a previous run's ``OUTPUT/INTERRUPTED`` (rank 0, at the start of a run)."""
    (Path(output) / INTERRUPTED_FILE).unlink(missing_ok=True)


def write_interrupted(output: Path, checkpoint: str | None, step: int | None, cause: str | None) -> Path:
    """Write ``OUTPUT/INTERRUPTED`` (rank 0, after the interrupted run's checkpoint was saved): one JSON line with
    the checkpoint's folder name (``checkpoints/latest``), its step and the cause (a signal's name, the launcher
    watch's reason, or ``"another rank"``), atomically (a temporary file renamed)."""
    path = Path(output) / INTERRUPTED_FILE
    tmp = path.with_name(f".{INTERRUPTED_FILE}.tmp")
    tmp.write_text(json.dumps({"checkpoint": checkpoint, "step": step, "cause": cause or "another rank",
                               "exit_code": EXIT_INTERRUPTED}) + "\n")
    os.replace(tmp, path)
    return path
