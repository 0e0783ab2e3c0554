"""Target-forward benchmark: per-rank peak memory and time of the online target forward vs cp at a fixed length.

    python -m recipe.bench target [--cp 1,2,4] [--length 4096] [--layers 30] [--target DIR] [--json OUT]

Each cp runs in cp fresh processes (gloo on CPU, ``recipe.bench.ranks``), as training does: cp = 1 the full-sequence
``TargetModel.capture`` (the model's own sdpa attention), cp > 1 the context-parallel ``CPTarget.capture`` (the ring
over zigzag shards, ``recipe.target.cp``). The target is ``--target`` or a random target of SmolLM2-135M's
shape (Llama, hidden 576, 9 / 3 KV heads, MLP 1536, vocab 49152; ``--layers`` decoder layers), random tokens, no
padding. Per rank: ``act_bytes`` = peak RSS during the forward minus the RSS just before it (weights loaded; the
glibc set-up of ``recipe.bench.measure``), ``kept_bytes`` = the capture's output tensors (aux states, last hidden
rows, argmax), wall and CPU seconds of the forward (CPU seconds are the process's own, unaffected by ranks sharing
cores); the maximum over ranks is reported. ``tp_sharing`` sets the measured cost of replicating the forward over
the tp ranks of a cp rank against splitting the sequence over them (``tp_sharing``).

Issue target (reported, not asserted): per-rank target activation memory at cp = 4 <= 0.3x cp = 1.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe.bench.common import MIB, add_draft_shape_arguments, tensor_bytes, write_json
from recipe.cli import positive_int_list

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
"""SmolLM2-135M's architecture (its config.json) without the layer count."""


def save_random_target(folder: Path, layers: int, max_positions: int, seed: int = 0) -> Path:
    """A random fp32 Llama of ``SMOLLM2_SHAPE`` with ``layers`` decoder layers saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_positions,
                                             **SMOLLM2_SHAPE))
    model.save_pretrained(folder)
    return folder


def _forward(target, cp_target, ids, mask, ttt_steps, argmax_chunk):
    if cp_target is None:
        cap = target.capture(ids, mask, argmax_chunk)
        return [cap.aux_hidden_BSA, cap.last_hidden_BSH, cap.argmax_BS]
    cap = cp_target.capture(ids, mask, ttt_steps)
    return [cap.aux_hidden_BSA, cap.label_hidden_BUH, cap.argmax_BS]


def _rank(rank: int, world: int, folder: str, length: int, batch: int, ttt_steps: int, backend: str,
          tile: int | None, argmax_chunk: int, repeats: int) -> dict:
    """One rank's measurement (``spawn_gloo_ranks`` worker): a warm-up forward on a short sequence, then
    ``repeats`` timed forwards of the [batch, length] sequence."""
    import torch.distributed as dist

    from recipe.bench.measure import CpuPeak
    from recipe.parallel.collectives import Collectives
    from recipe.target.capture import TargetModel

    target = TargetModel(folder, dtype=torch.float32, device="cpu")
    cp_target = None
    if world > 1:
        from recipe.target.cp import CPTarget

        cp_target = CPTarget(target, Collectives("cpu"), dist.group.WORLD, world, rank, backend, tile, argmax_chunk)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    _forward(target, cp_target, ids[:, :4 * world], mask[:, :4 * world], ttt_steps, argmax_chunk)  # warm-up
    probe = CpuPeak()
    probe.reset()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        kept = _forward(target, cp_target, ids, mask, ttt_steps, argmax_chunk)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = probe.peak()
    return {"act_bytes": int(peak - probe.base), "kept_bytes": tensor_bytes(kept), "seconds": sum(wall) / repeats,
            "cpu_seconds": sum(cpu) / repeats, "method": probe.method}


def run(folder: Path, cps: list[int], length: int, batch: int, ttt_steps: int, backend: str, tile: int | None,
        argmax_chunk: int, repeats: int) -> dict:
    """One row per cp (maxima over ranks) and the issue target's ratio."""
    from recipe.bench.measure import mmap_threshold_for_children
    from recipe.bench.ranks import spawn_gloo_ranks

    rows = []
    for cp in cps:
        with mmap_threshold_for_children("cpu"):
            ranks = spawn_gloo_ranks(cp, _rank, str(folder), length, batch, ttt_steps, backend, tile, argmax_chunk,
                                     repeats, timeout=3600.0)
        rows.append({"cp": cp, "forward": "TargetModel.capture" if cp == 1 else "CPTarget.capture",
                     **{key: max(r[key] for r in ranks) for key in ("act_bytes", "kept_bytes", "seconds",
                                                                    "cpu_seconds")},
                     "method": ranks[0]["method"], "ranks": ranks})
    by_cp = {r["cp"]: r for r in rows}
    targets = {}
    if 1 in by_cp and 4 in by_cp:
        ratio = by_cp[4]["act_bytes"] / max(by_cp[1]["act_bytes"], 1)
        targets["act_cp4_over_cp1"] = {"value": ratio, "target": "<= 0.3", "met": ratio <= 0.3}
    return {"rows": rows, "targets": targets, "tp_sharing": tp_sharing(rows)}


def tp_sharing(rows: list[dict], tp: int = 2) -> list[dict]:
    """How the ``tp`` ranks of one cp rank could share the target, from the measured rows: replicate (each runs the
    cp row's forward; what ``CPTarget`` does) or split the sequence further (each runs the cp·tp row's forward, then
    the tp ranks exchange their kept states: ``tp_exchange_bytes`` per rank, every tp rank holding the cp row's kept
    states afterwards, since the draft's TP splits heads, not positions). One entry per cp with a cp·tp row."""
    by_cp = {r["cp"]: r for r in rows}
    out = []
    for cp, rep in sorted(by_cp.items()):
        split = by_cp.get(cp * tp)
        if split is None:
            continue
        out.append({"cp": cp, "tp": tp,
                    "replicate": {k: rep[k] for k in ("cpu_seconds", "act_bytes", "kept_bytes")},
                    "split_sequence": {"cpu_seconds": split["cpu_seconds"], "act_bytes": split["act_bytes"],
                                       "kept_bytes": rep["kept_bytes"],
                                       "tp_exchange_bytes": rep["kept_bytes"] - split["kept_bytes"]}})
    return out


def table(res: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("cp", "forward", "act MiB / rank", "× cp=1", "kept MiB / rank", "wall s", "CPU s / rank"):
        t.add_column(col, justify="left" if col == "forward" else "right")
    base = res["rows"][0]["act_bytes"] if res["rows"][0]["cp"] == 1 else None
    for r in res["rows"]:
        t.add_row(str(r["cp"]), r["forward"], f"{r['act_bytes'] / MIB:.1f}",
                  "-" if base is None else f"{r['act_bytes'] / max(base, 1):.2f}", f"{r['kept_bytes'] / MIB:.1f}",
                  f"{r['seconds']:.2f}", f"{r['cpu_seconds']:.2f}")
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench target", description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=positive_int_list, default=[1, 2, 4], help="context-parallel sizes (default 1,2,4)")
    p.add_argument("--length", type=int, default=4096, help="global sequence length (a multiple of 2·cp)")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the random SmolLM2-shaped target")
    p.add_argument("--target", type=Path, help="a HF target folder instead of the random one")
    add_draft_shape_arguments(p, ttt_steps=(7, "the label rows beyond each chunk"))
    p.add_argument("--attention-backend", default="auto", help="the ring's kernel (kernels.attention_backends)")
    p.add_argument("--tile", type=int, default=1024, help="the ring's attention tile (positions)")
    p.add_argument("--argmax-chunk", type=int, default=1024,
                   help="positions per lm_head matmul of the argmax (training's default 1024): [chunk, V] logits")
    p.add_argument("--repeats", type=int, default=1, help="timed forwards per rank (averaged)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [cp for cp in args.cp if args.length % (2 * cp)]
    if bad or args.length < 1 or args.batch < 1 or args.layers < 7 or args.repeats < 1 or args.argmax_chunk < 1:
        parser.error(f"--length {args.length} must be a positive multiple of 2·cp for every cp (not {bad}); "
                     "--batch, --repeats, --argmax-chunk >= 1, --layers >= 7 (three distinct aux layers)")
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.target or save_random_target(Path(tmp) / "target", args.layers, args.length + 1)
        res = run(folder, args.cp, args.length, args.batch, args.ttt_steps, args.attention_backend, args.tile,
                  args.argmax_chunk, args.repeats)
    what = str(args.target) if args.target else f"random SmolLM2-shaped target, {args.layers} layers"
    console.print(table(res, f"target forward per rank, {args.batch}×{args.length} tokens, {what}, fp32 CPU"))
    for name, target in res["targets"].items():
        console.print(f"{name}: {target['value']:.3f} (target {target['target']}): "
                      f"{'met' if target['met'] else 'NOT met'}")
    write_json(args.json, {"benchmark": "target", "length": args.length, "batch": args.batch,
                           "target": what, "ttt_steps": args.ttt_steps, "attention_backend": args.attention_backend,
                           "tile": args.tile, "argmax_chunk": args.argmax_chunk, "repeats": args.repeats, **res})
    return 0
