"""GPU check on one CUDA GPU, inside one device call: the recipe end to end under NCCL, then the 8B-shaped draft's
memory table with the flex backend, then the eval.

A lent GPU gives 15 minutes in all (one to two of them to start) and at most 600 s a command, so this script runs
in ONE call on a schedule: every stage has a time cap made of estimated start-up and compile times
(``ESTIMATES_S``, ``STAGE_COSTS``; ``--dry-run`` prints each cap and what it is made of) and the caps sum to at most
``BUDGET_S`` = 540 s. A stage may run until the sum of its own and the earlier stages' caps (time an earlier stage
did not use passes on; no stage eats a later one's cap). Every stage is a subprocess with its own timeout, so a
hang, a crash or an out-of-memory error ends that stage only; ``OUT/gpu_check.json`` is rewritten after every stage
and table row, so a call stopped at its limit still brings back what it did (OUT = ``--out``, else ``$OUT``, else
./gpu_check_out).

Stages (e2e at world size 1; DeepSpeed picks NCCL on CUDA, gloo on the CPU):

0. ``imports`` (fail fast): every carried wheel's modules and every module of ``recipe`` and ``kernels`` import on
   the device's Python, and the versions it sees (``scripts/gpu_check_parts.py``). When one fails, the e2e stages
   are skipped (recorded); the table still runs when its own modules imported.
1. ``target``: a SmolLM2-135M-Instruct-shaped target (its config and tokenizer, carried) with **seeded random
   weights** in bf16: the point is the code path, not τ.
2. ``online``: ``python run.py --data ...`` (the target runs every step), ZeRO-3 bf16 (``ds_configs/zero3_bf16.json``,
   its memory switches "auto": chosen at start for the GPU's free memory; attention ``auto`` = flex on CUDA), 5
   optimizer steps, export.
3. ``check_export``: ``python -m recipe.export --check`` of the export. When ``online`` left none (timed out, failed),
   a random-weight draft of the same geometry is exported first (``"export_source"`` says which), so the export
   check and the eval still run.
4. ``table``: a bf16 TTT training step of a Llama-3.1-8B-shaped draft (hidden 4096, 32 query / 8 KV heads of dim
   128, intermediate 14336, draft vocabulary 32000, target hidden 4096, K = 7, random weights built once, each
   row's batch drawn on the GPU) with every memory switch but the MLP tiles on (loss chunks of 4096, per-step checkpointing, flex
   attention) at 4k, 32k and 128k tokens. A row runs only when its predicted time fits what the table has left,
   else it is recorded "skipped"; each row records the allocator's peaks beside ``torch.cuda.mem_get_info``, flex
   compiles, seconds per step, its speed (token positions and supervised tokens a second, model and hardware
   TFLOP/s, MFU against the device's bf16 peak: ``recipe.plan.spec.spec_speed``) and the planner's prediction
   (``recipe.plan``, made here by ``--plan-rows`` into ``docs/results/gpu/plan_gpu_check.json`` and carried with the
   repository).
5. ``eval`` (last): ``python -m recipe.eval`` of the bf16 export on 2 prompts (chain τ, lossless check).

The GPU machine (no network; Python 3.12, torch 2.11 with CUDA 13, transformers 5.17) has no DeepSpeed, hjson,
pydantic or datasets: ``bash scripts/gpu_wheels.sh`` writes them as wheels to ``.whl/`` (about 6 MB) and checks
that what travels fits 64 MiB; ``--prepare .gpu_assets`` writes the carried config, tokenizer, conversations and
prompts (about 4 MB) and ``provenance.json`` (commit, uncommitted files, date, versions here), which the report
copies (``.git`` does not travel). docs/results/gpu/README.md gives the exact device command.

Copy step (here, after the call): ``python scripts/gpu_check.py --collect FILES_AT`` copies the returned
``gpu_check.json`` to ``docs/results/gpu/gpu_check_<date>.json``; commit that file.
``--smoke`` runs the same code paths on the CPU at tiny sizes (the tests).

What one GPU cannot prove: NCCL cannot place two ranks on one GPU, so every multi-rank path (the TP all-reduces, the
ring's ``batch_isend_irecv``, ZeRO partitioning over several ranks, the dp/cp/tp subgroups under NCCL) runs here at
world size 1 only; those run under gloo on the CPU (tests/) and need a multi-GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_e2e import (E2E, PROVENANCE, e2e_commands, e2e_env, prepare_carry, provenance,  # noqa: E402
                                   run_e2e_stage, run_stage, skipped)
from scripts.gpu_check_parts import import_stage, local_action, output_folder  # noqa: E402

BUDGET_S = 540
"""Running time of one GPU check: a device call may run 600 s (the wheels' install and this process's own start
take the rest), and the lease is 15 minutes with a 1-2 minute start."""

ESTIMATES_S = dict(
    start=15,        # a fresh python3: torch, transformers, DeepSpeed, datasets, the recipe, CUDA (3 s here, warm)
    cuda=5,          # the import stage's CUDA probe
    target_build=10,  # a 135M-parameter target drawn on the CPU and saved in bf16
    ds_init=15,      # deepspeed.initialize (ZeRO-3, NCCL at world size 1) and the target's load
    data=10,         # tokenizing 40 conversations (datasets map), the draft vocabulary
    flex_fwd=20,     # first Inductor/Triton compile of flex attention's forward (dynamic shapes)
    flex_bwd=40,     # ... and of its backward (the larger kernel)
    online_steps=10,  # 5 optimizer steps of 2 micro-batches of <= 2048 tokens
    export=5,        # the ZeRO-3 gather and safetensors write of the export
    check=5,         # reloading an export and checking it
    model_8b=15,     # the 8B-shaped draft (0.95 B parameters) drawn on the CPU, moved to the GPU in bf16
    row_step=0.5,    # one 4k-token step of the 8B-shaped draft (K = 7, checkpointed: ~1e14 FLOP at ~200-400 TFLOP/s)
    row_batch=2,     # drawing a row's batch on the GPU
    attn_crossover=32768,  # tokens where the draft's attention costs its linear layers' time (flex ~half as fast)
    table_margin=5,  # the table child's slack before its hard cap
    eval_load=10,    # the target and the draft export loaded onto the GPU
    eval_decode=10,  # 2 prompts x 32 new tokens, 3 draft tokens a round
)
"""Estimated seconds on the H200 (no GPU has run this project yet: public orders of magnitude, "tens of seconds"
for a first flex forward + backward compile; the first check's JSON records the real ones: each stage's seconds,
each row's first step beside its later ones). ``STAGE_COSTS`` adds them up into the stage caps."""

STAGE_COSTS = {
    "imports": {"start": 1, "cuda": 1},
    "target": {"start": 1, "target_build": 1},
    # the training variant compiles twice when the first micro-batch is one flex block (kernels.flex_attention)
    "online": {"start": 1, "ds_init": 1, "data": 1, "flex_fwd": 2, "flex_bwd": 2, "online_steps": 1, "export": 1},
    "check_export": {"start": 1, "check": 1, "export": 1},
    "table": {"start": 1, "model_8b": 1},  # + the rows' caps (row_costs)
    # the inference variant compiles per KV-cache layout: prefill, concatenated cache, one-token queries
    "eval": {"start": 1, "eval_load": 1, "flex_fwd": 3, "eval_decode": 1},
}
TABLE_LENGTHS = (4096, 32768, 131072)
TABLE_STEPS = {4096: 2, 32768: 2, 131072: 1}
"""Steps per row: 4k and 32k run 2 (the first compiles; the time is the second's), 128k one (compiled by then)."""
SMOKE_CAP_FACTOR = 4
"""``--smoke`` multiplies every cap by this: the 2-core CPU runs the tiny sizes slower than the GPU the real ones."""

LLAMA_8B_DRAFT = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                      vocab=128256, target_hidden=4096)
PLAN_FILE = ROOT / "docs" / "results" / "gpu" / "plan_gpu_check.json"
"""The planner's predictions of the table rows, made here (``--plan-rows``; tracing an 8B step takes ~40 s of CPU,
which the GPU's time cap cannot spare) and carried with the repository."""
SMOKE_DRAFT = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=512, vocab=512,
                   target_hidden=64)
SMOKE_LENGTHS = (64, 128, 256)


def _cost(parts: dict) -> float:
    return sum(ESTIMATES_S[k] * n for k, n in parts.items())


def row_costs(index: int, length: int) -> dict:
    """A table row's ``ESTIMATES_S`` terms: the flex compiles it triggers (the first row compiles forward and
    backward with every size symbolic, so later rows compile nothing: ``kernels.flex_attention``, "Compile
    policy"), its steps in 4k-step units (``gpu_check_parts.step_units``) and drawing its batch."""
    from scripts.gpu_check_parts import step_units

    compiles = {"flex_fwd": 1, "flex_bwd": 1} if index == 0 else {}
    units = TABLE_STEPS[length] * step_units(length, ESTIMATES_S["attn_crossover"])
    return {**compiles, "row_step": round(units, 2), "row_batch": 1}


def row_caps() -> dict[int, int]:
    """Table row -> cap in seconds (``row_costs``, rounded up to 5 s)."""
    return {n: int(-(-_cost(row_costs(i, n)) // 5) * 5) for i, n in enumerate(TABLE_LENGTHS)}


def stage_caps() -> dict[str, int]:
    """Stage -> cap in seconds, in running order (eval last): each stage's ``STAGE_COSTS`` (the table's plus its
    rows' caps), rounded up to 5 s."""
    caps = {s: int(-(-_cost(parts) // 5) * 5) for s, parts in STAGE_COSTS.items()}
    caps["table"] += sum(row_caps().values())
    return caps


def stage_plan(smoke: bool) -> list[tuple[str, int]]:
    """[(stage, cap seconds)] in running order, the table's rows as ``table:<length>`` after ``table`` (their caps
    are part of the table's); ``--smoke``: caps × SMOKE_CAP_FACTOR and the smoke lengths."""
    f = SMOKE_CAP_FACTOR if smoke else 1
    lengths = SMOKE_LENGTHS if smoke else TABLE_LENGTHS
    plan = []
    for stage, cap in stage_caps().items():
        plan.append((stage, cap * f))
        if stage == "table":
            plan += [(f"table:{n}", c * f) for n, c in zip(lengths, row_caps().values())]
    return plan


assert sum(stage_caps().values()) <= BUDGET_S, stage_caps()
assert list(stage_caps())[0] == "imports" and list(stage_caps())[-1] == "eval"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_check_out)")
    p.add_argument("--work", type=Path, help="folder for the target and runs (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo), the same code paths")
    p.add_argument("--parts", default="e2e,table", help="comma-separated subset of e2e,table")
    p.add_argument("--dry-run", action="store_true",
                   help="print the stages, their time caps and estimates; run nothing")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="only write the carried assets folder and exit")
    p.add_argument("--assets", type=Path, help="a folder written by --prepare (default: prepared from recipe.assets)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                   help="the carried wheels the import stage imports (default .whl)")
    p.add_argument("--collect", type=Path, metavar="DIR",
                   help="copy DIR/gpu_check.json to docs/results/gpu/gpu_check_<date>.json and exit")
    p.add_argument("--plan-rows", action="store_true",
                   help=f"write the planner's predictions of the table rows to {PLAN_FILE.relative_to(ROOT)} and exit")
    p.add_argument("--child", choices=("imports", "table"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # a child's time.time() to be done by
    return p


def dry_run(smoke: bool) -> None:
    plan = stage_plan(smoke)
    for name, cap in plan:
        rows = {f"table:{n}": row_costs(i, n) for i, n in enumerate(TABLE_LENGTHS)}
        parts = rows.get(name) if name.startswith("table:") else STAGE_COSTS.get(name)
        made = " + ".join(f"{n:g}×{k} {ESTIMATES_S[k]:g}" for k, n in parts.items()) if parts and not smoke else ""
        if name == "table" and not smoke:
            made += " + the rows' caps"
        indent = "  " if name.startswith("table:") else ""
        print(f"{indent + name:<14} {cap:>4} s  {made}")
    total = sum(c for n, c in plan if not n.startswith("table:"))
    print(f"{'total':<14} {total:>4} s (budget {BUDGET_S * (SMOKE_CAP_FACTOR if smoke else 1)} s; eval last)")


# ---- the schedule and the table ---------------------------------------------------------------------------------
class Schedule:
    """Stage deadlines: a stage may run until the sum of its own and the earlier stages' caps from ``start``."""

    def __init__(self, smoke: bool):
        self.caps = {n: c for n, c in stage_plan(smoke) if not n.startswith("table:")}
        self.start = time.monotonic()

    def timeout(self, stage: str) -> float:
        names = list(self.caps)
        deadline = sum(self.caps[n] for n in names[:names.index(stage) + 1])
        return max(1.0, deadline - (time.monotonic() - self.start))


def table_spec(smoke: bool, length: int):
    """The ``recipe.plan.spec.BenchSpec`` of a table row: bf16, every memory switch on (loss chunks, per-step
    checkpointing, flex on the GPU; the tiled kernel on the CPU, where flex has no backward)."""
    from recipe.plan.spec import BenchSpec

    steps = 2 if smoke else TABLE_STEPS[length]
    return BenchSpec(seq_len=length, layout="chunked+ckpt", ttt_steps=2 if smoke else 7, dtype="bf16",
                     device="cpu" if smoke else "cuda", loss_chunk_size=32 if smoke else 4096,
                     attention_tile=32 if smoke else 1024, attention_backend="tiled" if smoke else "flex",
                     steps=steps, **(SMOKE_DRAFT if smoke else LLAMA_8B_DRAFT))


def planned_peak(spec) -> dict:
    """The planner's prediction of a table row's step (``recipe.plan.predict_step``: ``step_bytes``, ``peak_bytes``
    without the device's fixed overheads, ``method``), or ``{"error": ...}`` when it cannot say."""
    from recipe.plan import predict_step

    try:
        return predict_step(spec)
    except Exception as exc:  # noqa: BLE001 - a prediction failure must not cost the measurement
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def write_plan_rows() -> Path:
    """``PLAN_FILE``: the planner's prediction of every GPU table row (traced, or the layout's activation fit)."""
    rows = {str(n): planned_peak(table_spec(False, n)) for n in TABLE_LENGTHS}
    PLAN_FILE.parent.mkdir(parents=True, exist_ok=True)
    PLAN_FILE.write_text(json.dumps({"command": "python scripts/gpu_check.py --plan-rows", "date":
                                     date.today().isoformat(), "rows": rows}, indent=1) + "\n")
    return PLAN_FILE


def table_child(smoke: bool, out: Path, deadline: float) -> None:
    """The table, in this (child) process, done by ``deadline`` (``time.time()``)."""
    from scripts.gpu_check_parts import table_rows

    lengths = SMOKE_LENGTHS if smoke else TABLE_LENGTHS
    plan = [(n, c * (SMOKE_CAP_FACTOR if smoke else 1)) for n, c in zip(lengths, row_caps().values())]
    plans = ({str(n): planned_peak(table_spec(True, n)) for n in lengths} if smoke else
             json.loads(PLAN_FILE.read_text())["rows"] if PLAN_FILE.is_file() else {})
    table_rows(plan, lambda n: table_spec(smoke, n), deadline - time.time(), out, dict(ESTIMATES_S, steps=TABLE_STEPS),
               smoke, plans)


def run_child(kind: str, args, out: Path, timeout: float, cap: int, log) -> dict:
    """``--child kind`` as a subprocess capped at ``timeout`` seconds (the parent's hard limit)."""
    from recipe.processes import subprocess_env

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--out", str(out), "--deadline",
           f"{time.time() + timeout:.1f}", "--wheels", str(args.wheels)] + (["--smoke"] if args.smoke else [])
    env = subprocess_env(1 if args.smoke else max(1, os.cpu_count() or 1))
    return run_stage(kind, cmd, env, timeout, cap, log)


# ---- entry --------------------------------------------------------------------------------------------------------
def collect(src: Path) -> Path:
    """Copy ``src/gpu_check.json`` to ``docs/results/gpu/gpu_check_<date>.json`` (the date the check ran)."""
    report = json.loads((src / "gpu_check.json").read_text())
    day = report.get("info", {}).get("date") or date.today().isoformat()
    dest = ROOT / "docs" / "results" / "gpu" / f"gpu_check_{day}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1) + "\n")
    return dest


def _source(assets: Path | None) -> dict:
    """The carried ``provenance.json`` (``--prepare``), else this tree's (``provenance()``: git is here)."""
    if assets is not None and (assets / PROVENANCE).is_file():
        return {"from": str(assets / PROVENANCE), **json.loads((assets / PROVENANCE).read_text())}
    return {"from": "git (no carried provenance.json)", **provenance()}


def run_check(args, parts: list[str], out: Path) -> dict:
    """Every stage in order on the schedule; the report (also written to ``out/gpu_check.json`` as it goes)."""
    import torch

    sched = Schedule(args.smoke)
    # this process never touches the GPU (its context would sit in every row's mem_get_info): the import stage
    # names the device
    report = {"info": {"device": None if not args.smoke else "cpu (smoke)",
                       "torch": torch.__version__, "date": date.today().isoformat(), "parts": parts,
                       "stage_caps_s": dict(stage_plan(args.smoke)), "estimates_s": ESTIMATES_S,
                       "budget_s": BUDGET_S}, "e2e": []}
    path = out / "gpu_check.json"

    def save():
        report["elapsed_s"] = round(time.monotonic() - sched.start, 1)
        path.write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, open(out / "gpu_check.log", "w") as log:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sizes = E2E["smoke" if args.smoke else "gpu"]
        assets = args.assets
        if "e2e" in parts and assets is None:
            assets = prepare_carry(work / "assets", sizes["conversations"], sizes["prompts"])
        report["info"]["source"] = _source(assets)
        save()
        report["imports"] = run_child("imports", args, out, sched.timeout("imports"), sched.caps["imports"], log)
        found = out / "imports.json"
        imports = json.loads(found.read_text()) if found.is_file() else {"failed": ["<no imports.json>"]}
        report["imports"].update(imports)
        report["info"]["device"] = report["info"]["device"] or imports.get("cuda", {}).get("device")
        save()
        e2e_ok = not imports.get("failed")
        ctx = dict(smoke=args.smoke, work=work, env=None, schedule=sched, log=log,
                   cmds=e2e_commands(args.smoke, assets, work) if "e2e" in parts else {})
        ctx["env"] = e2e_env(args.smoke)
        for name in ("target", "online", "check_export"):
            if "e2e" in parts:
                report["e2e"].append(run_e2e_stage(name, ctx) if e2e_ok else skipped(name, "the import stage failed"))
                save()
        if "table" in parts:
            if imports.get("table_ok", False) or args.smoke and not imports.get("failed"):
                record = run_child("table", args, out, sched.timeout("table"), sched.caps["table"], log)
            else:
                record = skipped("table", "the table's modules did not import")
            rows = out / "table.json"
            report["table"] = {"stage": record, "rows": json.loads(rows.read_text()) if rows.is_file() else []}
            save()
        if "e2e" in parts:
            report["e2e"].append(run_e2e_stage("eval", ctx) if e2e_ok else skipped("eval", "the import stage failed"))
        save()
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    done = local_action(args, {"dry_run": lambda _: dry_run(args.smoke) or 0,
                               "prepare": lambda folder: prepare_carry(folder, E2E["gpu"]["conversations"],
                                                                       E2E["gpu"]["prompts"]),
                               "collect": collect, "plan_rows": lambda _: write_plan_rows()})
    if done is not None:
        return done
    out = output_folder(args, "gpu_check_out")
    if args.child == "imports":
        return import_stage(args.wheels, out, need_cuda=not args.smoke)
    if args.child == "table":
        table_child(args.smoke, out, args.deadline or time.time() + stage_caps()["table"])
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --smoke for the CPU test run", file=sys.stderr)
        return 2
    report = run_check(args, parts, out)
    print(json.dumps({"imports_failed": report["imports"].get("failed"),
                      "e2e": [(s["stage"], s["rc"], s.get("seconds")) for s in report["e2e"]],
                      "table": [(r["length"], r["status"], r.get("max_memory_allocated"), r.get("seconds"),
                                 r.get("model_tflops_per_gpu"), r.get("mfu"))
                                for r in report.get("table", {}).get("rows", [])],
                      "elapsed_s": report["elapsed_s"]}, indent=1))
    print(f"wrote {out / 'gpu_check.json'}")
    failed = [s["stage"] for s in report["e2e"] if s["rc"] != 0]
    failed += [r["length"] for r in report.get("table", {}).get("rows", []) if r["status"] not in ("ok", "skipped")]
    return 1 if failed or report["imports"].get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
