"""Failures to write the run's output (checkpoints, ``metrics.jsonl``, monitor files, the export) as one message.

A full disk, an I/O error or a missing permission surfaces in many shapes: ``OSError`` (often without the file
name, e.g. ENOSPC from ``write``), ``torch.save``'s ``RuntimeError`` (``[enforce fail at inline_container.cc:…] .
unexpected pos …``), safetensors' ``SafetensorError`` (``I/O error: No space left on device``). :func:`writing`
turns any of them, raised while writing one known path, into :class:`WriteError` whose message is ``PATH: cause``.
``run.py`` prints it as ``error (rank N): ...`` and exits with :data:`EXIT_WRITE_FAILED`: the run is not complete,
and what was last written completely (``checkpoints/latest``) is intact.

Leaf module (no project imports): ``recipe.export`` and ``recipe.train`` both use it.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

EXIT_WRITE_FAILED = 74  # sysexits EX_IOERR: the run's output could not be written; the run is not complete


# what torch.save's RuntimeError says when the file system refused part of the file (full disk, I/O error)
TORCH_SHORT_WRITE = ("inline_container", "unexpected pos", "basic_ios::clear", "iostream error")


class WriteError(OSError):
    """A file of the run's output could not be written; the message names the path and the cause."""


def cause(exc: BaseException) -> str:
    """The cause of a write failure in words: ``strerror`` of an OSError, else the exception's message (torch's
    ``inline_container.cc ... unexpected pos`` / ``basic_ios::clear: iostream error`` explained as a short write)."""
    if isinstance(exc, WriteError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip() or type(exc).__name__
    if any(sign in text for sign in TORCH_SHORT_WRITE):
        return f"the file could not be written completely: disk full or I/O error ({text})"
    return text


@contextlib.contextmanager
def writing(path: Path | str):
    """Turn any exception raised in the block (``OSError``, torch's and safetensors' write errors) into
    :class:`WriteError` ``"PATH: cause"``; a WriteError passes through unchanged."""
    try:
        yield
    except WriteError:
        raise
    except Exception as exc:  # noqa: BLE001 - every write failure of one path becomes one message
        raise WriteError(f"{path}: {cause(exc)}") from exc
