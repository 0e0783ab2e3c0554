"""Training curves of a run folder: loss, accuracy per TTT step and learning rate over the optimizer steps.

    python -m recipe.plot RUN_DIR [--out FILE]      # default RUN_DIR/curves.png

Reads ``RUN_DIR/metrics.jsonl`` (steps skipped as non-finite are left out) and writes a PNG of three panels sharing
the step axis: the objective ``loss`` (Σ_k 0.8^k·L_k/N_k), ``acc_k`` of every TTT step k, and ``lr``.
Needs matplotlib (``pip install -e '.[plot]'``); without it nothing is written and a one-line note says so. The
training loop calls it at the end of a finished run (rank 0).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe.jsonl import read_jsonl

CURVES_FILE = "curves.png"
METRICS_FILE = "metrics.jsonl"
NO_MATPLOTLIB = "matplotlib is not installed: no training curve drawn (pip install -e '.[plot]')"


def read_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl that carry a loss, in file order.

    Raises ValueError naming the file (and line) when it is missing, empty of steps, or holds invalid JSON.
    """
    path = Path(path)
    records = [record for _, record in read_jsonl(path) if isinstance(record, dict) and "loss" in record]
    if not records:
        raise ValueError(f"{path}: no training step with a loss to plot")
    return records


def curves_figure(records: list[dict], title: str = ""):
    """The three-panel ``matplotlib.figure.Figure`` of ``records`` (``step``, ``loss``, ``acc`` list, ``lr``):
    axes 0 loss, 1 one line per ``acc_k``, 2 lr, each line's x the steps. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency (matplotlib)

    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 8), layout="constrained")
    loss_ax, acc_ax, lr_ax = fig.subplots(3, 1, sharex=True)
    loss_ax.plot(steps, [r["loss"] for r in records], color="tab:red")
    loss_ax.set_ylabel("loss")
    for k in range(len(records[0]["acc"])):
        acc_ax.plot(steps, [r["acc"][k] for r in records], label=f"acc_{k}")
    acc_ax.set_ylabel("accuracy per TTT step")
    acc_ax.legend(fontsize="small", ncols=4)
    lr_ax.plot(steps, [r["lr"] for r in records], color="tab:green")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def save_figure(make, out: Path) -> Path | None:
    """Write the figure ``make()`` returns as a PNG to ``out`` (parents created); None (and nothing written) when
    matplotlib is not installed (``make`` raised ImportError)."""
    try:
        fig = make()
    except ImportError:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def plot_curves(records: list[dict], out: Path, title: str = "") -> Path | None:
    """Write :func:`curves_figure` of ``records`` as a PNG to ``out``; None (and nothing written) when matplotlib
    is not installed."""
    return save_figure(lambda: curves_figure(records, title), out)


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """:func:`plot_curves` of ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/curves.png``); None
    without matplotlib. Raises ValueError from :func:`read_metrics`."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    return plot_curves(records, out or run_dir / CURVES_FILE, title=str(run_dir.name))


def plot_note(run_dir: Path) -> str:
    """Plot a run folder's curves and return a one-line note of what happened (never raises for bad metrics)."""
    try:
        out = plot_run(run_dir)
    except ValueError as exc:
        return f"no training curve drawn: {exc}"
    return f"training curves written to {out}" if out is not None else NO_MATPLOTLIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipe.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="run folder holding metrics.jsonl (run.py --output)")
    p.add_argument("--out", type=Path, help=f"PNG to write (default RUN_DIR/{CURVES_FILE})")
    args = p.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"training curves written to {out}" if out is not None else NO_MATPLOTLIB)
    return 0


if __name__ == "__main__":
    sys.exit(main())
