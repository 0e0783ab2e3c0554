"""The one-GPU recipe as the README writes it, on one lent GPU in ONE device call: ``run.py`` itself (DeepSpeed
engine, ZeRO-1 and ZeRO-3 bf16, NCCL, the online target forward, the optimizer, checkpoints, ``--resume``) with an
8B-shaped target at 8k, 32k and 128k tokens and at the longest length the planner says fits this GPU, then
``recipe.eval`` of that target at long context. Every row is measured against the planner's prediction of exactly
that run.

    python scripts/gpu_online_check.py --prepare .gpu_assets   # here: the carried assets (gpu_check's + chat data)
    python scripts/gpu_online_check.py --plan-rows             # here: the planner's predictions, H100 and H200
    python scripts/gpu_online_check.py --dry-run [--gpu h100]  # the stages, estimates and deadlines (<= 540 s)
    python scripts/gpu_online_check.py --assets .gpu_assets    # on the device (docs/results/gpu/README.md)
    python scripts/gpu_online_check.py --collect FILES_AT      # here: docs/results/gpu/gpu_online_check_<date>.json

Stages, in order (``--rows`` picks a subset of the rows, e.g. ``--rows longest_zero1_mlp`` for a second call):

0. ``imports``: ``scripts/gpu_check_parts.import_stage`` (every carried wheel and project module; CUDA).
1. ``target``: ``python -m recipe.target.random_target --arch Llama-3.1-8B-Instruct`` (random bf16 weights drawn on
   the GPU, 15 GiB of sharded safetensors, the carried SmolLM2 tokenizer); reused when ``--work`` holds one.
2. the ``run.py`` rows of ``scripts/gpu_online_rows.ROWS`` (8k ZeRO-1 with a checkpoint at step 2; its ZeRO-3
   resume from that checkpoint, step 3 compared with the straight run's; 32k ZeRO-1, the README's one-GPU command;
   128k ZeRO-1 with the MLP tiled), each a child process running ``run.main`` and recording the allocator's peaks.
3. ``eval``: ``python -m recipe.eval --context-lengths 8k,32k,127k`` of the target (bf16: fp32 weights and KV cache
   of an 8B target at 127k would not fit an 80 GB GPU, and its prefill would take minutes) with the resume row's
   export (a random draft of the same geometry when there is none), ``--on-mismatch record``: peak memory and
   seconds per verification step per length. 127k, not 128k: the target serves 131072 positions, and 128k of
   context plus the request and the new tokens would pass them.
4. ``longest_zero1_mlp``: the 128k row's layout at the planner's longest fit for this GPU (H100 or H200, from
   ``--plan-rows``), last because it is the likeliest not to fit the call's time.

Schedule: each stage has an estimate (``ESTIMATES_S``; ``--dry-run`` prints the terms) and a deadline, the sum of
the estimates up to it, at most ``BUDGET_S`` = 540 s after the start. A stage starts only when its predicted
seconds fit before its deadline (time an earlier stage did not use passes on; the rows' predictions are scaled by
the last row's measured / estimated seconds); otherwise it is recorded "skipped" with the prediction and the time
left, so no stage is killed mid-write (the child's timeout at the deadline is only a guard). ``OUT/
gpu_online_check.json`` is rewritten after every stage. A finished row's checkpoints are deleted (the disk is 64
GiB: the target takes 15, a checkpoint of the 8B-shaped draft about 13).

What one GPU cannot prove: multi-rank NCCL paths (tp, cp, ZeRO partitioning over ranks), see scripts/gpu_check.py.
``--smoke`` runs every stage on the CPU at tiny sizes (gloo, a scaled-down target; the tests).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_e2e import e2e_env, prepare_carry, random_export, run_stage, skipped  # noqa: E402
from scripts.gpu_check_parts import import_stage, local_action, output_folder  # noqa: E402
from scripts.gpu_online_rows import (ROW, ROWS, Row, eval_length_record, fitting, gpu_key,  # noqa: E402
                                     read_metrics, resume_continuity, row_argv, row_ds_config, row_estimate,
                                     row_length, row_record, run_row_child, target_forward_flops)

BUDGET_S = 540
ESTIMATES_S = dict(
    start=15,            # a fresh python3 with torch and the recipe (the import stage: 14.8-16.9 s on the H200)
    cuda=5,              # the import stage's CUDA probe
    target_init=10,      # 8.0 B bf16 parameters drawn on the GPU by transformers' initialisation
    target_write=25,     # 15 GiB of safetensors shards written
    run_start=20,        # run.py: imports, NCCL process group, deepspeed.initialize
    target_load=15,      # 15 GiB of safetensors (page cache) onto the GPU
    data=10, data_cached=4,           # chaining and tokenising the conversations; later rows hit the cache
    compile=30, compile_cached=10,    # flex forward + backward compiles (first 4k step on the H200: 10.3 s)
    save=20,             # a checkpoint of the 8B-shaped draft: ~13 GB of files and their sha256 manifest
    resume_load=15,      # manifest check, DeepSpeed's files and the layout change (recipe.lifecycle.reshard)
    export=5,
    draft_step_linear=1.92, draft_step_quadratic=0.89,  # draft step s at x = L / 32k: a·x + b·x² (H200 table)
    mlp_tile_factor=1.15,  # the MLP tiles' recompute
    target_tflops=400,   # the target's bf16 forward (transformers, SDPA), effective
    eval_load=15, eval_compile=30, eval_context=10, eval_decode=5,  # per length: 16 tokens, greedy and k = 3
)
"""Estimated seconds on one H100/H200 (public orders of magnitude and the H200 calls of scripts/gpu_check.py; this
script has not run on a GPU yet: its JSON records every stage's seconds against these)."""
SMOKE_CAP_FACTOR = 4
PLAN_FILE = ROOT / "docs" / "results" / "gpu" / "plan_gpu_online_check.json"
LONG_FILE = "long_conversations.jsonl"
LONG_CHARS = 6_000_000   # carried chat text: about 1.5 M tokens, five chains of the H200's longest fit
SMOKE_CHARS = 150_000    # --smoke: enough for a few chains at its lengths
LONG_CONV_CHARS = 16_000  # a carried conversation's text: at most ~6k tokens, below CHAIN_SLACK
EVAL_LENGTHS = {False: "8k,32k,127k", True: "128,256"}
ARCH = "Llama-3.1-8B-Instruct"
SMOKE_TARGET = ["--layers", "8", "--set", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                "num_key_value_heads=2", "head_dim=16", "vocab_size=49152"]  # SmolLM2's ids: valid positions


def eval_estimate(smoke: bool) -> dict[str, float]:
    est = ESTIMATES_S
    lengths = (128, 256) if smoke else (8192, 32768, 130048)
    prefill = sum(target_forward_flops(n) for n in lengths) / (est["target_tflops"] * 1e12)
    return {"start": est["start"], "eval_load": est["eval_load"], "eval_compile": est["eval_compile"],
            "eval_context": est["eval_context"], "prefill": prefill, "decode": len(lengths) * est["eval_decode"]}


def stage_estimates(rows: list[Row], smoke: bool, longest: int | None,
                    with_eval: bool = True) -> dict[str, dict[str, float]]:
    """Stage -> its estimate's terms (seconds), in running order: imports, target, the rows before the longest,
    eval (``with_eval``), then the longest row (``longest``: its length, None when unknown: estimated at the
    budget)."""
    est = ESTIMATES_S
    out = {"imports": {"start": est["start"], "cuda": est["cuda"]},
           "target": {"start": est["start"], "target_init": est["target_init"], "target_write": est["target_write"]}}
    first = True
    for row in [r for r in rows if r.length != "longest"]:
        out[row.name] = row_estimate(row, row_length(row, smoke, longest), first, est)
        first = False
    if with_eval:
        out["eval"] = eval_estimate(smoke)
    for row in [r for r in rows if r.length == "longest"]:
        length = row_length(row, smoke, longest)
        out[row.name] = row_estimate(row, length, first, est) if length else {"unknown length": BUDGET_S}
    return out


def deadlines(estimates: dict[str, dict[str, float]], smoke: bool) -> dict[str, float]:
    """Stage -> seconds after the start by which it must end: the sum of the estimates up to it, at most the
    budget (``--smoke``: both × SMOKE_CAP_FACTOR)."""
    f = SMOKE_CAP_FACTOR if smoke else 1
    total, out = 0.0, {}
    for name, parts in estimates.items():
        total += sum(parts.values()) * f
        out[name] = min(total, BUDGET_S * f)
    return out


def dry_run(rows: list[Row], gpu: str, smoke: bool) -> None:
    plans = json.loads(PLAN_FILE.read_text()) if PLAN_FILE.is_file() else {}
    longest = plans.get("gpus", {}).get(gpu, {}).get("longest")
    left_out = [r.name for r in rows if r not in fitting(rows, plans, gpu)]
    estimates = stage_estimates(fitting(rows, plans, gpu), smoke, longest)
    ends = deadlines(estimates, smoke)
    print(f"schedule on {gpu} (longest fit {longest} tokens, {PLAN_FILE.name}); budget {BUDGET_S} s")
    before = 0.0
    for name, parts in estimates.items():
        est = sum(parts.values())
        note = "" if ends[name] - before >= est - 0.5 else "  (runs only on time banked by earlier stages)"
        made = " + ".join(f"{k} {v:.0f}" for k, v in parts.items())
        print(f"{name:<20} est {est:>5.0f} s  deadline {ends[name]:>5.0f} s  [{made}]{note}")
        before = ends[name]
    print(f"{'total':<20} est {sum(sum(p.values()) for p in estimates.values()):>5.0f} s  "
          f"deadline {max(ends.values()):>5.0f} s (budget {BUDGET_S} s)")
    if left_out:
        print(f"not scheduled (the planner says they do not fit {gpu}): {', '.join(left_out)}")


def prepare(out: Path, chars: int = LONG_CHARS) -> Path:
    """gpu_check's carried assets (``prepare_carry``) plus ``LONG_FILE``: ShareGPT conversations of at most
    ``LONG_CONV_CHARS`` characters, ``chars`` in all, for the chained samples and the eval's context."""
    from recipe.assets import prepare_assets

    prepare_carry(out, 40, 2)
    total = 0
    with open(prepare_assets().conversations) as src, open(out / LONG_FILE, "w") as dst:
        for line in src:
            turns = json.loads(line).get("conversations") or []
            size = sum(len(t.get("value") or "") for t in turns)
            if len(turns) >= 2 and size <= LONG_CONV_CHARS:
                dst.write(line)
                total += size
            if total >= chars:
                break
    return out


def write_plan_rows() -> Path:
    """``PLAN_FILE``: for an H100 and an H200, the planner's prediction of every row (its DeepSpeed JSON at world
    size 1, the shipped Llama-3.1-8B-Instruct config, K = 7, Vd = 32000) and the longest fit of the longest row's
    layout."""
    from recipe.plan import load_inputs, longest_fit, plan_length

    out = {"command": "python scripts/gpu_online_check.py --plan-rows", "date": date.today().isoformat(),
           "target": ARCH, "gpus": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for gpu in ("h100", "h200"):
            inputs = {}
            for row in ROWS:
                path = Path(tmp) / f"{row.name}.json"
                path.write_text(json.dumps(row_ds_config(row, False)))
                inputs[row.name] = load_inputs(path, ARCH, gpu, world_size=1)
            longest = longest_fit(inputs["longest_zero1_mlp"])
            rows = {r.name: plan_length(inputs[r.name], row_length(r, False, longest)) for r in ROWS}
            out["gpus"][gpu] = {"longest": longest, "rows": rows}
    PLAN_FILE.write_text(json.dumps(out, indent=1) + "\n")
    return PLAN_FILE


# ---- the call ----------------------------------------------------------------------------------------------------
class Check:
    """One call's state: the schedule, the report (rewritten to ``out/gpu_online_check.json`` by :meth:`save`) and
    the row calibration (the last row's measured / estimated seconds, within [0.5, 3])."""

    def __init__(self, args, rows: list[Row], out: Path, work: Path, log):
        self.args, self.rows, self.out, self.work, self.log = args, rows, out, work, log
        self.smoke, self.start, self.scale = args.smoke, time.monotonic(), 1.0
        self.env = e2e_env(self.smoke)
        self.plans = json.loads(PLAN_FILE.read_text()) if PLAN_FILE.is_file() and not self.smoke else {}
        self.report = {"info": {"date": date.today().isoformat(), "budget_s": BUDGET_S, "estimates_s": ESTIMATES_S,
                                "rows": [r.name for r in rows], "smoke": self.smoke,
                                "plan_file": self.plans.get("date")}, "stages": []}

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        (self.out / "gpu_online_check.json").write_text(json.dumps(self.report, indent=1))

    def schedule(self, longest: int | None) -> dict[str, float]:
        rows = fitting(self.rows, self.plans, self.report["info"].get("gpu"))
        return deadlines(stage_estimates(rows, self.smoke, longest, "eval" in self.args.stages), self.smoke)

    def allowed(self, name: str, longest: int | None) -> float:
        return self.schedule(longest)[name] - (time.monotonic() - self.start)

    def stage(self, name: str, cmd: list[str], predicted: float, longest: int | None = None) -> dict:
        """Run ``cmd`` as stage ``name`` when ``predicted`` seconds fit before its deadline, else record it skipped."""
        allowed = self.allowed(name, longest)
        if predicted > allowed:
            record = skipped(name, f"predicted {predicted:.0f} s > {allowed:.0f} s left before its deadline; "
                                   "not started")
        else:
            record = run_stage(name, cmd, self.env, max(1.0, allowed), round(predicted), self.log)
        record["predicted_s"] = round(predicted, 1)
        self.report["stages"].append(record)
        self.save()
        return record

    def child(self, kind: str, *extra: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--out", str(self.out), "--work",
                str(self.work), "--wheels", str(self.args.wheels), *extra] + (["--smoke"] if self.smoke else [])


def run_rows(check: Check, data: Path, longest_pass: bool) -> None:
    """The run.py rows: all but the longest, or (``longest_pass``) only it, at the planned longest fit of the GPU
    the import stage found."""
    longest = check.plans.get("gpus", {}).get(check.report["info"].get("gpu") or "", {}).get("longest")
    for row in check.rows:
        if (row.length == "longest") != longest_pass:
            continue
        length = row_length(row, check.smoke, longest)
        if length is None:
            check.report["stages"].append(skipped(row.name, "no planned longest fit for this GPU "
                                                             f"({check.report['info'].get('device')})"))
            continue
        if row.resume and not (check.work / row.resume / "checkpoints").is_dir():
            check.report["stages"].append(skipped(row.name, f"no checkpoint of {row.resume} to resume"))
            continue
        plan = check.plans.get("gpus", {}).get(check.report["info"].get("gpu") or "", {}).get("rows", {})
        if plan.get(row.name) and not plan[row.name]["fits"]:
            check.report["stages"].append({**skipped(row.name, f"the planner's {plan[row.name]['total'] / 2 ** 30:.1f}"
                                                              " GiB a rank does not fit this GPU"),
                                           "plan": plan[row.name]})
            continue
        parts = stage_estimates(check.rows, check.smoke, longest)[row.name]
        predicted = sum(parts.values()) * check.scale * (SMOKE_CAP_FACTOR if check.smoke else 1)
        argv = row_argv(row, length, check.work, data, check.smoke)
        raw_file = check.out / "rows" / f"{row.name}.json"
        record = check.stage(row.name, check.child("row", "--row", row.name, "--argv", json.dumps(argv)),
                             predicted, longest)
        if record["rc"] == "skipped":
            continue
        raw = json.loads(raw_file.read_text()) if raw_file.is_file() else {}
        record.update(row_record(row, length, raw, check.work / row.name, check.work / "target", plan.get(row.name)))
        if record.get("seconds") and not check.smoke:
            check.scale = min(3.0, max(0.5, record["seconds"] / sum(parts.values())))
        if row.resume:
            record["resume"] = resume_continuity(read_metrics(check.work / row.resume),
                                                 read_metrics(check.work / row.name))
        needed = any(r.resume == row.name for r in check.rows)  # a later row resumes from it: kept until then
        for done in [n for n in (row.resume, None if needed else row.name) if n]:
            shutil.rmtree(check.work / done / "checkpoints", ignore_errors=True)  # 13 GB each on a 64 GiB disk
        check.save()


def run_eval(check: Check, assets: Path) -> None:
    target, work = check.work / "target", check.work
    export = work / "8k_zero3_resume" / "export"
    source = "8k_zero3_resume"
    if not (export / "model.safetensors").is_file() and (target / "config.json").is_file():
        export, source = random_export(target, work / "random_export", 16384 if check.smoke else 32000), "random"
    cmd = [sys.executable, "-m", "recipe.eval", "--target", str(target), "--draft", str(export), "--prompts",
           str(assets / "prompts.jsonl"), "--limit", "1", "--context-lengths", EVAL_LENGTHS[check.smoke],
           "--context-data", str(assets / LONG_FILE), "--num-draft-tokens", "3", "--tree-depth", "0",
           "--max-new-tokens", "4" if check.smoke else "16", "--dtype", "bf16", "--on-mismatch", "record",
           "--device", "cpu" if check.smoke else "cuda", "--output", str(work / "eval.json")]
    predicted = sum(eval_estimate(check.smoke).values()) * (SMOKE_CAP_FACTOR if check.smoke else 1)
    record = check.stage("eval", cmd, predicted)
    record["draft_source"] = source
    if (work / "eval.json").is_file():
        result = json.loads((work / "eval.json").read_text())
        record["target_dtype"] = result.get("target_dtype")
        record["lengths"] = [eval_length_record(e) for e in result["lengths"]]
        check.save()


def run_check(args, rows: list[Row], out: Path, work: Path) -> dict:
    with open(out / "gpu_online_check.log", "w") as log:
        check = Check(args, rows, out, work, log)
        assets = args.assets or prepare(work / "assets", SMOKE_CHARS if args.smoke else LONG_CHARS)
        source = assets / "provenance.json"
        check.report["info"]["source"] = json.loads(source.read_text()) if source.is_file() else None
        record = check.stage("imports", check.child("imports"), sum(stage_estimates(rows, args.smoke, None)
                                                                  ["imports"].values()))
        imports = json.loads((out / "imports.json").read_text()) if (out / "imports.json").is_file() else {}
        device = imports.get("cuda", {}).get("device")
        check.report["info"].update(device=device or ("cpu (smoke)" if args.smoke else None), gpu=gpu_key(device))
        if imports.get("failed") or record["rc"] != 0:
            check.report["stages"].append(skipped("target", "the import stage failed"))
            check.save()
            return check.report
        target = work / "target"
        build = [sys.executable, "-m", "recipe.target.random_target", "--arch", ARCH, "--out", str(target),
                 "--tokenizer", str(assets / "target_source"), "--dtype", "bf16",
                 "--device", "cpu" if args.smoke else "cuda"] + (SMOKE_TARGET if args.smoke else [])
        if (target / "config.json").is_file():
            check.report["stages"].append({"stage": "target", "rc": 0, "detail": f"reused {target}"})
        else:
            check.stage("target", build, sum(stage_estimates(rows, args.smoke, None)["target"].values()))
        if not (target / "config.json").is_file():
            check.save()
            return check.report
        data = assets / LONG_FILE
        run_rows(check, data, longest_pass=False)
        if "eval" in args.stages:
            run_eval(check, assets)
        run_rows(check, data, longest_pass=True)
        check.save()
    return check.report


# ---- entry --------------------------------------------------------------------------------------------------------
def collect(src: Path) -> Path:
    """Copy ``src/gpu_online_check.json`` to ``docs/results/gpu/gpu_online_check_<date>.json``."""
    report = json.loads((src / "gpu_online_check.json").read_text())
    dest = ROOT / "docs" / "results" / "gpu" / f"gpu_online_check_{report['info'].get('date')}.json"
    dest.write_text(json.dumps(report, indent=1) + "\n")
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_online_check_out)")
    p.add_argument("--work", type=Path, help="folder for the target and the runs (default: a temporary one; a "
                   "folder that holds a target from an earlier call reuses it)")
    p.add_argument("--assets", type=Path, help="a folder written by --prepare (default: prepared from recipe.assets)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default .whl)")
    p.add_argument("--rows", default=",".join([r.name for r in ROWS if r.length != "longest"] + ["eval"] +
                                              [r.name for r in ROWS if r.length == "longest"]),
                   help="comma-separated stages to run after imports and target: row names and eval")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo): the same code paths")
    p.add_argument("--dry-run", action="store_true", help="print the schedule; run nothing")
    p.add_argument("--gpu", default="h200", choices=("h100", "h200"), help="with --dry-run: the GPU planned for")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="write the carried assets folder and exit")
    p.add_argument("--plan-rows", action="store_true", help=f"write docs/results/gpu/{PLAN_FILE.name} and exit")
    p.add_argument("--collect", type=Path, metavar="DIR", help="copy DIR/gpu_online_check.json under docs/results/gpu")
    p.add_argument("--child", choices=("imports", "row"), help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--argv", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.stages = {s.strip() for s in args.rows.split(",") if s.strip()}
    unknown = args.stages - set(ROW) - {"eval"}
    if unknown:
        print(f"gpu_online_check: --rows: unknown {sorted(unknown)}; choose from {[*ROW, 'eval']}", file=sys.stderr)
        return 2
    rows = [r for r in ROWS if r.name in args.stages]
    done = local_action(args, {"dry_run": lambda _: dry_run(rows, args.gpu, args.smoke) or 0, "prepare": prepare,
                               "plan_rows": lambda _: write_plan_rows(), "collect": collect})
    if done is not None:
        return done
    out = output_folder(args, "gpu_online_check_out")
    if args.child == "imports":
        return import_stage(args.wheels, out, need_cuda=not args.smoke)
    if args.child == "row":
        (out / "rows").mkdir(exist_ok=True)
        return run_row_child(json.loads(args.argv), out / "rows" / f"{args.row}.json")
    with tempfile.TemporaryDirectory(prefix="gpu_online_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run_check(args, rows, out, work)
    print(json.dumps([(s["stage"], s["rc"], s.get("seconds"), s.get("max_memory_allocated"))
                      for s in report["stages"]], indent=1))
    print(f"wrote {out / 'gpu_online_check.json'}")
    return 0 if all(s["rc"] in (0, "skipped") for s in report["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
