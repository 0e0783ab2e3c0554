"""The result of ``python -m recipe.experiments demo-gpu``: its JSON, tables, plots and the results page.

``build_result`` adds to the run's report (plan, stages, arms): each arm's training summary and curve
(``long_context_report.arm_summary`` and ``metrics.jsonl``), ``mtbench`` (per draft chain τ at each k and tree τ on
MT-Bench, each ± its standard error over prompts, and warm − short paired on the same prompts), ``about_context``
and ``unrelated`` (``long_context_report.length_rows`` / ``paired_rows``: τ by context length per draft and warm −
short per length), ``mismatches`` (outputs that differed from greedy decoding, expected 0) and the merged
``recipe.eval`` JSONs (``evals``). Paired rows also carry ``*_abs``, the magnitudes the page prints after a sign.
``write_outputs`` writes the JSON, the plot of τ by context length with the paired differences (``.png``) and the
training curves (``_curves.png``); ``page_markdown`` is docs/results/demo_gpu.md, made from that JSON alone
(``scripts/gpu_demo.py --collect``).
"""
from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from recipe.bench.common import write_json
from recipe.eval.report import paired_tau_difference
from recipe.experiments.long_context_report import arm_summary, length_rows, paired_rows, paired_table, report_table
from recipe.plot import METRICS_FILE, read_metrics, save_figure

CURVE_KEYS = ("step", "loss", "lr", "time_s", "tokens", "samples")


def arm_record(run: Path, info: dict) -> dict:
    """An arm's ``arm_summary``, its seconds per step after the first, positions and its curve (``CURVE_KEYS``
    and ``acc``, the accuracy per TTT step, of every step), with ``info`` (the stage's fields)."""
    out = {**info, **arm_summary(run)}
    if (run / METRICS_FILE).is_file():
        records = read_metrics(run / METRICS_FILE)
        later = [r["time_s"] for r in records[1:] if r.get("time_s")]
        out["s_per_step"] = sum(later) / len(later) if later else None
        out["positions"] = sum(r.get("positions", 0) for r in records)
        out["curve"] = [{**{k: r.get(k) for k in CURVE_KEYS}, "acc": r.get("acc")} for r in records]
    return out


def _with_abs(rows: list[dict]) -> list[dict]:
    return [{**r, **{f"{k}_abs": abs(r[k]) for k in ("delta_tau", "delta_tau_tree") if r.get(k) is not None}}
            for r in rows]


def section(evaluation: dict | None) -> dict | None:
    """``{"lengths", "rows", "paired"}`` of a merged ``recipe.eval --context-lengths`` JSON (None for none)."""
    if not evaluation:
        return None
    return {"lengths": evaluation["context_lengths"], "rows": length_rows(evaluation),
            "paired": _with_abs(paired_rows(evaluation))}


def mtbench_section(unrelated: dict | None) -> dict | None:
    """Per draft, chain τ at every k and tree τ (± standard error) of the unrelated length-0 entry (MT-Bench
    itself), and each draft minus ``short`` paired per k and for the tree; None without that entry."""
    entry = next((e for e in (unrelated or {}).get("lengths", []) if e["context_length"] == 0), None)
    if entry is None:
        return None
    drafts: dict[str, dict] = {}
    for r in entry["runs"]:
        drafts.setdefault(r["draft"], {"chain": {}, "tree": None})["chain"][str(r["num_draft_tokens"])] = {
            "tau": r["tau"], "tau_se": r["tau_se"], "acceptance_rate_per_position": r["acceptance_rate_per_position"]}
    for r in entry["tree_runs"]:
        drafts.setdefault(r["draft"], {"chain": {}, "tree": None})["tree"] = {
            "tau": r["tau"], "tau_se": r["tau_se"], "tree": r.get("tree"),
            "acceptance_rate_per_position": r["acceptance_rate_per_position"]}
    paired = []
    runs = {(r["draft"], str(r["num_draft_tokens"])): r for r in entry["runs"]}
    runs.update({(r["draft"], "tree"): r for r in entry["tree_runs"]})
    for (draft, what), run in runs.items():
        ref = runs.get(("short", what))
        diff = paired_tau_difference(run, ref) if draft != "short" and ref else None
        if diff:
            paired.append({"draft": draft, "what": what, "delta_tau": diff[0], "delta_tau_se": diff[1],
                           "delta_tau_abs": abs(diff[0])})
    return {"num_prompts": entry["num_prompts"], "drafts": drafts, "paired": paired}


def build_result(report: dict, evals: dict, settings: dict) -> dict:
    """The demo's result JSON (module docstring) from the run's ``report`` and the merged ``evals``."""
    arms = {arm: arm_record(Path(info["run"]), info) for arm, info in report["arms"].items()}
    about, unrelated = evals.get("about_context"), evals.get("unrelated")
    entries = [e for ev in (about, unrelated) if ev for e in ev["lengths"]]
    return {**report, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
            "arms": arms, "mtbench": mtbench_section(unrelated), "about_context": section(about),
            "unrelated": section(unrelated), "mismatches": sum(len(e.get("mismatches", [])) for e in entries),
            "evals": evals}


def curves_figure(result: dict):
    """Loss and first-step accuracy over the optimizer steps, the warm arm's steps after the short arm's. Raises
    ImportError without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency (matplotlib)

    fig = Figure(figsize=(10, 4), layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2, sharex=True)
    offset = 0
    for arm, record in result["arms"].items():
        curve = record.get("curve") or []
        steps = [offset + r["step"] for r in curve]
        loss_ax.plot(steps, [r["loss"] for r in curve], label=arm)
        acc_ax.plot(steps, [r["acc"][0] if r.get("acc") else math.nan for r in curve], label=f"{arm} acc_0")
        offset = steps[-1] if steps else offset
    for ax, name in ((loss_ax, "loss"), (acc_ax, "accuracy of TTT step 0")):
        ax.set_xlabel("optimizer step (warm after short)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def context_figure(result: dict):
    """Two panels against mean context tokens: each draft's chain τ at the first k (about-context requests solid,
    the unrelated contrast dotted; ± standard error), and each draft minus the short one on the same prompts (±
    the paired standard error). Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency (matplotlib)

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    tau_ax, diff_ax = fig.subplots(1, 2)
    colors: dict[str, str] = {}  # one colour per draft in both panels and both request kinds
    for key, style, suffix in (("about_context", "-", ""), ("unrelated", ":", " (unrelated)")):
        sec = result.get(key) or {"rows": [], "paired": []}
        means = {r["context_length"]: r["mean_context_tokens"] for r in sec["rows"]}
        for draft in dict.fromkeys(r["draft"] for r in sec["rows"]):
            rows = [r for r in sec["rows"] if r["draft"] == draft]
            color = colors.setdefault(draft, f"C{len(colors)}")
            tau_ax.errorbar([r["mean_context_tokens"] for r in rows], [r["tau"] for r in rows],
                            yerr=[_finite(r["tau_se"]) for r in rows], marker="o", capsize=3, linestyle=style,
                            color=color, label=draft + suffix)
        for draft in dict.fromkeys(p["draft"] for p in sec["paired"]):
            rows = [p for p in sec["paired"] if p["draft"] == draft and p["delta_tau"] is not None]
            diff_ax.errorbar([means[p["context_length"]] for p in rows], [p["delta_tau"] for p in rows],
                             yerr=[_finite(p["delta_tau_se"]) for p in rows], marker="o", capsize=3, linestyle=style,
                             color=colors.setdefault(draft, f"C{len(colors)}"), label=f"{draft} − short{suffix}")
    k = (result.get("about_context") or {"rows": [{"k": "?"}]})["rows"][0]["k"]
    tau_ax.set_title(f"chain τ (k = {k}) by context length")
    tau_ax.set_ylabel("acceptance length τ")
    diff_ax.set_title("paired difference on the same prompts")
    diff_ax.set_ylabel("τ − τ(short)")
    diff_ax.axhline(0.0, color="grey", linewidth=0.8)
    for ax in (tau_ax, diff_ax):
        ax.set_xlabel("context tokens (mean per length)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def _finite(se) -> float:
    return 0.0 if se is None or math.isnan(se) else se


def write_outputs(result: dict, path: Path, also: Path | None = None) -> list[Path]:
    """The JSON at ``path`` (and ``also``), each with its plots beside it: τ by context length and the paired
    differences (same name, ``.png``: :func:`context_figure`) and the training curves (``_curves.png``). Returns the
    files written (the plots only with matplotlib and their data)."""
    written = []
    for out in [path] + ([also] if also else []):
        write_json(out, result)
        written.append(out)
        if result.get("about_context"):
            written.append(save_figure(lambda: context_figure(result), out.with_suffix(".png")))
        written.append(save_figure(lambda: curves_figure(result), out.with_name(out.stem + "_curves.png")))
    return [p for p in written if p is not None]


def tau_cell(tau, se) -> str:
    """``τ ± se`` to three decimals (τ alone without a finite se; — for none)."""
    return "—" if tau is None else f"{tau:.3f} ± {se:.3f}" if se is not None and not math.isnan(se) else f"{tau:.3f}"


def signed_cell(delta, se, magnitude) -> str:
    """A paired difference: its sign, ``magnitude`` (|delta|, as the JSON stores it) and ``± se``."""
    return "—" if delta is None else f"{'+' if delta >= 0 else '−'}{magnitude:.3f} ± {se:.3f}"


def mtbench_table(result: dict) -> Table | None:
    m = result.get("mtbench")
    if not m:
        return None
    ks = sorted({k for d in m["drafts"].values() for k in d["chain"]}, key=int, reverse=True)
    t = Table(title=f"τ on MT-Bench ({m['num_prompts']} prompts; ± standard error over prompts)")
    for col in ["draft"] + [f"chain k={k}" for k in ks] + ["tree"]:
        t.add_column(col, justify="right")
    for draft, d in m["drafts"].items():
        tree = d["tree"] or {}
        t.add_row(draft, *[tau_cell(d["chain"][k]["tau"], d["chain"][k]["tau_se"]) if k in d["chain"] else "—"
                           for k in ks], tau_cell(tree.get("tau"), tree.get("tau_se")))
    by = {(p["draft"], p["what"]): p for p in m["paired"]}
    for draft in dict.fromkeys(p["draft"] for p in m["paired"]):
        cells = [by.get((draft, what)) for what in ks + ["tree"]]
        t.add_row(f"{draft} − short (paired)", *[signed_cell(c["delta_tau"], c["delta_tau_se"], c["delta_tau_abs"])
                                                 if c else "—" for c in cells])
    return t


def print_tables(result: dict, console) -> None:
    """The stages (seconds against estimates), the arms, MT-Bench, τ by context length and the paired differences."""
    t = Table(title="stages (seconds; the plan's estimate and deadline)")
    for col in ("stage", "seconds", "estimate", "deadline"):
        t.add_column(col, justify="right")
    for name, s in result["stages"].items():
        t.add_row(name, f"{s['seconds']:.0f}", f"{s['estimate_s']:.0f}", f"{s['deadline_s']:.0f}")
    console.print(t)
    t = Table(title="training")
    for col in ("arm", "steps", "samples", "supervised tokens", "s / step", "acc_0 last 10", "stopped"):
        t.add_column(col, justify="right")
    for arm, a in result["arms"].items():
        t.add_row(arm, str(a.get("steps")), str(a.get("samples")), str(a.get("supervised_tokens")),
                  f"{a['s_per_step']:.2f}" if a.get("s_per_step") else "—",
                  f"{a['acc0_last10']:.3f}" if a.get("acc0_last10") is not None else "—",
                  str(a.get("stopped_at_deadline", False)))
    console.print(t)
    for table in (mtbench_table(result), report_table(result) if result.get("about_context") else None,
                  paired_table(result), paired_table(result, "unrelated")):
        if table is not None:
            console.print(table)
    if result["mismatches"]:
        console.print(f"[bold red]{result['mismatches']} output(s) differed from greedy decoding[/bold red] "
                      "(each length's 'mismatches' in the JSON)")
