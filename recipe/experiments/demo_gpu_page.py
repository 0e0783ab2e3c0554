"""docs/results/demo_gpu.md from the JSON of ``python -m recipe.experiments demo-gpu`` (``page_markdown``; written by
``python scripts/gpu_demo.py --collect``). Every table's introducing paragraph links the JSON beside the page and
every number in its cells is one of that JSON's values as the docs print them (τ to three decimals; a paired
difference prints its sign, then its ``*_abs`` magnitude), so tests/test_docs.py checks the page against it."""
from __future__ import annotations

import math
import textwrap

from recipe.experiments.demo_gpu_report import signed_cell, tau_cell

HOW = ("`make demo` on a machine whose torch sees CUDA (or `DEMO_SCALE=gpu make demo`) runs `python -m "
       "recipe.experiments demo-gpu` ([recipe/experiments/demo_gpu.py](../../recipe/experiments/demo_gpu.py))")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _stages(result: dict, link: str) -> list[str]:
    rows = [[name, f"{s['seconds']:.0f}", f"{s['estimate_s']:.0f}", f"{s['deadline_s']:.0f}"]
            for name, s in result["stages"].items()]
    return ["## Stages", "", f"Seconds of each stage against the plan's estimate and deadline, from the demo's start "
            f"({link}; `--dry-run` prints the plan):", "", *_table(["stage", "seconds", "estimate s", "deadline s"],
                                                                    rows)]


def _training(result: dict, link: str, curves: str) -> list[str]:
    s = result["scale_settings"]
    rows = []
    for arm, a in result["arms"].items():
        length = s["short_length"] if arm == "short" else s["warm_length"]
        rows.append([arm, str(length), str(a.get("steps", "—")), str(a.get("samples", "—")),
                     f"{round(a['supervised_tokens'] / 1024)}k" if a.get("supervised_tokens") else "—",
                     f"{a['s_per_step']:.2f}" if a.get("s_per_step") else "—",
                     f"{a['acc0_last10']:.3f}" if a.get("acc0_last10") is not None else "—",
                     f"{a['lr']:g}" if a.get("lr") is not None else "—",
                     "yes" if a.get("stopped_at_deadline") else "no"])
    return ["## Training", "", f"The short draft on every conversation cut at {s['short_length']} tokens, then its "
            f"warm continuation (`run.py --init-draft`) on the first {s['warm_conversations']} conversations "
            f"chained into samples of up to {s['warm_length']} tokens, anchor-offset positions off ({link}; "
            "acc₀: the first TTT step's accuracy over all supervised positions of the last 10 steps):", "",
            *_table(["arm", "samples ≤ tokens", "steps", "samples", "supervised tokens (k = 1024)", "s / step",
                     "acc₀ last 10 steps", "peak lr", "stopped at its deadline"], rows),
            "", f"![loss and acc₀ over the optimizer steps, warm after short]({curves})"]


def _mtbench(result: dict, link: str) -> list[str]:
    m = result.get("mtbench")
    if not m:
        return ["## τ on MT-Bench", "", "No MT-Bench result (see the stages' errors in the JSON)."]
    ks = sorted({k for d in m["drafts"].values() for k in d["chain"]}, key=int, reverse=True)
    rows = []
    for draft, d in m["drafts"].items():
        chain = [tau_cell(d["chain"][k]["tau"], d["chain"][k]["tau_se"]) if k in d["chain"] else "—" for k in ks]
        tree = d["tree"] or {}
        rows.append([draft, *chain, tau_cell(tree.get("tau"), tree.get("tau_se"))])
    by = {(p["draft"], p["what"]): p for p in m["paired"]}
    for draft in dict.fromkeys(p["draft"] for p in m["paired"]):
        rows.append([f"{draft} − short (paired)"] + [
            signed_cell(c["delta_tau"], c["delta_tau_se"], c["delta_tau_abs"]) if c else "—"
            for c in (by.get((draft, w)) for w in ks + ["tree"])])
    new_tokens = result["scale_settings"]["max_new_tokens"]
    return ["## τ on MT-Bench", "", f"The {m['num_prompts']} MT-Bench first turns, {new_tokens} new tokens each, "
            "every output checked against greedy decoding; τ ± its standard error over prompts, "
            f"and each draft minus the short one on the same prompts ± the paired standard error ({link}):", "",
            *_table(["draft"] + [f"chain k = {k}" for k in ks] + ["tree (top-4, depth 5, 16 tokens)"], rows)]


def _by_length(result: dict, key: str, title: str, what: str, link: str) -> list[str]:
    sec = result.get(key)
    if not sec:
        return [f"## {title}", "", "No result (see the stages' errors in the JSON)."]
    lengths = sec["lengths"]
    rows_by = {(r["draft"], r["context_length"]): r for r in sec["rows"]}
    means = {r["context_length"]: r["mean_context_tokens"] for r in sec["rows"]}
    head = ["draft"] + [f"{n} ({means[n]:.0f} tok)" if means.get(n) is not None else str(n) for n in lengths]
    rows = []
    for draft in dict.fromkeys(r["draft"] for r in sec["rows"]):
        rows.append([draft] + [tau_cell(rows_by[draft, n]["tau"], rows_by[draft, n]["tau_se"])
                               if (draft, n) in rows_by else "—" for n in lengths])
    paired = {(p["draft"], p["context_length"]): p for p in sec["paired"]}
    for draft in dict.fromkeys(p["draft"] for p in sec["paired"]):
        rows.append([f"{draft} − short (paired)"] + [
            signed_cell(p["delta_tau"], p["delta_tau_se"], p.get("delta_tau_abs")) if p else "—"
            for p in (paired.get((draft, n)) for n in lengths)])
    k = sec["rows"][0]["k"] if sec["rows"] else "?"
    return [f"## {title}", "", f"{what}, chain drafting at k = {k}; τ ± its standard error over prompts, and the "
            "warm draft minus the short one on the same prompts ± the paired standard error (column: context "
            f"length, mean context tokens; {link}):", "", *_table(head, rows)]


def findings(result: dict) -> list[str]:
    """Plain statements computed from the JSON: the short draft's τ at the shortest and the longest about-context
    length, and warm − short per length (paired)."""
    sec, out = result.get("about_context"), []
    rows = [r for r in (sec or {}).get("rows", []) if r["draft"] == "short"]
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        diff, se = b["tau"] - a["tau"], math.hypot(a["tau_se"], b["tau_se"])
        trained = result["scale_settings"]["short_length"]
        out.append(f"- The short draft (trained at {trained} tokens): τ {a['tau']:.3f} at "
                   f"{a['mean_context_tokens']:.0f} tokens of context, {b['tau']:.3f} at "
                   f"{b['mean_context_tokens']:.0f}: {diff:+.3f} ± {se:.3f} ({100 * diff / a['tau']:+.1f} %; "
                   "unpaired, the contexts and requests differ by length).")
    for p in (sec or {}).get("paired", []):
        if p["delta_tau"] is not None:
            out.append(f"- {p['draft']} − short at {p['context_length']}: {p['delta_tau']:+.3f} ± "
                       f"{p['delta_tau_se']:.3f} on the same {p['num_prompts']} prompts "
                       f"({p['delta_tau'] / p['delta_tau_se']:+.1f} standard errors)." if p["delta_tau_se"] else "")
    out.append(f"- Outputs that differed from greedy decoding: {result.get('mismatches', 0)}.")
    return [line for line in out if line]


def page_markdown(result: dict, json_name: str = "demo_gpu.json", plot: str = "demo_gpu.png",
                  curves: str = "demo_gpu_curves.png") -> str:
    """The results page of one GPU demo run (module docstring)."""
    link = f"[{json_name}]({json_name})"
    call = result.get("call") or {}
    source = call.get("source") or {}
    day = (call.get("info") or {}).get("date") or (source.get("prepared") or "")[:10] or "date unknown"
    s = result["scale_settings"]
    conversations = ("every shipped ShareGPT conversation" if s["conversations"] is None else
                     f"the first {s['conversations']} ShareGPT conversations")
    intro = (f"Measured on {result.get('device')} ({day}, commit {(source.get('commit') or 'unknown')[:7]}): "
             f"{HOW}; here in one device call (`scripts/gpu_demo.py`, "
             f"[gpu/README.md](gpu/README.md#the-gpu-demo-scriptsgpu_demopy)), {result.get('elapsed_s', 0):.0f} s "
             "of demo stages. Target SmolLM2-135M-Instruct (8192 positions; fp32 in the evaluation), "
             f"{conversations}, K = {s['ttt_steps']} TTT steps, draft vocabulary {s['draft_vocab']}, bf16 ZeRO-1 "
             f"(`ds_configs/zero1_bf16.json`), attention `auto` (flex on CUDA). JSON: {link}; the CPU demo: "
             "[demo_cpu.md](demo_cpu.md).")
    lines = ["# The demo at GPU scale (`make demo` on one GPU)", "", intro, "", *_stages(result, link), "",
             *_training(result, link, curves), "", *_mtbench(result, link), "",
             *_by_length(result, "about_context", "τ by context length", "Requests about an inserted earlier "
                         "ShareGPT conversation (summarise, list its points, quote, answer a question)", link), "",
             *_by_length(result, "unrelated", "The unrelated contrast", "The MT-Bench question itself after the "
                         "inserted conversation (0: no context, MT-Bench above)", link), "",
             f"![τ against context tokens, short and warm drafts]({plot})", "", "## What it means", "",
             *findings(result), "",
             "<!-- after the run: say plainly whether the short draft falls with context at this scale, by how much "
             "with what error, and whether the warm continuation holds it -->", ""]
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str) -> str:
    """A prose line wrapped at 120 columns (tables, headings and images as they are; links hold no spaces)."""
    if line.startswith(("|", "#", "![")) or len(line) <= 120:
        return line
    return textwrap.fill(line, width=120, break_long_words=False, break_on_hyphens=False)
