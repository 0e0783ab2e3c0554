"""``python -m recipe.bench step --packing``: the TTT step of a micro-batch padded against the same samples packed
(``data.packing``; docs/algorithm.md, "Packing"), on ShareGPT-length mixes.

The lengths are the real ones: the ShareGPT conversations of the cached assets (``recipe.assets``) under the target's
chat template (``recipe.data.examples``; SmolLM2 by default), cut at ``--max-length``. ``--mixes`` micro-batches of
``--micro-batch`` samples are drawn from them with ``--seed``; each is measured padded to its longest sample (the batch
builder's rows) and packed (``recipe.data.packing.packed_layout`` at ``--packing-tokens``, default one row per
micro-batch), forward + backward of ``TTTModel`` at the step benchmark's geometry with the attention kernel the step
benchmark passes (the last of ``--backends``, default the one "auto" picks on the device), in fresh processes
(``recipe.bench.measure.time_step``: the mean after the first of ``--steps``), interleaved ``--rounds`` times; the
samples' tokens, supervision (``recipe.plan.spec.MASKS``' ``sharegpt`` turns, per sample) and hidden states are the same
in both layouts. Printed per mix: the lengths, both shapes, the padding shares, the positions' ratio (packed B·S
over padded), the seconds and ``packed / padded``; the summary's ratio is the total packed time over the total padded
time. The JSON records the machine's load average (1, 5, 15 minutes) at the start and the end: the arms share
whatever else runs on it. ``--sparse`` measures the dense path, the sparse anchors' (``memory.sparse_anchors``) or
both.
"""
from __future__ import annotations

import os
import queue as queue_mod
import random
import statistics
import time
import traceback

import torch
import torch.multiprocessing as mp
from rich.table import Table

from recipe.arg_types import length, parse_length
from recipe.bench.common import GIB, write_json
from recipe.bench.measure import mmap_threshold_for_children, time_step
from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.data.packing import RowLayout, packed_layout, padded_layout
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.ttt import make_ttt_batch
from recipe.parallel.parallelize import build_training_model


def add_packing_arguments(p) -> None:
    """The flags of ``step --packing`` (the step benchmark's own ones give the geometry, dtype, tile and device)."""
    p.add_argument("--packing", action="store_true",
                   help="measure micro-batches of ShareGPT-length samples padded vs packed (data.packing)")
    def at_least(minimum):
        def count(text):  # argparse names the type "count" in its error
            return parse_length(text, minimum)
        return count

    p.add_argument("--micro-batch", type=at_least(2), default=8, help="--packing: samples per micro-batch (>= 2)")
    p.add_argument("--mixes", type=at_least(1), default=3, help="--packing: micro-batches drawn from the lengths")
    p.add_argument("--max-length", type=length, default=2048, help="--packing: samples cut at this many tokens (2k)")
    p.add_argument("--packing-tokens", type=length, help="--packing: row budget (default: one row per micro-batch)")
    p.add_argument("--data-limit", type=at_least(1), default=2000,
                   help="--packing: ShareGPT conversations tokenised")
    p.add_argument("--seed", type=int, default=0, help="--packing: the draw of the mixes")


def sharegpt_lengths(max_length: int, limit: int, cache_dir=None) -> tuple[list[int], dict]:
    """The token counts of the first ``limit`` ShareGPT conversations of the assets under the SmolLM2 target's chat
    template, each cut at ``max_length``, and where they came from."""
    from recipe.assets import prepare_assets  # import cost: the asset cache (a check when built)
    from recipe.data.examples import build_examples  # import cost: datasets, transformers
    from recipe.target.capture import load_tokenizer  # import cost: transformers

    assets = prepare_assets()
    cache = cache_dir or assets.cache_dir / "bench_packing"
    _, report = build_examples([str(assets.conversations)], load_tokenizer(assets.target), max_length,
                               cache_dir=str(cache), limit=limit)
    lengths = [min(n, max_length) for n in report.lengths.lengths]
    return lengths, {"source": assets.conversations.name, "tokenizer": assets.target.name, "limit": limit,
                     "samples": len(lengths), "cut_at_max_length": sum(n >= max_length for n in lengths)}


def draw_mixes(lengths: list[int], micro_batch: int, mixes: int, seed: int) -> list[list[int]]:
    """``mixes`` micro-batches of ``micro_batch`` lengths drawn without replacement (``random.Random(seed)``)."""
    rng = random.Random(seed)
    return [rng.sample(lengths, micro_batch) for _ in range(mixes)]


def layout_batch(layout: RowLayout, lengths: list[int], spec: dict, device, seed: int = 0):
    """The ``TTTBatch`` of samples of ``lengths`` placed as ``layout`` says: per sample (seeded by its slot) random
    tokens, aux and last hidden states and the ``sharegpt`` supervision; every target argmax in the draft
    vocabulary; documents isolated when packed. The same samples whatever the layout; drawn on ``device`` (a
    generator per sample there: on CUDA other values than on the CPU, the same in either layout)."""
    dtype, device = layout_dtype(spec), torch.device(device)
    b, s = layout.rows, layout.seq
    ids = torch.zeros(b, s, dtype=torch.long, device=device)
    mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    aux = torch.zeros(b, s, 3 * spec["target_hidden"], device=device)
    last = torch.zeros(b, s, spec["target_hidden"], device=device)
    for p in layout.placements:
        g = torch.Generator(device=device).manual_seed(seed * 1000 + p.slot)
        cols = slice(p.offset, p.offset + p.length)
        ids[p.row, cols] = torch.randint(0, spec["vocab"], (p.length,), generator=g, device=device)
        mask[p.row, cols] = (torch.arange(p.length, device=device) % 195 >= 60).long()
        attention[p.row, cols] = 1
        aux[p.row, cols] = torch.randn(p.length, aux.shape[-1], generator=g, device=device)
        last[p.row, cols] = torch.randn(p.length, last.shape[-1], generator=g, device=device)
    docs = layout.documents()[0].to(device) if layout.packed else None
    return make_ttt_batch(ids, mask, attention, aux.to(dtype), last.to(dtype), attention.bool(), spec["ttt_steps"],
                          docs)


def _child(spec: dict, lengths: list[int], packed: bool, sparse: bool, queue) -> None:
    """One measurement in a fresh process: the model of ``spec`` and the batch of ``lengths``, padded or packed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        device = torch.device(spec["device"])
        divisor = 2
        layout = packed_layout(lengths, spec["packing_tokens"] or sum(lengths), divisor) if packed \
            else padded_layout(lengths, divisor)
        config = Eagle3DraftConfig(
            hidden_size=spec["hidden"], intermediate_size=spec["intermediate"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], vocab_size=spec["vocab"],
            draft_vocab_size=spec["draft_vocab"], target_hidden_size=spec["target_hidden"], aux_layer_ids=[1, 2, 3],
            max_position_embeddings=max(2048, layout.seq + spec["ttt_steps"]))
        head = torch.randn(spec["draft_vocab"], spec["target_hidden"], generator=torch.Generator().manual_seed(1))
        memory = MemoryOptions(attention_tile_size=spec["attention_tile"], sparse_anchors=sparse)
        model = build_training_model(Eagle3Draft(config, seed=0), head, memory, KernelOptions(
            attention=spec["backend"]), None, device).to(device=device, dtype=layout_dtype(spec))
        result = time_step(model, layout_batch(layout, lengths, spec, device), spec["steps"])
        queue.put(("ok", {**result, "shape": [layout.rows, layout.seq], "padding_share": layout.padding_share}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put(("error", traceback.format_exc()[-2000:]))


def layout_dtype(spec: dict) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]


def measure(spec: dict, lengths: list[int], packed: bool, sparse: bool, timeout: float) -> dict:
    """:func:`_child` in a fresh spawned process; ``{"status", ...the result}``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(spec, lengths, packed, sparse, results))
    with mmap_threshold_for_children(spec["device"]):
        proc.start()
    try:
        kind, value = results.get(timeout=timeout)
    except queue_mod.Empty:
        kind, value = "timeout", f"no result within {timeout:.0f} s"
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return {"status": "ok", **value} if kind == "ok" else {"status": kind, "detail": value}


def run_packing(args, device: str, backend: str, console) -> dict:
    """Measure every mix padded and packed (``--sparse``: dense, sparse or both) with the attention kernel
    ``backend``, interleaved; the report."""
    lengths, source = sharegpt_lengths(args.max_length, args.data_limit)
    mixes = draw_mixes(lengths, args.micro_batch, args.mixes, args.seed)
    spec = {"device": device, "dtype": args.dtype, "hidden": args.hidden, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate": args.intermediate,
            "vocab": args.vocab, "draft_vocab": args.draft_vocab, "target_hidden": args.target_hidden,
            "ttt_steps": args.ttt_steps, "attention_tile": args.attention_tile or None, "backend": backend,
            "steps": args.steps, "packing_tokens": args.packing_tokens}
    paths = {"off": [False], "on": [True], "both": [False, True]}[args.sparse]
    rows, load_start = [], list(os.getloadavg())
    for round_ in range(args.rounds):
        for m, mix in enumerate(mixes):
            for sparse in paths:
                for packed in (False, True):
                    what = f"mix {m} {'packed' if packed else 'padded'} {'sparse' if sparse else 'dense'}"
                    console.print(f"[dim]{what}, round {round_ + 1}/{args.rounds} ...[/dim]")
                    start = time.perf_counter()
                    result = measure(spec, mix, packed, sparse, args.timeout)
                    rows.append({"mix": m, "packed": packed, "sparse": sparse, "round": round_,
                                 "wall_s": time.perf_counter() - start, **result})
    return {"config": {**spec, "micro_batch": args.micro_batch, "max_length": args.max_length, "seed": args.seed,
                       "rounds": args.rounds, "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
                       "torch": torch.__version__, "lengths_from": source, "cpus": os.cpu_count(),
                       "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())},
            "mixes": mixes, "summary": summarise(rows, mixes), "rounds": rows}


def summarise(rows: list[dict], mixes: list[list[int]]) -> list[dict]:
    """Per (mix, path): median seconds padded and packed, the shapes and padding shares, ``packed_vs_padded`` and
    ``positions_packed_vs_padded`` (the rows' positions, B·S); and per path a total row (mix "all": summed medians,
    the positions' ratio of the sums and the padded rows' padding share over all their positions)."""
    out = []
    for sparse in dict.fromkeys(r["sparse"] for r in rows):
        totals, positions, padding = {False: 0.0, True: 0.0}, {False: 0, True: 0}, 0.0
        for m, mix in enumerate(mixes):
            entry = {"mix": m, "sparse": sparse, "lengths": mix}
            for packed, name in ((False, "padded"), (True, "packed")):
                ok = [r for r in rows if (r["mix"], r["sparse"], r["packed"]) == (m, sparse, packed)
                      and r["status"] == "ok"]
                if ok:
                    entry[name] = {"seconds": statistics.median(r["seconds"] for r in ok), "shape": ok[0]["shape"],
                                   "padding_share": ok[0]["padding_share"],
                                   "peak_bytes": max(r["peak_bytes"] for r in ok)}
                    totals[packed] += entry[name]["seconds"]
            if "padded" in entry and "packed" in entry:
                entry["packed_vs_padded"] = entry["packed"]["seconds"] / entry["padded"]["seconds"]
                entry["positions_packed_vs_padded"] = _positions(entry["packed"]) / _positions(entry["padded"])
                positions[False] += _positions(entry["padded"])
                positions[True] += _positions(entry["packed"])
                padding += entry["padded"]["padding_share"] * _positions(entry["padded"])
            out.append(entry)
        if totals[False]:
            out.append({"mix": "all", "sparse": sparse, "padded_seconds": totals[False],
                        "packed_seconds": totals[True], "packed_vs_padded": totals[True] / totals[False],
                        "positions_packed_vs_padded": positions[True] / max(positions[False], 1),
                        "padding_share": padding / max(positions[False], 1)})
    return out


def _positions(arm: dict) -> int:
    return arm["shape"][0] * arm["shape"][1]


def packing_table(report: dict) -> Table:
    """The printed table of :func:`run_packing`'s report."""
    cfg = report["config"]
    table = Table(title=f"TTT step (fwd+bwd), micro-batch of {cfg['micro_batch']} ShareGPT-length samples cut at "
                        f"{cfg['max_length']}, padded vs packed; H={cfg['hidden']}, Vd={cfg['draft_vocab']}, "
                        f"K={cfg['ttt_steps']}, {cfg['dtype']}, {cfg['backend']}, {cfg['device']}")
    for col in ("mix", "path", "lengths", "padded B x S", "padding", "packed B x S", "padding ", "positions ratio",
                "padded s", "packed s", "packed / padded", "peak GiB (padded, packed)"):
        table.add_column(col, justify="left" if col in ("mix", "path", "lengths") else "right")
    for e in report["summary"]:
        path = "sparse" if e["sparse"] else "dense"
        if e["mix"] == "all":
            table.add_row("all", path, "", "", f"{e['padding_share']:.0%}", "", "",
                          f"{e['positions_packed_vs_padded']:.2f}", f"{e['padded_seconds']:.2f}",
                          f"{e['packed_seconds']:.2f}", f"{e['packed_vs_padded']:.2f}", "")
            continue
        pad, pk = e.get("padded"), e.get("packed")

        def shape(x):
            return "x".join(map(str, x["shape"])) if x else "failed"
        table.add_row(str(e["mix"]), path, ",".join(map(str, e["lengths"])), shape(pad),
                      f"{pad['padding_share']:.0%}" if pad else "-", shape(pk),
                      f"{pk['padding_share']:.0%}" if pk else "-",
                      f"{e['positions_packed_vs_padded']:.2f}" if "positions_packed_vs_padded" in e else "-",
                      f"{pad['seconds']:.2f}" if pad else "-",
                      f"{pk['seconds']:.2f}" if pk else "-",
                      f"{e['packed_vs_padded']:.2f}" if "packed_vs_padded" in e else "-",
                      f"{pad['peak_bytes'] / GIB:.2f}, {pk['peak_bytes'] / GIB:.2f}" if pad and pk else "-")
    return table


def main_packing(args, device: str, backend: str, console) -> int:
    """``step --packing``: run, print, write ``--json``. Returns 0, or 1 when a measurement failed."""
    report = run_packing(args, device, backend, console)
    console.print(packing_table(report))
    failed = [r for r in report["rounds"] if r["status"] != "ok"]
    for r in failed:
        console.print(f"[red]mix {r['mix']} packed={r['packed']}: {r['status']}: {r['detail'][-400:]}[/red]")
    write_json(args.json, report)
    if args.json:
        console.print(f"wrote {args.json}")
    return 1 if failed else 0
