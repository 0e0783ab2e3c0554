"""Helpers shared by the benchmarks and the experiments: byte counts, JSON and the subcommand dispatch of their
``__main__`` (process launch lives in ``recipe.bench.ranks``, the flag types in ``recipe.arg_types``)."""
from __future__ import annotations

import importlib
import json
import sys
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


DRAFT_SHAPE_HELP = {
    "hidden": "draft hidden size H",
    "heads": "attention heads",
    "kv_heads": "key/value heads",
    "head_dim": "head dim",
    "intermediate": "MLP width",
    "draft_vocab": "draft vocabulary Vd",
    "vocab": "target vocabulary V (the frozen embedding rows)",
    "target_hidden": "target hidden size H_t",
    "ttt_steps": "TTT steps K",
}
"""The draft-shape flags every benchmark shares (``--hidden``, ``--kv-heads``, …) and what they mean."""


def add_draft_shape_arguments(parser, **defaults) -> None:
    """Add the draft-shape flags named by ``defaults``' keys (those of :data:`DRAFT_SHAPE_HELP`, e.g.
    ``hidden=256``) to ``parser``: ``--hidden``, ``--kv-heads``, … as ints with that default. A value
    ``(default, note)`` appends ``note`` to the help (e.g. ``(None, "default H/64")``). Raises KeyError for a name
    that is not a draft-shape flag."""
    for name, value in defaults.items():
        default, note = value if isinstance(value, tuple) else (value, None)
        text = DRAFT_SHAPE_HELP[name] + (f" ({note})" if note else "")
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text)


def dispatch(commands: dict[str, str], usage: str, argv: list[str] | None, what: str) -> int:
    """Run ``commands[argv[0]]``'s ``main(argv[1:])`` (the module imported only then: each has its own imports and
    ``--help``); ``usage`` printed for no argument (exit 2) or ``-h`` (0), and with an error naming the ``what``
    (e.g. "benchmark") for an unknown one (2). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    if argv[0] not in commands:
        print(f"error: unknown {what} {argv[0]!r}\n{usage}", file=sys.stderr)
        return 2
    return importlib.import_module(commands[argv[0]]).main(argv[1:])
