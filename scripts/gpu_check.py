"""GPU check on one CUDA GPU: the real run end to end under NCCL, then the memory/throughput table of an 8B draft.

Part ``e2e`` runs the recipe's own command lines as subprocesses at world size 1 (DeepSpeed picks NCCL on CUDA, gloo
on the CPU), ZeRO-3 and bf16 through ``ds_configs/zero3_bf16.json`` (memory switches on):

1. target: a folder with SmolLM2-135M-Instruct's config and tokenizer and **seeded random weights** (bf16). The
   packaged weights are too big to carry to the GPU machine and the point here is the code path, not τ.
2. ``python run.py --data ...`` (online: the target runs every step), 20 optimizer steps, export;
3. ``python -m recipe.dump``, then ``python run.py --hidden-states ...`` (offline), 20 steps, export;
4. ``python -m recipe.export --check`` of each export; ``python -m recipe.eval`` of the offline (bf16) draft on 8
   prompts.
Each stage records its exit code, seconds, the communication backend its log names, first/last loss and the tail of
its log (``OUT/gpu_check.log`` holds the whole logs).

Part ``table``: a bf16 TTT training step of a Llama-3.1-8B-shaped draft (hidden 4096, 32 query / 8 KV heads of dim
128, intermediate 14336, draft vocabulary 32000, target hidden 4096, random weights and aux states, K = 7) at 4k,
8k, 16k, 32k, 64k and 128k tokens for the layouts ``chunked+ckpt`` (every memory switch), ``chunked`` (loss chunks),
``ckpt`` (per-step checkpointing) and ``full``: peak ``torch.cuda.max_memory_allocated``, seconds per forward +
backward (mean after a warm-up step), tokens/s and the longest length that fits. The causal block is tiled
(``--attention-tile``) as training does; an out-of-memory length is recorded (``"oom"``) and the layout's longer
lengths are skipped.

Results go to ``OUT/gpu_check.json`` (OUT = ``--out``, else ``$OUT``, else ./gpu_check_out), rewritten after every
stage and measurement, so a run stopped by its time limit still leaves what it did; ``--deadline-s`` (from the start)
stops starting new stages and measurements. Work files (target, store, runs) go to ``--work`` (default: a temporary
folder), never to OUT.

Usage::

    python scripts/gpu_check.py --prepare gpu_assets        # here: SmolLM2 config + tokenizer, conversations, prompts
                                                            # (about 4 MB; carry the folder to the GPU machine)
    python scripts/gpu_check.py --assets gpu_assets         # on the GPU machine (about 6 minutes)
    python scripts/gpu_check.py --smoke                     # the same code paths on the CPU at tiny sizes (tests)

The GPU machine (no internet; torch 2.11 with CUDA 13, transformers 5.17) has no DeepSpeed. Carry it as a wheel built
in an environment with torch by ``pip wheel --no-deps --no-build-isolation deepspeed==0.19.8`` (pure Python; its ops
JIT-compile on first use, which needs ninja), with its runtime dependencies hjson, py-cpuinfo, msgpack, einops,
pydantic, psutil, tqdm and ninja, and ``datasets`` with its own (dill, multiprocess, ...) where the machine lacks
them. Nothing here needs transformers newer than 5.17.

What one GPU cannot prove: NCCL cannot place two ranks on one GPU, so every multi-rank path runs here at world size
1 only. Exercised under NCCL: every flag, sum, barrier and object gather of a run (``recipe.parallel.collectives``,
world group of one rank), ZeRO-3 on one rank, bf16. Unproven on CUDA: the tensor-parallel all-reduce/all-gather of
activations, the ring's ``batch_isend_irecv``, ZeRO partitioning and gradient reduction over several ranks, and the
dp/cp/tp subgroups under NCCL; these run only under gloo on the CPU (tests/), and need a multi-GPU machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from recipe.bench.estimate import estimate_step_bytes  # noqa: E402
from recipe.bench.measure import LAYOUTS, BenchSpec, build_model, random_batch, time_step  # noqa: E402
from recipe.bench.memory import length_list, layout_list, print_report  # noqa: E402
from recipe.demo import subprocess_env  # noqa: E402

LLAMA_8B_DRAFT = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                      vocab=32000, target_hidden=4096)
SMOKE_DRAFT = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=512, vocab=512,
                   target_hidden=64)
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
# e2e sizes; the smoke target keeps SmolLM2's tokenizer (49152 ids) and shrinks the decoder
E2E = {"gpu": dict(conversations=100, max_length=2048, steps=20, batch=4, micro=2, ttt_steps=7, draft_vocab=32000,
                   prompts=8, new_tokens=32, target={}),
       "smoke": dict(conversations=12, max_length=128, steps=3, batch=2, micro=1, ttt_steps=2, draft_vocab=256,
                     prompts=2, new_tokens=4, target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                                          num_attention_heads=4, num_key_value_heads=2,
                                                          head_dim=16))}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_check_out)")
    p.add_argument("--work", type=Path, help="folder for the target, store and runs (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo), the same code paths")
    p.add_argument("--parts", default="e2e,table", help="comma-separated subset of e2e,table")
    p.add_argument("--prepare", type=Path, metavar="DIR",
                   help="only write the carry folder (SmolLM2 config + tokenizer, conversations, prompts) and exit")
    p.add_argument("--assets", type=Path, help="a folder written by --prepare (default: prepared from recipe.assets)")
    p.add_argument("--lengths", type=length_list, help="table lengths, default 4k,...,128k (smoke: 64,128)")
    p.add_argument("--layouts", type=layout_list, default=["chunked+ckpt", "chunked", "ckpt", "full"])
    p.add_argument("--ttt-steps", type=int, help="table TTT steps K (default 7; smoke 2)")
    p.add_argument("--loss-chunk-size", type=int, help="table positions per loss chunk (default 4096; smoke 32)")
    p.add_argument("--attention-tile", type=int,
                   help="table positions per causal-attention tile (default 1024; smoke 32); 0: dense [S, S] scores")
    p.add_argument("--steps", type=int, default=2, help="table steps per measurement; time = mean after the first")
    p.add_argument("--stage-timeout-s", type=float, default=300.0, help="limit of one e2e stage")
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="start no stage or measurement after this many seconds from the start")
    return p


# ---- assets and the random target ---------------------------------------------------------------------------------
def prepare_carry(out: Path, conversations: int, prompts: int) -> Path:
    """Write ``out/target_source`` (SmolLM2's config and tokenizer files), ``out/conversations.jsonl`` (the first
    ``conversations`` ShareGPT records) and ``out/prompts.jsonl`` (the first ``prompts`` MT-Bench questions) from the
    ``recipe.assets`` cache; a few MB, what the GPU machine needs. Returns ``out``."""
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
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in TARGET_FILES[2:]:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


# ---- e2e ----------------------------------------------------------------------------------------------------------
def _losses(run_dir: Path) -> tuple[int, float | None, float | None]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    losses = [r["loss"] for r in records if "loss" in r]
    return len(records), (losses[0] if losses else None), (losses[-1] if losses else None)


def run_stage(name: str, cmd: list[str], env: dict, timeout: float, log, run_dir: Path | None = None) -> dict:
    """Run one command line; the record of the stage (never raises for a failed command)."""
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
    record = {"stage": name, "rc": rc, "seconds": round(time.monotonic() - start, 1),
              "backend": " on ".join(backend.groups()) if backend else None, "command": " ".join(cmd), "tail": output[-1500:]}
    if run_dir is not None:
        record["steps"], record["loss_first"], record["loss_last"] = _losses(run_dir)
        record["export"] = (run_dir / "export" / "model.safetensors").is_file()
    return record


def run_e2e(sizes: dict, assets: Path, work: Path, device: str, report: dict, save, deadline, timeout: float,
            log) -> None:
    """The e2e stages in order (see the module docstring); each record is appended to ``report["e2e"]``."""
    py = sys.executable
    stages = report["e2e"]
    env = subprocess_env(1 if device == "cuda" else 2)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a plain `python run.py` is a one-process run with its own rendezvous
    env["COLUMNS"] = "200"  # rich wraps at 80 columns in a pipe
    target = build_random_target(assets / "target_source", work / "target", sizes["target"])
    cfg = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg.update(train_batch_size=sizes["batch"], train_micro_batch_size_per_gpu=sizes["micro"])
    ds_config = work / "zero3_bf16.json"
    ds_config.write_text(json.dumps(cfg, indent=2))
    data = assets / "conversations.jsonl"
    common = ["--ds_config", str(ds_config), "--target", str(target), "--max-length", str(sizes["max_length"]),
              "--ttt-steps", str(sizes["ttt_steps"]), "--draft-vocab-size", str(sizes["draft_vocab"]),
              "--max-steps", str(sizes["steps"]), "--limit", str(sizes["conversations"]),
              "--cache-dir", str(work / "cache")]
    plan = [
        ("online", [py, "run.py", *common, "--data", str(data), "--output", str(work / "online")], work / "online"),
        ("dump", [py, "-m", "recipe.dump", "--target", str(target), "--data", str(data), "--output",
                  str(work / "store"), "--max-length", str(sizes["max_length"]), "--limit",
                  str(sizes["conversations"]), "--cache-dir", str(work / "cache")], None),
        ("offline", [py, "run.py", *common, "--hidden-states", str(work / "store"), "--output",
                     str(work / "offline")], work / "offline"),
        ("check_online_export", [py, "-m", "recipe.export", "--check", str(work / "online" / "export")], None),
        ("check_offline_export", [py, "-m", "recipe.export", "--check", str(work / "offline" / "export")], None),
        ("eval", [py, "-m", "recipe.eval", "--target", str(target), "--draft", str(work / "offline" / "export"),
                  "--prompts", str(assets / "prompts.jsonl"), "--limit", str(sizes["prompts"]),
                  "--num-draft-tokens", "3", "--max-new-tokens", str(sizes["new_tokens"]), "--device", device,
                  "--output", str(work / "eval.json")], None),
    ]
    for name, cmd, run_dir in plan:
        if deadline():
            stages.append({"stage": name, "rc": "not run", "detail": "past --deadline-s"})
            continue
        stages.append(run_stage(name, cmd, env, timeout, log, run_dir))
        if name == "eval" and (work / "eval.json").is_file():
            result = json.loads((work / "eval.json").read_text())
            stages[-1].update(tau=result["tau"], draft_dtypes=result["draft_dtypes"])
        save()


def print_e2e(stages: list[dict], console: Console) -> None:
    table = Table(title="End to end at world size 1 (ZeRO-3, bf16, random-weight SmolLM2-shaped target)")
    for col in ("stage", "exit", "s", "backend", "steps", "loss first → last", "note"):
        table.add_column(col, justify="right" if col in ("s", "steps") else "left", no_wrap=col != "note")
    for s in stages:
        loss = (f"{s['loss_first']:.3f} → {s['loss_last']:.3f}" if s.get("loss_last") is not None else "")
        note = f"τ {s['tau']:.2f}, draft {s['draft_dtypes']}" if "tau" in s else s.get("detail", "")
        if s["rc"] not in (0, "not run"):
            note = (s.get("tail") or "").strip().splitlines()[-1:] or [""]
            note = note[0][-120:]
        table.add_row(s["stage"], str(s["rc"]), str(s.get("seconds", "")), str(s.get("backend") or ""),
                      str(s.get("steps", "")), loss, note)
    console.print(table)


# ---- table --------------------------------------------------------------------------------------------------------
def _attention_tile(args) -> int | None:
    """The tile size of the table: the flag (0 = dense block), else 32 for --smoke and 1024 on the GPU."""
    if args.attention_tile is None:
        return 32 if args.smoke else 1024
    return args.attention_tile or None


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_table(args, device: str, report: dict, save, deadline, console: Console) -> None:
    lengths = args.lengths or ([64, 128] if args.smoke else [4096, 8192, 16384, 32768, 65536, 131072])
    geometry = SMOKE_DRAFT if args.smoke else LLAMA_8B_DRAFT
    base = BenchSpec(seq_len=lengths[0], ttt_steps=args.ttt_steps or (2 if args.smoke else 7), dtype="bf16",
                     device=device, loss_chunk_size=args.loss_chunk_size or (32 if args.smoke else 4096),
                     attention_tile=_attention_tile(args), steps=args.steps, **geometry)
    budget = report["info"]["total_memory_bytes"]
    config = {**dataclasses.asdict(base), "lengths": lengths, "layouts": args.layouts, "tp": 1, "cp": 1,
              "budget_gib": None if budget is None else budget / 1024 ** 3}
    table = report["table"] = {"config": config, "results": [], "max_length": {}}
    model = build_model(base, torch.device(device))
    for layout in args.layouts:
        chunked, ckpt = LAYOUTS[layout]
        model.loss_chunk_size = base.loss_chunk_size if chunked else None
        model.checkpoint_steps = ckpt
        table["max_length"][layout], skip = None, None
        for length in lengths:
            spec = dataclasses.replace(base, seq_len=length, layout=layout)
            row = {"layout": layout, "length": length, "estimate": estimate_step_bytes(spec.shape()), "detail": ""}
            if skip or deadline():
                row["status"], row["detail"] = "not run", skip or f"past --deadline-s {args.deadline_s:g}"
            else:
                console.print(f"[dim]{layout} at {length} tokens ...[/dim]")
                try:
                    row.update(time_step(model, random_batch(spec, torch.device(device)), spec.steps), status="ok")
                except torch.OutOfMemoryError as exc:
                    row["status"], row["detail"] = "oom", str(exc).splitlines()[0]
                    skip = "a shorter length ran out of memory"
                _free_device_memory()
            if row["status"] == "ok":
                row["tokens_per_s"] = spec.batch * length / row["seconds"]
                row["fits"] = True
                table["max_length"][layout] = length
            table["results"].append(row)
            save()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.prepare:
        sizes = E2E["gpu"]
        print(f"wrote {prepare_carry(args.prepare, sizes['conversations'], sizes['prompts'])}")
        return 0
    started = time.monotonic()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --smoke for the CPU test run", file=sys.stderr)
        return 2
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.smoke else max(1, os.cpu_count() or 1))
    console = Console(width=None if sys.stdout.isatty() else 150)
    budget = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    report = {"info": {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke)",
                       "torch": torch.__version__, "total_memory_bytes": budget, "parts": parts}, "e2e": []}
    path = out_dir / "gpu_check.json"

    def save():
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=1))

    def deadline() -> bool:
        return time.monotonic() - started > args.deadline_s

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work or Path(tmp)
        if "e2e" in parts:
            sizes = E2E["smoke" if args.smoke else "gpu"]
            assets = args.assets or prepare_carry(work / "assets", sizes["conversations"], sizes["prompts"])
            with open(out_dir / "gpu_check.log", "w") as log:
                run_e2e(sizes, assets, work, device, report, save, deadline, args.stage_timeout_s, log)
            print_e2e(report["e2e"], console)
        if "table" in parts:
            run_table(args, device, report, save, deadline, console)
            print_report(report["table"], console)
    save()
    console.print(f"wrote {path}")
    failed = [s["stage"] for s in report["e2e"] if s["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
