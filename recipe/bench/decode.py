"""Decoding-time benchmark of the target on the CPU: plain vs oneDNN-packed linear layers, and the greedy reference
of the lossless check decoded prompt by prompt vs in one batch.

    python -m recipe.bench decode [--rows 1,6,17] [--context 200] [--reps 10] [--rounds 3] [--prompts 16]
        [--new-tokens 64] [--layers 30] [--target DIR] [--threads N] [--json OUT] [--smoke]

Part 1: one cached forward of the target over m new tokens after a ``--context``-token prefix (m = 1: greedy
decoding; 6: a chain round at k = 5; 17: a tree round with a budget of 16), with the model's own ``nn.Linear``
layers and with them replaced by ``recipe.model.packed_linear.PackedLinear``; median over ``--rounds`` rounds (the
two variants interleaved) of the mean over ``--reps`` forwards. Part 2: the greedy reference of ``--prompts`` random
prompts (50-110 tokens) of ``--new-tokens`` tokens with the packed layers, ``greedy_generate`` prompt by prompt vs
``greedy_generate_batched``; the token lists are compared. The target is ``--target`` or a random target of
SmolLM2-135M's shape (``recipe.bench.target.SMOLLM2_SHAPE``, ``--layers`` layers; the timing does not depend on the
weights). ``x`` columns are the plain time over the fast one, measured in the same run. float32, ``--threads``
threads (default every core).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe.arg_types import positive_int_list
from recipe.bench.common import write_json
from recipe.bench.target import save_random_target
from recipe.model.packed_linear import pack_linear_layers, packing_available


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int_list, default=[1, 6, 17], help="new tokens per forward")
    p.add_argument("--context", type=int, default=200, help="cached tokens before each timed forward")
    p.add_argument("--reps", type=int, default=10, help="forwards per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements per (variant, rows)")
    p.add_argument("--prompts", type=int, default=16, help="prompts of the greedy-reference comparison")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt in the reference comparison")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the random target")
    p.add_argument("--target", type=Path, help="a Hugging Face target folder instead of the random one")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="a 2-layer target, few reps: checks the script runs")
    return p


@torch.no_grad()
def forward_ms(model, rows: int, context: int, reps: int) -> float:
    """Mean milliseconds of one cached forward over ``rows`` new random tokens after ``context`` cached ones."""
    from transformers import DynamicCache  # import cost: transformers

    gen = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    cache = DynamicCache()
    model(input_ids=torch.randint(0, vocab, (1, context), generator=gen), past_key_values=cache, use_cache=True)
    new = [torch.randint(0, vocab, (1, rows), generator=gen) for _ in range(reps + 1)]
    model(input_ids=new[0], past_key_values=cache, use_cache=True)  # warm-up
    cache.crop(-rows)
    start = time.perf_counter()
    for ids in new[1:]:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.crop(-rows)
    return (time.perf_counter() - start) / reps * 1e3


def reference_seconds(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """Seconds of the greedy reference of ``prompts`` prompt by prompt and in one batch (after a short warm-up of
    each), and whether they agree."""
    from recipe.eval.speculative import greedy_generate, greedy_generate_batched  # import cost: pulls in transformers
    from recipe.target.runtime import CachedTarget  # import cost: pulls in transformers

    greedy_generate(CachedTarget(model), prompts[0], 2)  # warm-up of both paths, so neither pays a first call
    greedy_generate_batched(model, prompts[:2], 2)
    start = time.perf_counter()
    sequential = [greedy_generate(CachedTarget(model), p, new_tokens).tokens for p in prompts]
    mid = time.perf_counter()
    batched = greedy_generate_batched(model, prompts, new_tokens)
    end = time.perf_counter()
    return {"sequential_s": mid - start, "batched_s": end - mid, "x": (mid - start) / max(end - mid, 1e-9),
            "tokens": sum(len(t) for t in sequential), "identical": batched == sequential}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.layers, args.reps, args.rounds, args.prompts, args.new_tokens = 2, 2, 1, 3, 4
    from transformers import AutoModelForCausalLM  # import cost: transformers

    torch.set_num_threads(args.threads)
    console = Console()
    if not packing_available():
        console.print("this PyTorch has no oneDNN linear ops: nothing to compare")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.target or save_random_target(Path(tmp) / "target", args.layers, 4096)
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packed = copy.deepcopy(plain)
    replaced = pack_linear_layers(packed)
    times: dict[str, dict[int, list[float]]] = {"plain": {}, "packed": {}}
    for _ in range(args.rounds):
        for rows in args.rows:
            for name, model in (("plain", plain), ("packed", packed)):
                times[name].setdefault(rows, []).append(forward_ms(model, rows, args.context, args.reps))
    forward = [{"rows": rows, "plain_ms": statistics.median(times["plain"][rows]),
                "packed_ms": statistics.median(times["packed"][rows])} for rows in args.rows]
    for row in forward:
        row["x"] = row["plain_ms"] / row["packed_ms"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, plain.config.vocab_size, (int(torch.randint(50, 111, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(args.prompts)]
    reference = reference_seconds(packed, prompts, args.new_tokens)

    table = Table(title=f"one cached target forward after {args.context} tokens (ms; {replaced} linear layers "
                        f"packed, {torch.get_num_threads()} threads)")
    for col in ("new tokens", "nn.Linear", "packed", "x"):
        table.add_column(col, justify="right")
    for row in forward:
        table.add_row(str(row["rows"]), f"{row['plain_ms']:.1f}", f"{row['packed_ms']:.1f}", f"{row['x']:.2f}")
    console.print(table)
    console.print(f"greedy reference, {args.prompts} prompts x {args.new_tokens} tokens: prompt by prompt "
                  f"{reference['sequential_s']:.1f} s, batched {reference['batched_s']:.1f} s "
                  f"({reference['x']:.2f}x), identical tokens: {reference['identical']}")
    write_json(args.json, {"what": __doc__.split("\n\n")[0], "target": str(args.target or "random SmolLM2-135M shape"),
                           "layers": plain.config.num_hidden_layers, "context": args.context, "reps": args.reps,
                           "rounds": args.rounds, "threads": torch.get_num_threads(), "packed_layers": replaced,
                           "forward": forward, "greedy_reference": {"prompts": args.prompts,
                                                                    "new_tokens": args.new_tokens, **reference}})
    return 0
