"""Context-parallel benchmark: per-rank activation memory and step time at a fixed global length, the longest length
that fits a per-rank activation budget, and the per-rank attention work of the zigzag vs a contiguous split.

    python -m recipe.bench cp [--cp 1,2,4] [--length 2048] [--budget-gib 0.25] [--json OUT] [--plot OUT.png]

Each measurement is one forward + backward of the whole TTT draft (K steps, random aux states, every position a
valid label) in ``cp`` fresh processes (gloo on CPU; ``recipe.bench.measure``): cp = 1 runs the draft's default
causal block (``block_attention``), cp > 1 the ring attention over zigzag shards, as training does. Activation memory
= peak RSS during the step minus the RSS just before it (weights, batch); the maximum over ranks is reported. Per-
position tensors (logits, loss) are split by CP too. The longest length per cp is found by doubling from
``--search-step`` while the activation memory fits ``--budget-gib``, then bisecting in multiples of it.

Issue targets (reported, not asserted): activation memory at cp=4 ≤ 0.3x cp=1, longest length at cp=4 ≥ 3.5x cp=1.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe.arg_types import positive_int_list
from recipe.bench.common import GIB, MIB, add_draft_shape_arguments, write_json
from recipe.bench.measure import run_measurement
from recipe.parallel.cp_shard import contiguous_indices, zigzag_indices
from recipe.plan.spec import BenchSpec

NUM_CHUNKS = 2  # local chunks per shard in the ring's work skipping (the ring kernel's default, ring_attention_forward)


def attention_work(seq_len: int, cp: int, split) -> dict:
    """Per-rank causal attention work of one ring pass for a split (``zigzag_indices`` or ``contiguous_indices``).

    ``pairs``: (query chunk, key chunk) blocks the ring computes (each rank's shard cut into NUM_CHUNKS chunks; a
    pair is skipped when all its keys come after all its queries, as the ring kernel's ``ring_attention_forward``
    does).
    ``scores``: causal (query, key) entries, Σ over local queries q of (q + 1). Lists indexed by cp rank.
    """
    shards = [split(seq_len, cp, r) for r in range(cp)]
    key_chunks = [c for s in shards for c in s.tensor_split(NUM_CHUNKS)]
    pairs, scores = [], []
    for s in shards:
        pairs.append(sum(int(k.min() <= q.max()) for q in s.tensor_split(NUM_CHUNKS) for k in key_chunks))
        scores.append(int((s + 1).sum()))
    return {"pairs": pairs, "scores": scores}


def measure(spec: BenchSpec) -> dict:
    """One measurement (fresh processes): ``status`` ("ok", or run_measurement's failure status with ``detail``) and,
    when ok, the maxima over ranks of activation/peak/base bytes and step seconds."""
    result = run_measurement(spec)
    if result["status"] != "ok":
        return {"status": result["status"], "detail": result["detail"]}
    ranks = result["ranks"]
    return {"status": "ok", "act_bytes": max(r["step_bytes"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "base_bytes": max(r["base_bytes"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks), "method": ranks[0]["method"]}


def longest_fitting(spec: BenchSpec, budget_bytes: float, step: int, max_length: int) -> dict:
    """Longest multiple of ``step`` (≤ max_length) whose activation memory fits; probes listed in order."""
    probes = []

    def fits(length: int) -> bool:
        m = measure(dataclasses.replace(spec, seq_len=length))
        probes.append({"length": length, **m})
        return m["status"] == "ok" and m["act_bytes"] <= budget_bytes

    good, bad = 0, None
    length = step
    while length <= max_length:
        if not fits(length):
            bad = length
            break
        good, length = length, length * 2
    if bad is None:
        bad = min(length, max_length + step)
    while bad - good > step:  # bisect on multiples of step
        mid = (good + bad) // 2 // step * step
        if fits(mid):
            good = mid
        else:
            bad = mid
    return {"longest": good, "capped": good >= max_length, "probes": probes}


def run(spec: BenchSpec, cps: list[int], budget_gib: float, search_step: int, max_length: int) -> dict:
    fixed, search, work = [], [], []
    for cp in cps:
        fixed.append({"cp": cp, **measure(dataclasses.replace(spec, cp=cp))})
        unit = math.lcm(search_step, 2 * cp)
        search.append({"cp": cp, "step": unit,
                       **longest_fitting(dataclasses.replace(spec, cp=cp), budget_gib * GIB, unit, max_length)})
        work.append({"cp": cp, "zigzag": attention_work(spec.seq_len, cp, zigzag_indices),
                     "contiguous": attention_work(spec.seq_len, cp, contiguous_indices)})
    out = {"fixed": fixed, "search": search, "work": work, "targets": {}}
    by_cp = {r["cp"]: r for r in fixed}
    longest = {r["cp"]: r["longest"] for r in search}
    if 1 in by_cp and 4 in by_cp and by_cp[1].get("act_bytes") and by_cp[4].get("act_bytes") is not None:
        ratio = by_cp[4]["act_bytes"] / by_cp[1]["act_bytes"]
        out["targets"]["act_cp4_over_cp1"] = {"value": ratio, "target": "<= 0.3", "met": ratio <= 0.3}
    if longest.get(1) and 4 in longest:
        ratio = longest[4] / longest[1]
        out["targets"]["length_cp4_over_cp1"] = {"value": ratio, "target": ">= 3.5", "met": ratio >= 3.5,
                                                 "capped": any(r["capped"] for r in search)}
    return out


def tables(res: dict, spec: BenchSpec, budget_gib: float) -> list[Table]:
    t1 = Table(title=f"CP per rank at global length {spec.seq_len} (hidden {spec.hidden}, {spec.heads}/"
                     f"{spec.kv_heads} heads, draft vocab {spec.draft_vocab}, K={spec.ttt_steps}, batch {spec.batch})")
    for col in ("cp", "tokens/rank", "act MiB", "act vs cp=1", "peak MiB", "step s"):
        t1.add_column(col, justify="right")
    base = next((r.get("act_bytes") for r in res["fixed"] if r["cp"] == 1), None)
    for r in res["fixed"]:
        if r["status"] != "ok":
            t1.add_row(str(r["cp"]), str(spec.seq_len // r["cp"]), r["status"], "", "", "")
            continue
        t1.add_row(str(r["cp"]), str(spec.seq_len // r["cp"]), f"{r['act_bytes'] / MIB:.1f}",
                   f"{r['act_bytes'] / base:.2f}x" if base else "-", f"{r['peak_bytes'] / MIB:.0f}",
                   f"{r['seconds']:.2f}")
    t2 = Table(title=f"Longest length with activation memory <= {budget_gib} GiB per rank")
    for col in ("cp", "longest", "vs cp=1", "probes (length: act MiB)"):
        t2.add_column(col, justify="right")
    base_len = next((r["longest"] for r in res["search"] if r["cp"] == 1), None)
    for r in res["search"]:
        probes = ", ".join(f"{p['length']}: {p['act_bytes'] / MIB:.0f}" if p["status"] == "ok"
                           else f"{p['length']}: {p['status']}" for p in r["probes"])
        t2.add_row(str(r["cp"]), f"{r['longest']}{'+' if r['capped'] else ''}",
                   f"{r['longest'] / base_len:.2f}x" if base_len else "-", probes)
    t3 = Table(title=f"Attention work per rank at length {spec.seq_len}: zigzag vs contiguous (max/min over ranks)")
    for col in ("cp", "zigzag pairs", "contiguous pairs", "zigzag scores", "contiguous scores"):
        t3.add_column(col, justify="right")
    for w in res["work"]:
        z, c = w["zigzag"], w["contiguous"]
        t3.add_row(str(w["cp"]), f"{max(z['pairs'])}/{min(z['pairs'])}", f"{max(c['pairs'])}/{min(c['pairs'])}",
                   f"{max(z['scores'])}/{min(z['scores'])}", f"{max(c['scores'])}/{min(c['scores'])}")
    return [t1, t2, t3]


def plot(res: dict, path: Path) -> bool:
    """PNG of activation memory of the search probes vs length, one line per cp; False without matplotlib."""
    try:
        import matplotlib  # optional dependency (matplotlib)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency (matplotlib)
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in res["search"]:
        pts = sorted((p["length"], p["act_bytes"] / MIB) for p in r["probes"] if p["status"] == "ok")
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"cp={r['cp']}")
    ax.set_xlabel("global sequence length (tokens)")
    ax.set_ylabel("activation memory per rank (MiB)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench cp", description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=positive_int_list, default=[1, 2, 4], help="context-parallel sizes (default 1,2,4)")
    p.add_argument("--length", type=int, default=2048, help="global sequence length of the fixed-length table")
    p.add_argument("--budget-gib", type=float, default=0.25, help="per-rank activation budget of the length search")
    p.add_argument("--search-step", type=int, default=256, help="length granularity of the search")
    p.add_argument("--max-length", type=int, default=32768, help="stop the search here")
    add_draft_shape_arguments(p, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, draft_vocab=4096,
                              vocab=8192, ttt_steps=3)
    p.add_argument("--layout", default="full", help="loss/checkpointing layout of recipe.bench.measure (full, "
                                                    "chunked, ckpt, chunked+ckpt)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="PNG of activation memory vs length (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_gib <= 0 or args.search_step < 1 or args.max_length < args.search_step:
        parser.error("--budget-gib must be > 0 and --max-length >= --search-step >= 1")
    try:
        spec = BenchSpec(seq_len=args.length, layout=args.layout, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                         draft_vocab=args.draft_vocab, vocab=args.vocab, target_hidden=args.hidden,
                         ttt_steps=args.ttt_steps)
        for cp in args.cp:
            dataclasses.replace(spec, cp=cp)  # validates the length for every cp
    except ValueError as exc:
        parser.error(str(exc))
    console = Console()
    res = run(spec, args.cp, args.budget_gib, args.search_step, args.max_length)
    for t in tables(res, spec, args.budget_gib):
        console.print(t)
    for name, target in res["targets"].items():
        console.print(f"{name}: {target['value']:.3f} (target {target['target']}): "
                      f"{'met' if target['met'] else 'NOT met'}")
    if args.plot is not None and not plot(res, args.plot):
        console.print("matplotlib is not installed: no plot written")
    write_json(args.json, {"benchmark": "cp", "spec": dataclasses.asdict(spec), "budget_gib": args.budget_gib,
                           **res})
    return 0
