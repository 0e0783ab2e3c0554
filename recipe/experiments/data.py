"""τ per data recipe at equal training compute: which answers (ShareGPT's or the target's own) and how many distinct
samples (few seen over many epochs, or many seen once) give the better draft for the same optimizer steps.

    python -m recipe.experiments data [--output runs/bench-data] [--arms sharegpt:740:1,sharegpt:190:4,regenerated:190:7]
        [--steps 154] [--json FILE] [-- DEMO FLAGS ...]

Each arm ``ANSWERS:CONVERSATIONS:EPOCHS`` is one ``python -m recipe.demo`` run in ``OUTPUT/<arm>`` (so it resumes and
skips what is done, like the demo) with ``--max-steps STEPS``: every arm makes the same number of optimizer steps of
the same global batch, so the same training compute (sample passes = steps · batch); ``EPOCHS`` only has to be
enough to reach them (an arm that runs out trains fewer steps, and its row says so; 190 conversations give 153
ShareGPT samples but 146 regenerated ones, hence 7 epochs for the regenerated arm). Flags after ``--`` go to every
demo run (e.g. ``--eval-prompts 16 --ttt-steps 4``; the table in docs/results/data_cpu.json was measured
with K = 4, the demo's default then, now 2). The table lists per arm the conversations read, the samples
dumped (the rest were skipped, e.g. no assistant token within ``--max-length``), epochs actually made, steps,
supervised tokens trained on (regenerated answers are shorter, so a step holds fewer), seconds spent making the
data (regeneration + dump) and training (a rerun of an arm reports the seconds its earlier run recorded for a
skipped dump or training; the regeneration, which resumes rather than skips, reports its own), the first-token
accuracy of the last 10 steps (``acc_all_supervised``: all supervised positions, out-of-vocabulary = miss; on
samples seen for the first time only in a one-epoch arm) and τ of chain (first k) and tree drafting on
MT-Bench; the JSON has every arm's row.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe.bench.common import write_json
from recipe.data.store import HiddenStateStore
from recipe.plot import METRICS_FILE, read_metrics

DEFAULT_ARMS = "sharegpt:740:1,sharegpt:190:4,regenerated:190:7"


def parse_arm(text: str) -> tuple[str, int, float]:
    """``"ANSWERS:CONVERSATIONS:EPOCHS"`` -> (answers, conversations, epochs); ValueError naming the arm."""
    from recipe.demo import ANSWERS  # import cost: pulls in transformers

    parts = text.split(":")
    try:
        answers, n, epochs = parts[0], int(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"arm {text!r}: expected ANSWERS:CONVERSATIONS:EPOCHS, e.g. sharegpt:740:1") from None
    if len(parts) != 3 or answers not in ANSWERS or n < 1 or epochs <= 0:
        raise ValueError(f"arm {text!r}: ANSWERS one of {ANSWERS}, CONVERSATIONS >= 1, EPOCHS > 0")
    return answers, n, epochs


def arm_name(answers: str, n: int, epochs: float) -> str:
    return f"{answers}-n{n}-e{epochs:g}"


def arm_row(run: Path, answers: str, n: int, epochs: float, batch: int) -> dict:
    """What one finished demo run in ``run`` measured (its eval.json, store and metrics.jsonl)."""
    result = json.loads((run / "eval.json").read_text())
    settings = result["settings"]
    store = HiddenStateStore(run / f"store-{answers}-n{n}-len{settings['max_length']}")
    records = read_metrics(run / METRICS_FILE)
    steps = records[-1]["step"] if records else 0  # steps count from 1
    samples = store.meta.num_samples
    tail = [r["acc_all_supervised"][0] for r in records[-10:] if r.get("acc_all_supervised")]
    return {"arm": arm_name(answers, n, epochs), "answers": answers, "conversations": n, "samples": samples,
            "epochs": steps * batch / max(samples, 1), "steps": steps, "sample_passes": steps * batch,
            "supervised_tokens": sum(r.get("tokens", 0) for r in records),
            "data_s": (sum(result["stage_seconds"].get(k, 0.0) for k in ("regenerate", "dump"))
                       if "dump" in result["stage_seconds"] else None),
            "train_s": result["stage_seconds"].get("train"), "acc0_last10": sum(tail) / len(tail) if tail else None,
            "tau": result["tau"], "tau_tree": result.get("tau_tree"), "num_draft_tokens": result["num_draft_tokens"],
            "num_prompts": result["num_prompts"], "tree": result.get("tree"), "per_k": result["per_k"]}


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("arm", "samples", "epochs", "steps", "supervised tokens", "data s", "train s", "acc₀ last 10",
                "τ chain", "τ tree"):
        t.add_column(col, justify="right")
    for r in rows:
        acc = r["acc0_last10"]
        t.add_row(r["arm"], str(r["samples"]), f"{r['epochs']:.2f}", str(r["steps"]), str(r["supervised_tokens"]),
                  f"{r['data_s']:.0f}" if r["data_s"] is not None else "-",
                  f"{r['train_s']:.0f}" if r["train_s"] is not None else "-", f"{acc:.3f}" if acc is not None else "-",
                  f"{r['tau']:.3f}", f"{r['tau_tree']:.3f}" if r["tau_tree"] is not None else "-")
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    demo_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m recipe.experiments data", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("runs") / "bench-data", help="folder of the arms' runs")
    p.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated ANSWERS:CONVERSATIONS:EPOCHS")
    p.add_argument("--steps", type=int, default=154, help="optimizer steps of every arm (equal compute)")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = p.parse_args(own)
    console = Console()
    try:
        arms = [parse_arm(a) for a in args.arms.split(",") if a]
    except ValueError as exc:
        console.print(f"[bold red]error[/bold red]: {exc}")
        return 2
    from recipe.demo import build_parser  # import cost: pulls in transformers
    from recipe.demo import main as demo_main  # import cost: pulls in transformers

    batch = build_parser().parse_args(demo_flags).batch_size
    rows = []
    for answers, n, epochs in arms:
        run = args.output / arm_name(answers, n, epochs)
        flags = ["--output", str(run), "--answers", answers, "--conversations", str(n), "--epochs", str(epochs),
                 "--max-steps", str(args.steps), *demo_flags]
        console.rule(f"arm {arm_name(answers, n, epochs)}")
        if demo_main(flags) != 0:
            console.print(f"[bold red]arm {arm_name(answers, n, epochs)} failed[/bold red]")
            return 1
        rows.append(arm_row(run, answers, n, epochs, batch))
    title = f"τ per data recipe at equal compute ({args.steps} steps × batch {batch})"
    console.print(table(rows, title))
    write_json(args.json, {"config": {"steps": args.steps, "batch": batch, "arms": args.arms,
                                      "demo_flags": demo_flags}, "rows": rows})
    return 0
