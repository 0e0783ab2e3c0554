"""Performance of our draft step against SpecForge's on one GPU, in ONE device call of at most 540 s (issue 50,
item 5): our training step with the optimizer at SpecForge's published geometry (4 × 2048, the 8B draft: hidden
4096, 32/8 heads, MLP 14336, K = 7, Vd 32000, bf16, flex), at 32k and at 128k, with the memory switches ``auto``
picks; ablations that flip one switch (step checkpointing, the teacher logits once, compiled small ops, flex with
static shapes); a ``torch.profiler`` breakdown at 4 × 2048 and 32k; micro-batches of eight ShareGPT-length samples
padded against packed (``data.packing``, ``scripts/gpu_perf_packing.py``); the causal block's TFLOP/s per attention
backend; and SpecForge's own step (its wheel, its flex backend, its optimizer) in the same process on the same
weights and batches, so the ratio of the two is measured in one run.

    python scripts/gpu_perf_check.py --plan-rows               # here: the planner's memory of each switch set
    python scripts/gpu_perf_check.py --dry-run [--gpu h100]    # the rows, their estimates and the budget
    python scripts/gpu_perf_check.py --assets .gpu_assets      # on the device (docs/results/gpu/README.md)
    python scripts/gpu_perf_check.py --collect FILES_AT        # here: docs/results/gpu/perf_<date>.{json,md}

Stages: ``imports`` (``scripts/gpu_check_parts.import_stage``: every carried wheel, SpecForge's included, and every
project module), then one child process that builds the draft and the DeepSpeed engine once and runs the rows of
``scripts/gpu_perf_rows.ROWS`` in order of importance. A row starts only when its predicted seconds fit the time
left before the call's end (``BUDGET_S`` = 540 s after the start, less a margin) and, for our step, when the
planner's memory of its switches fits the GPU; otherwise it is recorded "skipped" with the prediction, so no row is
killed mid-write. ``OUT/gpu_perf_check.json`` is rewritten (atomically) after every row. A child that dies (a crash,
a hang killed at the deadline) leaves its finished rows; the row it was in is recorded with the log's tail and a
new child runs the rest when time is left.

Every row records its length, batch, seconds (timed steps after warm-up; the first step's too), positions and
supervised tokens a second, model and hardware TFLOP/s and MFU (``recipe.plan.spec.spec_speed``, the FLOP model of
``recipe.model.flops``), the allocator's peaks, and our step's time over SpecForge's at the same geometry
(``specforge_ratio``). ``--smoke`` runs every row on the CPU at tiny sizes (gloo, sdpa for flex, Dynamo's
``aot_eager`` for the compiled small ops and static flex, SpecForge's sdpa path run eagerly).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_e2e import PROVENANCE, e2e_env, provenance, run_stage, skipped  # noqa: E402
from scripts.gpu_check_parts import import_stage, local_action, output_folder  # noqa: E402
from scripts.gpu_online_rows import gpu_key  # noqa: E402
from scripts.gpu_perf_rows import (BUDGET_S, ESTIMATES_S, PLAN_FILE, ROW, ROWS, auto_switches, bench_spec,  # noqa: E402
                                   flipped, plan_key, row_estimate, row_length, step_seconds)

REPORT = "gpu_perf_check.json"
CRASH_ENV = "GPU_PERF_CHECK_CRASH_ROW"
"""Test hook: the child exits (code 3) as it starts the row this names, as a crash would."""
SMOKE_BUDGET_FACTOR = 4
MAX_CHILDREN = 3


def setup_estimate() -> dict[str, float]:
    """The child's seconds before its first row: a fresh python3, the draft built and kept, DeepSpeed's engine."""
    est = ESTIMATES_S
    return {"start": est["start"], "model_8b": est["model_8b"], "ds_init": est["ds_init"]}


def schedule(gpu: str, plans: dict) -> list[dict]:
    """Every row's switches and estimate on ``gpu`` ("h100"/"h200"), in running order, before any measurement."""
    from recipe.plan.states import gpu_bytes

    rate = ESTIMATES_S["h100_rate"] if gpu == "h100" else 1.0
    done, out, total = set(), [], ESTIMATES_S["start"] + ESTIMATES_S["cuda"] + sum(setup_estimate().values())
    for row in ROWS:
        switches, _ = row_switches(row, False, "cuda", gpu_bytes(gpu), plans, gpu)
        memory = memory_fit(row, switches, gpu_bytes(gpu), plans)
        runs = memory is None or memory["fits"]  # a row the plan says does not fit is skipped at once
        parts = row_estimate(row, switches, done if runs else set(done), ESTIMATES_S, rate)
        total += sum(parts.values()) if runs else 0.0
        out.append({"row": row, "switches": switches, "parts": parts, "end": total, "memory": memory, "runs": runs})
    return out


def row_switches(row, smoke: bool, device: str, device_bytes, plans: dict, gpu: str | None):
    switches, source = auto_switches(row, smoke, device, device_bytes, plans, gpu)
    return flipped(switches, row.flip), source


def memory_fit(row, switches, device_bytes: int | None, plans: dict) -> dict | None:
    """``{"planned_bytes", "fits"}`` of a row on a GPU of ``device_bytes``: our step's planned total (the plan
    file), SpecForge's lower bound (``gpu_perf_specforge.estimate_bytes``); None when unknown."""
    if device_bytes is None or row.kind == "attention":
        return None
    if row.kind == "specforge":
        from scripts.gpu_perf_rows import LLAMA_8B, TTT_STEPS
        from scripts.gpu_perf_specforge import estimate_bytes

        g, trainable, weights = LLAMA_8B, 424_689_664, 950_026_240  # the 8B draft's parameters (recipe.plan)
        need = estimate_bytes(row.batch, row.length, TTT_STEPS[False], g["hidden"], g["intermediate"],
                              g["draft_vocab"], g["vocab"], trainable, weights)
        need += 2 * weights + 16 * trainable  # our engine's weights and ZeRO-1 bf16 states stay resident
    else:
        entry = plans.get("rows", {}).get(plan_key(row, switches))
        if entry is None:
            return None
        need = entry["total"]
    return {"planned_bytes": int(need), "fits": need <= device_bytes}


def dry_run(gpu: str) -> int:
    from recipe.plan.states import gpu_bytes

    plans = json.loads(PLAN_FILE.read_text()) if PLAN_FILE.is_file() else {}
    setup = ESTIMATES_S["start"] + ESTIMATES_S["cuda"]
    print(f"schedule on {gpu} (plan {PLAN_FILE.name}: {plans.get('date', 'missing: run --plan-rows')}); "
          f"budget {BUDGET_S} s, rows start only when their estimate fits the time left")
    print(f"{'imports':<27} est {setup:>4.0f} s  end {setup:>4.0f} s")
    print(f"{'child setup':<27} est {sum(setup_estimate().values()):>4.0f} s  end "
          f"{setup + sum(setup_estimate().values()):>4.0f} s  [{_terms(setup_estimate())}]")
    rows = schedule(gpu, plans)
    print(f"auto switches: {row_switches(ROWS[0], False, 'cuda', gpu_bytes(gpu), plans, gpu)[1]}")
    for item in rows:
        row, mem = item["row"], item["memory"]
        what = item["switches"].label if row.kind in ("ours", "profile", "packing") else row.backend or "SpecForge"
        gib = "" if mem is None else f"{mem['planned_bytes'] / 2 ** 30:.1f} GiB"
        note = "" if item["runs"] else f"  skipped: {gib} > the {gpu}'s {gpu_bytes(gpu) / 2 ** 30:.1f} GiB"
        print(f"{row.name:<27} est {sum(item['parts'].values()) if item['runs'] else 0:>4.0f} s  end "
              f"{item['end']:>4.0f} s  {what:<30} {gib:>10}  [{_terms(item['parts'])}]{note}")
    end = rows[-1]["end"]
    print(f"{'total':<27} est {end:>4.0f} s of {BUDGET_S} s: {'fits' if end <= BUDGET_S else 'DOES NOT FIT'}")
    return 0 if end <= BUDGET_S else 1


def _terms(parts: dict) -> str:
    return " + ".join(f"{k} {v:.1f}" for k, v in parts.items())


# ---- the report file ------------------------------------------------------------------------------------------------
def write_report(path: Path, report: dict) -> None:
    """Atomic rewrite (a reader never sees half a file), with the SpecForge ratios filled in."""
    fill_ratios(report)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def fill_ratios(report: dict) -> None:
    """``specforge_ratio`` (our seconds / SpecForge's at the same batch and length) on every ok row of our step and
    SpecForge's ``ours_seconds`` beside its own."""
    theirs = {(r["batch"], r["length"]): r for r in report.get("rows", []) if r.get("kind") == "specforge"
              and r.get("status") == "ok"}
    for r in report.get("rows", []):
        sf = theirs.get((r.get("batch"), r.get("length")))
        if r.get("kind") == "ours" and r.get("status") == "ok" and sf:
            r["specforge_ratio"] = r["seconds"] / sf["seconds"]
            if r.get("flip") is None:
                sf["ours_seconds"], sf["specforge_ratio"] = r["seconds"], r["specforge_ratio"]


def skip_reason(predicted: float, left: float, memory: dict | None, device_bytes: int | None) -> str | None:
    """Why a row is not started (its predicted seconds past the time left, its planned bytes past the GPU), or
    None to run it."""
    if predicted > left:
        return f"predicted {predicted:.0f} s > {left:.0f} s left; not started"
    if memory is not None and not memory["fits"]:
        return (f"planned {memory['planned_bytes'] / 2 ** 30:.1f} GiB > the GPU's {device_bytes / 2 ** 30:.1f} GiB; "
                "not started")
    return None


# ---- the child: every row in one process ----------------------------------------------------------------------------
def run_rows_child(args, out: Path) -> int:
    """The rows of ``args.rows`` in this process (module docstring), each written to the report as it ends."""
    import torch

    from scripts.gpu_perf_profile import attention_row, profile_row
    from scripts.gpu_perf_steps import Bench, run_ours, run_specforge

    path, smoke = out / REPORT, args.smoke
    report = json.loads(path.read_text()) if path.is_file() else {"info": {}, "rows": []}
    rows = [ROW[n] for n in args.rows.split(",")]
    device = "cpu" if smoke else "cuda"
    device_bytes = None if smoke else torch.cuda.get_device_properties(0).total_memory
    gpu = None if smoke else gpu_key(torch.cuda.get_device_name(0))
    plans = {} if smoke else json.loads(PLAN_FILE.read_text()) if PLAN_FILE.is_file() else {}
    deadline = args.deadline or time.time() + BUDGET_S
    first, _ = row_switches(rows[0], smoke, device, device_bytes, plans, gpu)
    longest = max(r.length for r in rows if r.kind != "attention") if any(r.kind != "attention" for r in rows) else 2048
    t0 = time.monotonic()
    bench = Bench(smoke, longest, 1, first)
    report.setdefault("children", []).append({"rows": [r.name for r in rows], "setup_s": round(time.monotonic() - t0,
                                                                                                  1)})
    done = set()
    rate = ESTIMATES_S["h100_rate"] if gpu == "h100" else 1.0
    for row in rows:
        switches, source = row_switches(row, smoke, device, device_bytes, plans, gpu)
        parts = row_estimate(row, switches, set(done), ESTIMATES_S, rate)
        predicted = 0.0 if smoke else sum(parts.values())
        left = deadline - time.time() - ESTIMATES_S["margin"]
        mem = memory_fit(row, switches, device_bytes, plans)
        record = {"name": row.name, "kind": row.kind, "length": row_length(row, smoke), "batch": row.batch,
                  "flip": row.flip, "switches": vars(switches) if row.kind != "attention" else None,
                  "switches_source": source if row.kind in ("ours", "profile", "packing") else None,
                  "predicted_s": round(predicted, 1), "allowed_s": round(left, 1), "memory_plan": mem}
        why = skip_reason(predicted, left, mem, device_bytes)
        if why:
            record.update(status="skipped", detail=why)
        else:
            report["in_flight"] = row.name
            write_report(path, report)
            if os.environ.get(CRASH_ENV) == row.name:  # the tests' child that dies in a row
                os._exit(3)
            record.update(_run_row(bench, row, switches, out, run_ours, run_specforge, profile_row, attention_row))
            row_estimate(row, switches, done, ESTIMATES_S, rate)  # the compiles are paid now
            if row.kind == "ours" and record.get("status") == "ok" and not smoke and record["seconds"] > 0:
                spec = bench_spec(row, False, switches, device)
                rate = min(5.0, max(0.2, rate * step_seconds(spec, ESTIMATES_S, rate) / record["seconds"]))
        record["rate_after"] = rate
        report["rows"].append(record)
        report.pop("in_flight", None)
        write_report(path, report)
        print(f"gpu_perf_check: {row.name}: {record['status']} {record.get('seconds', '')}", flush=True)
    return 0


def _run_row(bench, row, switches, out, run_ours, run_specforge, profile_row, attention_row) -> dict:
    from scripts.gpu_perf_rows import STEPS
    from scripts.gpu_perf_steps import _error_record, _recover

    warm, timed = STEPS[row.length]
    start = time.monotonic()
    if row.kind == "ours":
        record = run_ours(bench, row, switches, warm + (0 if bench.steps_taken else 1), timed)  # 1st: compiles
    elif row.kind == "specforge":
        record = run_specforge(bench, row, warm, timed)
    elif row.kind == "packing":
        from scripts.gpu_perf_packing import run_packing

        record = run_packing(bench, row, switches)
    else:
        try:
            record = profile_row(bench, row, switches, out) if row.kind == "profile" else attention_row(bench, row)
        except Exception as exc:  # noqa: BLE001 - recorded; the next row still runs
            record = _error_record(exc)
            _recover(bench)
    record["seconds_wall"] = round(time.monotonic() - start, 1)
    return record


# ---- the parent -----------------------------------------------------------------------------------------------------
def run_check(args, out: Path) -> dict:
    """The imports stage, then the rows' child (again while a child died and time is left); the report."""
    start = time.monotonic()
    budget = BUDGET_S * (SMOKE_BUDGET_FACTOR if args.smoke else 1)
    path = out / REPORT
    source = args.assets / PROVENANCE if args.assets else None
    report = {"info": {"date": date.today().isoformat(), "budget_s": budget, "estimates_s": ESTIMATES_S,
                       "smoke": args.smoke, "rows": args.rows.split(","), "plan_file": PLAN_FILE.name,
                       "auto_hook": "scripts/gpu_perf_rows.recipe_auto_switches",
                       "source": json.loads(source.read_text()) if source and source.is_file() else provenance()},
              "stages": [], "rows": []}
    write_report(path, report)
    env = e2e_env(args.smoke)
    with open(out / "gpu_perf_check.log", "w") as log:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "imports", "--out", str(out), "--wheels",
               str(args.wheels)] + (["--smoke"] if args.smoke else [])
        cap = ESTIMATES_S["start"] + ESTIMATES_S["cuda"]
        report["stages"].append(run_stage("imports", cmd, env, cap * (SMOKE_BUDGET_FACTOR if args.smoke else 2),
                                          cap, log))
        imports = json.loads((out / "imports.json").read_text()) if (out / "imports.json").is_file() else {}
        report["imports"] = {k: imports.get(k) for k in ("python", "versions", "failed", "table_ok", "cuda")}
        report["info"]["device"] = (imports.get("cuda") or {}).get("device") or ("cpu (smoke)" if args.smoke else None)
        write_report(path, report)
        if not imports.get("table_ok"):
            report["stages"].append(skipped("rows", "the project's modules did not import"))
            write_report(path, report)
            return report
        for _ in range(MAX_CHILDREN):
            remaining = [n for n in args.rows.split(",") if n not in {r["name"] for r in report["rows"]}]
            left = budget - (time.monotonic() - start)
            if not remaining or left < sum(setup_estimate().values()):
                break
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "rows", "--out", str(out), "--rows",
                   ",".join(remaining), "--deadline", f"{time.time() + left:.1f}"] + (["--smoke"] if args.smoke else [])
            stage = run_stage("rows", cmd, env, left + 5, round(left), log)
            report = json.loads(path.read_text())
            report["stages"].append(stage)
            crashed = report.pop("in_flight", None)
            if crashed:
                report["rows"].append({"name": crashed, "kind": ROW[crashed].kind, "length": row_length(
                    ROW[crashed], args.smoke), "batch": ROW[crashed].batch, "status": "crashed",
                    "detail": f"the child ended (rc {stage['rc']}) in this row", "tail": stage["tail"][-1000:]})
            write_report(path, report)
        for name in [n for n in args.rows.split(",") if n not in {r["name"] for r in report["rows"]}]:
            report["rows"].append({"name": name, "kind": ROW[name].kind, "status": "skipped",
                                   "detail": "not reached: no time left for a child process"})
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    write_report(path, report)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_perf_check_out)")
    p.add_argument("--assets", type=Path, help="the carried assets folder (gpu_check's --prepare): its provenance")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default .whl)")
    p.add_argument("--rows", default=",".join(r.name for r in ROWS),
                   help="comma-separated rows, in the order to run them (default: all, by importance)")
    p.add_argument("--smoke", action="store_true", help="every row on the CPU at tiny sizes (the tests)")
    p.add_argument("--dry-run", action="store_true", help="print the rows, their estimates and the budget")
    p.add_argument("--gpu", default="h200", choices=("h100", "h200"), help="with --dry-run: the GPU planned for")
    p.add_argument("--plan-rows", action="store_true", help=f"write docs/results/gpu/{PLAN_FILE.name} and exit")
    p.add_argument("--collect", type=Path, metavar="DIR",
                   help="write docs/results/gpu/perf_<date>.json and .md from DIR (the call's returned $OUT)")
    p.add_argument("--results-dir", type=Path, default=PLAN_FILE.parent, help="where --collect writes")
    p.add_argument("--child", choices=("imports", "rows"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # a child's time.time() to be done by
    return p


def _plan_rows(_) -> Path:
    from scripts.gpu_perf_rows import write_plan_rows  # import cost: the planner (torch)

    return write_plan_rows()


def _collect(folder: Path, results_dir: Path) -> list[Path]:
    from scripts.gpu_perf_report import collect  # import cost: the report's page builder

    return collect(folder, results_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [n for n in args.rows.split(",") if n not in ROW]
    if unknown:
        print(f"gpu_perf_check: --rows: unknown {unknown}; choose from {list(ROW)}", file=sys.stderr)
        return 2
    done = local_action(args, {"dry_run": lambda _: dry_run(args.gpu), "plan_rows": _plan_rows,
                               "collect": lambda folder: _collect(folder, args.results_dir)})
    if done is not None:
        return done
    out = output_folder(args, "gpu_perf_check_out")
    if args.child == "imports":
        return import_stage(args.wheels, out, need_cuda=not args.smoke)
    if args.child == "rows":
        return run_rows_child(args, out)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_perf_check: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    report = run_check(args, out)
    print(json.dumps([(r["name"], r["status"], r.get("seconds"), r.get("mfu"), r.get("specforge_ratio"))
                      for r in report["rows"]], indent=1))
    print(f"wrote {out / REPORT}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
