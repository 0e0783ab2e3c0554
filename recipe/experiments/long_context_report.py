"""The report of ``python -m recipe.experiments long-context``: per arm what its training cost, and τ by context length.

``report`` returns the JSON: ``{"settings", "arms": {arm: arm_summary}, "about_context": {"lengths": [...],
"rows": [...]}, "unrelated": {...} | None, "evals": {"about_context": <recipe.eval JSON>, "unrelated": ...}}``, one
row per (draft label, context length) with chain τ at the first k and tree τ, each with its standard error over
prompts, the prompt count and the mean context tokens. ``report_table`` prints it (arm × context length);
``plot_report`` draws τ against mean context tokens per arm (chain, and tree dashed). ``about_context`` also holds
``paired``: each arm minus the short arm on the same prompts (``paired_rows``, printed by ``paired_table``), and so
does ``unrelated`` (empty when the contrast ran the short draft alone).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table

from recipe.eval.report import paired_tau_difference
from recipe.plot import METRICS_FILE, read_metrics, save_figure


def arm_summary(run: Path) -> dict:
    """What training one arm cost, from ``run``'s ``metrics.jsonl`` and ``run_config.json``: optimizer steps,
    samples, supervised tokens, seconds of training steps (``time_s`` summed), the last 10 steps' mean first-token
    accuracy (all supervised positions), the longest training sample, the run's position / init options and ``layout``
    (its tp / cp / dp, whether set by flag or by the DeepSpeed JSON; ``cp_size`` is the flag alone). A run
    folder without metrics (e.g. a ``--short-run`` copied without them) gives the export folder only."""
    out = {"run": str(run), "export": str(run / "export")}
    if not (run / METRICS_FILE).is_file():
        return out
    records = read_metrics(run / METRICS_FILE)
    tail = [r["acc_all_supervised"][0] for r in records[-10:] if r.get("acc_all_supervised")]
    out.update(steps=records[-1]["step"], samples=sum(r.get("samples", 0) for r in records),
               supervised_tokens=sum(r.get("tokens", 0) for r in records),
               train_s=round(sum(r.get("time_s", 0.0) for r in records), 1),
               acc0_last10=sum(tail) / len(tail) if tail else None)
    config = run / "run_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        run_args = cfg.get("args", {})
        out.update({k: run_args.get(k) for k in ("max_length", "chain_conversations", "limit", "epochs",
                                                  "init_draft", "position_offset_max", "cp_size")})
        out["layout"] = cfg.get("parallelism")  # {"tp", "cp", "dp"} as run.py resolved them (JSON or flags)
        out["lr"] = cfg.get("deepspeed", {}).get("optimizer", {}).get("params", {}).get("lr")
    return out


def length_rows(evaluation: dict) -> list[dict]:
    """One row per (draft label, context length) of a ``recipe.eval --context-lengths`` JSON: ``draft``,
    ``context_length``, ``num_prompts``, ``mean_context_tokens``, ``k``, ``tau``, ``tau_se``, ``tau_tree``,
    ``tau_tree_se`` (None without trees), ``accepted_per_position``."""
    rows = []
    for entry in evaluation["lengths"]:
        trees = {r["draft"]: r for r in entry.get("tree_runs") or []}
        first_k = {}
        for r in entry["runs"]:
            first_k.setdefault(r["draft"], r)
        for label, r in first_k.items():
            tree = trees.get(label)
            rows.append({"draft": label, "context_length": entry["context_length"],
                         "num_prompts": entry["num_prompts"], "mean_context_tokens": entry["mean_context_tokens"],
                         "k": r["num_draft_tokens"], "tau": r["tau"], "tau_se": r["tau_se"],
                         "tau_tree": tree["tau"] if tree else None, "tau_tree_se": tree["tau_se"] if tree else None,
                         "accepted_per_position": r["accepted_per_position"]})
    return rows


def paired_rows(evaluation: dict, reference: str = "short") -> list[dict]:
    """Each other draft against ``reference`` on the same prompts, per context length: ``draft``,
    ``context_length``, ``num_prompts``, ``delta_tau`` / ``delta_tau_se`` (chain, first k) and ``delta_tau_tree`` /
    ``delta_tau_tree_se`` (tree), from :func:`recipe.eval.report.paired_tau_difference`; None where the JSON has no
    per-prompt counts (written before ``recipe.eval`` recorded them)."""
    rows = []
    for entry in evaluation["lengths"]:
        chains, trees = {}, {r["draft"]: r for r in entry.get("tree_runs") or []}
        for r in entry["runs"]:
            chains.setdefault(r["draft"], r)
        if reference not in chains:
            continue
        for label in chains:
            if label == reference:
                continue
            chain = paired_tau_difference(chains[label], chains[reference])
            tree = (paired_tau_difference(trees[label], trees[reference])
                    if label in trees and reference in trees else None)
            rows.append({"draft": label, "reference": reference, "context_length": entry["context_length"],
                         "num_prompts": entry["num_prompts"],
                         "delta_tau": chain[0] if chain else None, "delta_tau_se": chain[1] if chain else None,
                         "delta_tau_tree": tree[0] if tree else None,
                         "delta_tau_tree_se": tree[1] if tree else None})
    return rows


def paired_table(result: dict, section: str = "about_context") -> Table | None:
    """Arm × context length: τ − τ(short) on the same prompts (chain / tree) ± paired standard error, of the
    ``section`` (``about_context`` or ``unrelated``); None when no length has per-prompt counts."""
    rows = [r for r in (result.get(section) or {}).get("paired", []) if r["delta_tau"] is not None]
    if not rows:
        return None
    lengths = sorted({r["context_length"] for r in rows})
    what = "" if section == "about_context" else f", {section} requests"
    t = Table(title=f"τ − τ(short) on the same prompts (chain / tree; ± paired standard error{what})")
    t.add_column("arm")
    for n in lengths:
        t.add_column(f"{n}", justify="right")
    by = {(r["draft"], r["context_length"]): r for r in rows}
    for draft in dict.fromkeys(r["draft"] for r in rows):
        cells = []
        for n in lengths:
            r = by.get((draft, n))
            cells.append("" if r is None else f"{_signed(r['delta_tau'], r['delta_tau_se'])}\n"
                                              f"{_signed(r['delta_tau_tree'], r['delta_tau_tree_se'])}")
        t.add_row(draft, *cells)
    return t


def _signed(delta, se) -> str:
    return "-" if delta is None else f"{delta:+.3f} ± {se:.3f}"


def report(args, arms: dict, about: dict, contrast: dict | None) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"settings": settings, "arms": arms,
            "about_context": {"lengths": about["context_lengths"], "rows": length_rows(about),
                              "paired": paired_rows(about)},
            "unrelated": ({"lengths": contrast["context_lengths"], "rows": length_rows(contrast),
                           "paired": paired_rows(contrast)} if contrast else None),
            "evals": {"about_context": about, "unrelated": contrast}}


def _cell(tau, se) -> str:
    if tau is None:
        return "-"
    return f"{tau:.3f}" if se is None or math.isnan(se) else f"{tau:.3f} ± {se:.3f}"


def report_table(result: dict) -> Table:
    """Arm × context length: chain τ (first k) and tree τ, ± standard error; the unrelated contrast below."""
    sections = [("about-context", result["about_context"])]
    if result.get("unrelated"):
        sections.append(("unrelated", result["unrelated"]))
    lengths = sorted({r["context_length"] for _, s in sections for r in s["rows"]})
    t = Table(title="τ by context length per arm (chain first k / tree; ± standard error over prompts)")
    t.add_column("requests")
    t.add_column("arm")
    for n in lengths:
        t.add_column(f"{n}", justify="right")
    for name, section in sections:
        by = {(r["draft"], r["context_length"]): r for r in section["rows"]}
        for draft in dict.fromkeys(r["draft"] for r in section["rows"]):
            cells = []
            for n in lengths:
                r = by.get((draft, n))
                cells.append("" if r is None else f"{_cell(r['tau'], r['tau_se'])}\n"
                                                  f"{_cell(r['tau_tree'], r['tau_tree_se'])}")
            t.add_row(name, draft, *cells)
    return t


def report_figure(result: dict):
    """Two panels (chain at the first k, tree) of τ against mean context tokens, one line per arm (about-context
    requests), the short arm's unrelated contrast dotted. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    sections = [("", result["about_context"], "-")]
    if result.get("unrelated"):
        sections.append((" (unrelated)", result["unrelated"], ":"))
    for ax, (key, se_key, what) in zip(axes, (("tau", "tau_se", "chain"), ("tau_tree", "tau_tree_se", "tree"))):
        for suffix, section, style in sections:
            for draft in dict.fromkeys(r["draft"] for r in section["rows"]):
                rows = [r for r in section["rows"] if r["draft"] == draft and r[key] is not None]
                if not rows:
                    continue
                ax.errorbar([r["mean_context_tokens"] for r in rows], [r[key] for r in rows],
                            yerr=[0 if r[se_key] is None or math.isnan(r[se_key]) else r[se_key] for r in rows],
                            marker="o", capsize=3, linestyle=style, label=draft + suffix)
        k = result["about_context"]["rows"][0]["k"] if result["about_context"]["rows"] else "?"
        ax.set_title(f"{what} drafting" + (f" (k = {k})" if what == "chain" else ""))
        ax.set_xlabel("context tokens (mean per length)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("acceptance length τ")
    return fig


def plot_report(result: dict, out: Path) -> Path | None:
    """Write :func:`report_figure` as a PNG to ``out``; None (nothing written) without matplotlib."""
    return save_figure(lambda: report_figure(result), out)
