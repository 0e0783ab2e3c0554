"""Summaries of speculative-decoding runs: τ overall and per prompt category, per-position acceptance, speed;
as JSON-ready dicts and rich tables."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rich.table import Table

from recipe.eval.prompts import Prompt
from recipe.eval.speculative import Generation


def position_counts(generations: list[Generation], k: int) -> tuple[list[int], list[int]]:
    """``(drafted, accepted)`` per draft position i = 1..k over all verification steps: position i is drafted in
    every step and accepted in the steps that accepted at least i draft tokens."""
    steps = sum(g.verify_steps for g in generations)
    accepted = [sum(1 for g in generations for a in g.accepted if a >= i) for i in range(1, k + 1)]
    return [steps] * k, accepted


def _tau(generations: list[Generation]) -> float:
    steps = sum(g.verify_steps for g in generations)
    emitted = sum(sum(g.accepted) + g.verify_steps for g in generations)
    return emitted / steps if steps else float("nan")


def tokens_per_s(generations: list[Generation]) -> float:
    """Emitted tokens over wall seconds summed over ``generations``; nan for none."""
    seconds = sum(g.seconds for g in generations)
    return sum(len(g.tokens) for g in generations) / max(seconds, 1e-9) if generations else float("nan")


def summarise_run(label: str, k: int, prompts: list[Prompt], generations: list[Generation],
                  greedy: list[Generation]) -> dict:
    """One draft at one k over all prompts (``Prompt`` or ``ContextPrompt``: their ``category`` is read).

    Keys: ``draft``, ``num_draft_tokens``, ``tau`` (emitted tokens / verification steps over all prompts),
    ``tau_by_category``, ``verify_steps``, ``new_tokens``, ``drafted_per_position`` / ``accepted_per_position``
    (position 1..k), ``acceptance_rate_per_position`` (accepted/drafted), ``seconds``, ``tokens_per_s``,
    ``greedy_tokens_per_s`` and ``speedup`` (speculative over greedy tokens/s), both over the prompts whose greedy
    generation in ``greedy`` (one per prompt) was timed, i.e. has finite ``seconds`` (every prompt when the reference
    was decoded prompt by prompt; nan when none was timed). ``tokens_per_s`` is over all prompts.
    ``per_prompt`` holds ``emitted`` (tokens emitted by verification steps: accepted + 1 per step) and
    ``verify_steps``, one int per prompt in prompt order, so two drafts run on the same prompts can be compared
    paired (:func:`paired_tau_difference`).
    """
    by_cat: dict[str, list[Generation]] = defaultdict(list)
    for prompt, gen in zip(prompts, generations):
        by_cat[prompt.category].append(gen)
    drafted, accepted = position_counts(generations, k)
    tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(g.seconds for g in generations)
    timed = [i for i, g in enumerate(greedy) if g.timed]
    greedy_tps = tokens_per_s([greedy[i] for i in timed])
    tps = tokens / max(seconds, 1e-9)
    speedup = tokens_per_s([generations[i] for i in timed]) / greedy_tps if timed else float("nan")
    return {
        "draft": label, "num_draft_tokens": k, "tau": _tau(generations),
        "tau_by_category": {cat: _tau(gens) for cat, gens in sorted(by_cat.items())},
        "verify_steps": sum(g.verify_steps for g in generations), "new_tokens": tokens,
        "drafted_per_position": drafted, "accepted_per_position": accepted,
        "acceptance_rate_per_position": [a / d if d else float("nan") for a, d in zip(accepted, drafted)],
        "seconds": seconds, "tokens_per_s": tps, "greedy_tokens_per_s": greedy_tps,
        "speedup": speedup,
        "per_prompt": {"emitted": [sum(g.accepted) + g.verify_steps for g in generations],
                       "verify_steps": [g.verify_steps for g in generations]},
    }


def paired_tau_difference(run_a: dict, run_b: dict) -> tuple[float, float] | None:
    """τ_a − τ_b of two :func:`summarise_run` dicts over the same prompts, and its paired standard error.

    τ = Σ_i e_i / Σ_i s_i (e_i emitted tokens, s_i verification steps of prompt i). Each ratio is linearised per
    prompt, z_i = (e_i − τ·s_i) / mean_i s_i (the delta method for a ratio estimator, Cochran, "Sampling
    Techniques", 3rd ed., §6.3), and d_i = z_a,i − z_b,i; SE = sqrt(Σ_i d_i² / (n (n − 1))) (Σ_i d_i = 0 by
    construction). Pairing removes the spread between prompts that both drafts share (easy and hard prompts), so
    a small difference can be significant where the unpaired standard errors overlap. None when either run lacks
    ``per_prompt`` (JSON written before it existed), the prompt counts differ, or fewer than 2 prompts have a
    verification step in both runs. Raises ValueError when the per-prompt emitted counts differ: lossless runs of
    the same prompts emit the same greedy tokens, so a difference means misaligned prompts.
    """
    pa, pb = run_a.get("per_prompt"), run_b.get("per_prompt")
    if not pa or not pb or len(pa["verify_steps"]) != len(pb["verify_steps"]):
        return None
    if pa["emitted"] != pb["emitted"]:
        raise ValueError(f"{run_a.get('draft')} and {run_b.get('draft')}: the per-prompt emitted tokens differ, so "
                         "the runs did not decode the same prompts in the same order (lossless runs of one prompt "
                         "emit the same greedy tokens whatever the draft)")
    keep = [i for i, (sa, sb) in enumerate(zip(pa["verify_steps"], pb["verify_steps"])) if sa and sb]
    n = len(keep)
    if n < 2:
        return None
    tau_a, z_a = ratio_residuals([(pa["emitted"][i], pa["verify_steps"][i]) for i in keep])
    tau_b, z_b = ratio_residuals([(pb["emitted"][i], pb["verify_steps"][i]) for i in keep])
    return tau_a - tau_b, (sum((a - b) ** 2 for a, b in zip(z_a, z_b)) / (n * (n - 1))) ** 0.5


def ratio_residuals(rows: list[tuple[int, int]]) -> tuple[float, list[float]]:
    """τ = Σ_i e_i / Σ_i s_i of ``rows`` = [(e_i emitted tokens, s_i verification steps), ...] (every s_i > 0) and
    each prompt's linearised residual z_i = (e_i − τ·s_i) / mean_i s_i, the delta method for a ratio estimator
    (Cochran, "Sampling Techniques", 3rd ed., §6.3): SE(τ) = sqrt(Σ_i z_i² / (n (n − 1)))."""
    tau = sum(e for e, _ in rows) / sum(s for _, s in rows)
    mean_s = sum(s for _, s in rows) / len(rows)
    return tau, [(e - tau * s) / mean_s for e, s in rows]


def tau_table(runs: list[dict], title: str = "Acceptance length τ (chain drafting, greedy verification)",
              k_label: str = "k") -> Table:
    """τ per draft and k (or tree depth: ``k_label``) with per-position acceptance and speed (one row per run)."""
    table = Table(title=title)
    for col in ("draft", k_label, "τ", "accept rate by position", "tok/s spec", "tok/s greedy", "speedup"):
        table.add_column(col, justify="left" if col in ("draft", "accept rate by position") else "right")
    for r in runs:
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"])
        table.add_row(Path(r["draft"]).name or r["draft"], str(r["num_draft_tokens"]), f"{r['tau']:.3f}", rates,
                      f"{r['tokens_per_s']:.1f}", f"{r['greedy_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x")
    return table


def category_table(runs: list[dict]) -> Table:
    """τ per prompt category (rows) for each draft and k or tree (columns; tree runs have a ``tree`` key)."""
    table = Table(title="τ by prompt category")
    table.add_column("category")
    for r in runs:
        kind = f"tree d={r['num_draft_tokens']}" if "tree" in r else f"k={r['num_draft_tokens']}"
        table.add_column(f"{Path(r['draft']).name or r['draft']} {kind}", justify="right")
    for cat in sorted({c for r in runs for c in r["tau_by_category"]}):
        table.add_row(cat, *[f"{r['tau_by_category'].get(cat, float('nan')):.3f}" for r in runs])
    return table
