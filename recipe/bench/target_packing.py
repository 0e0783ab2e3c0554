"""``python -m recipe.bench target --packing``: the online target's forward of micro-batches of ShareGPT-length
samples at one rank, in the three ways a run could compute it (docs/algorithm.md, "Packing"):

- ``padded``: one sample per right-padded row, ``TargetModel.capture`` (the model's own sdpa attention, causal);
- ``packed, whole``: the samples packed into one row (``recipe.data.packing.packed_layout``), ``TargetModel.capture``
  with the positions restarting per document: transformers isolates the documents with a block-diagonal mask over
  the whole row, so its attention scores (ΣL)² pairs;
- ``packed, split``: the same row through the one-rank ``SplitTarget`` a run at one rank uses for its packed
  micro-batches (``BatchBuilder``'s ``packed_target``): the project's causal block on the document positions
  (``--attention-backend``, tiles of ``--tile`` cut at the documents), ΣL² pairs like the padded forward.

The lengths are the step benchmark's (``recipe.bench.packing.sharegpt_lengths``: the cached ShareGPT conversations
under SmolLM2's chat template, cut at ``--max-length``), ``--mixes`` micro-batches of ``--micro-batch`` drawn with
``--seed``; each sample's tokens are seeded by its slot, the same in every layout. In one process, after a warm-up
of each arm, the arms run in turn ``--repeats`` times per mix; per arm and mix the median wall seconds, the RSS
high-water mark above the start of the call (``recipe.bench.measure.CpuPeak``; on CUDA the allocator's peak) and the
largest relative difference of its aux hidden states from the padded ones over every sample's tokens (the
documents' isolation, checked). The summary: each packed arm's summed seconds over the padded arm's.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
from rich.table import Table

from recipe.bench.common import MIB, write_json
from recipe.data.packing import RowLayout, packed_layout, padded_layout

ARMS = ("padded", "packed, whole", "packed, split")


def layout_inputs(layout: RowLayout, lengths: list[int], vocab: int, seed: int = 0):
    """(input ids [B, S] int64, attention mask [B, S] int64, token positions [B, S], attention positions [B, S]) of
    the samples of ``lengths`` placed as ``layout`` says, each sample's tokens drawn from a generator seeded by its
    slot (the same tokens in any layout)."""
    from kernels.documents import document_positions  # import cost: none beyond torch (kept with its one user)

    ids = torch.zeros(layout.rows, layout.seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p in layout.placements:
        g = torch.Generator().manual_seed(seed * 1000 + p.slot)
        ids[p.row, p.offset:p.offset + p.length] = torch.randint(0, vocab, (p.length,), generator=g)
        mask[p.row, p.offset:p.offset + p.length] = 1
    docs, tok = layout.documents()
    return ids, mask, tok, document_positions(docs, tok)


def _aux_rows(aux_BSA: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Every sample's aux rows, in slot order, concatenated ([ΣL, A])."""
    rows = sorted(layout.placements, key=lambda p: p.slot)
    return torch.cat([aux_BSA[p.row, p.offset:p.offset + p.length] for p in rows]).float().cpu()


def _arms(target, split, lengths: list[int], ttt_steps: int, argmax_chunk: int, budget: int | None = None) -> dict:
    """arm -> (layout, a function running its capture and returning the aux states); packed rows of at most
    ``budget`` tokens (None: one row)."""
    padded, packed = padded_layout(lengths, 2), packed_layout(lengths, budget or sum(lengths), 2)
    pad_ids, pad_mask, _, _ = layout_inputs(padded, lengths, target.vocab_size)
    ids, mask, tok, pos = layout_inputs(packed, lengths, target.vocab_size)
    return {"padded": (padded, lambda: target.capture(pad_ids, pad_mask, argmax_chunk).aux_hidden_BSA),
            "packed, whole": (packed, lambda: target.capture(ids, mask, argmax_chunk,
                                                             position_ids_BS=tok).aux_hidden_BSA),
            "packed, split": (packed, lambda: split.capture(ids, mask, ttt_steps, positions_BS=pos).aux_hidden_BSA)}


def _timed(run, device: torch.device) -> tuple[float, int, torch.Tensor]:
    """(wall seconds, peak bytes above the call's start, aux states) of one capture."""
    from recipe.bench.measure import CpuPeak, CudaPeak  # import cost: pulls in transformers

    probe = CudaPeak() if device.type == "cuda" else CpuPeak()
    probe.reset()
    start = time.perf_counter()
    aux = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, int(probe.peak() - probe.base), aux


def measure_mixes(target, split, mixes: list[list[int]], ttt_steps: int, argmax_chunk: int, repeats: int,
                  console, budget: int | None = None) -> list[dict]:
    """Per mix: the lengths, each arm's shape, median seconds, peak bytes and aux difference from the padded arm."""
    for _, run in _arms(target, split, [8, 5], ttt_steps, argmax_chunk).values():  # warm-up: every path once
        run()
    out = []
    for m, lengths in enumerate(mixes):
        arms, seconds, peaks, aux = _arms(target, split, lengths, ttt_steps, argmax_chunk, budget), {}, {}, {}
        for round_ in range(repeats):
            for name, (_, run) in arms.items():
                console.print(f"[dim]mix {m} {name}, round {round_ + 1}/{repeats} ...[/dim]")
                s, peak, got = _timed(run, target.device)
                seconds.setdefault(name, []).append(s)
                peaks[name] = max(peaks.get(name, 0), peak)
                aux[name] = _aux_rows(got, arms[name][0])
        ref = aux["padded"]
        out.append({"mix": m, "lengths": lengths, **{name: {
            "shape": [arms[name][0].rows, arms[name][0].seq], "padding_share": arms[name][0].padding_share,
            "seconds": statistics.median(seconds[name]), "peak_bytes": peaks[name],
            "aux_max_rel": float((aux[name] - ref).abs().max() / ref.abs().max())} for name in ARMS}})
    return out


def run_target_packing(args, folder, console) -> dict:
    """The report of ``target --packing`` on the target in ``folder`` (module docstring)."""
    from recipe.bench.packing import draw_mixes, sharegpt_lengths  # import cost: the draft's model
    from recipe.parallel.collectives import Collectives  # import cost: pulls in deepspeed
    from recipe.target.capture import TargetModel  # import cost: pulls in transformers
    from recipe.target.split import SplitTarget  # import cost: pulls in transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetModel(folder, dtype=dtype, device=device)
    split = SplitTarget(target, Collectives(device.type), None, 1, 0, args.attention_backend, args.tile,
                        args.argmax_chunk)
    lengths, source = sharegpt_lengths(args.max_length, args.data_limit)
    mixes = draw_mixes(lengths, args.micro_batch, args.mixes, args.seed)
    rows = measure_mixes(target, split, mixes, args.ttt_steps, args.argmax_chunk, args.repeats, console,
                         args.packing_tokens)
    totals = {name: sum(r[name]["seconds"] for r in rows) for name in ARMS}
    return {"benchmark": "target --packing", "device": str(device), "dtype": str(dtype).split(".")[-1],
            "micro_batch": args.micro_batch, "max_length": args.max_length, "seed": args.seed,
            "packing_tokens": args.packing_tokens,
            "repeats": args.repeats, "attention_backend": args.attention_backend, "tile": args.tile,
            "argmax_chunk": args.argmax_chunk, "lengths_from": source, "threads": torch.get_num_threads(),
            "loadavg": list(os.getloadavg()), "mixes": rows, "seconds": totals,
            "whole_vs_padded": totals["packed, whole"] / totals["padded"],
            "split_vs_padded": totals["packed, split"] / totals["padded"]}


def packing_table(report: dict, title: str) -> Table:
    """One row per mix and arm, then the totals."""
    table = Table(title=title)
    for col in ("mix", "arm", "B x S", "padding", "seconds", "x padded", "peak MiB", "aux max rel"):
        table.add_column(col, justify="left" if col in ("mix", "arm") else "right")
    for r in report["mixes"]:
        for name in ARMS:
            a = r[name]
            table.add_row(str(r["mix"]), name, "x".join(map(str, a["shape"])), f"{a['padding_share']:.0%}",
                          f"{a['seconds']:.2f}", f"{a['seconds'] / r['padded']['seconds']:.2f}",
                          f"{a['peak_bytes'] / MIB:.0f}", f"{a['aux_max_rel']:.1e}")
    for name in ARMS:
        table.add_row("all", name, "", "", f"{report['seconds'][name]:.2f}",
                      f"{report['seconds'][name] / report['seconds']['padded']:.2f}", "", "")
    return table


def main_packing(args, folder, what: str, console) -> int:
    """``target --packing``: measure, print, write ``--json``; 0."""
    report = run_target_packing(args, folder, console)
    report["target"] = what
    console.print(packing_table(report, f"target forward, micro-batches of {args.micro_batch} ShareGPT-length "
                                        f"samples cut at {args.max_length}, {what}, {report['dtype']} "
                                        f"{report['device']}"))
    write_json(args.json, report)
    return 0
