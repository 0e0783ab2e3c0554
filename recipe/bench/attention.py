"""Causal-block attention per backend: time and peak memory of forward and forward+backward vs length, per dtype.

``python -m recipe.bench attention [--lengths 512,1k,2k,4k] [--dtypes fp32,bf16] [--backends tiled,sdpa]
[--tile 1024] [--heads 8 --kv-heads 4 --head-dim 64] [--device cpu|cuda] [--repeats 2] [--json OUT]`` runs, per
(backend, dtype), one fresh process that times ``make_causal_attention(backend, tile, device)`` on random q/k/v at
every length: the draft's training call (global positions 0..S-1, all keys valid, queries = keys) and a loss that
reads out and lse, so the backward carries the LSE's gradient as in TTT. Times are medians of ``--repeats`` runs
after one warm-up (which also absorbs flex's compilation). Memory is what the call adds on top of its inputs: on
CUDA the allocator peak, on CPU the resident-set high-water mark (``recipe.bench.measure.CpuPeak``, children started
with glibc's mmap threshold at 1 MiB so freed tensors leave the RSS). Backends default to every one that runs on
the device (``kernels.attention_backends``); the table gives each one's speed-up over ``tiled``.
"""
from __future__ import annotations

import argparse
import os
import queue as queue_mod
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from kernels.attention_backends import backend_names, backend_runs_on, make_causal_attention, resolve_attention_backend
from recipe.arg_types import length_list
from recipe.bench.common import MIB, add_draft_shape_arguments, write_json
from recipe.bench.measure import MALLOC_ENV, CpuPeak, CudaPeak
from recipe.plan.spec import DTYPES


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_attention(attention, length: int, dtype, device, heads: int, kv_heads: int, head_dim: int,
                   repeats: int, seed: int = 0) -> dict:
    """Median seconds of the forward alone and of forward + backward of ``attention`` on one [1, H, S, D] block,
    and the bytes the forward+backward adds at its peak (over its inputs). Raises what the attention raises."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, heads, length, head_dim, generator=g).to(device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, length, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    w = torch.randn(q.shape, generator=g).to(device=device, dtype=dtype)
    u = torch.randn(1, heads, length, generator=g).to(device=device)
    pos = torch.arange(length, device=device)[None]
    valid = torch.ones(1, length, dtype=torch.bool, device=device)

    def forward_only():
        with torch.no_grad():
            attention(q, k, v, pos, pos, valid)

    def forward_backward():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention(*leaves, pos, pos, valid)
        ((out * w).sum() + (lse * u).sum()).backward()

    probe = CudaPeak() if device.type == "cuda" else CpuPeak()
    result = {}
    for name, fn in (("forward", forward_only), ("forward_backward", forward_backward)):
        fn()  # warm-up (and compilation)
        _sync(device)
        if name == "forward_backward":
            probe.reset()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        result[f"{name}_seconds"] = statistics.median(seconds)
    result["peak_bytes"] = int(probe.peak() - probe.base)
    result["memory_method"] = probe.method
    return result


def _child(backend: str, dtype_name: str, cfg: dict, queue) -> None:
    """One (backend, dtype) in a fresh process: every length, results (or the error) on ``queue``."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device(cfg["device"])
    rows = []
    for length in cfg["lengths"]:
        row = {"backend": backend, "dtype": dtype_name, "length": length}
        try:
            attention = make_causal_attention(backend, cfg["tile"], device)
            row.update(status="ok", **time_attention(attention, length, DTYPES[dtype_name], device, cfg["heads"],
                                                     cfg["kv_heads"], cfg["head_dim"], cfg["repeats"]))
        except torch.OutOfMemoryError as exc:
            row.update(status="oom", detail=str(exc).splitlines()[0])
        except Exception:  # noqa: BLE001 - reported in the table
            row.update(status="error", detail=traceback.format_exc()[-1500:])
        rows.append(row)
        if row["status"] != "ok":
            break
    queue.put(rows)


def run_child(backend: str, dtype_name: str, cfg: dict, timeout: float) -> list[dict]:
    """``_child`` in a spawned process (CPU: mmap threshold 1 MiB); a row with status "error" if it dies."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = os.environ.get(MALLOC_ENV)
    if cfg["device"] == "cpu" and saved is None:
        os.environ[MALLOC_ENV] = str(1 << 20)
    try:
        proc = ctx.Process(target=_child, args=(backend, dtype_name, cfg, results))
        proc.start()
    finally:
        if saved is None:
            os.environ.pop(MALLOC_ENV, None)
    try:
        rows = results.get(timeout=timeout)
    except queue_mod.Empty:
        rows = [{"backend": backend, "dtype": dtype_name, "length": cfg["lengths"][0], "status": "error",
                 "detail": f"no result within {timeout:.0f} s (exit code {proc.exitcode})"}]
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return rows


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_tiled`` (tiled forward+backward seconds / this row's) on every ok row with a tiled twin."""
    tiled = {(r["dtype"], r["length"]): r for r in rows if r["backend"] == "tiled" and r["status"] == "ok"}
    for r in rows:
        ref = tiled.get((r["dtype"], r["length"]))
        if r["status"] == "ok" and ref:
            r["speedup_vs_tiled"] = ref["forward_backward_seconds"] / r["forward_backward_seconds"]


def print_table(report: dict, console: Console) -> None:
    cfg = report["config"]
    table = Table(title=f"Causal-block attention, 1 x {cfg['heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, "
                        f"tile {cfg['tile']}, {cfg['device']} (auto = {report['auto']})")
    for col in ("backend", "dtype", "S", "fwd s", "fwd+bwd s", "peak MiB", "x vs tiled", "status"):
        table.add_column(col, justify="left" if col in ("backend", "dtype", "status") else "right", no_wrap=True)
    for r in report["results"]:
        ok = r["status"] == "ok"
        table.add_row(r["backend"], r["dtype"], str(r["length"]), f"{r['forward_seconds']:.4f}" if ok else "-",
                      f"{r['forward_backward_seconds']:.4f}" if ok else "-",
                      f"{r['peak_bytes'] / MIB:.1f}" if ok else "-",
                      f"{r['speedup_vs_tiled']:.2f}" if "speedup_vs_tiled" in r else "-", r["status"])
    console.print(table)
    for r in report["results"]:
        if r["status"] != "ok":
            console.print(f"[red]{r['backend']} {r['dtype']} at {r['length']}: {r['detail'].strip()[-400:]}[/red]")


def _names(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; choose from {', '.join(allowed)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[512, 1024, 2048, 4096], help="e.g. 512,1k,2k (k = 1024)")
    p.add_argument("--dtypes", type=lambda t: _names(t, DTYPES, "dtype"), default=["fp32", "bf16"])
    p.add_argument("--backends", type=lambda t: _names(t, backend_names(), "backend"),
                   help=f"subset of {','.join(backend_names())} (default: those that run on the device)")
    p.add_argument("--tile", type=int, default=1024, help="attention_tile_size (0: none)")
    add_draft_shape_arguments(p, heads=8, kv_heads=4, head_dim=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (median)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per (backend, dtype) process")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``python -m recipe.bench attention``). Returns 0, or 2 on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("heads", "kv_heads", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tile < 0 or args.heads % args.kv_heads:
        parser.error("--tile must be >= 0 and --kv-heads must divide --heads")

    def runs_here(name):
        return backend_runs_on(name, device)

    backends = args.backends or [b for b in backend_names() if runs_here(b)]
    if "tiled" not in backends:
        backends = ["tiled", *backends]  # the reference every speed-up is relative to
    for b in backends:
        if not runs_here(b):
            parser.error(f"backend {b!r} does not run on {device}")
    cfg = dict(device=device, lengths=args.lengths, tile=args.tile or None, heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim, repeats=args.repeats, threads=int(os.environ.get("OMP_NUM_THREADS", "1")),
               torch=torch.__version__)
    console = Console(width=None if sys.stdout.isatty() else 150)
    rows = []
    for dtype_name in args.dtypes:
        for backend in backends:
            console.print(f"[dim]{backend} {dtype_name} ...[/dim]")
            rows += run_child(backend, dtype_name, cfg, args.timeout)
    add_speedups(rows)
    report = {"config": cfg, "auto": resolve_attention_backend("auto", device), "results": rows}
    print_table(report, console)
    if args.json:
        write_json(args.json, report)
        console.print(f"wrote {args.json}")
    return 0
