"""Does training at long context keep τ up where a short-trained draft falls? Five arms, one evaluation.

    python -m recipe.experiments long-context [--output runs/long_context] [--target DIR] [--data FILE]
        [--short-run DIR] [--long-length 4k] [--long-conversations 180] [--cp-size 2] [--warm-fraction 0.33]
        [--position-offset-max N] [--windows 256,1024] [--context-lengths 256,1k,2k,4k,7k] [--prompts 16]
        [--prompts-longest N] [--contrast-prompts N] [--eval-jobs J]
        [--max-new-tokens 32] [--num-draft-tokens 3] [--json FILE] [-- DEMO FLAGS ...]

Arms (each a run folder under ``OUTPUT``, resumed or skipped like ``recipe.demo``'s stages):

- **short**: the demo recipe as it is (``recipe.demo``'s dump and training: ``--short-conversations`` ShareGPT
  conversations cut at ``--short-length`` tokens), or the run given by ``--short-run`` (its ``export/`` and store);
- **long**: the first ``--long-conversations`` conversations, whole, chained into samples of up to
  ``--long-length`` tokens (``run.py --chain-conversations``), trained online with context parallelism
  (``--cp-size`` ranks, the ring), one pass (``--long-epochs``), one sample per optimizer step;
- **warm**: the short draft continued on the long samples (``run.py --init-draft``) for ``--warm-fraction`` of a
  pass at ``--warm-lr``;
- **posrobust**: the short recipe again with ``run.py --position-offset-max N`` (anchor-offset positions: a sample
  of ``--short-length`` tokens is rotated as if it sat up to N positions further on; default N = the target's
  ``max_position_embeddings`` − ``--short-length``), same samples, steps and seed as short;
- **short@W**: the short draft served with a sliding window of W positions (``recipe.eval --draft DIR@W``) for
  each W of ``--windows``: no training.

Then ``python -m recipe.eval --context-lengths L --context-request about-context`` with every arm's draft (``--draft``
repeated, so each prompt's prefill and greedy reference are computed once for all arms; the working directory is
``OUTPUT/drafts``, whose links name the arms), one run per length L (``OUTPUT/eval_about_context-L{L}.json``: a rerun
skips the lengths done), and the same with the short draft alone on ``unrelated`` requests at ``--contrast-lengths``. The table (arm × context length: chain τ at the first k and tree τ, each ±
its standard error over prompts), the plot of τ against context (``--json`` with ``.png``) and the JSON (arms with
their steps, supervised tokens and seconds; both evaluations whole) are ``recipe.experiments.long_context_report``'s.
Flags after ``--`` go to every arm's ``recipe.demo`` settings (``--lr``, ``--ttt-steps``, ``--draft-vocab-size``,
``--ds-config``, ``--ranks`` of the short arms, ``--seed`` …). On a GPU cluster the same command trains the arms
with DeepSpeed's launcher on the GPUs (``recipe.demo`` picks ``--num_gpus``); docs/results/long_context_cpu.md has
the CPU run and what to change for an 8B target.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from recipe import demo
from recipe.arg_types import context_length_list, length, positive_int_list
from recipe.bench.common import write_json
from recipe.experiments.long_context_report import arm_summary, paired_table, report, report_table
from recipe.processes import subprocess_env

ARMS = ("short", "long", "warm", "posrobust")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.experiments long-context", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("runs") / "long_context", help="folder of the arms' runs")
    p.add_argument("--target", type=Path, help="target model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--data", type=Path, help="conversations to train on and to draw context from (default: the "
                                              "packaged ShareGPT)")
    p.add_argument("--short-run", type=Path, help="a finished recipe.demo run folder to use as the short arm")
    p.add_argument("--short-length", type=length, default=256, help="tokens per short sample")
    p.add_argument("--short-conversations", type=int, default=540, help="conversations the short arms read")
    p.add_argument("--long-length", type=length, default=4096, help="tokens per chained long sample at most")
    p.add_argument("--long-conversations", type=int, default=180, help="conversations chained for the long arms")
    p.add_argument("--long-epochs", type=float, default=1.0, help="passes of the long arm over its samples")
    p.add_argument("--long-batch-size", type=int, default=1, help="long samples per optimizer step")
    p.add_argument("--cp-size", type=int, default=2, help="context-parallel ranks of the long arms")
    p.add_argument("--warm-fraction", type=float, default=0.33, help="the warm arm's passes over the long samples")
    p.add_argument("--warm-lr", type=float, default=5e-4, help="the warm arm's peak learning rate")
    p.add_argument("--position-offset-max", type=int,
                   help="the posrobust arm's N (default: max_position_embeddings - --short-length)")
    p.add_argument("--windows", type=positive_int_list, default=[256, 1024],
                   help="sliding windows the short draft is also served with")
    p.add_argument("--arms", default=",".join(ARMS), help=f"trained arms to run and evaluate, from {','.join(ARMS)}")
    p.add_argument("--context-lengths", type=context_length_list, default=[256, 1024, 2048, 4096, 7168])
    p.add_argument("--contrast-lengths", type=context_length_list, default=[0, 4096],
                   help="lengths of the short arm's unrelated-request contrast")
    p.add_argument("--no-contrast", action="store_true", help="skip the unrelated-request contrast")
    p.add_argument("--prompts", type=int, default=16, help="MT-Bench prompts per context length")
    p.add_argument("--prompts-longest", type=int,
                   help="prompts at the longest about-context length (default: --prompts; its prefill dominates)")
    p.add_argument("--contrast-prompts", type=int, help="prompts per length of the unrelated contrast (default: "
                   "--prompts)")
    p.add_argument("--eval-jobs", type=int, default=1,
                   help="context lengths evaluated at once, each with its share of the CPU threads (on 2 cores, 2 "
                        "jobs of 1 thread decode faster than 1 job of 2)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-draft-tokens", type=positive_int_list, default=[3])
    p.add_argument("--train-only", action="store_true", help="train (or find) the arms, evaluate nothing")
    p.add_argument("--json", type=Path, help="write the report JSON here (and the plot beside it, .png)")
    return p


def arm_args(base: list[str], output: Path, **flags) -> argparse.Namespace:
    argv = list(base) + ["--output", str(output)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = demo.build_parser().parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    return args


def _target_positions(target: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(target).max_position_embeddings)


def train_arms(args, demo_flags: list[str], assets, console: Console) -> dict[str, Path]:
    """Train (or find) every arm of ``--arms``; returns arm -> run folder (each with ``export/``). Raises
    RuntimeError when a stage fails."""
    out, arms = args.output, [a for a in args.arms.split(",") if a]
    short_flags = {"conversations": args.short_conversations, "max_length": args.short_length}
    runs = {}
    short = arm_args(demo_flags, args.short_run.resolve() if args.short_run else out / "short", **short_flags)
    runs["short"] = short.output
    store = runs["short"] / f"store-{short.answers}-n{short.conversations}-len{short.max_length}"
    if args.short_run is None or not (runs["short"] / "export" / "config.json").is_file():
        demo.stage_dump(short, assets, assets.conversations, store, console)
        demo.stage_train(short, assets, store, console)
    chained = ["--data", str(assets.conversations), "--limit", str(args.long_conversations),
               "--chain-conversations", str(args.long_length)]
    long_flags = {"max_length": args.long_length, "batch_size": args.long_batch_size,
                  "ranks": args.cp_size * args.long_batch_size}
    cp = ["--cp-size", str(args.cp_size)]
    if "long" in arms:
        a = arm_args(demo_flags, out / "long", epochs=args.long_epochs, **long_flags)
        demo.stage_train(a, assets, None, console, data_args=chained, extra=cp)
        runs["long"] = a.output
    if "warm" in arms:
        a = arm_args(demo_flags, out / "warm", epochs=args.warm_fraction, **{**long_flags, "lr": args.warm_lr})
        demo.stage_train(a, assets, None, console, data_args=chained,
                         extra=cp + ["--init-draft", str(runs["short"] / "export")])
        runs["warm"] = a.output
    if "posrobust" in arms:
        offset = args.position_offset_max
        if offset is None:
            offset = _target_positions(assets.target) - args.short_length
        a = arm_args(demo_flags, out / "posrobust", **short_flags)
        demo.stage_dump(a, assets, assets.conversations, store, console)  # the short arm's store: skipped
        demo.stage_train(a, assets, store, console, extra=["--position-offset-max", str(offset)])
        runs["posrobust"] = a.output
    for arm, run in runs.items():
        if not (run / "export" / "config.json").is_file():
            raise RuntimeError(f"arm {arm}: {run}/export was not written")
    return runs


def eval_one(assets, args, drafts_dir: Path, drafts: list[str], length: int, request: str, out: Path,
             console: Console, prompts: int, threads: int, extra: list[str] | tuple = (), log: Path | None = None,
             timeout: float | None = None) -> dict:
    """One ``python -m recipe.eval --context-lengths LENGTH --limit PROMPTS`` run in ``drafts_dir`` with every draft
    of ``drafts``, ``threads`` OpenMP threads and the further ``recipe.eval`` flags ``extra`` (``recipe.experiments
    demo-gpu``: ``--seed``, ``--on-mismatch record``), its output to ``log`` (default: this process's), killed
    after ``timeout`` seconds; skipped when ``out`` holds the result of the same command. Returns the JSON. Raises
    RuntimeError when it fails or times out; with ``--on-mismatch record`` its exit code 1 after writing the JSON
    (outputs that differed from greedy decoding, listed in each length's ``mismatches``) is a result."""
    cmd = [sys.executable, "-m", "recipe.eval", "--target", str(assets.target), "--prompts", str(assets.prompts),
           "--context-data", str(assets.conversations), "--context-lengths", str(length),
           "--context-request", request, "--limit", str(prompts), "--num-draft-tokens",
           ",".join(map(str, args.num_draft_tokens)), "--max-new-tokens", str(args.max_new_tokens), "--output",
           str(out)] + [x for d in drafts for x in ("--draft", d)] + list(extra)
    stamp = out.with_suffix(".command.json")
    if out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]:
        console.print(f"eval: {out} is up to date, skipped")
        return json.loads(out.read_text())
    console.print(f"[bold]$ (cd {drafts_dir}) {' '.join(cmd)}[/bold]")
    env = subprocess_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(demo.REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.unlink(missing_ok=True)
    try:
        with open(log, "w") if log else contextlib.nullcontext() as sink:
            rc = subprocess.call(cmd, env=env, cwd=drafts_dir, stdout=sink, stderr=sink, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"evaluation timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    recorded = rc == 1 and "record" in extra and out.is_file()
    if rc != 0 and not recorded:
        raise RuntimeError(f"evaluation failed: {' '.join(cmd)}")
    stamp.write_text(json.dumps(cmd[1:]) + "\n")
    return json.loads(out.read_text())


def _eval(assets, args, drafts_dir: Path, drafts: list[str], lengths: list[int], request: str, prefix: Path,
          console: Console) -> dict:
    """``recipe.eval`` per context length (``PREFIX-L{length}.json``: a prompt's prefill and greedy reference serve
    every draft of its length, so nothing is shared across lengths, and an interrupted experiment keeps the lengths
    it finished), merged into one ``recipe.eval --context-lengths`` JSON with every length's entry. With
    ``--eval-jobs J`` up to J lengths run at once (longest first), each with 1/J of the CPU threads."""
    jobs = max(1, min(args.eval_jobs, len(lengths)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    longest = max(lengths)

    def one(n: int) -> dict:
        if request != "about-context":
            prompts = args.contrast_prompts or args.prompts
        else:
            prompts = args.prompts_longest if n == longest and args.prompts_longest else args.prompts
        return eval_one(assets, args, drafts_dir, drafts, n, request, prefix.with_name(f"{prefix.name}-L{n}.json"),
                         console, prompts, threads)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(sorted(lengths, reverse=True), pool.map(one, sorted(lengths, reverse=True))))
    parts = [done[n] for n in lengths]
    return {**parts[0], "context_lengths": list(lengths), "lengths": [e for p in parts for e in p["lengths"]]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    demo_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    console = Console()
    unknown = [a for a in args.arms.split(",") if a and a not in ARMS]
    if unknown or "short" not in args.arms.split(","):
        console.print(f"[bold red]error[/bold red]: --arms {args.arms}: the short arm and names from {ARMS}")
        return 2
    from recipe.assets import prepare_assets

    assets = prepare_assets()
    if args.target is not None or args.data is not None:
        assets = dataclasses.replace(assets, **{k: v.resolve() for k, v in (("target", args.target),
                                                                            ("conversations", args.data)) if v})
    args.output = args.output.resolve()
    args.output.mkdir(parents=True, exist_ok=True)
    try:
        runs = train_arms(args, demo_flags, assets, console)
        if args.train_only:
            console.print("arms: " + ", ".join(f"{arm} {run}" for arm, run in runs.items()))
            return 0
        drafts_dir = args.output / "drafts"
        drafts_dir.mkdir(exist_ok=True)
        for arm, run in runs.items():
            link = drafts_dir / arm
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(run / "export", target_is_directory=True)
        labels = list(runs) + [f"short@{w}" for w in args.windows]
        about = _eval(assets, args, drafts_dir, labels, args.context_lengths, "about-context",
                      args.output / "eval_about_context", console)
        contrast = (_eval(assets, args, drafts_dir, ["short"], args.contrast_lengths, "unrelated",
                          args.output / "eval_unrelated", console) if not args.no_contrast else None)
    except RuntimeError as exc:
        console.print(f"[bold red]long-context experiment failed[/bold red]: {exc}")
        return 1
    result = report(args, {arm: arm_summary(run) for arm, run in runs.items()}, about, contrast)
    console.print(report_table(result))
    paired = paired_table(result)
    if paired is not None:
        console.print(paired)
    if args.json is not None:
        write_json(args.json, result)
        from recipe.experiments.long_context_report import plot_report

        plot = plot_report(result, args.json.with_suffix(".png"))
        console.print(f"report written to {args.json}" + (f", plot {plot}" if plot else " (no matplotlib: no plot)"))
    return 0
