"""The rows of ``scripts/gpu_perf_check.py``: what each measures, in order of importance, the memory switches of each
(the set ``auto`` picks, and the ablations that flip one switch of it), and the time each is predicted to take.

Switch sets. Our ``auto`` rows run the switches the recipe's own ``"auto"`` resolves to (``recipe.config_memory.
MemoryOptions.resolve``, issue 50 item 2): for the geometry's longest sample and the GPU, the candidate with the fewest
hardware FLOPs whose planned per-rank total fits. That resolution traces the planner (seconds to a minute per
candidate at 8B), which the call's time cannot spare, so ``--plan-rows`` makes it here for an H100 and an H200 (as
``run.py`` would at start on that GPU, ``ds_configs/zero1_bf16.json`` at one rank, offline, the named
Llama-3.1-8B-Instruct target's geometry) and the call reads the device's entry (:func:`recipe_auto_switches`, the
hook). On another GPU the stand-in (:func:`stand_in`) applies the same rule to the plan file's predicted totals;
on the CPU smoke ``resolve`` itself gives its CPU values. Kernels as ``auto`` picks them on the device: small ops
compiled and flex with dynamic shapes on CUDA, eager small ops and sdpa on the CPU.

Estimates (``ESTIMATES_S``, seconds on one H200; ``--gpu h100`` scales the step rate): a step is its hardware FLOPs
(``recipe.plan.spec.spec_flops``, the memory switches' recompute included) at an effective rate (``tflops``), plus
the optimizer; the first of each compile variant adds its compile time. The child rescales the step rate by the
measured / predicted seconds of the last measured row of our step.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN_FILE = ROOT / "docs" / "results" / "gpu" / "plan_gpu_perf_check.json"
BUDGET_S = 540

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                vocab=128256, target_hidden=4096)
"""SpecForge's published draft geometry (Llama-3.1-8B's draft: hidden 4096, 32/8 heads, MLP 14336, Vd 32000)."""
TARGET = "Llama-3.1-8B-Instruct"
"""The shipped named config whose draft that is (``recipe.target.named``): the planner's target."""
SMOKE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=96, vocab=128,
             target_hidden=48)
TTT_STEPS = {False: 7, True: 3}
LOSS_CHUNK = {False: 4096, True: 32}
MLP_TILE = {False: 4096, True: 64}
SMOKE_LENGTHS = {2048: 64, 4096: 64, 32768: 128, 131072: 256}
"""GPU length -> the ``--smoke`` length (the 4 × 2048 rows stay 4 samples)."""

ESTIMATES_S = dict(
    start=15,        # a fresh python3 with torch, the recipe and DeepSpeed (the import stage: 14.8-16.9 s on the H200)
    cuda=5,          # the import stage's CUDA probe
    model_8b=15,     # the 8B-shaped draft drawn on the CPU, its initial tensors kept, moved to the GPU
    ds_init=10,      # NCCL at world size 1 and deepspeed.initialize (ZeRO-1 bf16: fp32 masters, Adam)
    batch=2,         # a length's random batch and the in-vocabulary flags, on the GPU
    flex_compile=30,  # flex forward + backward, dynamic shapes (the first 4k step of gpu_check: 10.3 s in all)
    small_ops_compile=30,  # the compiled small ops' graphs (norms, RoPE, SwiGLU, TTT merge, soft CE)
    flex_static_compile=30,  # flex forward + backward with static shapes, per length
    specforge_build=10,  # SpecForge's draft built on the GPU from our initial tensors, its full target head
    specforge_compile=60,  # its compiled norm, RoPE, teacher softmax and flex (KV length grows per TTT step)
    specforge_recompile=20,  # at a new length
    attention_compile=20,  # flex alone: the inference and training graphs of time_attention
    profile_export=5,  # the profiler's trace processed and its key_averages table written
    packing_compile=20,  # the packed layout's first steps: flex with document positions, new dynamic shapes
    packing_batch=1,  # a mix's batch in one layout (``recipe.bench.packing.layout_batch``, drawn on the GPU)
    optimizer=0.05,  # DeepSpeed's / SpecForge's AdamW over 0.42 B trainable parameters (fp32 masters)
    tflops=300,      # effective hardware TFLOP/s of a bf16 step (the H200 check's steps: ~260 model TFLOP/s)
    tiled_tflops=100,  # the pure-PyTorch tile loops' attention
    specforge_flops_factor=1.2,  # its full-vocabulary teacher and fp32 target slices beyond our FLOP model
    h100_rate=0.8,   # an H100's step rate against the H200's (same bf16 peak, 3.35 against 4.8 TB/s)
    margin=10,       # kept free before the call's end
)
STEPS = {2048: (1, 3), 4096: (1, 3), 32768: (1, 2), 131072: (1, 1)}
"""Length -> (warm-up steps, timed steps) of our step and SpecForge's (the first row adds a warm-up for compiles)."""


@dataclass(frozen=True)
class Switches:
    """A row's switches: ``checkpoint`` (``memory.checkpoint_ttt_steps``), ``chunked`` (``memory.loss_chunk_size``
    set), ``teacher_once`` (``memory.teacher_logits_once``), ``mlp_tiles`` (``memory.mlp_tile_size`` set),
    ``compile`` (``kernels.compile_small_ops``), ``flex_dynamic`` (the ``CompiledFlex`` shape policy)."""

    checkpoint: bool = False
    chunked: bool = False
    teacher_once: bool = True
    mlp_tiles: bool = False
    compile: bool = True
    flex_dynamic: bool = True

    @property
    def layout(self) -> str:
        """The ``recipe.plan.spec.LAYOUTS`` name of the loss chunks and checkpointing."""
        return {(False, False): "full", (True, False): "chunked", (False, True): "ckpt",
                (True, True): "chunked+ckpt"}[(self.chunked, self.checkpoint)]

    @property
    def label(self) -> str:
        """The memory switches as the plan file keys them (the kernel switches do not change memory)."""
        return self.layout + ("" if self.teacher_once else "+teacher-per-step") + ("+mlp-tiles" * self.mlp_tiles)




def candidates(row: "Row") -> list[Switches]:
    """The memory switch sets the stand-in chooses from for ``row``'s samples, in ladder order (MLP tiles, then the
    teacher logits, then the loss chunks, then checkpointing, each off before on; the teacher per step only with a
    chunked loss: unchunked, each step's loss keeps its teacher logits anyway; MLP tiles only where a sample is
    longer than one tile)."""
    out = []
    for mlp, teacher, chunked, ckpt in itertools.product((False, True) if row.length > MLP_TILE[False] else (False,),
                                                         (True, False), (False, True), (False, True)):
        if teacher or chunked:
            out.append(Switches(checkpoint=ckpt, chunked=chunked, teacher_once=teacher, mlp_tiles=mlp))
    return out


FLIPS = ("checkpoint", "teacher_once", "compile", "flex_static")


@dataclass(frozen=True)
class Row:
    """One row: ``kind`` "ours" (our step with the optimizer, ``flip`` None for the ``auto`` set, else the switch
    flipped), "specforge" (SpecForge's step), "profile" (our ``auto`` step under ``torch.profiler``), "packing" (our
    ``auto`` step on ShareGPT-length micro-batches padded against packed: ``scripts/gpu_perf_packing.py``; ``length``
    the samples' cut) or "attention" (the causal block of ``backend`` alone); ``length`` tokens per sample,
    ``batch`` samples."""

    name: str
    kind: str
    length: int
    batch: int = 1
    flip: str | None = None
    backend: str | None = None


def _geometry_rows() -> tuple[Row, ...]:
    rows = [Row("ours_auto_4x2048", "ours", 2048, 4), Row("specforge_4x2048", "specforge", 2048, 4),
            Row("ours_auto_32k", "ours", 32768), Row("ours_auto_128k", "ours", 131072),
            Row("profile_4x2048", "profile", 2048, 4), Row("profile_32k", "profile", 32768),
            Row("packing_8x2048", "packing", 2048, 8)]
    rows += [Row(f"ablate_{f}_4x2048", "ours", 2048, 4, flip=f) for f in FLIPS]
    rows += [Row("attention_flex_4k", "attention", 4096, backend="flex"),
             Row("attention_tiled_4k", "attention", 4096, backend="tiled"),
             Row("attention_flex_32k", "attention", 32768, backend="flex"),
             Row("attention_tiled_32k", "attention", 32768, backend="tiled"),
             Row("attention_flex_128k", "attention", 131072, backend="flex")]
    rows += [Row(f"ablate_{f}_32k", "ours", 32768, flip=f) for f in FLIPS]
    return (*rows, Row("specforge_32k", "specforge", 32768), Row("specforge_128k", "specforge", 131072))


ROWS = _geometry_rows()
"""In running order = order of importance: our step and SpecForge's at SpecForge's published 4 × 2048, our step at
32k and 128k (the MFU targets), the profiles, packed against padded micro-batches of 8, the ablations at 4 × 2048,
the attention kernels, the ablations at 32k, SpecForge at 32k and 128k (its whole-sequence teacher and logits: likely
past one GPU's memory)."""
ROW = {r.name: r for r in ROWS}
SMOKE_BACKENDS = {"flex": "sdpa", "tiled": "tiled"}
"""``--smoke`` attention rows: the CPU's fused kernel in flex's place (flex has no CPU backward)."""


def auto_rows() -> list[Row]:
    """The rows whose ``auto`` switch set is planned (``--plan-rows``) and resolved: our step's and the packing
    row's (at its padded bound, batch × length)."""
    return [r for r in ROWS if r.kind in ("ours", "packing") and r.flip is None]


def row_length(row: Row, smoke: bool) -> int:
    return SMOKE_LENGTHS[row.length] if smoke else row.length


def geometry(smoke: bool) -> dict:
    return SMOKE if smoke else LLAMA_8B


def bench_spec(row: Row, smoke: bool, switches: Switches, device: str):
    """The ``recipe.plan.spec.BenchSpec`` of the row's step: its geometry, length, batch and memory switches, bf16,
    flex on CUDA (the CPU's ``auto``, sdpa, in the smoke), full supervision."""
    from recipe.plan.spec import BenchSpec

    return BenchSpec(seq_len=row_length(row, smoke), batch=row.batch, layout=switches.layout,
                     ttt_steps=TTT_STEPS[smoke], dtype="bf16", device=device, loss_chunk_size=LOSS_CHUNK[smoke],
                     attention_tile=1024 if not smoke else 32, attention_backend="sdpa" if smoke else "flex",
                     mlp_tile=MLP_TILE[smoke] if switches.mlp_tiles else None,
                     teacher_logits_once=switches.teacher_once,
                     **geometry(smoke))


# ---- memory: the plan file and the stand-in -----------------------------------------------------------------------
def plan_key(row: Row, switches: Switches) -> str:
    return f"{row.batch}x{row.length}:{switches.label}"


def state_bytes(trainable: int) -> int:
    """DeepSpeed ZeRO-1 bf16 with fp32 gradient accumulation at one rank, beyond the step the planner traces (which
    holds the bf16 weights and gradients): fp32 masters and Adam's two moments (12 B per trainable parameter) and
    BF16_Optimizer's fp32 gradients (4 B; ``recipe.plan.states``)."""
    return 16 * trainable


def planned_total(entry: dict) -> int:
    """Bytes a row needs on the GPU from its plan entry: the step's peak + ``state_bytes`` + the CUDA context, times
    the planner's allocator slack (``recipe.plan.states``)."""
    from recipe.plan.states import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES

    return int((entry["peak_bytes"] + state_bytes(entry["params"]["trainable"]) + CUDA_CONTEXT_BYTES)
               * (1 + ALLOCATOR_SLACK))


def write_plan_rows(path: Path = PLAN_FILE) -> Path:
    """``path``: the planner's prediction of every (geometry, switch set) the GPU rows may run (the stand-in's
    candidates and the ablations' flips, at 4 × 2048, 32k and 128k), with each total and, per GPU, the stand-in's
    choice per geometry. Tracing takes seconds to a minute a row here; the GPU's time cannot spare it."""
    from datetime import date

    from recipe.plan import predict_step
    from recipe.plan.states import gpu_bytes

    rows, picks = {}, {}
    for row in auto_rows():
        sets = candidates(row)
        for switches in (*sets, *[flipped(s, f) for s in sets for f in FLIPS[:2]]):
            key = plan_key(row, switches)
            if key not in rows:
                entry = predict_step(bench_spec(row, False, switches, "cuda"))
                rows[key] = {**entry, "total": planned_total(entry)}
    for gpu in ("h100", "h200"):
        picks[gpu] = {f"{r.batch}x{r.length}": stand_in(r, gpu_bytes(gpu), {"rows": rows}).label
                      for r in auto_rows()}
    path.write_text(json.dumps({"command": "python scripts/gpu_perf_check.py --plan-rows",
                                "date": date.today().isoformat(), "target": TARGET, "recipe_auto": recipe_auto_plans(),
                                "rows": rows, "stand_in": picks}, indent=1) + "\n")
    return path


def _savings(s: Switches) -> int:
    return s.checkpoint + s.chunked + (not s.teacher_once) + s.mlp_tiles


def stand_in(row: Row, device_bytes: int, plans: dict) -> Switches:
    """Of :func:`candidates`, the fewest hardware FLOPs (ties: their order) whose planned total (the plan file's
    ``total``) fits ``device_bytes``; when none fits (or the plan file lacks them), the one saving the most."""
    from recipe.plan.spec import spec_flops

    sets = candidates(row)
    ranked = sorted(range(len(sets)), key=lambda i: (spec_flops(bench_spec(row, False, sets[i], "cuda"))
                                                     .hardware_total, i))
    for i in ranked:
        entry = plans.get("rows", {}).get(plan_key(row, sets[i]))
        if entry is not None and entry["total"] <= device_bytes:
            return sets[i]
    return max(sets, key=_savings)


def switches_of(memory) -> Switches:
    """The memory switches of a resolved ``recipe.config_memory.MemoryOptions`` (its chunk and tile sizes are
    ``LOSS_CHUNK`` / ``MLP_TILE`` here, the values its ``"auto"`` takes: ``AUTO_LOSS_CHUNK``, ``AUTO_MLP_TILE``)."""
    return Switches(checkpoint=bool(memory.checkpoint_ttt_steps), chunked=memory.loss_chunk_size is not None,
                    teacher_once=bool(memory.teacher_logits_once), mlp_tiles=memory.mlp_tile_size is not None)


def recipe_auto_plans() -> dict:
    """gpu -> geometry -> the recipe's resolution (``recipe.plan.load_inputs(..., length=)``, which calls
    ``MemoryOptions.resolve``): ``switches``, ``predicted_peak_bytes``, ``fits``, ``rejected`` and the run plan's
    ``line``, for each ``auto`` row's geometry on an H100 and an H200."""
    import tempfile

    from recipe.plan import load_inputs

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for gpu in ("h100", "h200"):
            out[gpu] = {}
            for row in auto_rows():
                cfg = json.loads((ROOT / "ds_configs" / "zero1_bf16.json").read_text())
                cfg.update(train_batch_size=row.batch, train_micro_batch_size_per_gpu=row.batch)
                path = Path(tmp) / f"zero1_bf16_{row.batch}.json"
                path.write_text(json.dumps(cfg))
                inputs = load_inputs(path, TARGET, gpu, world_size=1, ttt_steps=TTT_STEPS[False],
                                     draft_vocab_size=LLAMA_8B["draft_vocab"], offline=True, length=row.length)
                report = inputs.memory_report
                out[gpu][f"{row.batch}x{row.length}"] = {
                    "switches": dataclasses.asdict(switches_of(inputs.memory)), "fits": report.fits,
                    "predicted_peak_bytes": report.predicted_peak_bytes, "rejected": report.rejected,
                    "line": report.line()}
    return out


def recipe_auto_switches(row: Row, smoke: bool, gpu: str | None, plans: dict) -> tuple[Switches, str] | None:
    """THE AUTO HOOK: (switches, source) the recipe's ``"auto"`` resolves to for ``row`` on ``gpu`` ("h100",
    "h200"; from the plan file, module docstring), or on the CPU (``resolve`` without device memory); None for a
    GPU the plan file does not cover."""
    if smoke:
        from recipe.config_memory import PLANNED, MemoryOptions

        memory, report = MemoryOptions(**dict.fromkeys(PLANNED, "auto")).resolve(None, "cpu", None)
        return switches_of(memory), f"recipe auto ({report.rule}: MemoryOptions.resolve without device memory)"
    entry = plans.get("recipe_auto", {}).get(gpu or "", {}).get(f"{row.batch}x{row.length}")
    if entry is None:
        return None
    return Switches(**entry["switches"]), f"recipe auto: MemoryOptions.resolve for an {gpu} (--plan-rows)"


def auto_switches(row: Row, smoke: bool, device: str, device_bytes: int | None, plans: dict,
                  gpu: str | None = None) -> tuple[Switches, str]:
    """(switches, source) of the row's ``auto`` set: the recipe's resolution (:func:`recipe_auto_switches`), else
    the stand-in for ``device_bytes``; the kernels as ``auto`` picks them for ``device``."""
    from kernels.compile_policy import compile_on

    kernels = dict(compile=compile_on("auto", device), flex_dynamic=True)
    resolved = recipe_auto_switches(row, smoke, gpu, plans)
    if resolved is not None:
        return dataclasses.replace(resolved[0], **kernels), resolved[1]
    if device_bytes is None:
        return Switches(**kernels), "no device memory to plan against: nothing recomputed"
    return (dataclasses.replace(stand_in(row, device_bytes, plans), **kernels),
            "stand-in (a GPU the plan file does not cover): the cheapest candidate the plan fits")


def flipped(switches: Switches, flip: str | None) -> Switches:
    """``switches`` with one switch flipped (``FLIPS``; None: unchanged)."""
    if flip is None:
        return switches
    if flip == "flex_static":
        return dataclasses.replace(switches, flex_dynamic=not switches.flex_dynamic)
    return dataclasses.replace(switches, **{flip: not getattr(switches, flip)})


# ---- time -----------------------------------------------------------------------------------------------------------
def step_seconds(spec, est: dict, rate: float = 1.0, factor: float = 1.0) -> float:
    """Predicted seconds of one step of ``spec``: its hardware FLOPs at ``est["tflops"]`` × ``rate``, × ``factor``,
    plus the optimizer."""
    from recipe.plan.spec import spec_flops

    return spec_flops(spec).hardware_total * factor / (est["tflops"] * rate * 1e12) + est["optimizer"]


def attention_seconds(length: int, backend: str, est: dict, rate: float = 1.0, heads: int = 32,
                      head_dim: int = 128) -> float:
    """``recipe.bench.attention.time_attention`` of one causal block: a warm-up and two timed runs of the forward
    and of forward + backward (3.5 forwards: a flash-style backward recomputes the scores)."""
    forward = 4 * heads * head_dim * length * (length + 1) / 2
    tflops = est["tiled_tflops"] if backend == "tiled" else est["tflops"]
    return 3 * (forward + 3.5 * forward) / (tflops * rate * 1e12)


def row_estimate(row: Row, switches: Switches, done: set, est: dict, rate: float = 1.0) -> dict[str, float]:
    """The row's seconds by part. ``done``: the compile variants already paid for in this process ("flex",
    "small_ops", "flex_static:<length>", "specforge", "specforge:<length>", "attention"), updated here as the
    row would; ``rate``: the step-rate factor (the GPU's, times the child's calibration)."""
    parts = {}
    if row.kind == "attention":
        if row.backend == "flex" and "attention" not in done:
            parts["compile"] = est["attention_compile"]
            done.add("attention")
        parts["runs"] = attention_seconds(row.length, row.backend, est, rate)
        return parts
    spec = bench_spec(row, False, switches, "cuda")
    warm, timed = STEPS[row.length]
    if row.kind == "specforge":  # built for its row and released after it
        parts["build"] = est["specforge_build"]
        if "specforge" not in done:
            parts["compile"] = est["specforge_compile"]
        elif f"specforge:{row.length}" not in done:
            parts["compile"] = est["specforge_recompile"]
        done |= {"specforge", f"specforge:{row.length}"}
        parts["steps"] = (warm + timed) * step_seconds(bench_spec(row, False, Switches(), "cuda"), est, rate,
                                                       est["specforge_flops_factor"])
        return parts
    if not switches.flex_dynamic and f"flex_static:{row.length}" not in done:
        parts["compile"] = est["flex_static_compile"]
        done.add(f"flex_static:{row.length}")
    if switches.flex_dynamic and "flex" not in done:
        parts["compile"] = est["flex_compile"]
        warm += 1
        done.add("flex")
    if switches.compile and "small_ops" not in done:
        parts["compile"] = parts.get("compile", 0) + est["small_ops_compile"]
        done.add("small_ops")
    if row.kind == "packing":
        from scripts.gpu_perf_packing import packing_estimate

        for key, value in packing_estimate(row, switches, done, est, rate).items():
            parts[key] = parts.get(key, 0.0) + value
        return parts
    steps = 2 if row.kind == "profile" else warm + timed
    parts["steps"] = steps * step_seconds(spec, est, rate) * (1.5 if row.kind == "profile" else 1.0)
    if row.kind == "profile":
        parts["export"] = est["profile_export"]
    parts["batch"] = est["batch"]
    return parts
