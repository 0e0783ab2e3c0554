"""Helpers shared by the benchmarks: byte counts and JSON (process launch lives in ``recipe.bench.ranks``, the
int-list flag type in ``recipe.config``)."""
from __future__ import annotations

import json
from pathlib import Path

MIB, GIB = 1024 ** 2, 1024 ** 3


def tensor_bytes(tensors) -> int:
    """Sum of ``numel · element_size`` over tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_json(path: Path | None, payload: dict) -> None:
    """Write ``payload`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
