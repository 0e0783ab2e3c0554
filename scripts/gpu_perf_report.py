"""The collect step of ``scripts/gpu_perf_check.py``: the returned ``gpu_perf_check.json`` filed as
``docs/results/gpu/perf_<date>.json``, its profile tables beside it, and the page ``perf_<date>.md`` generated from
it (:func:`page`). Every number of a table whose paragraph links the JSON is one of the JSON's values as printed
(seconds to 3 decimals, rates whole, TFLOP/s to 1, MFU to 3, bytes in GiB to 1); ratio columns (marked ×) are
derived. The page states the issue's two GPU targets against the rows: our step at 4 × 2048 at most 0.8× SpecForge's
time, model-FLOP MFU at least 0.40 at 32k and 128k."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from scripts.gpu_perf_profile import CATEGORIES

GIB = 2 ** 30
RATIO_TARGET, MFU_TARGET = 0.8, 0.40


def _f(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _geometry(r: dict) -> str:
    return f"{r.get('batch', 1)} × {r.get('length', '?')}"


def _switches(r: dict) -> str:
    s = r.get("switches") or {}
    if not s:
        return "-"
    parts = [name for name in ("checkpoint", "chunked", "mlp_tiles") if s.get(name)]
    parts.append("teacher once" if s.get("teacher_once") else "teacher per step")
    parts.append("compiled ops" if s.get("compile") else "eager ops")
    parts.append(r.get("attention") or ("flex" if s.get("flex_dynamic") else "flex static shapes"))
    return ", ".join(parts)


def _ok(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == kind and r.get("status") == "ok"]


def headline(report: dict, link: str) -> list[str]:
    rows = report["rows"]
    ours = [r for r in _ok(rows, "ours") if r.get("flip") is None]
    sf = {(r["batch"], r["length"]): r for r in _ok(rows, "specforge")}
    out = [f"Our step (optimizer included, the switches `auto` picks) and SpecForge's at the same geometry, in the "
           f"same process ([{link}]({link})):", "",
           "| row | batch × tokens | switches | s / step | positions / s | supervised tokens / s | model TFLOP/s | "
           "MFU | SpecForge s / step | ours / SpecForge × |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ours + [r for r in _ok(rows, "specforge") if (r["batch"], r["length"]) not in
                     {(o["batch"], o["length"]) for o in ours}]:
        theirs = sf.get((r["batch"], r["length"])) if r["kind"] == "ours" else r
        out.append(f"| {r['name']} | {_geometry(r)} | {_switches(r) if r['kind'] == 'ours' else 'SpecForge'} | "
                   f"{r['seconds']:.3f} | {r['positions_per_s']:.0f} | {r['supervised_tokens_per_s']:.0f} | "
                   f"{r['model_tflops_per_gpu']:.1f} | {_f(r.get('mfu'), '.3f')} | "
                   f"{_f(theirs and theirs.get('seconds'), '.3f')} | {_f(r.get('specforge_ratio'), '.2f')} |")
    return out + [""] + targets(ours)


def targets(ours: list[dict]) -> list[str]:
    """The issue's GPU targets, each met, missed or not measured."""
    by = {(r["batch"], r["length"]): r for r in ours}
    lines = []
    r = by.get((4, 2048))
    ratio = r and r.get("specforge_ratio")
    lines.append(f"- 4 × 2048, ours / SpecForge ≤ {RATIO_TARGET}: " + (
        "not measured" if ratio is None else f"{ratio:.2f}, {'met' if ratio <= RATIO_TARGET else 'missed'}"))
    for length in (32768, 131072):
        mfu = by.get((1, length), {}).get("mfu")
        lines.append(f"- {length} tokens, MFU ≥ {MFU_TARGET:.2f}: " + (
            "not measured" if mfu is None else f"{mfu:.3f}, {'met' if mfu >= MFU_TARGET else 'missed'}"))
    return lines


def ablations(report: dict, link: str) -> list[str]:
    rows = report["rows"]
    auto = {(r["batch"], r["length"]): r for r in _ok(rows, "ours") if r.get("flip") is None}
    flips = [r for r in _ok(rows, "ours") if r.get("flip")]
    if not flips:
        return []
    out = ["## Ablations", "", f"One switch of the `auto` set flipped per row ([{link}]({link})):", "",
           "| row | batch × tokens | flipped | switches | s / step | MFU | peak GiB | vs auto × |",
           "|---|---|---|---|---|---|---|---|"]
    for r in flips:
        base = auto.get((r["batch"], r["length"]))
        vs = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        peak = r.get("max_memory_allocated")
        out.append(f"| {r['name']} | {_geometry(r)} | {r['flip']} | {_switches(r)} | {r['seconds']:.3f} | "
                   f"{_f(r.get('mfu'), '.3f')} | {_f(peak and peak / GIB, '.1f')} | {vs} |")
    return out + [""]


def profiles(report: dict, link: str) -> list[str]:
    rows = _ok(report["rows"], "profile")
    if not rows:
        return []
    head = " | ".join(f"{_geometry(r)} ms | share" for r in rows)
    tables = ", ".join(f"[{r['table_file']}]({r['table_file']})" for r in rows)
    out = ["## Where the time goes", "",
           f"One profiled step of the `auto` set by kernel category (`scripts/gpu_perf_profile.py`; the profiler's "
           f"tables: {tables}) ([{link}]({link})):", "",
           f"| category | {head} |", "|---|" + "---|---|" * len(rows)]
    for c in CATEGORIES:
        cells = " | ".join(f"{r['breakdown']['ms'][c]:.1f} | {_f(r['breakdown']['share'][c], '.3f')}" for r in rows)
        out.append(f"| {c} | {cells} |")
    return out + [""]


def packing(report: dict, link: str) -> list[str]:
    """The packing row's mixes: each layout's shape, padding and seconds, the ratios beside the CPU's."""
    rows = _ok(report["rows"], "packing")
    if not rows:
        return []
    r = rows[0]
    out = ["## Packing", "",
           f"Our step (optimizer included, {_switches(r)}) on micro-batches of {r['batch']} ShareGPT-length samples "
           f"cut at {r['length']} tokens, padded to the longest against packed into one row with the documents "
           f"isolated (`data.packing`); the lengths are the CPU measurement's mixes, whose fp32 ratio is beside "
           f"([{link}]({link})):", "",
           "| mix | lengths | padded B × S | padding | packed B × S | padded s / step | packed s / step | "
           "positions × | packed / padded × | CPU packed / padded × |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in r["mixes"]:
        pad, pk = e["padded"], e["packed"]
        out.append(f"| {e['mix']} | {', '.join(map(str, e['lengths']))} | {pad['shape'][0]} × {pad['shape'][1]} | "
                   f"{pad['padding_share']:.3f} | {pk['shape'][0]} × {pk['shape'][1]} | {pad['seconds']:.3f} | "
                   f"{pk['seconds']:.3f} | {e['positions_packed_vs_padded']:.2f} | {e['packed_vs_padded']:.2f} | "
                   f"{_f(e.get('cpu_packed_vs_padded'), '.2f')} |")
    out.append(f"| all | | | | | {r['padded_seconds']:.3f} | {r['packed_seconds']:.3f} | | "
               f"{r['packed_vs_padded']:.2f} | {_f(r.get('cpu_packed_vs_padded_same_mixes'), '.2f')} |")
    check = r.get("loss_check_bf16") or {}
    out += ["", f"Packed equals padded on this device's kernels (mix 0's forward from the same weights, bf16): the "
                f"TTT steps' loss sums differ by at most {_f(check.get('max_rel'), '.2e')} relative, the supervised "
                f"positions {'are equal' if check.get('valid_equal') else 'DIFFER'}."]
    return out + [""]


def attention(report: dict, link: str) -> list[str]:
    rows = _ok(report["rows"], "attention")
    if not rows:
        return []
    r0 = rows[0]
    out = ["## Attention per backend", "",
           f"The causal block alone, one sample, {r0['heads']}/{r0['kv_heads']} heads of {r0['head_dim']}, bf16, "
           f"forward and forward + backward ([{link}]({link})):", "",
           "| backend | tokens | forward s | forward + backward s | forward TFLOP/s | model TFLOP/s | "
           "hardware TFLOP/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['backend']} | {r['length']} | {r['forward_seconds']:.3f} | "
                   f"{r['forward_backward_seconds']:.3f} | {r['forward_tflops']:.1f} | "
                   f"{r['forward_backward_model_tflops']:.1f} | {r['forward_backward_hardware_tflops']:.1f} |")
    return out + [""]


def not_measured(report: dict) -> list[str]:
    rows = [r for r in report["rows"] if r.get("status") != "ok"]
    if not rows:
        return []
    out = ["## Rows not measured", "", "Skipped before they started, or failed (the JSON has each detail):", "",
           "| row | status | detail |", "|---|---|---|"]
    for r in rows:
        detail = str(r.get("detail", "")).replace("|", "/").replace("\n", " ")[:160]
        out.append(f"| {r['name']} | {r['status']} | {detail} |")
    return out + [""]


def page(report: dict, json_name: str) -> str:
    """The markdown page of one report (module docstring)."""
    info = report.get("info", {})
    source = info.get("source") or {}
    versions = (report.get("imports") or {}).get("versions") or {}
    sf = next((r for r in report["rows"] if r.get("kind") == "specforge" and r.get("version")), {})
    lines = [f"# GPU performance check, {info.get('date')}", "",
             f"`scripts/gpu_perf_check.py` on {info.get('device')} (commit {str(source.get('commit'))[:7]}, torch "
             f"{versions.get('torch')}, SpecForge {sf.get('version')}, SpecForge's flex backend "
             f"{sf.get('backend')}); every row of [{json_name}]({json_name}), generated by `python "
             "scripts/gpu_perf_check.py --collect`. Tokens a second count positions (every token of the batch) "
             "and supervised tokens (those the loss reads); MFU is model FLOPs (`recipe.model.flops`, no recompute) "
             "over the device's dense bf16 peak; seconds are per optimizer step after warm-up.", "",
             "## Our step and SpecForge's", ""]
    lines += headline(report, json_name) + [""]
    lines += ablations(report, json_name) + profiles(report, json_name) + packing(report, json_name)
    lines += attention(report, json_name)
    lines += not_measured(report)
    return "\n".join(lines).rstrip() + "\n"


def collect(src: Path, results: Path) -> list[Path]:
    """``src/gpu_perf_check.json`` -> ``results/perf_<date>.json`` (as returned), its profile tables as
    ``perf_<date>_<table>`` and the page ``perf_<date>.md``; the written paths."""
    report = json.loads((Path(src) / "gpu_perf_check.json").read_text())
    day = report.get("info", {}).get("date")
    results.mkdir(parents=True, exist_ok=True)
    name = f"perf_{day}"
    written = [results / f"{name}.json", results / f"{name}.md"]
    for r in report["rows"]:
        table = r.get("table_file")
        if table and (Path(src) / table).is_file():
            r["table_file"] = f"{name}_{table}"
            shutil.copyfile(Path(src) / table, results / r["table_file"])
            written.append(results / r["table_file"])
    written[0].write_text(json.dumps(report, indent=1) + "\n")
    written[1].write_text(page(report, written[0].name))
    return written
