"""The one JSON Lines reader of the recipe: metrics, prompts, MT-Bench questions, regenerated conversations.

``read_jsonl`` yields ``(line number, record)`` for every non-blank line; a line that is not JSON raises the caller's
error class with ``"PATH: line N: not valid JSON (reason)"``, or, with ``skip_bad=True`` (files a killed writer may
have cut mid-line), is skipped. No project imports.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_jsonl(path: str | Path, error: type[Exception] = ValueError, skip_bad: bool = False, raw: bool = False
               ) -> Iterator[tuple]:
    """``(line number from 1, parsed value)`` of each non-blank line of ``path`` (UTF-8); with ``raw``, ``(line
    number, parsed value, the line's text)``.

    Raises ``error("PATH: cannot read ...")`` when the file cannot be read and ``error("PATH: line N: not valid JSON
    (...)")`` for a bad line unless ``skip_bad``.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if skip_bad:
                continue
            raise error(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
        yield (number, value, line) if raw else (number, value)
