"""``python -m recipe.export CHECKPOINT_DIR OUT_DIR`` (export a training checkpoint) and
``python -m recipe.export --check EXPORT_DIR`` (reload an export and verify it); the format is ``recipe.export``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe.export import check_export, export_tensors, read_draft, write_export
from recipe.io_errors import EXIT_WRITE_FAILED, WriteError


def export_checkpoint(checkpoint_dir: Path, out_dir: Path) -> Path:
    """Export from a checkpoint folder written by the training loop (its consolidated draft copy, see
    ``recipe.export.read_draft``). Raises ValueError naming a missing file."""
    state, config = read_draft(checkpoint_dir)
    return write_export(export_tensors(state), config, out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipe.export",
                                description="Write or check the draft export folder that SGLang and vLLM load.")
    p.add_argument("paths", nargs="+", type=Path, help="CHECKPOINT_DIR OUT_DIR, or EXPORT_DIR with --check")
    p.add_argument("--check", action="store_true", help="verify an export folder instead of writing one")
    args = p.parse_args(argv)
    if args.check:
        if len(args.paths) != 1:
            p.error("--check takes exactly one EXPORT_DIR")
        problems = check_export(args.paths[0])
        for msg in problems:
            print(f"error: {msg}", file=sys.stderr)
        print(f"{args.paths[0]}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if len(args.paths) != 2:
        p.error("give CHECKPOINT_DIR OUT_DIR")
    try:
        out = export_checkpoint(*args.paths)
    except (ValueError, WriteError) as exc:  # WriteError: the export folder cannot be written (path and cause)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_WRITE_FAILED if isinstance(exc, WriteError) else 1
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
