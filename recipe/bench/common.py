"""Helpers shared by the TP and CP benchmarks: byte formatting, int-list flags, JSON (process launch lives in
``recipe.parallel.spawn``)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipe.parallel.spawn import spawn_gloo_ranks as spawn_ranks  # noqa: F401 - used by the tp benchmark

MIB, GIB = 1024 ** 2, 1024 ** 3


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; argparse error naming the text for anything else (or a value < 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


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
