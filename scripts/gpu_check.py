"""GPU check on one CUDA GPU, inside one device call: the real run end to end under NCCL, then the 8B-shaped draft's
memory table with the flex backend.

A lent GPU gives 15 minutes in all (one to two of them to start) and at most 600 s a command, so this script runs
in ONE call with a fixed time cap per stage; the caps (``STAGES``) sum to ``BUDGET_S`` = 540 s, and
``--dry-run`` prints them. Every stage is a subprocess with its own timeout, so a hang, a crash or an out-of-memory
error ends that stage only; results are rewritten to ``OUT/gpu_check.json`` after every stage and table row, so a
call stopped at its limit still brings back what it did (OUT = ``--out``, else ``$OUT``, else ./gpu_check_out).

Stages (e2e at world size 1; DeepSpeed picks NCCL on CUDA, gloo on the CPU):

1. ``target``: a SmolLM2-135M-Instruct-shaped target (its config and tokenizer, carried) with **seeded random
   weights** in bf16: the point is the code path, not τ.
2. ``online``: ``python run.py --data ...`` (the target runs every step), ZeRO-3 bf16 (``ds_configs/zero3_bf16.json``,
   every memory switch but the MLP tiles on, attention ``auto`` = flex on CUDA), 5 optimizer steps, export.
3. ``check_export``: ``python -m recipe.export --check`` of the export.
4. ``eval``: ``python -m recipe.eval`` of the bf16 export on 2 prompts (chain τ, lossless check).
5. ``table``: a bf16 TTT training step of a Llama-3.1-8B-shaped draft (hidden 4096, 32 query / 8 KV heads of dim 128,
   intermediate 14336, draft vocabulary 32000, target hidden 4096, K = 7, random weights, the batch made on the GPU)
   with every memory switch but the MLP tiles on (loss chunks of 4096, per-step checkpointing, flex attention) at 4k,
   32k and 128k tokens. Each row catches its own errors and records ``max_memory_allocated``, ``max_memory_reserved``,
   the flex compiles so far, seconds per step, and the planner's prediction for the same step (``recipe.plan``, made
   here by ``--plan-rows`` into ``docs/results/gpu/plan_gpu_check.json`` and carried with the repository).

The GPU machine (no internet; torch 2.11 with CUDA 13, transformers 5.17, pyarrow and pandas preinstalled) has no
DeepSpeed, hjson, pydantic or datasets: ``bash scripts/gpu_wheels.sh`` writes them as wheels to ``.whl/`` (a
DeepSpeed wheel built from its sdist here, the others downloaded for the device's Python 3.12; about 10 MB), and
``--prepare .gpu_assets`` writes the carried config, tokenizer, conversations and prompts (about 4 MB). The table
needs neither datasets nor the assets. On the device::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --assets .gpu_assets      # ≤ 540 s

Copy step (here, after the call): ``python scripts/gpu_check.py --collect FILES_AT`` copies the returned
``gpu_check.json`` to ``docs/results/gpu/gpu_check_<date>.json`` with the commit it ran; commit that file.
``--smoke`` runs the same code paths on the CPU at tiny sizes (the tests).

What one GPU cannot prove: NCCL cannot place two ranks on one GPU, so every multi-rank path (the TP all-reduces, the
ring's ``batch_isend_irecv``, ZeRO partitioning over several ranks, the dp/cp/tp subgroups under NCCL) runs here at
world size 1 only; those run under gloo on the CPU (tests/) and need a multi-GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGET_S = 540
"""Running time of one GPU check: a device call may run 600 s, and the lease is 15 minutes with a 1-2 minute start."""

STAGES = {"target": 30, "online": 160, "check_export": 20, "eval": 50, "table": 280}
"""Stage -> time cap in seconds (sum = ``BUDGET_S``). ``online`` includes DeepSpeed's start and the first flex
compiles; ``table`` holds three rows (``TABLE_ROW_CAPS``)."""

SMOKE_CAP_FACTOR = 4
"""``--smoke`` multiplies every cap by this: the 2-core CPU runs the tiny sizes slower than the GPU the real ones."""

TABLE_LENGTHS = (4096, 32768, 131072)
TABLE_ROW_CAPS = {4096: 70, 32768: 70, 131072: 140}
"""Per row: seconds it may start with (a row not started in time is recorded "not run")."""

LLAMA_8B_DRAFT = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                      vocab=128256, target_hidden=4096)
PLAN_FILE = ROOT / "docs" / "results" / "gpu" / "plan_gpu_check.json"
"""The planner's predictions of the table rows, made here (``--plan-rows``; tracing an 8B step takes ~40 s of CPU,
which the GPU's time cap cannot spare) and carried with the repository."""
SMOKE_DRAFT = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=512, vocab=512,
                   target_hidden=64)
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
E2E = {"gpu": dict(conversations=40, max_length=2048, steps=5, batch=4, micro=2, ttt_steps=7, draft_vocab=32000,
                   prompts=2, new_tokens=32, target={}),
       "smoke": dict(conversations=12, max_length=128, steps=3, batch=2, micro=1, ttt_steps=2, draft_vocab=256,
                     prompts=2, new_tokens=4, target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                                          num_attention_heads=4, num_key_value_heads=2,
                                                          head_dim=16))}
assert sum(STAGES.values()) == BUDGET_S and sum(TABLE_ROW_CAPS.values()) == STAGES["table"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_check_out)")
    p.add_argument("--work", type=Path, help="folder for the target and runs (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo), the same code paths")
    p.add_argument("--parts", default="e2e,table", help="comma-separated subset of e2e,table")
    p.add_argument("--dry-run", action="store_true", help="print the stages and their time caps, run nothing")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="only write the carried assets folder and exit")
    p.add_argument("--assets", type=Path, help="a folder written by --prepare (default: prepared from recipe.assets)")
    p.add_argument("--collect", type=Path, metavar="DIR",
                   help="copy DIR/gpu_check.json to docs/results/gpu/gpu_check_<date>.json and exit")
    p.add_argument("--plan-rows", action="store_true",
                   help=f"write the planner's predictions of the table rows to {PLAN_FILE.relative_to(ROOT)} and exit")
    p.add_argument("--table-child", action="store_true", help=argparse.SUPPRESS)
    return p


def stage_plan(smoke: bool) -> list[tuple[str, int]]:
    """[(stage, cap seconds)] in order; table rows as ``table:<length>`` (``--smoke``: caps × SMOKE_CAP_FACTOR)."""
    f = SMOKE_CAP_FACTOR if smoke else 1
    lengths = (64, 128, 256) if smoke else TABLE_LENGTHS
    rows = [(f"table:{n}", cap * f) for n, cap in zip(lengths, TABLE_ROW_CAPS.values())]
    return [(s, c * f) for s, c in STAGES.items() if s != "table"] + rows


def stage_cap(name: str, smoke: bool) -> int:
    return STAGES[name] * (SMOKE_CAP_FACTOR if smoke else 1)


# ---- assets and the random target ---------------------------------------------------------------------------------
def prepare_carry(out: Path, conversations: int, prompts: int) -> Path:
    """Write ``out/target_source`` (SmolLM2's config and tokenizer files), ``out/conversations.jsonl`` and
    ``out/prompts.jsonl`` (the first records of ShareGPT and MT-Bench) from the ``recipe.assets`` cache."""
    from recipe.assets import prepare_assets

    assets = prepare_assets()
    (out / "target_source").mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        if (assets.target / name).is_file():
            shutil.copyfile(assets.target / name, out / "target_source" / name)
    for src, dst, n in ((assets.conversations, "conversations.jsonl", conversations),
                        (assets.prompts, "prompts.jsonl", prompts)):
        with open(src) as fh, open(out / dst, "w") as w:
            for _, line in zip(range(n), fh):
                w.write(line)
    return out


def build_random_target(source: Path, out: Path, overrides: dict, seed: int = 0) -> Path:
    """A target folder: ``source``'s config (with ``overrides``) and tokenizer, weights drawn with ``seed`` by the
    model's own initialisation, saved in bf16 safetensors. Returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    for name in TARGET_FILES[2:]:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


# ---- stages -------------------------------------------------------------------------------------------------------
def run_stage(name: str, cmd: list[str], env: dict, timeout: float, log) -> dict:
    """Run one command line with a time cap; the stage's record (never raises for a failed command)."""
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
    log.write(f"===== {name}: {' '.join(cmd)}\n{output}\n")
    log.flush()
    backend = re.search(r"collectives\s+(\w+)\s+on\s+([\w:]+)", output)  # run.py's plan summary
    compiles = re.search(r"flex attention: (\d+) compile", output)
    return {"stage": name, "rc": rc, "cap_s": timeout, "seconds": round(time.monotonic() - start, 1),
            "backend": " on ".join(backend.groups()) if backend else None,
            "flex_compiles": int(compiles.group(1)) if compiles else None, "command": " ".join(cmd),
            "tail": output[-1500:]}


def _losses(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    losses = [r["loss"] for r in records if "loss" in r]
    return {"steps": len(records), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "export": (run_dir / "export" / "model.safetensors").is_file()}


def run_e2e(smoke: bool, assets: Path, work: Path, report: dict, save, log) -> None:
    """target → online → check_export → eval, each capped by ``STAGES``; records in ``report["e2e"]``."""
    from recipe.demo import subprocess_env

    sizes, py, stages = E2E["smoke" if smoke else "gpu"], sys.executable, report["e2e"]
    env = subprocess_env(2 if smoke else 1)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a plain `python run.py` is a one-process run with its own rendezvous
    env["COLUMNS"] = "200"  # rich wraps at 80 columns in a pipe
    target, run_dir = work / "target", work / "online"
    build = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from scripts.gpu_check import build_random_target; "
             f"from pathlib import Path; build_random_target(Path({str(assets / 'target_source')!r}), "
             f"Path({str(target)!r}), {sizes['target']!r})")
    cfg = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg.update(train_batch_size=sizes["batch"], train_micro_batch_size_per_gpu=sizes["micro"])
    ds_config = work / "zero3_bf16.json"
    ds_config.write_text(json.dumps(cfg, indent=2))
    plan = {
        "target": [py, "-c", build],
        "online": [py, "run.py", "--ds_config", str(ds_config), "--target", str(target), "--data",
                   str(assets / "conversations.jsonl"), "--output", str(run_dir), "--max-length",
                   str(sizes["max_length"]), "--ttt-steps", str(sizes["ttt_steps"]), "--draft-vocab-size",
                   str(sizes["draft_vocab"]), "--max-steps", str(sizes["steps"]), "--limit",
                   str(sizes["conversations"]), "--cache-dir", str(work / "cache")],
        "check_export": [py, "-m", "recipe.export", "--check", str(run_dir / "export")],
        "eval": [py, "-m", "recipe.eval", "--target", str(target), "--draft", str(run_dir / "export"), "--prompts",
                 str(assets / "prompts.jsonl"), "--limit", str(sizes["prompts"]), "--num-draft-tokens", "3",
                 "--max-new-tokens", str(sizes["new_tokens"]), "--device", "cpu" if smoke else "cuda",
                 "--output", str(work / "eval.json")],
    }
    for name, cmd in plan.items():
        record = run_stage(name, cmd, env, stage_cap(name, smoke), log)
        if name == "online":
            record.update(_losses(run_dir))
        if name == "eval" and (work / "eval.json").is_file():
            result = json.loads((work / "eval.json").read_text())
            record.update(tau=result["tau"], draft_dtypes=result["draft_dtypes"])
        stages.append(record)
        save()


# ---- table --------------------------------------------------------------------------------------------------------
def table_rows(smoke: bool, out: Path, started: float) -> list[dict]:
    """The table (in this process): one row per length, each catching its own errors; rows are appended to
    ``out/table.json`` as they finish. A row whose cap no longer fits the table's cap is "not run"."""
    import dataclasses

    import torch

    from kernels.flex_attention import flex_compile_stats
    from recipe.bench.measure import build_model, random_batch, time_step

    device = torch.device("cpu" if smoke else "cuda")
    plans = {} if smoke or not PLAN_FILE.is_file() else json.loads(PLAN_FILE.read_text())["rows"]
    rows, path = [], out / "table.json"
    for name, cap in stage_plan(smoke)[len(STAGES) - 1:]:
        length = int(name.split(":")[1])
        spec = table_spec(smoke, length)
        row = {"length": length, "cap_s": cap, "spec": dataclasses.asdict(spec),
               "plan": planned_peak(spec) if smoke else plans.get(str(length))}
        if time.monotonic() - started + cap > stage_cap("table", smoke) + 5:
            row.update(status="not run", detail="the table's time cap would be exceeded")
        else:
            t0, model = time.monotonic(), None
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                model = build_model(spec, device)
                row.update(time_step(model, random_batch(spec, device), spec.steps), status="ok")
                row["tokens_per_s"] = spec.batch * length / row["seconds"]
            except torch.OutOfMemoryError as exc:
                row.update(status="oom", detail=str(exc).splitlines()[0])
            except Exception as exc:  # noqa: BLE001 - recorded, the next row still runs
                row.update(status="error", detail=f"{type(exc).__name__}: {str(exc)[:500]}")
            del model
            if device.type == "cuda":
                row.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                           max_memory_reserved=torch.cuda.max_memory_reserved())
                torch.cuda.empty_cache()
            row["seconds_wall"] = round(time.monotonic() - t0, 1)
        row["flex"] = flex_compile_stats()
        rows.append(row)
        path.write_text(json.dumps(rows, indent=1))
    return rows


def table_spec(smoke: bool, length: int):
    """The ``recipe.bench.measure.BenchSpec`` of a table row: bf16, every memory switch on (loss chunks, per-step
    checkpointing, flex on the GPU; the tiled kernel on the CPU, where flex has no backward)."""
    from recipe.bench.measure import BenchSpec

    return BenchSpec(seq_len=length, layout="chunked+ckpt", ttt_steps=2 if smoke else 7, dtype="bf16",
                     device="cpu" if smoke else "cuda", loss_chunk_size=32 if smoke else 4096,
                     attention_tile=32 if smoke else 1024, attention_backend="tiled" if smoke else "flex", steps=2,
                     **(SMOKE_DRAFT if smoke else LLAMA_8B_DRAFT))


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


def run_table(smoke: bool, out: Path, report: dict, save, log) -> None:
    """The table in a child process capped at ``STAGES["table"]``; its rows (however far it got) into ``report``."""
    from recipe.demo import subprocess_env

    cmd = [sys.executable, str(Path(__file__).resolve()), "--table-child", "--out", str(out)] + (
        ["--smoke"] if smoke else [])
    env = subprocess_env(1 if smoke else max(1, os.cpu_count() or 1))
    record = run_stage("table", cmd, env, stage_cap("table", smoke), log)
    path = out / "table.json"
    report["table"] = {"stage": record, "rows": json.loads(path.read_text()) if path.is_file() else []}
    save()


# ---- entry --------------------------------------------------------------------------------------------------------
def collect(src: Path) -> Path:
    """Copy ``src/gpu_check.json`` to ``docs/results/gpu/gpu_check_<date>.json`` with the commit it ran."""
    report = json.loads((src / "gpu_check.json").read_text())
    dest = ROOT / "docs" / "results" / "gpu" / f"gpu_check_{date.today().isoformat()}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1) + "\n")
    return dest


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.dry_run:
        plan = stage_plan(args.smoke)
        for name, cap in plan:
            print(f"{name:<14} {cap:>4} s")
        print(f"{'total':<14} {sum(c for _, c in plan):>4} s (budget {BUDGET_S} s)")
        return 0
    if args.prepare:
        print(f"wrote {prepare_carry(args.prepare, E2E['gpu']['conversations'], E2E['gpu']['prompts'])}")
        return 0
    if args.collect:
        print(f"wrote {collect(args.collect)}")
        return 0
    if args.plan_rows:
        print(f"wrote {write_plan_rows()}")
        return 0
    started = time.monotonic()
    out = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    if args.table_child:
        table_rows(args.smoke, out, started)
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --smoke for the CPU test run", file=sys.stderr)
        return 2
    report = {"info": {"device": torch.cuda.get_device_name(0) if not args.smoke else "cpu (smoke)",
                       "torch": torch.__version__, "commit": _commit(), "date": date.today().isoformat(),
                       "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory if not args.smoke
                       else None, "parts": parts, "stage_caps_s": dict(stage_plan(args.smoke))}, "e2e": []}
    path = out / "gpu_check.json"

    def save():
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=1))

    save()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, open(out / "gpu_check.log", "w") as log:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "e2e" in parts:
            sizes = E2E["smoke" if args.smoke else "gpu"]
            assets = args.assets or prepare_carry(work / "assets", sizes["conversations"], sizes["prompts"])
            run_e2e(args.smoke, assets, work, report, save, log)
        if "table" in parts:
            run_table(args.smoke, out, report, save, log)
    save()
    print(json.dumps({"e2e": [(s["stage"], s["rc"], s["seconds"]) for s in report["e2e"]],
                      "table": [(r["length"], r["status"], r.get("max_memory_allocated"))
                                for r in report.get("table", {}).get("rows", [])],
                      "elapsed_s": report["elapsed_s"]}, indent=1))
    print(f"wrote {path}")
    failed = [s["stage"] for s in report["e2e"] if s["rc"] != 0]
    failed += [r["length"] for r in report.get("table", {}).get("rows", []) if r["status"] not in ("ok", "not run")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
