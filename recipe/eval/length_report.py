"""Reports of τ by context length: one JSON entry per length, the standard error of τ over prompts, the rich table,
and the plot of τ against context length (matplotlib, optional)."""
from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from recipe.eval.report import ratio_residuals, summarise_run
from recipe.eval.speculative import Generation
from recipe.plot import save_figure

NO_MATPLOTLIB = "matplotlib is not installed: no plot of τ by context length drawn (pip install -e '.[plot]')"


def tau_standard_error(generations: list[Generation]) -> float:
    """Standard error of τ over prompts (nan for fewer than 2 prompts with a verification step).

    τ = Σ_i e_i / Σ_i s_i over prompts i (e_i emitted tokens, s_i verification steps of prompt i) is a ratio of
    sums; its standard error treats prompts as the independent draws (the delta method for a ratio estimator,
    Cochran, "Sampling Techniques", 3rd ed., §6.3): SE = sqrt(Σ_i (e_i − τ·s_i)² / (n (n − 1))) / mean_i s_i.
    """
    return _ratio_se([(sum(g.accepted) + g.verify_steps, g.verify_steps) for g in generations if g.verify_steps])


def _ratio_se(rows: list[tuple[int, int]]) -> float:
    """:func:`tau_standard_error` of (emitted, verification steps) rows, every step count > 0."""
    if len(rows) < 2:
        return float("nan")
    _, z = ratio_residuals(rows)
    return math.sqrt(sum(x * x for x in z) / (len(z) * (len(z) - 1)))


def _run(label, k, prompts, gens, greedy) -> dict:
    return {**summarise_run(label, k, prompts, gens, greedy), "tau_se": tau_standard_error(gens)}


def length_entry(length: int, context_prompts: list, greedy: list[Generation],
                 chains: dict[tuple[str, int], list[Generation]], trees: dict[str, list[Generation]] | None,
                 tree=None) -> dict:
    """The JSON entry of one context length (``context_prompts``: its ``ContextPrompt`` list, one generation of each
    in ``greedy`` and in every list of ``chains`` and ``trees``).

    Keys: ``context_length`` (L, tokens), ``num_prompts``, ``mean_context_tokens`` and ``mean_prompt_tokens``
    (means over the prompts of ``ContextPrompt.context_tokens`` and of the rendered prompts' tokens), ``tau`` /
    ``tau_se`` of the first (draft, k), ``tau_tree`` / ``tau_tree_se`` of the first draft's tree (null without
    trees), ``runs`` (one ``summarise_run`` per (draft, k) with ``tau_se``, the standard error of τ over prompts,
    ``tau_standard_error``) and ``tree_runs`` (one per draft, with ``tree``). With no prompts the τ values are null.
    """
    n = len(context_prompts)
    runs = [_run(label, k, context_prompts, gens, greedy) for (label, k), gens in chains.items()] if n else []
    tree_runs = [{**_run(label, tree.depth, context_prompts, gens, greedy), "tree": tree.as_dict()}
                 for label, gens in trees.items()] if n and trees is not None else []
    return {
        "context_length": length, "num_prompts": n,
        "mean_context_tokens": sum(p.context_tokens for p in context_prompts) / n if n else None,
        "mean_prompt_tokens": sum(len(p.ids) for p in context_prompts) / n if n else None,
        "tau": runs[0]["tau"] if runs else None, "tau_se": runs[0]["tau_se"] if runs else None,
        "tau_tree": tree_runs[0]["tau"] if tree_runs else None,
        "tau_tree_se": tree_runs[0]["tau_se"] if tree_runs else None,
        "runs": runs, "tree_runs": tree_runs,
    }


def merge_entries(entries: list[dict]) -> dict:
    """One :func:`length_entry` from entries of the same context length measured on disjoint prompt sets (the
    parallel chunks of ``recipe.experiments demo-gpu``), in the given order: every run's ``per_prompt`` counts
    concatenated, its counts summed (``verify_steps``, ``new_tokens``, ``seconds``, ``drafted_per_position``,
    ``accepted_per_position``), τ = Σ emitted / Σ steps and ``tau_se`` recomputed over all prompts (as
    :func:`tau_standard_error`), ``tokens_per_s`` = new tokens / seconds; what the entries cannot give over all
    prompts (``tau_by_category``, ``greedy_tokens_per_s``, ``speedup``) is left empty / nan. The entry's prompt
    count, means (weighted by prompts), ``prefill_seconds``, ``device_memory`` (largest of each peak) and
    ``mismatches`` are combined the same way. Raises ValueError when the entries differ in length or in their
    (draft, k) runs, or a run has no per-prompt counts."""
    if len({e["context_length"] for e in entries}) != 1:
        raise ValueError(f"entries of different context lengths: {[e['context_length'] for e in entries]}")
    keys = [[(r["draft"], r["num_draft_tokens"]) for r in e["runs"] + e["tree_runs"]] for e in entries]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"entries with different (draft, k) runs: {keys}")
    n = sum(e["num_prompts"] for e in entries)
    runs = [_merge_runs([e["runs"][i] for e in entries]) for i in range(len(entries[0]["runs"]))]
    trees = [_merge_runs([e["tree_runs"][i] for e in entries]) for i in range(len(entries[0]["tree_runs"]))]
    peaks = [e.get("device_memory") for e in entries if e.get("device_memory")]
    return {"context_length": entries[0]["context_length"], "num_prompts": n,
            **{key: sum(e[key] * e["num_prompts"] for e in entries) / n if n else None
               for key in ("mean_context_tokens", "mean_prompt_tokens")},
            "tau": runs[0]["tau"] if runs else None, "tau_se": runs[0]["tau_se"] if runs else None,
            "tau_tree": trees[0]["tau"] if trees else None, "tau_tree_se": trees[0]["tau_se"] if trees else None,
            "runs": runs, "tree_runs": trees, "prefill_seconds": sum(e.get("prefill_seconds", 0.0) for e in entries),
            "device_memory": {k: max(p[k] for p in peaks) for k in peaks[0]} if peaks else None,
            "mismatches": [m for e in entries for m in e.get("mismatches", [])], "merged_from": len(entries)}


def _merge_runs(parts: list[dict]) -> dict:
    if any(not p.get("per_prompt") for p in parts):
        raise ValueError(f"run {parts[0]['draft']} has no per-prompt counts to merge")
    emitted = [x for p in parts for x in p["per_prompt"]["emitted"]]
    steps = [x for p in parts for x in p["per_prompt"]["verify_steps"]]
    drafted = [sum(col) for col in zip(*(p["drafted_per_position"] for p in parts))]
    accepted = [sum(col) for col in zip(*(p["accepted_per_position"] for p in parts))]
    tokens, seconds = sum(p["new_tokens"] for p in parts), sum(p["seconds"] for p in parts)
    return {**parts[0], "tau": sum(emitted) / sum(steps) if sum(steps) else float("nan"), "tau_by_category": {},
              "verify_steps": sum(steps), "new_tokens": tokens, "drafted_per_position": drafted,
              "accepted_per_position": accepted,
              "acceptance_rate_per_position": [a / d if d else float("nan") for a, d in zip(accepted, drafted)],
              "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), "greedy_tokens_per_s": float("nan"),
              "speedup": float("nan"), "per_prompt": {"emitted": emitted, "verify_steps": steps},
              "tau_se": _ratio_se([(e, s) for e, s in zip(emitted, steps) if s])}


def _fmt(tau, se) -> str:
    return "—" if tau is None else f"{tau:.3f} ± {se:.3f}"


def length_table(entries: list[dict]) -> Table:
    """τ ± its standard error (over prompts) per context length (rows) for each draft and k or tree (columns), with
    the prompt count and mean context tokens."""
    table = Table(title="Acceptance length τ by context length (± standard error over prompts)")
    table.add_column("context", justify="right")
    table.add_column("prompts", justify="right")
    table.add_column("mean context tok", justify="right")
    first = next((e for e in entries if e["runs"]), None)
    columns = [] if first is None else [
        (r["draft"], "tree" in r, r["num_draft_tokens"]) for r in first["runs"] + first["tree_runs"]]
    for draft, is_tree, k in columns:
        table.add_column(f"{Path(draft).name or draft} {'tree d=' if is_tree else 'k='}{k}", justify="right")
    for e in entries:
        cells = []
        for draft, is_tree, k in columns:
            run = next((r for r in e["runs"] + e["tree_runs"] if r["draft"] == draft and ("tree" in r) == is_tree
                        and r["num_draft_tokens"] == k), None)
            cells.append(_fmt(run["tau"], run["tau_se"]) if run else "—")
        mean = e["mean_context_tokens"]
        table.add_row(str(e["context_length"]), str(e["num_prompts"]), "—" if mean is None else f"{mean:.0f}",
                      *cells)
    return table


def tau_by_length_figure(entries: list[dict], title: str = ""):
    """``matplotlib.figure.Figure`` of τ against mean context tokens: one line with standard-error bars per draft
    and k (solid) and per draft's tree (dashed). Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency (matplotlib)

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    series: dict[tuple[str, bool, int], list[tuple[float, float, float]]] = {}
    for e in entries:
        for r in e["runs"] + e["tree_runs"]:
            key = (Path(r["draft"]).name or r["draft"], "tree" in r, r["num_draft_tokens"])
            series.setdefault(key, []).append((e["mean_context_tokens"], r["tau"], r["tau_se"]))
    for (draft, is_tree, k), points in series.items():
        xs, ys, errs = zip(*points)
        ax.errorbar(xs, ys, yerr=[0 if math.isnan(s) else s for s in errs], marker="o", capsize=3,
                    linestyle="--" if is_tree else "-", label=f"{draft} {'tree d=' if is_tree else 'k='}{k}")
    ax.set_xlabel("context tokens (mean per length)")
    ax.set_ylabel("acceptance length τ")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return fig


def plot_tau_by_length(entries: list[dict], out: Path, title: str = "") -> Path | None:
    """Write :func:`tau_by_length_figure` as a PNG to ``out``; None (nothing written) without matplotlib."""
    return save_figure(lambda: tau_by_length_figure(entries, title), out)
