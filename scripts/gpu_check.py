"""GPU check: bf16 TTT training step of a Llama-3.1-8B-shaped EAGLE-3 draft on one GPU, 4k…64k tokens.

Draft: hidden 4096, 32 query / 8 KV heads (head dim 128), intermediate 14336, draft vocabulary 32000 (embedding rows
= 32000), target hidden 4096; random weights and random aux states (no target needed), K = 7 TTT steps. For every
layout (``full`` logits, ``chunked`` loss, ``ckpt`` per-step checkpointing, ``chunked+ckpt``) and length: peak
``torch.cuda.max_memory_allocated`` and tokens/s of forward + backward (mean of the steps after a warm-up step).
One model is built once and the layouts are switched through ``TTTModel.loss_chunk_size`` / ``checkpoint_steps``;
the causal block is tiled (``--attention-tile``, as training does) so no [S, S] scores are kept; an out-of-memory
step is recorded (``"oom"``) and the layout's longer lengths are skipped. Results are rewritten
after every measurement to ``OUT/gpu_check.json`` (OUT = ``--out``, else ``$OUT``, else ./gpu_check_out), so a run
stopped by its time limit still leaves what it measured; ``--deadline-s`` stops starting new measurements.

Usage: ``python scripts/gpu_check.py`` on the GPU machine (one run, ~5 min); ``python scripts/gpu_check.py --smoke``
runs tiny shapes on the CPU (what the tests do).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from recipe.bench.estimate import estimate_step_bytes  # noqa: E402
from recipe.bench.measure import LAYOUTS, BenchSpec, build_model, random_batch, time_step  # noqa: E402
from recipe.bench.memory import length_list, layout_list, print_report  # noqa: E402

LLAMA_8B_DRAFT = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                      vocab=32000, target_hidden=4096)
SMOKE_DRAFT = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=512, vocab=512,
                   target_hidden=64)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_check_out)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (64/128 tokens, K=2)")
    p.add_argument("--lengths", type=length_list, help="default 4k,8k,16k,32k,64k (smoke: 64,128)")
    p.add_argument("--layouts", type=layout_list, default=["chunked+ckpt", "chunked", "ckpt", "full"])
    p.add_argument("--ttt-steps", type=int, help="TTT steps K (default 7; smoke 2)")
    p.add_argument("--loss-chunk-size", type=int, help="positions per loss chunk (default 4096; smoke 32)")
    p.add_argument("--attention-tile", type=int,
                   help="positions per causal-attention tile (default 1024; smoke 32); 0: dense [S, S] scores")
    p.add_argument("--steps", type=int, default=2, help="steps per measurement; time = mean after the first")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no measurement after this many seconds")
    return p


def _attention_tile(args) -> int | None:
    """The tile size of the run: the flag (0 = dense block), else 32 for --smoke and 1024 on the GPU."""
    if args.attention_tile is None:
        return 32 if args.smoke else 1024
    return args.attention_tile or None


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --smoke for the CPU test run", file=sys.stderr)
        return 2
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = args.lengths or ([64, 128] if args.smoke else [4096, 8192, 16384, 32768, 65536])
    geometry = SMOKE_DRAFT if args.smoke else LLAMA_8B_DRAFT
    base = BenchSpec(seq_len=lengths[0], ttt_steps=args.ttt_steps or (2 if args.smoke else 7), dtype="bf16",
                     device=device, loss_chunk_size=args.loss_chunk_size or (32 if args.smoke else 4096),
                     attention_tile=_attention_tile(args), steps=args.steps, **geometry)
    torch.set_num_threads(1 if args.smoke else max(1, os.cpu_count() or 1))
    console = Console(width=None if sys.stdout.isatty() else 150)
    budget = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    info = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "total_memory_bytes": budget}
    model = build_model(base, torch.device(device))
    config = {**dataclasses.asdict(base), "lengths": lengths, "layouts": args.layouts, "tp": 1, "cp": 1,
              "budget_gib": None if budget is None else budget / 1024 ** 3}
    report = {"info": info, "config": config, "results": [], "max_length": {}}
    path = out_dir / "gpu_check.json"
    for layout in args.layouts:
        chunked, ckpt = LAYOUTS[layout]
        model.loss_chunk_size = base.loss_chunk_size if chunked else None
        model.checkpoint_steps = ckpt
        report["max_length"][layout], skip = None, None
        for length in lengths:
            spec = dataclasses.replace(base, seq_len=length, layout=layout)
            row = {"layout": layout, "length": length, "estimate": estimate_step_bytes(spec.shape()), "detail": ""}
            if skip or time.monotonic() - started > args.deadline_s:
                row["status"], row["detail"] = "not run", skip or f"past --deadline-s {args.deadline_s:g}"
            else:
                console.print(f"[dim]{layout} at {length} tokens ...[/dim]")
                try:
                    row.update(time_step(model, random_batch(spec, torch.device(device)), spec.steps), status="ok")
                except torch.OutOfMemoryError as exc:
                    row["status"], row["detail"] = "oom", str(exc).splitlines()[0]
                    skip = "a shorter length ran out of memory"
                _free_device_memory()
            if row["status"] == "ok":
                row["tokens_per_s"] = spec.batch * length / row["seconds"]
                row["fits"] = True
                report["max_length"][layout] = length
            report["results"].append(row)
            path.write_text(json.dumps(report, indent=1))
    report["elapsed_s"] = time.monotonic() - started
    path.write_text(json.dumps(report, indent=1))
    print_report(report, console)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
