"""``recipe.plan``: per-rank GPU memory plan of a training run, before it runs (``python -m recipe.plan``).

Per rank, by component (bytes; GiB in the table):
- ``draft_activations``: the training step's transient peak from a fake-tensor trace of the real rank-local step
  (``recipe.plan.trace``), minus the gradients (counted under ZeRO): traced directly up to a cheap length
  (:func:`trace_limit`), else extrapolated from two traced lengths (linear ``a + b·S``; dense attention three
  lengths, quadratic).
- ``weights`` / ``grads`` / ``optimizer`` / ``zero_buffers``: the draft's ZeRO states (``recipe.plan.states``).
- ``batch``: the micro-batch's aux and last hidden states on the rank; ``target_weights`` / ``target_forward``: the
  online target (none offline).
- ``cuda_context`` / ``nccl`` / ``allocator_slack``: stated constants until a GPU calibrates them.
``total = overheads + weights + grads + optimizer + zero_buffers + target_weights + batch + max(draft_activations,
target_forward)`` (the target's forward ends before the draft's step begins); a layout fits when total ≤ the GPU.

Public API: :func:`predict_step` (one ``recipe.plan.spec.BenchSpec`` row: the step bytes ``time_step`` would
measure), :class:`PlanInputs` / :func:`load_inputs` (from a ds_config, read by :func:`read_sections`, and a target) /
:func:`run_inputs` (from a run's resolved config), :func:`plan_rows` (the table of one layout), :func:`longest_fit`,
and for the memory section's ``"auto"`` (``recipe.config_memory.MemoryOptions.resolve``) :class:`PlanFacts` (each
candidate's hardware FLOPs and per-rank total) and :func:`resolve_inputs` (the inputs with the section resolved for
a GPU and length).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from recipe.config import KernelOptions, RunConfig, RunSections, load_sections
from recipe.config_keys import ConfigError
from recipe.config_memory import CPU_AUTO, MemoryOptions, MemoryReport
from recipe.model.flops import DraftShape, Recompute, step_flops
from recipe.parallel.dims import ParallelDims, seq_divisor
from recipe.plan import states
from recipe.plan.spec import DTYPES, BenchSpec, planned_sparse, spec_for_memory
from recipe.plan.states import gpu_bytes
from recipe.plan.trace import ActivationFit, fit_activation, is_dense, trace_lengths, trace_step, uses_tiles
from recipe.target.named import resolve_config

__all__ = [
    "PlanError",
    "PlanFacts",
    "PlanInputs",
    "layout_fit",
    "load_inputs",
    "longest_fit",
    "plan_length",
    "plan_rows",
    "predict_step",
    "read_sections",
    "resolve_inputs",
    "run_inputs",
    "trace_limit",
]

COMPONENTS = ("draft_activations", "weights", "grads", "optimizer", "zero_buffers", "batch", "target_weights",
              "target_forward", "cuda_context", "nccl", "allocator_slack")


class PlanError(ValueError):
    """Bad planner input; the message names the input (the CLI prints it on one line and exits 2)."""


def trace_limit(spec: BenchSpec) -> int:
    """The longest whole-sequence length traced directly (tokens): 32768·cp for flex or any backend with its own
    blocking (the trace costs O(S)), 8
    attention tiles per cp chunk for the tile loops (O((S/T)²) pairs), 16384 for dense attention; with the chunked
    loss at most 16 loss chunks per rank (each a checkpointed region the trace walks twice)."""
    if not uses_tiles(spec):
        limit = 32768 * spec.cp
    elif is_dense(spec):
        limit = 16384
    else:
        limit = 8 * spec.attention_tile * (2 * spec.cp if spec.dims.cp_enabled else 1)
    if "chunked" in spec.layout:
        limit = min(limit, 16 * spec.loss_chunk_size * spec.cp)
    return limit


def layout_fit(spec: BenchSpec, upto: int | None = None) -> ActivationFit:
    """The activation fit of ``spec``'s layout, traced at the longest cheap lengths (``trace_limit``, at most
    ``upto``): two lengths L/2 and L (three for dense attention), multiples of ``trace.trace_lengths``'s unit."""
    key = (dataclasses.replace(spec, seq_len=2 * spec.cp * spec.tp), upto)
    if key not in _FITS:
        _FITS[key] = _layout_fit(spec, upto)
    return _FITS[key]


_FITS: dict = {}  # (spec without its length, upto) -> ActivationFit: one fit per layout per process


def _layout_fit(spec: BenchSpec, upto: int | None) -> ActivationFit:
    base = trace_lengths(spec)
    unit = base[0] // 2
    top = min(trace_limit(spec), upto or trace_limit(spec))
    top = max(base[-1], top // unit * unit)
    if len(base) == 3:
        lengths = [max(unit, top // 3 // unit * unit) * m for m in (1, 2, 3)]
    else:
        lengths = [max(unit, top // 2 // unit * unit), 0]
        lengths[1] = max(top, 2 * lengths[0])
    return fit_activation(spec, lengths)


def predict_step(spec: BenchSpec, fit: ActivationFit | None = None) -> dict:
    """The planner's prediction of one ``recipe.bench.measure`` row (``scripts/gpu_check.py``, ``python -m
    recipe.bench memory``): ``{"step_bytes"`` (what ``time_step`` reports as ``step_bytes``: gradients +
    activations of one forward + backward on rank 0, bytes), ``"peak_bytes"`` (+ the model and batch live before the
    step: ``time_step``'s ``peak_bytes`` without the device's fixed overheads), ``"method"`` ("trace" or the fit's
    kind), ``"params"`` (rank-local ``trainable`` / ``frozen`` counts)``}``. Traced directly when ``spec.seq_len`` ≤
    ``trace_limit(spec)`` and no ``fit`` is given, else ``fit`` (default ``layout_fit(spec)``) at ``spec.seq_len``.
    Raises ValueError for a spec BenchSpec or the trace rejects."""
    if fit is None and spec.seq_len <= trace_limit(spec):
        t = trace_step(spec)
        return {"step_bytes": int(t.step_bytes), "peak_bytes": int(t.step_bytes + t.base_bytes), "method": "trace",
                "params": t.params}
    fit = fit or layout_fit(spec)
    step = int(fit(spec.seq_len))
    return {"step_bytes": step, "peak_bytes": int(step + fit.base(spec.seq_len)), "method": fit.kind,
            "params": fit.traces[-1].params}


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan reads: ``spec`` (draft geometry, layout, tp, cp, dtype, backend; its seq_len is replaced
    per length), ``dp``, ``zero_stage``, ``reduce_bucket`` (elements), ``params`` (``states.DraftParams``),
    ``target`` (``states.TargetShape``), ``offline``, ``partitioned_target``, ``gpu`` (name), ``gpu_bytes``,
    whether the bf16 run accumulates gradients (``fp32_grad_accum``) and reduces them (``fp32_comm``) in fp32,
    the target's architecture (``target_arch``: the ``model_type`` of its ``recipe.target.registry`` entry,
    "generic" for one it does not know; whether an online forward is split over the cp·tp ranks,
    ``recipe.target.split``, is ``recipe.target.registry.splits_target``'s rule), the argmax chunk
    (``argmax_chunk``, positions), the ``memory`` section as configured (``"auto"`` values until
    :func:`resolve_inputs`: ``spec`` then holds the CPU's values, ``recipe.config_memory.CPU_AUTO``, and
    :func:`plan_length` refuses to plan; ``sparse_anchors`` "auto" stays
    "auto" in ``spec`` too, decided per traced batch by the run's rule, ``recipe.plan.spec.planned_sparse``), the
    ``memory_report`` of its resolution and the run's ``kernels`` section (``recipe.config.KernelOptions``, resolved
    for the device planned: ``spec.attention_backend`` is its ``attention``)."""

    spec: BenchSpec
    dp: int
    zero_stage: int
    reduce_bucket: int
    params: states.DraftParams
    target: states.TargetShape
    offline: bool
    partitioned_target: bool
    gpu: str
    gpu_bytes: int
    fp32_grad_accum: bool = False
    fp32_comm: bool = False
    target_arch: str = "llama"
    argmax_chunk: int = 1024
    memory: MemoryOptions = MemoryOptions()
    memory_report: MemoryReport | None = None
    kernels: KernelOptions = KernelOptions()

    @property
    def world(self) -> int:
        return self.spec.tp * self.spec.cp * self.dp

    @property
    def dims(self) -> ParallelDims:
        """The planned run's layout: the spec's tp and cp, ``dp`` replicas."""
        return ParallelDims(world_size=self.world, tp=self.spec.tp, cp=self.spec.cp, dp=self.dp)


def _read_target_config(target: Path):
    """The target's transformers config from a folder holding config.json, a config.json file, or the public name of
    a shipped config (``recipe.target.named``: ``Llama-3.1-8B-Instruct``, ``meta-llama/Llama-3.1-8B-Instruct``)."""
    from transformers import AutoConfig  # import cost: transformers

    try:
        file = resolve_config(target)
    except FileNotFoundError as exc:
        raise PlanError(str(exc)) from None
    if not file.is_file():
        raise PlanError(f"--target {target}: no such folder with a config.json, nor a config.json file")
    try:
        data = json.loads(file.read_text())
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise PlanError(f"--target {file}: not a transformers config.json ({exc})") from None


def _ds_config_error(ds_config, exc: Exception) -> PlanError:
    """PlanError naming ``--ds_config`` once: a ConfigError's message already opens with the file's path."""
    text = str(exc)
    heads = (f"{ds_config}: ", f"{Path(ds_config)}: ")
    text = next((text[len(head):] for head in heads if text.startswith(head)), text)
    return PlanError(f"--ds_config {ds_config}: {text}")


def read_sections(ds_config: Path) -> RunSections:
    """``--ds_config`` parsed once, as run.py parses it (``recipe.config.load_sections``). Raises PlanError naming the
    file for a missing or bad one."""
    if not Path(ds_config).is_file():
        raise PlanError(f"--ds_config {ds_config}: no such file")
    try:
        return load_sections(Path(ds_config))
    except (ConfigError, ValueError, TypeError) as exc:
        raise _ds_config_error(ds_config, exc) from None


def load_inputs(ds_config: Path | RunSections, target: Path, gpu: str = "h200", world_size: int | None = None,
                tp: int | None = None, cp: int | None = None, ttt_steps: int = 7, draft_vocab_size: int = 32000,
                offline: bool = False, freeze_lm_head: bool = False, length: int | None = None) -> PlanInputs:
    """Resolve a ds_config (a path, or its ``recipe.config.RunSections`` from :func:`read_sections`: the objects
    run.py reads; ``RunSections.resolve``: layout, batch, bf16, ZeRO stage) and a target config into
    :class:`PlanInputs` (:func:`run_inputs`), the draft geometry derived as run.py derives it
    (``recipe.target.registry.draft_config_for``, draft vocab capped at V). ``tp`` / ``cp`` override the JSON's
    parallelism as ``--tp-size`` / ``--cp-size`` do; ``world_size`` defaults to the section's own (tp·cp, dp 1
    unless ``parallelism.dp_size`` says: ``ParallelismOptions.world_size``). The attention backend is resolved
    for CUDA ("auto" → flex). ``length``: the memory section's "auto" values are resolved for ``gpu`` at this many
    tokens (:func:`resolve_inputs`, as a run of that longest sample does); None leaves them to the caller. Raises
    PlanError naming the input for a missing/bad file, layout or GPU name."""
    from recipe.target.registry import draft_config_for, splits_target  # import cost: pulls in transformers

    try:
        size = gpu_bytes(gpu)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    sections = ds_config if isinstance(ds_config, RunSections) else read_sections(ds_config)
    ds_config = sections.path
    try:
        config = sections.resolve(world_size, {"tp_size": tp, "cp_size": cp}).for_device("cuda")
    except (ConfigError, ValueError, TypeError) as exc:
        raise _ds_config_error(ds_config, exc) from None
    hf = _read_target_config(target)
    try:
        draft = draft_config_for(hf, min(draft_vocab_size, int(hf.vocab_size)))
    except (ValueError, TypeError) as exc:
        raise PlanError(f"--target {target}: {exc}") from None
    if not offline:
        try:
            splits_target(hf, config.dims)
        except ValueError as exc:
            raise PlanError(f"--target {target} online at cp_size={config.dims.cp}: {exc}") from None
    try:
        inputs = run_inputs(config, hf, draft, ttt_steps=ttt_steps, offline=offline, freeze_lm_head=freeze_lm_head,
                            gpu=str(gpu), gpu_size=size)
    except ValueError as exc:
        raise PlanError(f"--ds_config {ds_config} with --target {target}: {exc}") from None
    if length is not None:
        _check_length(inputs, length)
        inputs, _ = resolve_inputs(inputs, length, str(gpu), size)
    return inputs


def run_inputs(config: RunConfig, hf, draft, *, ttt_steps: int, offline: bool, freeze_lm_head: bool, gpu: str,
               gpu_size: int) -> PlanInputs:
    """The :class:`PlanInputs` of a run: its resolved ``RunConfig`` (layout, batch, dtype, ZeRO stage, the kernels
    resolved for its device, its ``memory`` section, "auto" values included), the target's transformers config
    ``hf``, the draft's ``Eagle3DraftConfig`` ``draft``, run.py's ``--ttt-steps``, offline or online,
    ``--freeze-lm-head``, and the GPU planned for (``gpu`` name, ``gpu_size`` bytes). The one place a memory
    section becomes the planned step (``recipe.plan.spec.spec_for_memory``). Raises ValueError for a geometry
    BenchSpec rejects."""
    from recipe.target.registry import arch_facts  # import cost: pulls in transformers

    mem, dims = config.memory, config.dims
    planned = dataclasses.replace(mem, **{k: CPU_AUTO[k] for k in mem.auto_switches})  # until resolve_inputs
    spec = BenchSpec(seq_len=2 * dims.cp * dims.tp, hidden=draft.hidden_size, heads=draft.num_attention_heads,
                     kv_heads=draft.num_key_value_heads, head_dim=draft.head_dim,
                     intermediate=draft.intermediate_size, draft_vocab=draft.draft_vocab_size, vocab=draft.vocab_size,
                     target_hidden=draft.target_hidden_size, ttt_steps=ttt_steps, batch=config.plan.micro_batch,
                     tp=dims.tp, cp=dims.cp, dtype="bf16" if config.bf16 else "fp32", loss_chunk_size=1024,
                     attention_backend=config.kernels.attention)
    zero = config.deepspeed.get("zero_optimization") or {}
    return PlanInputs(spec=spec_for_memory(spec, planned), dp=dims.dp, zero_stage=int(zero.get("stage", 0)),
                      reduce_bucket=int(zero.get("reduce_bucket_size", states.DEFAULT_REDUCE_BUCKET)),
                      params=states.count_draft_params(draft, dims.tp, freeze_lm_head),
                      target=states.target_shape(hf), offline=offline,
                      partitioned_target=config.target.partitioned, gpu=gpu, gpu_bytes=gpu_size,
                      fp32_grad_accum=(config.deepspeed.get("data_types") or {}).get("grad_accum_dtype") == "fp32",
                      fp32_comm=config.deepspeed.get("communication_data_type") == "fp32",
                      target_arch=arch_facts(hf).model_type,
                      argmax_chunk=mem.argmax_positions(int(hf.vocab_size), torch.bfloat16), memory=mem,
                      kernels=config.kernels)


@dataclass
class PlanFacts:
    """What ``recipe.config_memory.MemoryOptions.resolve`` asks of a run (its ``MemoryFacts``), answered by the
    planner for ``inputs`` at ``length`` tokens a sample: ``rank_tokens`` (length / cp), ``hardware_flops(memory)``
    (``recipe.model.flops.step_flops`` of the micro-batch with those switches and the planned attention backend)
    and ``peak_bytes(memory)`` (:func:`plan_length`'s per-rank ``total``)."""

    inputs: PlanInputs
    length: int

    @property
    def rank_tokens(self) -> int:
        return self.length // self.inputs.spec.cp

    def hardware_flops(self, memory: MemoryOptions) -> int:
        s = self.inputs.spec
        shape = DraftShape(hidden=s.hidden, intermediate=s.intermediate, heads=s.heads, kv_heads=s.kv_heads,
                           head_dim=s.head_dim, draft_vocab=s.draft_vocab, target_hidden=s.target_hidden,
                           ttt_steps=s.ttt_steps)
        return step_flops(shape, [self.length] * s.batch, Recompute.of_memory(memory, s.attention_backend),
                          cp=s.cp).hardware_total

    def peak_bytes(self, memory: MemoryOptions) -> int:
        spec = spec_for_memory(self.inputs.spec, memory)
        return plan_length(dataclasses.replace(self.inputs, spec=spec, memory=memory), self.length)["total"]


def resolve_inputs(inputs: PlanInputs, length: int, device_name: str | None,
                   free_bytes: int | None) -> tuple[PlanInputs, MemoryReport]:
    """``inputs`` with its memory section resolved (``MemoryOptions.resolve`` with :class:`PlanFacts` at ``length``
    tokens, against ``free_bytes``; None: the CPU's values) and the spec planning it, and the report."""
    memory, report = inputs.memory.resolve(PlanFacts(inputs, length), device_name, free_bytes)
    return dataclasses.replace(inputs, spec=spec_for_memory(inputs.spec, memory), memory=memory,
                               memory_report=report), report


def _check_length(inputs: PlanInputs, seq_len: int) -> None:
    div = seq_divisor(inputs.spec.cp, inputs.spec.tp)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or seq_len % div:
        raise PlanError(f"--length {seq_len!r}: must be a positive multiple of {div} (2·cp·tp with "
                        f"cp={inputs.spec.cp}, tp={inputs.spec.tp})")


def plan_length(inputs: PlanInputs, seq_len: int, fit: ActivationFit | None = None) -> dict:
    """The plan at ``seq_len`` tokens: every ``COMPONENTS`` entry (bytes), ``total``, ``fits`` (total ≤ the GPU),
    ``method`` of the activation figure. ``fit`` (default: a direct trace when cheap, else ``layout_fit``) as in
    :func:`predict_step`. Raises PlanError for a length the layout cannot split or a memory section still holding
    "auto" (:func:`resolve_inputs`), ValueError for an online target the ring cannot run at cp > 1
    (``recipe.target.registry.splits_target``; :func:`load_inputs` refuses it first)."""
    from recipe.target.registry import splits_target  # import cost: pulls in transformers

    _check_length(inputs, seq_len)
    if inputs.memory.auto_switches:
        raise PlanError(f"memory switches {list(inputs.memory.auto_switches)} are \"auto\": resolve them for a GPU and "
                        "length first (recipe.plan.resolve_inputs, or load_inputs(..., length=))")
    spec = dataclasses.replace(inputs.spec, seq_len=seq_len)
    step = predict_step(spec, fit)
    w = DTYPES[spec.dtype].itemsize
    tokens = spec.batch * seq_len // spec.cp
    out = {"draft_activations": max(0, step["step_bytes"] - inputs.params.trainable * w)}
    out.update(states.zero_states(inputs.params, inputs.zero_stage, spec.cp * inputs.dp, spec.dtype == "bf16",
                                  inputs.reduce_bucket, inputs.fp32_grad_accum, inputs.fp32_comm))
    out["batch"] = states.batch_bytes(inputs.target, tokens, w, spec.ttt_steps)
    dims = inputs.dims
    split = not inputs.offline and splits_target({"model_type": inputs.target_arch}, dims)  # run.py's rule
    out.update(states.target_bytes(inputs.target, tokens // spec.tp if split else tokens, inputs.world,
                                   inputs.partitioned_target, inputs.offline, argmax_chunk=inputs.argmax_chunk))
    tensors = (sum(out[k] for k in ("weights", "grads", "optimizer", "zero_buffers", "batch", "target_weights"))
               + max(out["draft_activations"], out["target_forward"]))
    out.update(states.overheads(dims, tensors, split))
    total = tensors + out["cuda_context"] + out["nccl"] + out["allocator_slack"]
    return {"length": seq_len, **{k: int(out[k]) for k in COMPONENTS}, "total": int(total),
            "fits": total <= inputs.gpu_bytes, "method": step["method"]}


def longest_fit(inputs: PlanInputs, fit: ActivationFit | None = None, granularity: int = 1024,
                limit: int = 1 << 24) -> int | None:
    """The longest length (a multiple of lcm(``granularity``, 2·cp·tp), at most ``limit``) whose planned total
    fits the GPU, from the layout's fit (``layout_fit``; totals are monotone in S, so a bisection); None when not
    even the shortest fits."""
    fit = fit or layout_fit(inputs.spec)
    step = math.lcm(granularity, seq_divisor(inputs.spec.cp, inputs.spec.tp))
    lo, hi = 0, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan_length(inputs, mid * step, fit)["fits"]:
            lo = mid
        else:
            hi = mid - 1
    return lo * step if lo else None


def plan_rows(inputs: PlanInputs, lengths: list[int]) -> dict:
    """One layout's table: ``{"tp", "cp", "dp", "world", "layout", "backend", "mlp_tile", "sparse_anchors" (the path
    the longest length takes: "auto" decided by ``recipe.plan.spec.planned_sparse``), "teacher_logits_once", "mask",
    "fit": {a, b, c, kind, trace_lengths}, "rows": [plan_length per length], "longest_fit"}``."""
    for n in lengths:
        _check_length(inputs, n)
    spec = inputs.spec
    fit = layout_fit(spec)
    rows = [plan_length(inputs, n, None if n <= trace_limit(spec) else fit) for n in lengths]
    return {"tp": spec.tp, "cp": spec.cp, "dp": inputs.dp, "world": inputs.world, "layout": spec.layout,
            "backend": spec.attention_backend, "mlp_tile": spec.mlp_tile,
            "sparse_anchors": planned_sparse(dataclasses.replace(spec, seq_len=max(lengths))),  # "auto": decided
            "teacher_logits_once": spec.teacher_logits_once,
            "mask": spec.mask,
            "fit": {"a": fit.a, "b": fit.b, "c": fit.c, "kind": fit.kind,
                    "trace_lengths": [t.seq_len for t in fit.traces]},
            "rows": rows, "longest_fit": longest_fit(inputs, fit)}
