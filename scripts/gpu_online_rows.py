"""The rows of ``scripts/gpu_online_check.py``: what each ``run.py`` row trains (its DeepSpeed JSON, length, steps,
resume), how long it is expected to take, the child process that runs ``run.main`` with the CUDA allocator's peaks
recorded, and the row's record made from what the run wrote (``metrics.jsonl``, ``run_config.json``) beside the
planner's prediction of exactly that run.

Every row trains the 8B-shaped random target (``recipe.target.random_target``, Llama-3.1-8B-Instruct's config) on
samples chained from the carried conversations (``--chain-conversations`` of ``length + CHAIN_SLACK`` tokens, cut at
``--max-length length``, so every chain but a file's last is exactly ``length`` tokens long), K = 7, draft
vocabulary 32000, global batch 1 (micro 1, no accumulation).
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAIN_SLACK = 8192
"""Chain budget above the row's length: the carried conversations render to at most ~6k tokens each, so a chain's
conversations sum to more than the length and the sample is cut to exactly it."""


@dataclass(frozen=True)
class Row:
    """One ``run.py`` row: ``length`` tokens (``"longest"``: the planner's longest fit for the device), ``base`` the
    shipped DeepSpeed JSON, ``steps`` (``--max-steps``), ``mlp_tile`` (``memory.mlp_tile_size``), ``save_every``
    (``--save-every``), ``resume`` (the row whose checkpoint of step ``resume_step`` it resumes, in its own
    ``--output``), ``export`` (False: ``--no-export``)."""

    name: str
    length: int | str
    base: str
    steps: int
    mlp_tile: int | None = None
    save_every: int = 0
    resume: str | None = None
    resume_step: int = 0
    export: bool = False


ROWS = (
    Row("8k_zero1", 8192, "zero1_bf16.json", 3, save_every=2),
    Row("8k_zero3_resume", 8192, "zero3_bf16.json", 3, resume="8k_zero1", resume_step=2, export=True),
    Row("32k_zero1", 32768, "zero1_bf16.json", 3),
    Row("128k_zero1_mlp", 131072, "zero1_bf16.json", 2, mlp_tile=4096),
    Row("longest_zero1_mlp", "longest", "zero1_bf16.json", 2, mlp_tile=4096),
)
"""In running order. ``8k_zero3_resume`` continues ``8k_zero1`` from its step-2 checkpoint under ZeRO-3 (a layout
change: ``recipe.lifecycle.reshard``); its step 3 is compared with the straight run's step 3."""
ROW = {r.name: r for r in ROWS}
SMOKE_LENGTHS = {8192: 128, 32768: 256, 131072: 384, "longest": 512}
SMOKE_MLP_TILE = 64


def row_length(row: Row, smoke: bool, longest: int | None) -> int | None:
    """The row's tokens: the smoke size, the fixed length, or ``longest`` (None when unknown)."""
    if smoke:
        return SMOKE_LENGTHS[row.length]
    return longest if row.length == "longest" else int(row.length)


ROW_MEMORY = {"loss_chunk_size": 4096, "checkpoint_ttt_steps": True, "attention_tile_size": 1024,
              "teacher_logits_once": True, "mlp_tile_size": None}
"""The memory switches every row runs with, written out (the shipped bf16 configs say "auto", which a run resolves
for its free memory): the rows compare the allocator with the planner for these fixed switches."""


def row_ds_config(row: Row, smoke: bool) -> dict:
    """The row's DeepSpeed JSON: ``ds_configs/<base>`` at global batch 1 (micro 1, no accumulation), its memory
    section :data:`ROW_MEMORY` with ``memory.mlp_tile_size`` when the row tiles the MLP. The planner plans from this
    same dict (``--plan-rows``)."""
    cfg = json.loads((ROOT / "ds_configs" / row.base).read_text())
    cfg.pop("_comment", None)
    cfg.update(train_batch_size=1, train_micro_batch_size_per_gpu=1)
    cfg["memory"] = dict(ROW_MEMORY)
    if row.mlp_tile:
        cfg["memory"]["mlp_tile_size"] = SMOKE_MLP_TILE if smoke else row.mlp_tile
    return cfg


def row_argv(row: Row, length: int, work: Path, data: Path, smoke: bool) -> list[str]:
    """``run.py``'s flags for the row (writes its DeepSpeed JSON into ``work``)."""
    ds = work / f"ds_{row.name}.json"
    ds.write_text(json.dumps(row_ds_config(row, smoke), indent=1))
    argv = ["--ds_config", str(ds), "--target", str(work / "target"), "--data", str(data),
            "--chain-conversations", str(length + (256 if smoke else CHAIN_SLACK)), "--max-length", str(length),
            "--output", str(work / row.name), "--max-steps", str(row.steps), "--ttt-steps", "2" if smoke else "7",
            "--draft-vocab-size", "16384" if smoke else "32000", "--cache-dir", str(work / "cache"), "--seed", "0",
            "--save-every-minutes", "0", "--hang-timeout-minutes", "9"]
    if row.save_every:
        argv += ["--save-every", str(row.save_every)]
    if row.resume:
        argv += ["--resume", str(work / row.resume / "checkpoints" / f"step-{row.resume_step:08d}")]
    if not row.export:
        argv.append("--no-export")
    return argv


# ---- time estimates --------------------------------------------------------------------------------------------
def target_forward_flops(length: int, layers: int = 32, layer_params: int = 218_103_808, width: int = 4096) -> float:
    """FLOPs of the 8B target's forward over one sample (``recipe.model.flops``' formula: 2 per matmul weight and
    position, 4·d per causal (query, key) pair and layer). Defaults: Llama-3.1-8B's 32 layers of q/k/v/o + MLP
    weights (4096·(32 + 16)·128 + 4096² + 3·4096·14336) and d = 4096."""
    return 2.0 * layers * layer_params * length + 4.0 * width * layers * length * (length + 1) / 2


def step_seconds(length: int, mlp_tile: bool, est: dict) -> float:
    """A training step's estimated seconds: the draft's step from the H200 table's fit (``est`` draft_step_linear +
    draft_step_quadratic at 32k units: 4k 0.26 s, 32k 2.81 s, 128k 21.89 s measured with the MLP untiled), times
    ``mlp_tile_factor`` for the MLP tiles' recompute, plus the target's forward at ``target_tflops``."""
    x = length / 32768
    draft = est["draft_step_linear"] * x + est["draft_step_quadratic"] * x * x
    return draft * (est["mlp_tile_factor"] if mlp_tile else 1.0) + target_forward_flops(length) / (
        est["target_tflops"] * 1e12)


def row_estimate(row: Row, length: int, first: bool, est: dict) -> dict[str, float]:
    """The row's seconds by part (``ESTIMATES_S`` terms; ``first``: the first run.py of the call compiles the kernels
    and tokenises the data, later ones hit Inductor's and the datasets cache)."""
    saves = 1 + (1 if row.save_every and row.save_every < row.steps else 0)
    parts = {"run_start": est["run_start"], "target_load": est["target_load"],
             "data": est["data"] if first else est["data_cached"],
             "compile": est["compile"] if first else est["compile_cached"],
             "steps": (row.steps - row.resume_step) * step_seconds(length, bool(row.mlp_tile), est),
             "save": saves * est["save"]}
    if row.resume:
        parts["resume_load"] = est["resume_load"]
    if row.export:
        parts["export"] = est["export"]
    return parts


# ---- the child: run.main with the allocator's peaks --------------------------------------------------------------
class DevicePoll(threading.Thread):
    """Samples ``torch.cuda.mem_get_info`` every ``interval`` s: the largest device-used bytes and the largest
    used − reserved (memory outside the caching allocator: CUDA context, NCCL, cuBLAS/Triton workspaces)."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.used_max, self.outside_max, self.stop = interval, 0, 0, threading.Event()

    def run(self):
        import torch

        while not self.stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.used_max = max(self.used_max, total - free)
            self.outside_max = max(self.outside_max, total - free - torch.cuda.memory_reserved())
            self.stop.wait(self.interval)


class _Tee:
    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


DATA_LINE = re.compile(r"(\d+) samples, longest (\d+) tokens; truncated at --max-length: (\d+)")


def run_row_child(argv: list[str], out: Path) -> int:
    """Run ``run.main(argv)`` in this process (expandable segments set first, as run.py does), then write ``out``
    (JSON): ``run_rc``, ``run_seconds`` (run.main's, without this process's start), ``max_memory_allocated`` /
    ``max_memory_reserved`` (bytes), the polled
    ``device_used_max`` / ``outside_allocator_max``, the data report's ``samples`` / ``longest`` / ``truncated``
    and the device name. Returns run.main's exit code."""
    sys.path.insert(0, str(ROOT))
    from recipe.lifecycle.distributed import default_cuda_alloc_conf

    default_cuda_alloc_conf()
    import torch

    import run

    cuda = torch.cuda.is_available()
    poll = DevicePoll() if cuda else None
    if poll:
        poll.start()
    tee, err = _Tee(sys.stderr), sys.stderr
    sys.stderr = tee
    t0 = time.monotonic()
    try:
        rc = run.main(argv)
    except BaseException as exc:  # noqa: BLE001 - recorded; the parent reads the record
        rc, tee.parts = f"{type(exc).__name__}: {exc}"[:500], tee.parts
    finally:
        sys.stderr = err
    record = {"run_rc": rc, "run_seconds": round(time.monotonic() - t0, 1)}
    if cuda:
        poll.stop.set()
        poll.join(2)
        record.update(device=torch.cuda.get_device_name(0), max_memory_allocated=torch.cuda.max_memory_allocated(),
                      max_memory_reserved=torch.cuda.max_memory_reserved(), device_used_max=poll.used_max,
                      outside_allocator_max=poll.outside_max)
    found = DATA_LINE.search("".join(tee.parts))
    if found:
        record.update(samples=int(found[1]), longest=int(found[2]), truncated=int(found[3]))
    out.write_text(json.dumps(record, indent=1))
    return rc if isinstance(rc, int) else 1


# ---- the row's record ------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    """The step records of ``run_dir/metrics.jsonl`` (validation records left out)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in records if "loss" in r]


def mfu_fields(run_dir: Path, target: Path, lengths: list[int], supervised: int, seconds: float,
               device: str | None) -> dict:
    """``{"model_tflops_per_gpu", "mfu", "flops_model"}`` of one step (the target's forward counted) from the FLOP
    model ``recipe.model.flops`` when it is present, else ``mfu`` None and ``flops_model`` saying why (a hook: the
    FLOP model is being added beside this script)."""
    try:
        import torch
        from transformers import AutoConfig

        from recipe.model import flops  # optional (the FLOP model): the row is recorded without it
        from recipe.model.draft_config import Eagle3DraftConfig

        cfg = json.loads((run_dir / "run_config.json").read_text())
        shape = flops.DraftShape.of_config(Eagle3DraftConfig.from_hf_dict(cfg["draft_config"]),
                                           int(cfg["args"]["ttt_steps"]), bool(cfg["args"].get("freeze_lm_head")))
        memory = type("Memory", (), {**{"teacher_logits_once": True}, **cfg["memory"]})
        recompute = flops.Recompute.of_memory(memory, cfg["kernels"]["attention"])
        step = flops.step_flops(shape, lengths, recompute, target=flops.TargetShape.of_config(
            AutoConfig.from_pretrained(target)), supervised=supervised)
        peak = flops.device_peak_tflops(device, torch.bfloat16)
        return {**flops.speed_fields(step.model_total, seconds, 1, peak), "model_flops": step.model_total,
                "hardware_flops": step.hardware_total, "peak_tflops": peak, "flops_model": "recipe.model.flops"}
    except Exception as exc:  # noqa: BLE001 - the hook must not cost the row
        return {"mfu": None, "flops_model": f"unavailable: {type(exc).__name__}: {exc}"[:300]}


def plan_fields(plan: dict | None) -> dict:
    """The planner's prediction of the run (``--plan-rows``): its ``total`` per rank and ``tensors`` (the total less
    the fixed overheads ``cuda_context``, ``nccl`` and ``allocator_slack``: what the caching allocator should
    hold at its peak), bytes."""
    if not plan or "total" not in plan:
        return {"plan": plan}
    fixed = plan["cuda_context"] + plan["nccl"] + plan["allocator_slack"]
    return {"plan": plan, "planned_total": plan["total"], "planned_tensors": plan["total"] - fixed}


def row_record(row: Row, length: int, raw: dict, run_dir: Path, target: Path, plan: dict | None) -> dict:
    """The row's measurements (module docstring; docs/results/gpu/README.md lists every field)."""
    steps = read_metrics(run_dir)
    rec = {**raw, "length": length, "steps": [r["step"] for r in steps], "time_s": [r["time_s"] for r in steps],
           "loss": [r["loss"] for r in steps], "loss_first": steps[0]["loss"] if steps else None,
           "loss_last": steps[-1]["loss"] if steps else None, **plan_fields(plan)}
    later = steps[1:]
    if later:
        mean = lambda key: sum(r[key] for r in later) / len(later)  # noqa: E731
        seconds, supervised = mean("time_s"), mean("tokens")
        if all("positions" in r for r in later):  # run.py records each step's positions (recipe.train.metrics)
            positions, source = mean("positions"), "metrics.jsonl"
        elif raw.get("samples") is not None and raw.get("truncated") == raw.get("samples"):
            positions, source = length, "--max-length (every sample was cut at it)"
        else:  # a file's last chain may be shorter than the length: positions/s is then an upper bound
            positions, source = length, "--max-length (an upper bound: not every sample reached it)"
        rec.update(seconds_per_step=seconds, positions_per_step=positions, positions_source=source,
                   supervised_per_step=supervised,
                   tokens_per_s={"positions": positions / seconds, "supervised": supervised / seconds})
        if all(r.get("model_tflops_per_gpu") is not None for r in later):  # run.py's own FLOP count and MFU
            rec.update(model_tflops_per_gpu=mean("model_tflops_per_gpu"), flops_model="metrics.jsonl (run.py)",
                       mfu=mean("mfu") if all(r.get("mfu") is not None for r in later) else None)
        else:
            rec.update(mfu_fields(run_dir, target, [int(positions)], int(supervised), seconds, raw.get("device")))
    if raw.get("max_memory_allocated") and rec.get("planned_tensors"):
        rec["allocated_over_planned_tensors"] = raw["max_memory_allocated"] / rec["planned_tensors"]
        rec["device_over_planned_total"] = (raw["max_memory_reserved"] + raw["outside_allocator_max"]) / \
            rec["planned_total"]
    return rec


def resume_continuity(straight: list[dict], resumed: list[dict]) -> dict:
    """The resumed run's losses against the straight run's at the same steps: ``{"steps", "straight", "resumed",
    "max_rel_diff"}`` (None without a common step)."""
    by_step = {r["step"]: r["loss"] for r in straight}
    common = [r for r in resumed if r["step"] in by_step]
    diffs = [abs(r["loss"] - by_step[r["step"]]) / max(abs(by_step[r["step"]]), 1e-12) for r in common]
    return {"steps": [r["step"] for r in common], "straight": [by_step[r["step"]] for r in common],
            "resumed": [r["loss"] for r in common], "max_rel_diff": max(diffs) if diffs else None}


# ---- helpers of the schedule and the eval's record -------------------------------------------------------------
def gpu_key(device: str | None) -> str | None:
    """``"h100"`` / ``"h200"`` from a CUDA device name (the planner's GPU names), else None."""
    name = (device or "").lower()
    return next((k for k in ("h200", "h100") if k in name), None)


def fitting(rows: list[Row], plans: dict, gpu: str | None) -> list[Row]:
    """``rows`` less those the planner says do not fit ``gpu`` (``--plan-rows``): they are skipped, not scheduled."""
    planned = plans.get("gpus", {}).get(gpu or "", {}).get("rows", {})
    return [r for r in rows if planned.get(r.name, {}).get("fits", True)]


def eval_length_record(entry: dict) -> dict:
    """One context length of the eval: tokens, prefill seconds, device peaks, and per run the seconds per
    verification step ((decoding seconds − the prefill) / verification steps: the draft's k proposals and the
    target's verification forward)."""
    runs = [{"draft": r["draft"], "k": r["num_draft_tokens"], "tau": r["tau"], "verify_steps": r["verify_steps"],
             "seconds_per_verification_step": (r["seconds"] - entry["prefill_seconds"]) / r["verify_steps"]
             if r["verify_steps"] else None} for r in entry["runs"]]
    return {"context_length": entry["context_length"], "mean_prompt_tokens": entry["mean_prompt_tokens"],
            "prefill_seconds": entry["prefill_seconds"], "device_memory": entry["device_memory"], "runs": runs,
            "mismatches": len(entry["mismatches"])}
