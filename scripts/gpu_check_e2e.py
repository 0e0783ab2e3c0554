"""The end-to-end part of ``scripts/gpu_check.py``: the carried assets and their provenance, the random-weight target,
the stage runner, and the target → online → check_export → eval command lines (run.py and the recipe's modules,
each a subprocess with a time limit). A missing online export is replaced by a random-weight draft export of the same
geometry (``random_export``), so the export check and the eval still run."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
PROVENANCE = "provenance.json"
"""The file ``--prepare`` writes into the carried assets (``provenance()``): the report's commit and versions."""
E2E = {"gpu": dict(conversations=40, max_length=2048, steps=5, batch=4, micro=2, ttt_steps=7, draft_vocab=32000,
                   prompts=2, new_tokens=32, target={}),
       "smoke": dict(conversations=12, max_length=128, steps=3, batch=2, micro=1, ttt_steps=2, draft_vocab=256,
                     prompts=2, new_tokens=4, target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                                          num_attention_heads=4, num_key_value_heads=2,
                                                          head_dim=16))}


# ---- assets, provenance and the random target ---------------------------------------------------------------------
def provenance() -> dict:
    """The commit this tree is at, its uncommitted files, the date and the versions here (read with git, which is
    here; the device has no ``.git``)."""
    from importlib.metadata import PackageNotFoundError, version

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    versions = {}
    for dist in ("torch", "transformers", "deepspeed", "datasets"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    return {"commit": git("rev-parse", "HEAD").strip() or None, "branch": git("branch", "--show-current").strip(),
            "uncommitted": [line[3:] for line in git("status", "--porcelain").splitlines()],
            "prepared": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions_here": versions}


def prepare_carry(out: Path, conversations: int, prompts: int) -> Path:
    """Write ``out/target_source`` (SmolLM2's config and tokenizer files), ``out/conversations.jsonl`` and
    ``out/prompts.jsonl`` (the first records of ShareGPT and MT-Bench) from the ``recipe.assets`` cache, and
    ``out/provenance.json`` (:func:`provenance`)."""
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
    (out / PROVENANCE).write_text(json.dumps(provenance(), indent=1) + "\n")
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


def random_export(target: Path, out: Path, draft_vocab: int, seed: int = 0) -> Path:
    """A bf16 export of a random-weight draft of ``target``'s geometry (``recipe.target.registry.draft_config_for``)
    at ``out``: what ``check_export`` and ``eval`` use when the online stage left no export."""
    import torch
    from transformers import AutoConfig

    from recipe.export import export_tensors, write_export
    from recipe.model.draft import Eagle3Draft
    from recipe.target.registry import draft_config_for

    config = draft_config_for(AutoConfig.from_pretrained(target), draft_vocab)
    draft = Eagle3Draft(config, seed=seed).to(torch.bfloat16)
    return write_export(export_tensors(draft.state_dict()), config.to_hf_dict(), out)


# ---- stages -------------------------------------------------------------------------------------------------------
def run_stage(name: str, cmd: list[str], env: dict, timeout: float, cap: int, log) -> dict:
    """Run one command line with a time limit; the stage's record (never raises for a failed command)."""
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
    print(f"gpu_check: {name}: rc {rc} in {time.monotonic() - start:.1f} s (cap {cap} s, allowed {timeout:.0f} s)",
          flush=True)
    return {"stage": name, "rc": rc, "cap_s": cap, "allowed_s": round(timeout, 1),
            "seconds": round(time.monotonic() - start, 1),
            "backend": " on ".join(backend.groups()) if backend else None,
            "flex_compiles": int(compiles.group(1)) if compiles else None, "command": " ".join(cmd),
            "tail": output[-1500:]}


def skipped(name: str, why: str) -> dict:
    print(f"gpu_check: {name}: skipped ({why})", flush=True)
    return {"stage": name, "rc": "skipped", "detail": why}


def _losses(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    losses = [r["loss"] for r in records if "loss" in r]
    return {"steps": len(records), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "export": (run_dir / "export" / "model.safetensors").is_file()}


def e2e_commands(smoke: bool, assets: Path, work: Path) -> dict[str, list[str]]:
    """The e2e stages' command lines (target, online, check_export, eval); writes the run's DeepSpeed config."""
    sizes, py = E2E["smoke" if smoke else "gpu"], sys.executable
    target, run_dir = work / "target", work / "online"
    build = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from scripts.gpu_check_e2e import build_random_target; "
             f"from pathlib import Path; build_random_target(Path({str(assets / 'target_source')!r}), "
             f"Path({str(target)!r}), {sizes['target']!r})")
    cfg = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg.update(train_batch_size=sizes["batch"], train_micro_batch_size_per_gpu=sizes["micro"])
    ds_config = work / "zero3_bf16.json"
    ds_config.write_text(json.dumps(cfg, indent=2))
    return {
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


def run_e2e_stage(name: str, ctx: dict) -> dict:
    """One e2e stage by name (``ctx``: smoke, work, cmds, env, schedule, log); the check_export stage first writes a
    random-weight export when the online stage left none."""
    smoke, work, sched = ctx["smoke"], ctx["work"], ctx["schedule"]
    run_dir, target = work / "online", work / "target"
    if name != "target" and not (target / "config.json").is_file():
        return skipped(name, "the target stage wrote no target")
    extra = {}
    if name == "check_export":
        extra["export_source"] = "online"
        if not (run_dir / "export" / "model.safetensors").is_file():
            try:
                random_export(target, run_dir / "export", E2E["smoke" if smoke else "gpu"]["draft_vocab"])
                extra["export_source"] = "random weights (the online stage left no export)"
            except Exception as exc:  # noqa: BLE001 - recorded; the check below then fails on the missing export
                extra["export_source"] = f"none: {type(exc).__name__}: {exc}"[:500]
    record = run_stage(name, ctx["cmds"][name], ctx["env"], sched.timeout(name), sched.caps[name], ctx["log"])
    record.update(extra)
    if name == "online":
        record.update(_losses(run_dir))
    if name == "eval" and (work / "eval.json").is_file():
        result = json.loads((work / "eval.json").read_text())
        record.update(tau=result["tau"], draft_dtypes=result["draft_dtypes"])
    return record


def e2e_env(smoke: bool) -> dict:
    """The e2e stages' environment: ``recipe.processes.subprocess_env`` without a launcher's rank variables, wide rich."""
    from recipe.processes import subprocess_env

    env = subprocess_env(2 if smoke else 1)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a plain `python run.py` is a one-process run with its own rendezvous
    env["COLUMNS"] = "200"  # rich wraps at 80 columns in a pipe
    return env
