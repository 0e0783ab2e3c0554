"""Tensor-parallel memory benchmark: per-rank bytes of parameters, gradients and AdamW state, and the peak memory
of one training step (forward + backward + optimizer step), for tp = 1, 2, 4 at a fixed sequence length.

    python -m recipe.bench tp [--tp 1,2,4] [--length 1024] [--hidden 512] [--heads 8] [--kv-heads 4]
                              [--intermediate 1536] [--draft-vocab 8192] [--json OUT]

Each layout runs in ``tp`` fresh processes (gloo on CPU). Bytes are counted from the tensors each rank holds: the
trainable parameters (TP shards of q/k/v/o, gate/up/down and lm_head; replicated fc and norms), their gradients and
``torch.optim.AdamW``'s state (exp_avg, exp_avg_sq: 2x the parameters, plus a step counter); ``frozen`` is the target
embedding copy and the target head rows. Under ZeRO-1/2/3 the optimizer state (and gradients, parameters) are further
divided by the dp·cp group, which this benchmark leaves at 1. Peak memory is the resident-set high-water mark of the
second step (the first allocates gradients and optimizer state); ``step_act`` = peak minus the RSS just before it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe.arg_types import positive_int_list
from recipe.bench.common import GIB, MIB, add_draft_shape_arguments, tensor_bytes, write_json
from recipe.bench.measure import CpuPeak, build_model, random_batch
from recipe.bench.ranks import spawn_gloo_ranks
from recipe.model.ttt import ttt_objective
from recipe.parallel.dims import ParallelDims
from recipe.plan.spec import BenchSpec


def _train_step(model, batch, optimizer) -> float:
    start = time.perf_counter()
    out = model(batch)
    ttt_objective(out, out.valid_K).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers, as a training loop does
    return time.perf_counter() - start


def _rank(rank: int, world: int, spec_fields: dict) -> dict:
    """One rank of a tp=world layout: byte counts, then peak memory and time of a measured training step."""
    from recipe.parallel.topology import ParallelState  # import cost: pulls in deepspeed

    spec = BenchSpec(**spec_fields)
    pstate = ParallelState(ParallelDims(world_size=world, tp=world))
    model = build_model(spec, torch.device("cpu"), pstate)
    batch = random_batch(spec, torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    _train_step(model, batch, optimizer)  # allocates gradients and the optimizer state
    gc.collect()
    probe = CpuPeak()
    probe.reset()
    seconds = _train_step(model, batch, optimizer)
    peak = probe.peak()
    frozen = [p for p in model.parameters() if not p.requires_grad] + [model.target_head_d]
    return {"tp_rank": pstate.tp_rank, "param_bytes": tensor_bytes(trainable),
            "grad_bytes": tensor_bytes(p.grad for p in trainable),
            "optimizer_bytes": tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor)),
            "frozen_bytes": tensor_bytes(frozen), "num_params": sum(p.numel() for p in trainable),
            "base_bytes": int(probe.base), "peak_bytes": int(peak), "step_act_bytes": int(peak - probe.base),
            "seconds": seconds, "memory_method": probe.method}


def run(spec: BenchSpec, tps: list[int]) -> list[dict]:
    """Per-layout result dicts: ``tp``, ``ranks`` (each rank's ``_rank`` dict) and the maxima over ranks."""
    results = []
    for tp in tps:
        ranks = spawn_gloo_ranks(tp, _rank, dataclasses.asdict(dataclasses.replace(spec, tp=tp)))
        row = {"tp": tp, "ranks": ranks}
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "frozen_bytes", "peak_bytes", "step_act_bytes",
                    "seconds"):
            row[key] = max(r[key] for r in ranks)
        results.append(row)
    return results


def table(results: list[dict], spec: BenchSpec) -> Table:
    t = Table(title=f"TP memory per rank: length {spec.seq_len}, hidden {spec.hidden}, {spec.heads}/{spec.kv_heads} "
                    f"heads, intermediate {spec.intermediate}, draft vocab {spec.draft_vocab}, K={spec.ttt_steps}")
    for col in ("tp", "params MiB", "grads MiB", "AdamW MiB", "frozen MiB", "step peak GiB", "step act MiB",
                "step s", "params vs tp=1"):
        t.add_column(col, justify="right")
    base = results[0]["param_bytes"]
    for r in results:
        t.add_row(str(r["tp"]), f"{r['param_bytes'] / MIB:.1f}", f"{r['grad_bytes'] / MIB:.1f}",
                  f"{r['optimizer_bytes'] / MIB:.1f}", f"{r['frozen_bytes'] / MIB:.1f}",
                  f"{r['peak_bytes'] / GIB:.3f}", f"{r['step_act_bytes'] / MIB:.1f}", f"{r['seconds']:.2f}",
                  f"{r['param_bytes'] / base:.2f}x")
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=positive_int_list, default=[1, 2, 4], help="tensor-parallel sizes (default 1,2,4)")
    p.add_argument("--length", type=int, default=1024, help="sequence length (tokens, default 1024)")
    add_draft_shape_arguments(p, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536, draft_vocab=8192,
                              vocab=32000, target_hidden=512, ttt_steps=3)
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        specs = [BenchSpec(seq_len=args.length, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, intermediate=args.intermediate, draft_vocab=args.draft_vocab,
                           vocab=args.vocab, target_hidden=args.target_hidden, ttt_steps=args.ttt_steps, tp=tp)
                 for tp in args.tp]
    except ValueError as exc:
        parser.error(str(exc))
    console = Console()
    results = run(specs[0], args.tp)
    console.print(table(results, specs[0]))
    write_json(args.json, {"benchmark": "tp", "spec": dataclasses.asdict(specs[0]), "results": results})
    return 0
