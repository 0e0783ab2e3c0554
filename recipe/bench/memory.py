"""Memory report: peak memory per rank and time of a TTT training step vs sequence length, per layout.

``python -m recipe.bench memory --lengths 2k,4k,8k [--tp N --cp N] [--draft-vocab V] [--hidden H] [--budget-gib X]
[--attention-tile T] [--mlp-tile M] [--json OUT] [--plot OUT.png]`` measures forward + backward of ``TTTModel`` on
random aux states (no target) for each length and layout (``full`` logits, ``chunked`` loss, ``ckpt`` per-step
checkpointing, ``chunked+ckpt``), each in fresh processes (``recipe.bench.measure``), with the causal block tiled at
T positions as training does (0: the dense block) and the draft's norm + MLP in sequence tiles of M positions
(``memory.mlp_tile_size``; 0, the default: untiled), prints the measurement beside the planner's prediction
(``recipe.plan.predict_step``: a fake-tensor trace of the same step), and the longest length per layout whose peak
fits the budget. Once a layout exceeds the budget, or its predicted peak exceeds ``--skip-predicted-gib``, its
longer lengths are not run (so the report cannot exhaust the machine; ``--run-over-budget`` keeps measuring past the
budget).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe.arg_types import length_list
from recipe.bench.common import add_draft_shape_arguments
from recipe.bench.measure import run_measurement
from recipe.plan import layout_fit, predict_step, trace_limit
from recipe.plan.spec import LAYOUTS, BenchSpec

GIB = 1024 ** 3


def layout_list(text: str) -> list[str]:
    """argparse type: comma-separated names of ``recipe.plan.spec.LAYOUTS``; ArgumentTypeError naming unknown
    ones."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {bad}; choose from {list(LAYOUTS)}")
    return names


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024 ** 2
    except OSError:
        return None
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=length_list("1k,2k,4k"), help="e.g. 2k,4k,8k (k = 1024)")
    p.add_argument("--layouts", type=layout_list, default=list(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (spawned, gloo on CPU)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (spawned, gloo on CPU)")
    add_draft_shape_arguments(p, hidden=256, heads=(None, "default H/64"), kv_heads=(None, "default = heads"),
                              head_dim=(None, "default H/heads"), intermediate=(None, "default 3.5·H"),
                              draft_vocab=32000, vocab=(None, "default Vd"), target_hidden=(None, "default H"),
                              ttt_steps=7)
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--loss-chunk-size", type=int, default=1024, help="positions per loss chunk (chunked layouts)")
    p.add_argument("--attention-tile", type=int, default=1024,
                   help="positions per causal-attention tile (kernels.tiled_attention); 0: dense [S, S] scores")
    p.add_argument("--mlp-tile", type=int, default=0,
                   help="positions per sequence tile of the draft's norm + MLP (memory.mlp_tile_size); 0: untiled")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--steps", type=int, default=1, help="steps per measurement (time: mean after the first)")
    p.add_argument("--budget-gib", type=float, help="per-rank memory budget; default: none (all lengths run)")
    p.add_argument("--run-over-budget", action="store_true",
                   help="keep measuring a layout's longer lengths after one exceeded the budget")
    p.add_argument("--skip-predicted-gib", "--skip-estimate-gib", dest="skip_predicted_gib", type=float,
                   help="do not run a measurement whose predicted peak (recipe.plan) exceeds this (default on CPU: "
                        "60%% of MemAvailable)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of peak memory vs length per layout (needs matplotlib)")
    return p


def make_spec(args, length: int, layout: str) -> BenchSpec:
    heads = args.heads or max(1, args.hidden // 64)
    return BenchSpec(seq_len=length, layout=layout, hidden=args.hidden, heads=heads,
                     kv_heads=args.kv_heads or heads, head_dim=args.head_dim or args.hidden // heads,
                     intermediate=args.intermediate or int(3.5 * args.hidden), draft_vocab=args.draft_vocab,
                     vocab=args.vocab or args.draft_vocab, target_hidden=args.target_hidden or args.hidden,
                     ttt_steps=args.ttt_steps, batch=args.batch, tp=args.tp, cp=args.cp, dtype=args.dtype,
                     device=args.device, loss_chunk_size=args.loss_chunk_size,
                     attention_tile=args.attention_tile or None, mlp_tile=args.mlp_tile or None, steps=args.steps)


def run_report(args, console: Console) -> dict:
    """Measure every (layout, length); returns the JSON-ready report."""
    results, max_length = [], {}
    for layout in args.layouts:
        stopped, fit = None, None
        max_length[layout] = None
        for length in args.lengths:
            spec = make_spec(args, length, layout)
            if length > trace_limit(spec) and fit is None:
                fit = layout_fit(spec)
            pred = predict_step(spec, fit if length > trace_limit(spec) else None)
            row = {"layout": layout, "length": length, "predicted": {k: pred[k] for k in
                                                                    ("step_bytes", "peak_bytes", "method")}}
            if stopped:
                row.update(status="not run", detail=stopped)
            elif args.skip_predicted_gib and pred["peak_bytes"] > args.skip_predicted_gib * GIB:
                row.update(status="not run", detail=f"predicted peak {pred['peak_bytes'] / GIB:.1f} GiB > "
                                                    f"--skip-predicted-gib {args.skip_predicted_gib:g}")
                stopped = "a shorter length was not run"
            else:
                console.print(f"[dim]measuring {layout} at {length} tokens ...[/dim]")
                row.update(run_measurement(spec, args.timeout))
            if row["status"] == "ok":
                row["peak_bytes"] = max(r["peak_bytes"] for r in row["ranks"])
                row["step_bytes"] = max(r["step_bytes"] for r in row["ranks"])
                row["seconds"] = max(r["seconds"] for r in row["ranks"])
                row["fits"] = args.budget_gib is None or row["peak_bytes"] <= args.budget_gib * GIB
                if row["fits"]:
                    max_length[layout] = length
                elif not stopped and not args.run_over_budget:
                    stopped = f"a shorter length exceeded the {args.budget_gib:g} GiB budget"
            elif row["status"] in ("oom", "killed") and not stopped:
                stopped = "a shorter length ran out of memory"
            results.append(row)
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results, "max_length": max_length, "chunked_vs_full": chunked_vs_full(results)}


def chunked_vs_full(results: list[dict]) -> dict | None:
    """Peak and step-Δ ratios full / chunked at the longest length where both ran, or None."""
    ok = {(r["layout"], r["length"]): r for r in results if r["status"] == "ok"}
    common = [n for n in sorted({r["length"] for r in results}) if ("full", n) in ok and ("chunked", n) in ok]
    if not common:
        return None
    full, chunked = ok[("full", common[-1])], ok[("chunked", common[-1])]
    return {"length": common[-1], "peak_ratio": full["peak_bytes"] / chunked["peak_bytes"],
            "step_ratio": full["step_bytes"] / max(chunked["step_bytes"], 1)}


def print_report(report: dict, console: Console) -> None:
    cfg = report["config"]
    tile = cfg.get("attention_tile") or "dense"
    mlp = f"MLP tile {cfg['mlp_tile']}" if cfg.get("mlp_tile") else "untiled MLP"
    table = Table(title=f"TTT step memory per rank (K={cfg['ttt_steps']}, Vd={cfg['draft_vocab']}, H={cfg['hidden']}, "
                        f"tp={cfg['tp']}, cp={cfg['cp']}, attention tile {tile}, {mlp}, {cfg['dtype']}, "
                        f"{cfg['device']})")
    for col in ("length", "layout", "peak GiB", "step Δ GiB", "pred. step GiB", "pred. peak GiB", "s/step", "pos/s",
                "status"):
        table.add_column(col, justify="left" if col in ("layout", "status") else "right", no_wrap=True)
    for row in report["results"]:
        ok = row["status"] == "ok"
        status = ("fits" if row.get("fits") else "over budget") if ok else f"{row['status']}"
        table.add_row(str(row["length"]), row["layout"], f"{row['peak_bytes'] / GIB:.2f}" if ok else "-",
                      f"{row['step_bytes'] / GIB:.2f}" if ok else "-", f"{row['predicted']['step_bytes'] / GIB:.2f}",
                      f"{row['predicted']['peak_bytes'] / GIB:.2f}",
                      f"{row['seconds']:.2f}" if ok else "-", f"{row['length'] * cfg['batch'] / row['seconds']:.0f}"
                      if ok else "-", status)
    console.print(table)
    for row in report["results"]:
        if row["status"] not in ("ok", "not run"):
            console.print(f"[red]{row['layout']} at {row['length']}: {row['status']}: "
                          f"{row['detail'].strip().splitlines()[-1] if row['detail'].strip() else ''}[/red]")
    summary = Table(title=f"Longest length within the budget ({cfg['budget_gib'] or 'none'} GiB)")
    summary.add_column("layout", no_wrap=True)
    summary.add_column("max length", justify="right")
    for layout, length in report["max_length"].items():
        summary.add_row(layout, str(length) if length else "none measured")
    console.print(summary)
    ratio = report.get("chunked_vs_full")
    if ratio:
        console.print(f"chunked loss vs full logits at {ratio['length']} tokens: peak ×{ratio['peak_ratio']:.2f}, "
                      f"step Δ ×{ratio['step_ratio']:.2f}")


def write_plot(report: dict, path: Path, console: Console) -> bool:
    """PNG of peak GiB vs length per layout; False (and a note) when matplotlib is not installed."""
    try:
        import matplotlib  # optional dependency (matplotlib)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency (matplotlib)
    except ImportError:
        console.print("[yellow]--plot skipped: matplotlib is not installed (pip install matplotlib)[/yellow]")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layout in report["max_length"]:
        rows = [r for r in report["results"] if r["layout"] == layout and r["status"] == "ok"]
        ax.plot([r["length"] for r in rows], [r["peak_bytes"] / GIB for r in rows], marker="o", label=layout)
    if report["config"]["budget_gib"]:
        ax.axhline(report["config"]["budget_gib"], color="grey", linestyle="--", label="budget")
    lengths = sorted({r["length"] for r in report["results"]})
    ax.set(xscale="log", xlabel="sequence length (tokens)", ylabel="peak GiB per rank", title="TTT step memory")
    ax.set_xticks(lengths, [f"{n / 1024:g}k" if n % 256 == 0 else str(n) for n in lengths])
    ax.minorticks_off()
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``python -m recipe.bench memory``). Returns the exit status: 0, or 2 on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.attention_tile < 0:
        parser.error("--attention-tile must be >= 0 (0: dense attention)")
    if args.mlp_tile < 0:
        parser.error("--mlp-tile must be >= 0 (0: untiled)")
    if args.skip_predicted_gib is None and args.device == "cpu":
        available = _available_gib()
        args.skip_predicted_gib = round(0.6 * available, 1) if available else None
    for name in ("tp", "cp", "hidden", "ttt_steps", "batch", "loss_chunk_size", "steps", "draft_vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        make_spec(args, args.lengths[0], args.layouts[0])
        for n in args.lengths:
            make_spec(args, n, "full")
    except ValueError as exc:
        parser.error(str(exc))
    console = Console(width=None if sys.stdout.isatty() else 150)
    report = run_report(args, console)
    print_report(report, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    if args.plot and write_plot(report, args.plot, console):
        console.print(f"wrote {args.plot}")
    return 0
