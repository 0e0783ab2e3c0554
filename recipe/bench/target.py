"""Target-forward benchmark: per-rank peak memory and time of the online target forward vs (cp, tp) at a fixed length.

    python -m recipe.bench target [--cp 1,2] [--tp 1,2] [--length 8192] [--layers 30] [--target DIR] [--json OUT]
    python -m recipe.bench target --packing [--micro-batch 8] [--max-length 512] [--mixes 3] [--json OUT]

Each (cp, tp) of the product of ``--cp`` and ``--tp`` runs in cp·tp fresh processes (gloo on CPU,
``recipe.bench.ranks``), as training does: (1, 1) the full-sequence ``TargetModel.capture`` (the model's own sdpa
attention), otherwise ``SplitTarget.capture`` split over the cp·tp ranks (each runs the ring over 1/(cp·tp) of the
sequence, then the tp all-gather and the cp halo sum give every rank its cp rank's aux states and label rows:
``recipe.target.split``). The target is ``--target`` or a random target of SmolLM2-135M's shape (Llama, hidden 576,
9 / 3 KV heads, MLP 1536, vocab 49152; ``--layers`` decoder layers), random tokens, no padding. Per rank:
``act_bytes`` = peak RSS during the capture minus the RSS just before it (weights loaded; the glibc set-up of
``recipe.bench.measure``), ``kept_bytes`` = the capture's output tensors (aux states, last hidden rows, argmax), wall
and CPU seconds of the capture (CPU seconds are the process's own, unaffected by ranks sharing cores), and the bytes
it received in the exchange (``recipe.target.split.TargetExchangeCounts``); the maximum over ranks is reported.

``--packing``: the forward of ShareGPT-length micro-batches at one rank, padded against packed through the whole
target and through the one-rank split (``recipe.bench.target_packing``).

Issue targets (reported, not asserted): at (cp, tp) = (2, 2) per-rank activation bytes <= 0.3x and CPU seconds
<= 0.35x of (1, 1); at cp = 4 activation bytes <= 0.3x of cp = 1.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe.arg_types import positive_int_list
from recipe.bench.common import MIB, add_draft_shape_arguments, tensor_bytes, write_json
from recipe.bench.ranks import spawn_gloo_ranks
from recipe.config_memory import MemoryOptions
from recipe.parallel.dims import ParallelDims

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
"""SmolLM2-135M's architecture (its config.json) without the layer count."""


def save_random_target(folder: Path, layers: int, max_positions: int, seed: int = 0) -> Path:
    """A random fp32 Llama of ``SMOLLM2_SHAPE`` with ``layers`` decoder layers saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM  # import cost: transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_positions,
                                             **SMOLLM2_SHAPE))
    model.save_pretrained(folder)
    return folder


def _forward(target, split_target, ids, mask, ttt_steps, argmax_chunk):
    if split_target is None:
        cap = target.capture(ids, mask, argmax_chunk)
        return [cap.aux_hidden_BSA, cap.last_hidden_BSH, cap.argmax_BS]
    cap = split_target.capture(ids, mask, ttt_steps)
    return [cap.aux_hidden_BSA, cap.label_hidden_BUH, cap.argmax_BS]


def _rank(rank: int, world: int, folder: str, cp: int, length: int, batch: int, ttt_steps: int, backend: str,
          tile: int | None, argmax_chunk: int, repeats: int) -> dict:
    """One rank's measurement (``spawn_gloo_ranks`` worker, ``world`` = cp·tp): a warm-up forward on a short
    sequence, then ``repeats`` timed forwards of the [batch, length] sequence."""
    from recipe.bench.measure import CpuPeak  # import cost: pulls in transformers
    from recipe.parallel.topology import ParallelState  # import cost: pulls in deepspeed
    from recipe.target.capture import TargetModel  # import cost: pulls in transformers

    target = TargetModel(folder, dtype=torch.float32, device="cpu")
    split = None
    if world > 1:
        from recipe.target.split import SplitTarget  # import cost: pulls in transformers

        pstate = ParallelState(ParallelDims(world, tp=world // cp, cp=cp))
        split = SplitTarget.from_state(target, pstate, backend, tile, argmax_chunk)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    _forward(target, split, ids[:, :4 * world], mask[:, :4 * world], ttt_steps, argmax_chunk)  # warm-up
    probe = CpuPeak()
    probe.reset()
    wall, cpu = [], []
    if split is not None:
        split.counts = type(split.counts)()
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        kept = _forward(target, split, ids, mask, ttt_steps, argmax_chunk)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = probe.peak()
    counts = asdict(split.counts) if split is not None else {}
    return {"act_bytes": int(peak - probe.base), "kept_bytes": tensor_bytes(kept), "seconds": sum(wall) / repeats,
            "cpu_seconds": sum(cpu) / repeats, "method": probe.method,
            "exchange_bytes": sum(counts.get(k, 0) for k in ("gathered_bytes", "halo_bytes", "argmax_bytes"))
            // repeats, "forward_positions": counts.get("forward_positions", batch * length * repeats) // repeats}


def run(folder: Path, layouts: list[tuple[int, int]], length: int, batch: int, ttt_steps: int, backend: str,
        tile: int | None, argmax_chunk: int, repeats: int) -> dict:
    """One row per (cp, tp) (maxima over ranks) and the issue targets' ratios."""
    from recipe.bench.measure import mmap_threshold_for_children  # import cost: pulls in transformers

    rows = []
    for cp, tp in layouts:
        with mmap_threshold_for_children("cpu"):
            ranks = spawn_gloo_ranks(cp * tp, _rank, str(folder), cp, length, batch, ttt_steps, backend, tile,
                                     argmax_chunk, repeats, timeout=3600.0)
        rows.append({"cp": cp, "tp": tp, "forward": "TargetModel.capture" if cp * tp == 1 else "SplitTarget.capture",
                     **{key: max(r[key] for r in ranks) for key in ("act_bytes", "kept_bytes", "seconds",
                                                                    "cpu_seconds", "exchange_bytes",
                                                                    "forward_positions")},
                     "method": ranks[0]["method"], "ranks": ranks})
    by = {(r["cp"], r["tp"]): r for r in rows}
    targets = {}

    def ratio(name, key, over, limit):
        if over in by and (1, 1) in by:
            value = by[over][key] / max(by[(1, 1)][key], 1)
            targets[name] = {"value": value, "target": f"<= {limit}", "met": value <= limit}

    ratio("act_cp2tp2_over_cp1tp1", "act_bytes", (2, 2), 0.3)
    ratio("cpu_cp2tp2_over_cp1tp1", "cpu_seconds", (2, 2), 0.35)
    ratio("act_cp4_over_cp1", "act_bytes", (4, 1), 0.3)
    return {"rows": rows, "targets": targets}


def table(res: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("cp", "tp", "forward", "positions / rank", "act MiB / rank", "× (1,1)", "kept MiB / rank",
                "exchange MiB / rank", "wall s", "CPU s / rank", "× (1,1) CPU"):
        t.add_column(col, justify="left" if col == "forward" else "right")
    base = next((r for r in res["rows"] if (r["cp"], r["tp"]) == (1, 1)), None)
    for r in res["rows"]:
        t.add_row(str(r["cp"]), str(r["tp"]), r["forward"], str(r["forward_positions"]),
                  f"{r['act_bytes'] / MIB:.1f}",
                  "-" if base is None else f"{r['act_bytes'] / max(base['act_bytes'], 1):.2f}",
                  f"{r['kept_bytes'] / MIB:.1f}", f"{r['exchange_bytes'] / MIB:.1f}", f"{r['seconds']:.2f}",
                  f"{r['cpu_seconds']:.2f}", "-" if base is None else f"{r['cpu_seconds'] / base['cpu_seconds']:.2f}")
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench target", description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=positive_int_list, default=[1, 2], help="context-parallel sizes (default 1,2)")
    p.add_argument("--tp", type=positive_int_list, default=[1, 2],
                   help="tensor-parallel sizes (default 1,2); every (cp, tp) pair of the two lists runs")
    p.add_argument("--length", type=int, default=8192, help="global sequence length (a multiple of 2·cp·tp)")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the random SmolLM2-shaped target")
    p.add_argument("--target", type=Path, help="a HF target folder instead of the random one")
    add_draft_shape_arguments(p, ttt_steps=(7, "the label rows beyond each chunk"))
    p.add_argument("--attention-backend", default="auto", help="the ring's kernel (kernels.attention_backends)")
    p.add_argument("--tile", type=int, default=1024, help="the ring's attention tile (positions)")
    p.add_argument("--argmax-chunk", type=int, default=None,
                   help="positions per lm_head matmul of the argmax: [chunk, V] logits (training sizes it from the "
                        "vocabulary: memory.argmax_chunk_size)")
    p.add_argument("--repeats", type=int, default=1, help="timed forwards per rank (averaged; --packing: median)")
    p.add_argument("--device", default="cpu", help="--packing: the device of the forward (cpu, cuda)")
    p.add_argument("--json", type=Path, help="write the results here")
    from recipe.bench.packing import add_packing_arguments  # import cost: the draft's model (the step benchmark)

    add_packing_arguments(p)
    p.set_defaults(max_length=512)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    layouts = [(cp, tp) for cp in args.cp for tp in args.tp]
    bad = [f"{cp}x{tp}" for cp, tp in layouts if args.length % (2 * cp * tp)]
    if bad or args.length < 1 or args.batch < 1 or args.layers < 7 or args.repeats < 1 or (args.argmax_chunk or 1) < 1:
        parser.error(f"--length {args.length} must be a positive multiple of 2·cp·tp for every (cp, tp) (not "
                     f"{bad}); --batch, --repeats, --argmax-chunk >= 1, --layers >= 7 (three distinct aux layers)")
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        longest = args.max_length if args.packing else args.length
        folder = args.target or save_random_target(Path(tmp) / "target", args.layers, longest + 1)
        if args.argmax_chunk is None:  # as training sizes it (memory.argmax_chunk_size absent)
            from transformers import AutoConfig  # import cost: transformers

            args.argmax_chunk = MemoryOptions().argmax_positions(AutoConfig.from_pretrained(folder).vocab_size,
                                                                 torch.float32)
        what = str(args.target) if args.target else f"random SmolLM2-shaped target, {args.layers} layers"
        if args.packing:
            from recipe.bench.target_packing import main_packing  # import cost: the asset cache, transformers

            return main_packing(args, folder, what, console)
        res = run(folder, layouts, args.length, args.batch, args.ttt_steps, args.attention_backend, args.tile,
                  args.argmax_chunk, args.repeats)
    console.print(table(res, f"target forward per rank, {args.batch}×{args.length} tokens, {what}, fp32 CPU"))
    for name, target in res["targets"].items():
        console.print(f"{name}: {target['value']:.3f} (target {target['target']}): "
                      f"{'met' if target['met'] else 'NOT met'}")
    write_json(args.json, {"benchmark": "target", "length": args.length, "batch": args.batch,
                           "target": what, "ttt_steps": args.ttt_steps, "attention_backend": args.attention_backend,
                           "tile": args.tile, "argmax_chunk": args.argmax_chunk, "repeats": args.repeats, **res})
    return 0
