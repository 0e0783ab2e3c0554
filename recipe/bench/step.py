"""Whole-draft TTT step time per causal-attention backend, relative to the tiled reference, in one run.

``python -m recipe.bench step [--lengths 512,2k] [--backends tiled,sdpa] [--rounds 3] [--steps 2] [--json OUT]``
measures forward + backward of ``TTTModel`` (``recipe.bench.measure``: random aux states, every position a valid
label, one fresh process per measurement) at the geometry of issue 13 by default — hidden 576, 8 / 4 heads of dim
64, intermediate 1536, target vocab 49152, draft vocab 4096, target hidden 576, K = 7, fp32, batch 1, full logits
(so the teacher logits are computed once), attention tile 1024. The backends are measured interleaved, ``--rounds``
times each (the machine is shared: interleaving spreads background load over all of them), and each backend's time
is the median over rounds; ``x vs tiled`` is tiled's median / the backend's, at the same length.

Speed columns: ``pos/s`` counts every token position of the batch (``supervised_tokens_per_s`` in the JSON the
loss-masked ones), ``TFLOP/s`` the step's model FLOPs per GPU (``recipe.plan.spec.spec_flops``, no recompute; the
JSON also has the hardware FLOPs, with it) and ``MFU`` divides that by the device's dense peak for the dtype
(``recipe.model.flops.PEAK_TFLOPS``, or ``--peak-tflops``; none on the CPU: "-").

``--masks full,sharegpt,long10`` measures each supervision mask (``recipe.plan.spec.MASKS``) and ``--sparse both``
the dense path and the needed anchors only (``memory.sparse_anchors``) side by side, interleaved the same way;
``sparse / dense`` is the sparse median / the dense one for the same backend, length and mask.

``--packing`` measures micro-batches of ShareGPT-length samples padded against the same samples packed
(``recipe.bench.packing``; ``--micro-batch``, ``--mixes``, ``--max-length``, ``--packing-tokens``; the attention
kernel: the last of ``--backends``, default the one "auto" picks on the device).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kernels.attention_backends import backend_names, backend_runs_on, resolve_attention_backend
from recipe.arg_types import length_list
from recipe.bench.common import GIB, add_draft_shape_arguments, write_json
from recipe.bench.measure import run_measurement
from recipe.bench.packing import add_packing_arguments, main_packing
from recipe.model.flops import run_peak_tflops
from recipe.plan.spec import DTYPES, LAYOUTS, MASKS, BenchSpec, spec_speed


def build_parser() -> argparse.ArgumentParser:
    def names(text):
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(n not in backend_names() for n in out):
            raise argparse.ArgumentTypeError(f"unknown backend in {text!r}; choose from {', '.join(backend_names())}")
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
    p.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                   help="the device's dense peak TFLOP/s for --dtype, which MFU divides by (default: the bf16 peak of "
                        "a known GPU, recipe.model.flops.PEAK_TFLOPS; else no MFU)")

    def masks(text):
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(m not in MASKS for m in out):
            raise argparse.ArgumentTypeError(f"unknown mask in {text!r}; choose from {', '.join(MASKS)}")
        return out

    p.add_argument("--masks", type=masks, default=["full"], help=f"supervision masks, from {', '.join(MASKS)}")
    p.add_argument("--sparse", choices=["off", "on", "both"], default="off",
                   help="memory.sparse_anchors: the dense path, the needed anchors only, or both side by side")
    add_packing_arguments(p)  # --packing and its flags: recipe.bench.packing
    return p


def summarise(rows: list[dict], specs: dict | None = None, peak_tflops: float | None = None) -> list[dict]:
    """Per (backend, length, mask, sparse): median seconds over the ok rounds, peak, ``x_vs_tiled`` (same length,
    mask and path) and, for sparse entries, ``sparse_vs_dense`` (seconds and peak, same backend); with ``specs``
    (that key -> its ``BenchSpec``) the speed fields of ``recipe.plan.spec.spec_speed`` (positions/s, supervised
    tokens/s, model and hardware TFLOP/s a GPU, MFU against ``peak_tflops``)."""
    def key(r):
        return r["backend"], r["length"], r.get("mask", "full"), r.get("sparse", False)

    out = []
    for k in dict.fromkeys(key(r) for r in rows):
        ok = [r for r in rows if key(r) == k and r["status"] == "ok"]
        entry = {"backend": k[0], "length": k[1], "mask": k[2], "sparse": k[3], "rounds": len(ok)}
        if ok:
            entry.update(seconds=statistics.median(r["seconds"] for r in ok),
                         all_seconds=[r["seconds"] for r in ok], peak_bytes=max(r["peak_bytes"] for r in ok))
            if specs is not None:
                entry.update(spec_speed(specs[k], entry["seconds"], peak_tflops))
        out.append(entry)
    done = {(e["backend"], e["length"], e["mask"], e["sparse"]): e for e in out if "seconds" in e}
    for e in out:
        tiled = done.get(("tiled", e["length"], e["mask"], e["sparse"]))
        if "seconds" in e and tiled is not None:
            e["x_vs_tiled"] = tiled["seconds"] / e["seconds"]
        dense = done.get((e["backend"], e["length"], e["mask"], False))
        if "seconds" in e and e["sparse"] and dense is not None:
            e["sparse_vs_dense"] = e["seconds"] / dense["seconds"]
            e["peak_vs_dense"] = e["peak_bytes"] / dense["peak_bytes"]
    return out


def summary_table(args, device: str, report: dict) -> Table:
    """The printed table of ``main``'s ``report`` (its ``summary`` rows; the peak in its ``config``)."""
    peak, summary = report["config"]["peak_tflops"], report["summary"]
    table = Table(title=f"TTT step (fwd+bwd), H={args.hidden}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
                        f"Vd={args.draft_vocab}, K={args.ttt_steps}, {args.dtype}, {args.layout}, {device} "
                        f"(auto = {report['auto']}); pos/s: token positions, TFLOP/s: model FLOPs a GPU"
                        + (f", MFU of {peak:g} TFLOP/s" if peak else ""))
    for col in ("backend", "S", "mask", "path", "s/step (median)", "per round", "pos/s", "TFLOP/s", "MFU",
                "peak GiB", "x vs tiled", "sparse / dense (time, peak)"):
        table.add_column(col, justify="left" if col in ("backend", "mask", "path") else "right", no_wrap=True)
    for e in summary:
        ok = "seconds" in e
        ratio = f"{e['sparse_vs_dense']:.2f}, {e['peak_vs_dense']:.2f}" if "sparse_vs_dense" in e else "-"
        table.add_row(e["backend"], str(e["length"]), e["mask"], "sparse" if e["sparse"] else "dense",
                      f"{e['seconds']:.2f}" if ok else "failed",
                      ", ".join(f"{s:.2f}" for s in e.get("all_seconds", [])),
                      f"{e['positions_per_s']:.0f}" if ok else "-", f"{e['model_tflops_per_gpu']:.2f}" if ok else "-",
                      f"{e['mfu']:.1%}" if ok and e["mfu"] is not None else "-",
                      f"{e['peak_bytes'] / GIB:.2f}" if ok else "-",
                      f"{e['x_vs_tiled']:.2f}" if "x_vs_tiled" in e else "-", ratio)
    return table


def _spec(args, device: str, length: int, backend: str, mask: str, sparse: bool) -> BenchSpec:
    """The measured step of one variant: the flags' draft geometry at ``length`` tokens. Raises ValueError."""
    return BenchSpec(seq_len=length, layout=args.layout, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                     draft_vocab=args.draft_vocab, vocab=args.vocab, target_hidden=args.target_hidden,
                     ttt_steps=args.ttt_steps, dtype=args.dtype, device=device,
                     attention_tile=args.attention_tile or None, attention_backend=backend, steps=args.steps,
                     mask=mask, sparse_anchors=sparse)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``python -m recipe.bench step``). Returns 0, or 2 on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.rounds < 1 or args.steps < 1 or args.attention_tile < 0 or (args.peak_tflops or 1) <= 0:
        parser.error("--rounds and --steps must be >= 1, --attention-tile >= 0, --peak-tflops > 0")

    def runs_here(name):
        return backend_runs_on(name, device)

    if args.packing:  # padded vs packed micro-batches of ShareGPT-length samples
        if args.backends and not runs_here(args.backends[-1]):
            parser.error(f"{args.backends[-1]} does not run on {device}")
        backend = args.backends[-1] if args.backends else resolve_attention_backend("auto", device)
        return main_packing(args, device, backend, Console(width=None if sys.stdout.isatty() else 150))
    backends = args.backends or [b for b in backend_names() if runs_here(b)]
    backends = ["tiled", *[b for b in backends if b != "tiled"]]
    if not all(runs_here(b) for b in backends):
        parser.error(f"some of {backends} do not run on {device}")
    paths = {"off": [False], "on": [True], "both": [False, True]}[args.sparse]
    variants = [(b, m, sp) for m in args.masks for sp in paths for b in backends]
    try:
        specs = {(b, length, mask, sparse): _spec(args, device, length, b, mask, sparse)
                 for length in args.lengths for b, mask, sparse in variants}
    except ValueError as exc:
        parser.error(str(exc))
    console = Console(width=None if sys.stdout.isatty() else 150)
    rows = []
    for length in args.lengths:
        for round_ in range(args.rounds):
            for b, mask, sparse in variants:
                path = "sparse" if sparse else "dense"
                console.print(f"[dim]{b} {mask} {path} at {length} tokens, round {round_ + 1}/{args.rounds} ..."
                              "[/dim]")
                result = run_measurement(specs[(b, length, mask, sparse)], args.timeout)
                row = {"backend": b, "length": length, "mask": mask, "sparse": sparse, "round": round_,
                       "status": result["status"], "detail": result["detail"]}
                if result["status"] == "ok":
                    row.update(seconds=result["ranks"][0]["seconds"], peak_bytes=result["ranks"][0]["peak_bytes"])
                rows.append(row)
    peak = run_peak_tflops(device, DTYPES[args.dtype], args.peak_tflops)
    summary = summarise(rows, specs, peak)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg.update(device=device, backends=backends, torch=torch.__version__,
               threads=int(os.environ.get("OMP_NUM_THREADS", "1")), peak_tflops=peak)
    report = {"config": cfg, "auto": resolve_attention_backend("auto", device), "summary": summary, "rounds": rows}
    console.print(summary_table(args, device, report))
    for r in rows:
        if r["status"] != "ok":
            console.print(f"[red]{r['backend']} {r['mask']} at {r['length']}: {r['status']}: "
                          f"{r['detail'].strip()[-400:]}[/red]")
    if args.json:
        write_json(args.json, report)
        console.print(f"wrote {args.json}")
    return 0
