"""The whole job on a fresh machine (``make demo``): assets, hidden-state dump, 2-rank DeepSpeed training, export,
τ of the untrained vs the trained draft on MT-Bench.

    python -m recipe.demo [--output runs/demo] [--conversations N] [--max-length N] [--epochs E] [--ttt-steps K]
        [--draft-vocab-size V] [--lr LR] [--eval-prompts N] [--max-new-tokens N] [--num-draft-tokens 5,3] ...

Stages (each skips work already done): ``recipe.assets.prepare_assets`` (cached) → ``python -m recipe.dump`` into
``OUTPUT/store-n{N}-len{L}`` (resumes finished shards) → ``deepspeed --num_gpus R run.py --ds_config
ds_configs/demo_zero3.json --hidden-states STORE ...`` (CPU: ``DS_ACCELERATOR=cpu``, gloo, ``OMP_NUM_THREADS=1``;
resumes from ``OUTPUT/checkpoints``; skipped when ``OUTPUT/export`` exists) → the seed-initialised draft exported to
``OUTPUT/export_untrained`` → ``recipe.eval`` of both drafts → ``OUTPUT/eval.json`` (top level: ``tau`` of the
trained draft and ``tau_untrained`` at the first k, ``num_draft_tokens``, ``num_prompts``, ``per_k``, ``runs``) and
the training curves ``OUTPUT/curves.png`` (``recipe.plot``, with matplotlib).
The defaults fit about 20 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe.cli import positive_int_list
from recipe.plot import CURVES_FILE, plot_note
from recipe.train.distributed import free_port

REPO = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=REPO / "runs" / "demo", help="run folder")
    p.add_argument("--conversations", type=int, default=240, help="ShareGPT conversations to dump and train on")
    p.add_argument("--max-length", type=int, default=256, help="tokens per training sample")
    p.add_argument("--epochs", type=float, default=4.0, help="passes over the dumped samples")
    p.add_argument("--max-steps", type=int, help="stop training after this many optimizer steps")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (a rerun resumes)")
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test unroll steps K")
    p.add_argument("--draft-vocab-size", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (written into the DeepSpeed JSON)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per optimizer step (global)")
    p.add_argument("--ds-config", type=Path, default=REPO / "ds_configs" / "demo_zero3.json",
                   help="DeepSpeed JSON the lr/batch overrides are applied to")
    p.add_argument("--ranks", type=int, default=2, help="training processes (CPU) or GPUs")
    p.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    p.add_argument("--eval-prompts", type=int, default=16, help="MT-Bench first turns to evaluate on, spread evenly over the file (so over its categories)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per evaluation prompt")
    p.add_argument("--num-draft-tokens", type=positive_int_list, default=[5, 3],
                   help="k values, e.g. 5,3; the first is the headline")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run(cmd: list[str], env: dict, console: Console, what: str) -> None:
    console.print(f"[bold]$ {' '.join(cmd)}[/bold]")
    rc = subprocess.call(cmd, env=env, cwd=REPO)
    if rc != 0:
        raise RuntimeError(f"{what} failed with exit code {rc}: {' '.join(cmd)}")


def subprocess_env(threads: int) -> dict:
    """The environment for the recipe's command lines run as subprocesses: this one, offline Hugging Face, ``threads``
    OpenMP threads, the repository on ``PYTHONPATH`` (also used by ``scripts/gpu_check.py``)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def stage_dump(args, assets, store: Path, console: Console) -> None:
    from recipe.data.store import HiddenStateStore

    try:
        HiddenStateStore(store).validate()
        console.print(f"dump: {store} is complete, skipped")
        return
    except Exception:  # no store yet, or an interrupted one: the dump resumes its finished shards
        pass
    threads = 1 if _cuda_count() else max(1, min(os.cpu_count() or 1, args.ranks))
    _run([sys.executable, "-m", "recipe.dump", "--target", str(assets.target), "--data", str(assets.conversations),
          "--output", str(store), "--limit", str(args.conversations), "--max-length", str(args.max_length),
          "--dtype", "bf16", "--batch-size", "8", "--cache-dir", str(args.output / "cache")],
         subprocess_env(threads), console, "hidden-state dump")


def _ds_config(args) -> Path:
    cfg = json.loads(args.ds_config.read_text())
    cfg["optimizer"]["params"]["lr"] = args.lr
    cfg["train_batch_size"] = args.batch_size
    cfg.pop("gradient_accumulation_steps", None)
    path = args.output / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def stage_train(args, assets, store: Path, console: Console) -> None:
    export = args.output / "export"
    if (export / "config.json").is_file():
        console.print(f"train: {export} exists, skipped (delete it to retrain)")
        return
    gpus = _cuda_count()
    ranks = min(args.ranks, gpus) if gpus else args.ranks
    port = str(free_port())
    if args.launcher == "deepspeed":
        launch = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port]
    else:
        launch = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks),
                  "--master_port", port]
    argv = ["run.py", "--ds_config", str(_ds_config(args)), "--target", str(assets.target),
            "--hidden-states", str(store), "--output", str(args.output), "--max-length", str(args.max_length),
            "--ttt-steps", str(args.ttt_steps), "--draft-vocab-size", str(args.draft_vocab_size),
            "--epochs", str(args.epochs), "--seed", str(args.seed), "--cache-dir", str(args.output / "cache"),
            "--save-every", str(args.save_every)]
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    if (args.output / "checkpoints" / "latest").is_file():
        argv.append("--resume")
    env = subprocess_env(1)
    if not gpus:
        env["DS_ACCELERATOR"] = "cpu"
    _run(launch + argv, env, console, "training")


def stage_untrained_export(args, assets, console: Console) -> Path:
    """The draft as training starts (same config, seed, vocab map; lm_head from the target, as run.py does),
    exported next to the trained one: ``OUTPUT/export_untrained``."""
    import torch

    from recipe.export import export_tensors, load_export, write_export
    from recipe.model.draft import Eagle3Draft
    from recipe.model.draft_config import Eagle3DraftConfig
    from recipe.model.target_head import load_embedding_and_head

    out = args.output / "export_untrained"
    if (out / "config.json").is_file():
        return out
    tensors, cfg = load_export(args.output / "export")
    draft = Eagle3Draft(Eagle3DraftConfig.from_hf_dict(cfg), seed=args.seed)
    draft.set_vocab_map(tensors["d2t"], tensors["t2d"])
    _, lm_head_VH, _ = load_embedding_and_head(assets.target, dtype=torch.float32)
    draft.init_lm_head_from_target(lm_head_VH)
    console.print(f"untrained draft (seed {args.seed}) exported to {out}")
    return write_export(export_tensors(draft.state_dict()), cfg, out)


def _settings(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def stage_eval(args, assets, ks: list[int], console: Console) -> dict:
    from recipe.eval.harness import evaluate
    from recipe.eval.prompts import read_prompts

    done = args.output / "eval.json"
    if done.is_file() and done.stat().st_mtime > (args.output / "export" / "model.safetensors").stat().st_mtime:
        previous = json.loads(done.read_text())
        if previous.get("settings") == _settings(args):
            console.print(f"eval: {done} is up to date, skipped")
            return previous

    every = read_prompts(assets.prompts)
    stride = max(1, len(every) // max(1, args.eval_prompts))
    prompts = every[::stride][: args.eval_prompts]
    drafts = {"untrained": args.output / "export_untrained", "trained": args.output / "export"}
    result = evaluate(assets.target, drafts, prompts, ks, args.max_new_tokens, console=console)
    per_k = {}
    for k in ks:
        taus = {r["draft"]: r["tau"] for r in result["runs"] if r["num_draft_tokens"] == k}
        per_k[str(k)] = {"tau": taus["trained"], "tau_untrained": taus["untrained"]}
    head = per_k[str(ks[0])]
    return {"tau": head["tau"], "tau_untrained": head["tau_untrained"], "num_draft_tokens": ks[0],
            "num_prompts": len(prompts), "per_k": per_k, **result}


def summary_table(result: dict, seconds: dict[str, float]) -> Table:
    table = Table(title="EAGLE-3 demo: acceptance length τ on MT-Bench (greedy, chain drafting)")
    for col in ("k", "τ untrained", "τ trained"):
        table.add_column(col, justify="right")
    for k, row in result["per_k"].items():
        table.add_row(k, f"{row['tau_untrained']:.3f}", f"{row['tau']:.3f}")
    table.caption = "stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ks = args.num_draft_tokens
    args.output = args.output.resolve()
    args.output.mkdir(parents=True, exist_ok=True)
    console = Console()
    seconds: dict[str, float] = {}
    start = time.perf_counter()

    def timed(name, fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        seconds[name] = time.perf_counter() - t
        return out

    from recipe.assets import prepare_assets

    assets = timed("assets", prepare_assets)
    store = args.output / f"store-n{args.conversations}-len{args.max_length}"
    try:
        timed("dump", stage_dump, args, assets, store, console)
        timed("train", stage_train, args, assets, store, console)
        if args.launcher == "deepspeed" and not (args.output / "export" / "config.json").is_file():
            raise RuntimeError("training finished without writing an export")
        timed("untrained export", stage_untrained_export, args, assets, console)
        result = timed("eval", stage_eval, args, assets, ks, console)
    except RuntimeError as exc:
        console.print(f"[bold red]demo failed[/bold red]: {exc}")
        return 1
    seconds["total"] = time.perf_counter() - start
    result["stage_seconds"] = seconds
    result["settings"] = _settings(args)
    (args.output / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(summary_table(result, seconds))
    if not (args.output / CURVES_FILE).is_file():  # run.py draws it at the end of training; a skipped one may not
        console.print(plot_note(args.output))
    console.print(f"outputs in {args.output}: export/, metrics.jsonl, curves.png, eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
