"""The demo at GPU scale: ``make demo`` on a machine whose torch sees CUDA (or with ``DEMO_SCALE=gpu``).

    python -m recipe.experiments demo-gpu [--output runs/demo_gpu] [--target DIR] [--data FILE] [--prompts FILE]
        [--budget S] [--json FILE] [--num-proc N] [--seed S] [--tiny] [--dry-run]

The CPU demo's real target and data (SmolLM2-135M-Instruct, which serves 8192 positions; all 17,671 shipped ShareGPT
conversations; MT-Bench) with the EAGLE-3 settings (K = 7 TTT steps, a draft vocabulary of 32000 or the target's if
smaller, bf16 ZeRO-1 with the memory switches of ``ds_configs/zero1_bf16.json``, attention ``auto``: flex on CUDA),
in stages planned into ``--budget`` seconds (``recipe.experiments.demo_gpu_plan``; ``--dry-run`` prints the plan):

1. ``assets``: ``recipe.assets`` (``--target``, ``--data``, ``--prompts`` replace its paths).
2. ``short``: ``run.py`` online on every conversation cut at 2048 tokens, the planned steps (one process on the
   GPU; a run still going at its deadline is stopped, saves a checkpoint, and the export is made from it).
3. ``warm``: ``run.py --init-draft short/export`` on the first conversations chained into samples of up to 8192
   tokens (``--chain-conversations``), a quarter of the short run's peak lr, anchor-offset positions off (the
   continuation docs/recipes.md recommends); its steps fill the time left, at the short run's measured pace.
4. ``eval``: ``recipe.eval`` processes side by side on the device (``recipe.experiments.long_context.eval_one``), both
   drafts in each, every output checked against greedy decoding (``--on-mismatch record``: a near-tie that rounds
   apart is recorded, not fatal): MT-Bench (the unrelated request at context 0: chain at k = 5 and 3, dynamic
   tree), requests about an inserted earlier ShareGPT conversation at 256, 2k, 4k and 7k tokens and the unrelated
   contrast at 7k (64 prompts each, chain at k = 5), the chunks of one (request, length) merged
   (``recipe.eval.length_report.merge_entries``); short and warm paired on the same prompts.
5. ``report``: ``OUTPUT/demo_gpu.json`` (also ``--json``; rewritten after every stage), the tables, the plot of τ by
   context length with the paired differences (``.png`` beside the JSON) and the training curves of both arms
   (``_curves.png``) (``recipe.experiments.demo_gpu_report``).

Every stage prints its seconds against its estimate and deadline. A rerun skips an arm whose export exists (one
without is trained afresh) and an eval chunk whose command is unchanged. Without a CUDA device it refuses to start
(exit 2), but ``--tiny`` runs the same stages at toy sizes (fixed steps) on the CPU: the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console

from recipe import demo
from recipe.eval.length_report import merge_entries
from recipe.experiments import long_context as lc
from recipe.experiments.demo_gpu_plan import GPU, SMOLLM2, TINY, EvalJob, Scale, plan, plan_lines
from recipe.experiments.demo_gpu_report import build_result, print_tables, write_outputs
from recipe.export import LATEST, export_tensors, read_draft, write_export
from recipe.plot import METRICS_FILE, read_metrics
from recipe.processes import subprocess_env

RESULT = "demo_gpu.json"
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DRAFTS = ("short", "warm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.experiments demo-gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=demo.REPO / "runs" / "demo_gpu", help="run folder")
    p.add_argument("--target", type=Path, help="target folder (default: recipe.assets' SmolLM2-135M-Instruct)")
    p.add_argument("--data", type=Path, help="conversations (default: recipe.assets' ShareGPT JSONL)")
    p.add_argument("--prompts", type=Path, help="MT-Bench questions JSONL (default: recipe.assets')")
    p.add_argument("--budget", type=float, help="seconds the stages are planned into (default 540; --tiny 600)")
    p.add_argument("--json", type=Path, help="also write the result JSON here (plots beside it)")
    p.add_argument("--num-proc", type=int, default=max(1, os.cpu_count() or 1),
                   help="tokenisation processes of the training runs (run.py --num-proc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the same stages at toy sizes on the CPU (tests)")
    p.add_argument("--dry-run", action="store_true", help="print the stage plan (estimates, deadlines) and exit")
    return p


def target_config(target: Path | None) -> dict:
    """The target's ``config.json`` as a dict (``SMOLLM2``'s geometry when there is no target folder yet)."""
    path = Path(target or "") / "config.json"
    return json.loads(path.read_text()) if target and path.is_file() else dict(SMOLLM2)


def run_env(threads: int, cuda: bool) -> dict:
    """A one-process run's environment: ``subprocess_env`` without a launcher's rank variables (``run.py`` then
    makes its own one-rank group), DeepSpeed's CPU accelerator off CUDA, wide rich output in a pipe."""
    env = subprocess_env(threads)
    for name in LAUNCHER_VARS:
        env.pop(name, None)
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"
    env["COLUMNS"] = "160"
    return env


def run_until(cmd: list[str], env: dict, deadline: float, grace: float, log: Path | None = None) -> tuple[int, bool]:
    """Run ``cmd`` (in the repository) until it exits or ``time.monotonic()`` reaches ``deadline``; then SIGTERM (a
    ``run.py`` saves a checkpoint and exits 75) and, ``grace`` seconds later, SIGKILL. Output to ``log`` (default:
    this process's). Returns ``(exit code, stopped at the deadline)``."""
    sink = open(log, "w") if log else None
    with sink or contextlib.nullcontext():
        proc = subprocess.Popen(cmd, cwd=demo.REPO, env=env, stdout=sink, stderr=sink)
        try:
            return proc.wait(timeout=max(0.0, deadline - time.monotonic())), False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=grace), True
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait(), True


def export_checkpoint(run: Path) -> bool:
    """``run/export`` from ``run/checkpoints`` (its ``latest``); False when there is no checkpoint."""
    if not (run / "checkpoints" / LATEST).is_file():
        return False
    state, config = read_draft(run / "checkpoints")
    write_export(export_tensors(state), config, run / "export")
    return True


def spread_prompts(src: Path, out: Path) -> Path:
    """``src``'s prompts reordered round-robin over their categories (MT-Bench lists its 80 questions category by
    category), so that the first N of ``out`` cover every category evenly."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    by: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by[str(row.get("category"))].append(row)
    spread = [queue[i] for i in range(max(map(len, by.values()))) for queue in by.values() if i < len(queue)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in spread))
    return out


class Demo:
    """One run: the plan, the stages in order, the report (``OUTPUT/demo_gpu.json`` after every stage)."""

    def __init__(self, args, scale: Scale, console: Console):
        self.args, self.scale, self.console = args, scale, console
        self.out = args.output.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.cuda = demo._cuda_count() > 0
        self.plan = plan(scale, args.budget, with_assets=not (args.target and args.data and args.prompts),
                         target=target_config(args.target))
        self.steps = dict(self.plan["steps"])
        self.assets = None
        self.report = {"scale": scale.name, "scale_settings": asdict(scale), "device": self._device(),
                       "plan": {"budget_s": self.plan["budget_s"], "steps": self.plan["steps"],
                                "step_seconds": self.plan["step_seconds"], "estimates_s": self.plan["estimates_s"],
                                "stages": {k: {"estimate_s": v["seconds"], "deadline_s": v["deadline"]}
                                           for k, v in self.plan["stages"].items()}},
                       "stages": {}, "arms": {}}

    def _device(self) -> str:
        return torch.cuda.get_device_name(0) if self.cuda else "cpu"

    def left(self, stage: str) -> float:
        return self.start + self.plan["stages"][stage]["deadline"] - time.monotonic()

    def done(self, stage: str, t0: float, **fields) -> None:
        seconds = time.monotonic() - t0
        p = self.plan["stages"][stage]
        self.report["stages"][stage] = {"seconds": round(seconds, 1), "estimate_s": round(p["seconds"], 1),
                                        "deadline_s": round(p["deadline"], 1),
                                        "at_s": round(time.monotonic() - self.start, 1), **fields}
        self.console.print(f"[bold]stage {stage}[/bold]: {seconds:.0f} s (estimate {p['seconds']:.0f} s, deadline "
                           f"{p['deadline']:.0f} s, at {time.monotonic() - self.start:.0f} s)"
                           + "".join(f"; {k} {v}" for k, v in fields.items() if not isinstance(v, (dict, list))))
        self.save()

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        (self.out / RESULT).write_text(json.dumps(self.report, indent=1) + "\n")

    def stage_assets(self) -> None:
        t0 = time.monotonic()
        given = {"target": self.args.target, "conversations": self.args.data, "prompts": self.args.prompts}
        if all(given.values()):
            self.assets = SimpleNamespace(**{k: Path(v).resolve() for k, v in given.items()})
        else:
            from recipe.assets import prepare_assets  # import cost: the assets' build on a fresh cache

            a = prepare_assets()
            self.assets = SimpleNamespace(**{k: Path(v or getattr(a, k)).resolve() for k, v in given.items()})
        self.done("assets", t0, **{k: str(v) for k, v in vars(self.assets).items()})

    def train_arm(self, arm: str, steps: int, length: int, batch: int, micro: int, lr: float,
                  data_args: list[str], extra: list[str]) -> dict:
        """One arm's ``run.py`` (``demo.train_argv``) until its deadline, then its export (from the checkpoint of a
        run stopped at the deadline). Returns the stage's fields."""
        run = self.out / arm
        if (run / "export" / "config.json").is_file():
            self.console.print(f"{arm}: {run / 'export'} exists, skipped (delete it to retrain)")
            return {"skipped": True}
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # no resume: this run's steps are planned afresh
        run.mkdir(parents=True, exist_ok=True)
        base = json.loads((demo.REPO / "ds_configs" / "zero1_bf16.json").read_text())
        base["train_micro_batch_size_per_gpu"] = micro
        (run / "ds_base.json").write_text(json.dumps(base, indent=2) + "\n")
        s = self.scale
        flags = ["--ds-config", str(run / "ds_base.json"), "--ttt-steps", str(s.ttt_steps), "--draft-vocab-size",
                 str(min(s.draft_vocab, int(target_config(self.assets.target)["vocab_size"]))), "--lr", str(lr),
                 "--batch-size", str(batch), "--max-length", str(length), "--epochs", "1", "--max-steps",
                 str(steps), "--save-every", "0", "--seed", str(self.args.seed), "--ranks", "1"]
        argv = demo.train_argv(lc.arm_args(flags, run), self.assets, None, data_args,
                               extra + ["--num-proc", str(self.args.num_proc), "--save-every-minutes", "0",
                                        "--keep-checkpoints", "1", "--log-every", "10"])
        est = self.plan["estimates_s"]
        rc, stopped = run_until([sys.executable, *argv], run_env(1 if self.cuda else 2, self.cuda),
                                self.start + self.plan["stages"][arm]["deadline"] - est["stop"], est["stop"])
        exported = (run / "export" / "config.json").is_file() or (stopped and export_checkpoint(run))
        if not exported:
            raise RuntimeError(f"{arm}: run.py exited with {rc} and left no export (see the output above)")
        return {"rc": rc, "stopped_at_deadline": stopped, "planned_steps": steps}

    def stage_train(self, arm: str) -> None:
        t0, s = time.monotonic(), self.scale
        data = ["--data", str(self.assets.conversations)]
        if arm == "short":
            fields = self.train_arm("short", self.steps["short"], s.short_length, s.short_batch, s.short_micro,
                                    s.short_lr, data + (["--limit", str(s.conversations)] if s.conversations else []),
                                    [])
        else:
            self.steps["warm"] = self.warm_steps()
            fields = self.train_arm("warm", self.steps["warm"], s.warm_length, s.warm_batch, s.warm_micro, s.warm_lr,
                                    data + ["--limit", str(s.warm_conversations), "--chain-conversations",
                                            str(s.warm_length)],
                                    ["--init-draft", str(self.out / "short" / "export")])
        self.report["arms"][arm] = {"run": str(self.out / arm), **fields}
        self.done(arm, t0, **fields)

    def warm_steps(self) -> int:
        """The warm arm's steps: fixed at the tiny scale; else what fits before its deadline at the short arm's
        measured seconds per step over its estimate (the ratio clamped to [0.3, 3])."""
        if self.scale.warm_steps:
            return self.scale.warm_steps
        per_step, ratio = self.plan["step_seconds"], 1.0
        metrics = self.out / "short" / METRICS_FILE
        if metrics.is_file():
            times = [r["time_s"] for r in read_metrics(metrics)[1:] if r.get("time_s")]
            if times:
                ratio = min(3.0, max(0.3, sum(times) / len(times) / per_step["short"]))
        fixed = sum(v for k, v in self.plan["stages"]["warm"]["terms"].items() if k != "steps")
        return max(5, int((self.left("warm") - fixed) / (per_step["warm"] * ratio)))

    def stage_eval(self) -> dict:
        t0 = time.monotonic()
        drafts = self.out / "drafts"
        drafts.mkdir(exist_ok=True)
        for arm in DRAFTS:
            link = drafts / arm
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(self.out / arm / "export", target_is_directory=True)
        spread = spread_prompts(self.assets.prompts, self.out / "eval" / "mtbench_spread.jsonl")
        jobs = self.plan["jobs"]
        with ThreadPoolExecutor(max_workers=self.scale.eval_jobs) as pool:
            results = list(pool.map(lambda j: self.eval_job(j, spread, drafts), jobs))
        evals, failed = merge_jobs(results)
        self.done("eval", t0, jobs={j.name: r for j, (_, r) in zip(jobs, results)}, failed=failed)
        return evals

    def eval_job(self, job: EvalJob, spread: Path, drafts: Path) -> tuple[dict | None, dict]:
        """One chunk: ``lc.eval_one`` on its slice of the spread prompts; (its JSON or None, its record)."""
        folder = self.out / "eval"
        lines = spread.read_text().splitlines()[job.start:job.start + job.count]
        prompts = folder / f"prompts-{job.start}-{job.count}.jsonl"
        prompts.write_text("".join(line + "\n" for line in lines))
        extra = ["--seed", str(self.args.seed + job.seed), "--on-mismatch", "record"]
        extra += [] if job.tree else ["--tree-depth", "0"]
        threads = max(1, (os.cpu_count() or 1) // self.scale.eval_jobs)
        args = SimpleNamespace(num_draft_tokens=list(job.ks), max_new_tokens=self.scale.max_new_tokens)
        t0 = time.monotonic()
        try:
            result = lc.eval_one(replace_assets(self.assets, prompts), args, drafts, list(DRAFTS), job.length,
                                 job.request, folder / f"{job.name}.json", Console(quiet=True), job.count, threads,
                                 extra, log=folder / f"{job.name}.log", timeout=max(1.0, self.left("eval")))
            error = None
        except RuntimeError as exc:
            result, error = None, str(exc)[:500]
        record = {"seconds": round(time.monotonic() - t0, 1), "prompts": job.count, "error": error}
        self.console.print(f"eval {job.name}: {'failed: ' + error if error else 'done'} in {record['seconds']} s")
        return result, record

    def run(self) -> int:
        self.console.print("\n".join(plan_lines(self.plan, self.scale)))
        try:
            self.stage_assets()
            self.stage_train("short")
            self.stage_train("warm")
            evals = self.stage_eval()
        except RuntimeError as exc:
            self.console.print(f"[bold red]demo-gpu failed[/bold red]: {exc}")
            self.save()
            return 1
        t0 = time.monotonic()
        result = build_result(self.report, evals, settings={**vars(self.args), "scale": self.scale.name})
        self.report = result
        self.done("report", t0)
        written = write_outputs(result, self.out / RESULT, self.args.json)
        print_tables(result, self.console)
        self.console.print("written: " + ", ".join(str(p) for p in written))
        return 0 if not result["mismatches"] and not self.report["stages"]["eval"]["failed"] else 1


def replace_assets(assets, prompts: Path):
    return SimpleNamespace(**{**vars(assets), "prompts": prompts})


def merge_jobs(results: list[tuple[dict | None, dict]]) -> tuple[dict, list[str]]:
    """The chunks' ``recipe.eval`` JSONs merged per (request, length): ``{"about_context": <JSON with every length's
    entry>, "unrelated": ...}`` (None for a request with no finished chunk), and the failed chunks' errors."""
    by: dict[str, dict[int, list[dict]]] = {"about-context": defaultdict(list), "unrelated": defaultdict(list)}
    failed = []
    for result, record in results:
        if result is None:
            failed.append(record["error"])
            continue
        for entry in result["lengths"]:
            by[result["context_request"]][entry["context_length"]].append(entry)
    out = {}
    for request, key in (("about-context", "about_context"), ("unrelated", "unrelated")):
        lengths = sorted(by[request])
        first = next((r for r, _ in results if r and r["context_request"] == request), None)
        out[key] = None if not lengths else {**{k: v for k, v in first.items() if k != "lengths"},
                                             "context_lengths": lengths,
                                             "lengths": [merge_entries(by[request][n]) for n in lengths]}
    return out, failed


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = TINY if args.tiny else GPU
    if args.dry_run:
        p = plan(scale, args.budget, with_assets=not (args.target and args.data and args.prompts),
                 target=target_config(args.target))
        print("\n".join(plan_lines(p, scale)))
        return 0 if p["fits"] else 1
    if not args.tiny and not demo._cuda_count():
        print("error: no CUDA device: the GPU-sized demo needs one (DEMO_SCALE=cpu make demo runs the CPU demo; "
              "--tiny runs these stages at toy sizes on the CPU)", file=sys.stderr)
        return 2
    return Demo(args, scale, Console()).run()
