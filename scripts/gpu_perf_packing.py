"""The packing row of ``scripts/gpu_perf_check.py``: our training step (optimizer included) on micro-batches of eight
ShareGPT-length samples, padded to the longest (``data.packing`` false: one sample per row) against the same samples
packed into one row with the documents isolated (``data.packing`` true, no ``packing_tokens`` budget), on the
8B-shaped draft, the engine and the ``auto`` switches every row shares (those of 8 × 2048, the micro-batch's padded
bound: a packed row holds no more positions).

Lengths: the first ``MIXES`` micro-batches of the CPU measurement ``docs/results/step_packing_cpu.json``
(``"mixes"``: ShareGPT conversations under SmolLM2's chat template, cut at 2048 tokens), so no tokenizer or data
travels to the device and each mix's GPU ratio stands beside the CPU's ratio of the same mix; the smoke scales them to
its 64-token length (``SMOKE_LENGTHS``). The layouts are ``recipe.data.packing.micro_batch_layout`` at the run's
sequence divisor at one rank (2), the batches ``recipe.bench.packing.layout_batch`` (the same samples in either
layout: tokens, hidden states and the ``sharegpt`` supervision seeded per sample, drawn on the device).

Before timing, the first mix's forward (no gradient) from the same weights in both layouts gives the device's check
that packed equals padded on its kernels: each TTT step's loss sum and the supervised positions, their largest
relative difference (``loss_check_bf16``). Then per mix, padded then packed, ``STEPS`` warm-up and timed steps; the
row's ``packed_vs_padded`` is the packed seconds summed over the mixes over the padded ones (per mix too), beside the
positions' ratio (packed B·S over padded B·S) and the CPU's ratios.
"""
from __future__ import annotations

import dataclasses
import functools
import json

from scripts.gpu_perf_rows import ROOT, SMOKE_LENGTHS, Row, Switches, bench_spec, step_seconds

CPU_RESULT = ROOT / "docs" / "results" / "step_packing_cpu.json"
MIXES = 4
"""Mixes measured (the first four of the CPU JSON's eight: 0.71 packed / padded there, against 0.68 for all eight)."""
SEQ_DIVISOR = 2
"""``dims.seq_divisor`` (2·cp·tp) at one rank."""
STEPS = (1, 2)
"""(warm-up, timed) steps per mix and layout."""


@functools.cache
def cpu_result() -> dict:
    """``CPU_RESULT`` read once per process (the schedule's estimates and the row itself read it)."""
    return json.loads(CPU_RESULT.read_text())


def packing_mixes(smoke: bool) -> list[list[int]]:
    """The sample lengths of the first ``MIXES`` micro-batches of ``CPU_RESULT``; the smoke's scaled from 2048 to its
    64 tokens (at least 2 each)."""
    mixes = cpu_result()["mixes"][:MIXES]
    if not smoke:
        return mixes
    scale = SMOKE_LENGTHS[2048] / 2048
    return [[max(2, round(n * scale)) for n in mix] for mix in mixes]


def layouts(lengths: list[int]) -> dict:
    """{"padded": RowLayout, "packed": RowLayout} of one micro-batch, as the batch builder lays it out."""
    from recipe.data.packing import micro_batch_layout

    return {"padded": micro_batch_layout(lengths, False, None, SEQ_DIVISOR),
            "packed": micro_batch_layout(lengths, True, None, SEQ_DIVISOR)}


def cpu_ratios() -> dict:
    """Mix index (and "all") -> the CPU's packed / padded seconds (dense path) of ``CPU_RESULT``."""
    summary = cpu_result()["summary"]
    return {e["mix"]: e["packed_vs_padded"] for e in summary if not e["sparse"] and "packed_vs_padded" in e}


def packing_estimate(row: Row, switches: Switches, done: set, est: dict, rate: float) -> dict[str, float]:
    """The row's seconds by part: the packed layout's first compile (once per process: ``done`` gets "packing"), the
    batches and the steps (``STEPS`` per mix and layout, plus the check's two forwards at a third of a step each),
    each layout's step predicted at its own B × S by ``step_seconds``."""
    parts = {}
    if "packing" not in done:
        parts["compile"] = est["packing_compile"]
        done.add("packing")
    base = bench_spec(row, False, switches, "cuda")
    steps = 0.0
    for m, mix in enumerate(packing_mixes(False)):
        for layout in layouts(mix).values():
            step = step_seconds(dataclasses.replace(base, batch=layout.rows, seq_len=layout.seq), est, rate)
            steps += step * (sum(STEPS) + (1 / 3 if m == 0 else 0))
    parts["steps"] = steps
    parts["batch"] = 2 * MIXES * est["packing_batch"]
    return parts


def _arm(bench, batch, layout) -> dict:
    warm, timed = STEPS
    record = bench.time_steps(lambda: bench.our_step(batch), warm, timed)
    record.pop("losses")
    return {**record, "shape": [layout.rows, layout.seq], "padding_share": layout.padding_share}


def _loss_check(bench, batches: dict) -> dict:
    """Both layouts' forward from the same weights: per-step loss sums and supervised counts, largest relative
    difference of each."""
    import torch

    sums, counts = {}, {}
    with torch.no_grad():
        for name, batch in batches.items():
            out = bench.engine.module(batch)
            sums[name] = out.loss_sum_K.double().cpu()
            counts[name] = out.valid_K.double().cpu()
    rel = ((sums["packed"] - sums["padded"]).abs() / sums["padded"].abs()).max()
    return {name: [float(x) for x in sums[name]] for name in sums} | {
        "valid_K": [int(x) for x in counts["padded"]], "valid_equal": bool(torch.equal(counts["padded"],
                                                                                       counts["packed"])),
        "max_rel": float(rel)}


def run_packing(bench, row: Row, switches: Switches) -> dict:
    """The packing row (module docstring): ``status`` ok with ``mixes`` (per mix: lengths, each layout's seconds,
    shape, padding share and peaks, ``packed_vs_padded``, ``positions_packed_vs_padded``, ``cpu_packed_vs_padded``),
    the totals and ``loss_check_bf16``; or the error record."""
    from recipe.bench.packing import layout_batch

    from scripts.gpu_perf_steps import _error_record, _recover

    spec = {"vocab": bench.shape["vocab"], "target_hidden": bench.shape["target_hidden"], "ttt_steps": bench.K,
            "dtype": "bf16"}
    cpu, mixes, check = cpu_ratios(), [], None
    try:
        bench.apply(switches)
        for m, lengths in enumerate(packing_mixes(bench.smoke)):
            lay = layouts(lengths)
            batches = {name: layout_batch(layout, lengths, spec, bench.device) for name, layout in lay.items()}
            check = check or _loss_check(bench, batches)
            arms = {name: _arm(bench, batches.pop(name), lay[name]) for name in ("padded", "packed")}
            mixes.append({"mix": m, "lengths": lengths, **arms,
                          "packed_vs_padded": arms["packed"]["seconds"] / arms["padded"]["seconds"],
                          "positions_packed_vs_padded": lay["packed"].positions / lay["padded"].positions,
                          "cpu_packed_vs_padded": cpu.get(m)})
    except Exception as exc:  # noqa: BLE001 - recorded; the next row still runs
        record = _error_record(exc)
        _recover(bench)
        return {**record, "mixes": mixes, "loss_check_bf16": check}
    padded, packed = (sum(e[name]["seconds"] for e in mixes) for name in ("padded", "packed"))
    return {"status": "ok", "mixes": mixes, "loss_check_bf16": check, "padded_seconds": padded,
            "packed_seconds": packed, "seconds": packed, "packed_vs_padded": packed / padded,
            "cpu_packed_vs_padded_same_mixes": _cpu_total(mixes), "cpu_packed_vs_padded_all": cpu.get("all"),
            "attention": bench.attention_name(switches), "steps": list(STEPS)}


def _cpu_total(mixes: list[dict]) -> float | None:
    """The CPU's packed / padded over the same mixes (summed seconds), from ``CPU_RESULT``."""
    summary = {e["mix"]: e for e in cpu_result()["summary"] if not e["sparse"]}
    entries = [summary.get(e["mix"]) for e in mixes]
    if not entries or any(x is None or "packed" not in x for x in entries):
        return None
    return sum(x["packed"]["seconds"] for x in entries) / sum(x["padded"]["seconds"] for x in entries)
