"""Whole-draft TTT step time per causal-attention backend, relative to the tiled reference, in one run.

``python -m recipe.bench step [--lengths 512,2k] [--backends tiled,sdpa] [--rounds 3] [--steps 2] [--json OUT]``
measures forward + backward of ``TTTModel`` (``recipe.bench.measure``: random aux states, every position a valid
label, one fresh process per measurement) at the geometry of issue 13 by default — hidden 576, 8 / 4 heads of dim
64, intermediate 1536, target vocab 49152, draft vocab 4096, target hidden 576, K = 7, fp32, batch 1, full logits
(so the teacher logits are computed once), attention tile 1024. The backends are measured interleaved, ``--rounds``
times each (the machine is shared: interleaving spreads background load over all of them), and each backend's time
is the median over rounds; ``x vs tiled`` is tiled's median / the backend's, at the same length.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe.cli import length_list
from recipe.bench.common import GIB, add_draft_shape_arguments, write_json
from recipe.bench.measure import DTYPES, LAYOUTS, BenchSpec, run_measurement


def build_parser() -> argparse.ArgumentParser:
    from kernels.attention_backends import BACKENDS

    def names(text):
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(n not in BACKENDS for n in out):
            raise argparse.ArgumentTypeError(f"unknown backend in {text!r}; choose from {', '.join(BACKENDS)}")
        return out

    p = argparse.ArgumentParser(prog="python -m recipe.bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[512, 2048], help="e.g. 512,2k (k = 1024)")
    p.add_argument("--backends", type=names, help="default: every backend that runs on the device")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements per (backend, length)")
    p.add_argument("--steps", type=int, default=2, help="steps per measurement (time: mean after the first)")
    add_draft_shape_arguments(p, hidden=576, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=49152,
                              draft_vocab=4096, target_hidden=576, ttt_steps=7)
    p.add_argument("--layout", choices=list(LAYOUTS), default="full")
    p.add_argument("--attention-tile", type=int, default=1024, help="0: one tile")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    return p


def summarise(rows: list[dict]) -> list[dict]:
    """Per (backend, length): median seconds over the ok rounds, tokens/s, peak, and ``x_vs_tiled``."""
    out = []
    for key in dict.fromkeys((r["backend"], r["length"]) for r in rows):
        ok = [r for r in rows if (r["backend"], r["length"]) == key and r["status"] == "ok"]
        entry = {"backend": key[0], "length": key[1], "rounds": len(ok)}
        if ok:
            entry.update(seconds=statistics.median(r["seconds"] for r in ok),
                         all_seconds=[r["seconds"] for r in ok], peak_bytes=max(r["peak_bytes"] for r in ok))
            entry["tokens_per_s"] = key[1] / entry["seconds"]
        out.append(entry)
    tiled = {e["length"]: e for e in out if e["backend"] == "tiled" and "seconds" in e}
    for e in out:
        if "seconds" in e and e["length"] in tiled:
            e["x_vs_tiled"] = tiled[e["length"]]["seconds"] / e["seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``python -m recipe.bench step``). Returns 0, or 2 on bad flags."""
    import torch

    from kernels.attention_backends import BACKENDS, backend_runs_on, resolve_attention_backend

    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.rounds < 1 or args.steps < 1 or args.attention_tile < 0:
        parser.error("--rounds and --steps must be >= 1, --attention-tile >= 0")

    def runs_here(name):
        return backend_runs_on(name, device)

    backends = args.backends or [b for b in BACKENDS if runs_here(b)]
    backends = ["tiled", *[b for b in backends if b != "tiled"]]
    if not all(runs_here(b) for b in backends):
        parser.error(f"some of {backends} do not run on {device}")
    specs = {}
    try:
        for length in args.lengths:
            for b in backends:
                specs[(b, length)] = BenchSpec(
                    seq_len=length, layout=args.layout, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, intermediate=args.intermediate, draft_vocab=args.draft_vocab,
                    vocab=args.vocab, target_hidden=args.target_hidden, ttt_steps=args.ttt_steps, dtype=args.dtype,
                    device=device, attention_tile=args.attention_tile or None, attention_backend=b, steps=args.steps)
    except ValueError as exc:
        parser.error(str(exc))
    console = Console(width=None if sys.stdout.isatty() else 150)
    rows = []
    for length in args.lengths:
        for round_ in range(args.rounds):
            for b in backends:
                console.print(f"[dim]{b} at {length} tokens, round {round_ + 1}/{args.rounds} ...[/dim]")
                result = run_measurement(specs[(b, length)], args.timeout)
                row = {"backend": b, "length": length, "round": round_, "status": result["status"],
                       "detail": result["detail"]}
                if result["status"] == "ok":
                    row.update(seconds=result["ranks"][0]["seconds"], peak_bytes=result["ranks"][0]["peak_bytes"])
                rows.append(row)
    summary = summarise(rows)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg.update(device=device, backends=backends, torch=torch.__version__,
               threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    report = {"config": cfg, "auto": resolve_attention_backend("auto", device), "summary": summary, "rounds": rows}
    table = Table(title=f"TTT step (fwd+bwd), H={args.hidden}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
                        f"Vd={args.draft_vocab}, K={args.ttt_steps}, {args.dtype}, {args.layout}, {device} "
                        f"(auto = {report['auto']})")
    for col in ("backend", "S", "s/step (median)", "per round", "tok/s", "peak GiB", "x vs tiled"):
        table.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
    for e in summary:
        ok = "seconds" in e
        table.add_row(e["backend"], str(e["length"]), f"{e['seconds']:.2f}" if ok else "failed",
                      ", ".join(f"{s:.2f}" for s in e.get("all_seconds", [])), f"{e['tokens_per_s']:.0f}" if ok else "-",
                      f"{e['peak_bytes'] / GIB:.2f}" if ok else "-", f"{e['x_vs_tiled']:.2f}" if "x_vs_tiled" in e else "-")
    console.print(table)
    for r in rows:
        if r["status"] != "ok":
            console.print(f"[red]{r['backend']} at {r['length']}: {r['status']}: {r['detail'].strip()[-400:]}[/red]")
    if args.json:
        write_json(args.json, report)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
