"""Fake-tensor trace of one rank's real TTT training step: the draft activations' transient peak, in bytes.

What is traced: ``recipe.model.ttt.TTTModel`` forward + ``ttt_objective(...).backward()`` built exactly as
``recipe.bench.measure.build_model`` builds it (``Eagle3Draft`` from the seed, the target-head rows,
``recipe.parallel.parallelize.build_training_model`` with the spec's memory switches and the rank's
``ParallelState``), on a
``recipe.bench.measure.random_batch``-shaped batch (every position a valid label; zigzag-split under CP), inside
``torch._subclasses.fake_tensor.FakeTensorMode`` on the CPU (nothing is allocated: an 8B-shaped step at any length
traces in seconds) with ``torch.distributed._tools.mem_tracker.MemTracker`` counting every live storage. Under
tp·cp > 1 the trace runs in this one process on PyTorch's fake process group (``FakeStore``; collectives move no
data), so the shapes are exactly rank 0's. ``step_bytes`` = tracker peak − what was live when the step began (the
model and the batch): the gradients plus the activations, what ``measure.time_step`` reports as ``step_bytes``.

Where the real code cannot run on fake tensors, the trace uses the hooks the code declares for it (inside
:func:`trace_step` only; nothing is patched):
- the kernels' tracing mode (``kernels.tracing.tracing``): the tile loops compute EVERY (query tile, key tile) pair
  when the positions are fake (no values to read; one pair's temporaries live at a time, so the peak is the same as
  with the real skipping, at up to 2× the pairs); flex attention calls a memory-equivalent stand-in
  (``kernels.tracing.FusedStandIn``: forward saves q, k, v, out, lse and returns out [B, H, S, D] (q dtype) and lse
  [B, H, S] fp32; backward allocates dq, dk, dv and delta [B, H, S] fp32), its block mask built for real
  (O((S/128)²)); the project's own flex code path is built (the registered ``flex`` backend's single-device block,
  the ring's flex pair kernel under CP).
- the TTT model's ``trace_hints`` (``recipe.model.trace_hints.TraceHints``): U, the number of distinct label rows
  the teacher logits hold (``torch.unique`` has a data-dependent shape), and, with ``memory.sparse_anchors``, the
  anchor sets, both computed from the real host batch (the spec's supervision ``mask``) before the trace; an
  "auto" ``sparse_anchors`` is decided on that batch first, by the model's own rule
  (``recipe.plan.spec.planned_sparse``).
- a backend whose kernel reads position values (``sdpa``) is traced as the backend it declares
  (``AttentionBackend.traced_as``: ``tiled``, the same tiles).
Fit (:func:`fit_activation`): the step peak is affine in the rank's tokens, ``a + b·S``, once S is past the loss
chunk and the attention tile (every per-position tensor then grows linearly; chunk and tile temporaries are
constant), so two traced lengths determine it (linear). Dense attention (``attention_tile_size`` null, tiled
backend, cp = 1) keeps [S, S] scores: three lengths, ``a + b·S + c·S²``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels.attention_backends import backend_runs_on, resolve_attention_backend
from kernels.registry import attention_backend
from kernels.tracing import tracing
from recipe.model.draft import Eagle3Draft
from recipe.model.sparse_anchors import anchor_sets
from recipe.model.trace_hints import TraceHints
from recipe.parallel.dims import seq_divisor
from recipe.parallel.parallelize import build_training_model
from recipe.plan.spec import (DTYPES, LAYOUTS, BenchSpec, planned_sparse, spec_batch, spec_draft_config,
                              spec_kernels, spec_memory)

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


@dataclass(frozen=True)
class TraceResult:
    """One traced step on rank 0: ``step_bytes`` (peak − live at the start: grads + activations), ``peak_bytes``
    (tracker peak, model and batch included), ``base_bytes`` (live at the start), ``peak_by_kind`` (MemTracker's
    categories at the peak, bytes), ``params`` (this rank's draft parameters: ``trainable``, ``frozen`` counts) and
    ``seq_len`` (tokens of the whole sequence; the rank holds seq_len/cp)."""

    seq_len: int
    step_bytes: int
    peak_bytes: int
    base_bytes: int
    peak_by_kind: dict
    params: dict


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module.to(dtype)`` for fake-tensor modules (whose ``_apply`` cannot swap fake parameters): floating
    parameters and buffers re-bound in ``dtype``, parameter attributes (TP marks) and ``requires_grad`` kept; the
    draft's RoPE buffers stay float32 as ``Eagle3Draft._apply`` keeps them."""
    for mod in module.modules():
        keep = type(mod).__name__.endswith("RotaryEmbedding")
        for key, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                mod._parameters[key] = new
        for key, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype and not keep:
                mod._buffers[key] = b.to(dtype)
    return module


def build_traced_model(spec: BenchSpec, pstate, backend: str):
    """``recipe.bench.measure.build_model`` under the active fake mode: the same
    ``recipe.parallel.parallelize.build_training_model`` (``cast_module`` instead of ``.to``); the model is built
    for the device ``backend`` runs on (CUDA for flex: only named, never touched)."""
    draft = Eagle3Draft(spec_draft_config(spec), seed=spec.seed)
    head = torch.empty(spec.draft_vocab, spec.target_hidden)
    device = "cpu" if backend_runs_on(backend, "cpu") else "cuda"
    model = build_training_model(draft, head, spec_memory(spec), spec_kernels(spec, backend), pstate, device)
    return cast_module(model, DTYPES[spec.dtype])


@contextlib.contextmanager
def fake_world(tp: int, cp: int):
    """A ``ParallelState`` of rank 0 in a fake process group of tp·cp ranks (None when tp·cp = 1); the group is
    destroyed on exit. Raises RuntimeError when torch.distributed is already initialised (a real run)."""
    import torch.distributed as dist

    if tp * cp == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("recipe.plan traces tp/cp layouts on a fake process group; torch.distributed is already "
                           "initialised in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.topology import ParallelState

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp)
    try:
        yield ParallelState(ParallelDims(world_size=tp * cp, tp=tp, cp=cp), device="cpu")
    finally:
        dist.destroy_process_group()


def traced_backend(spec: BenchSpec) -> str:
    """The backend the trace builds for ``spec.attention_backend``: "auto" resolved for ``spec.device`` by the run's
    rule (``kernels.attention_backends.resolve_attention_backend``), then the backend's ``traced_as`` (``sdpa``,
    whose kernel picks its mask layout from position values, is traced as ``tiled``). Raises ValueError for a name
    that is not registered."""
    name = spec.attention_backend
    if name == "auto":
        name = resolve_attention_backend(name, spec.device)
    return attention_backend(name).traced_as or name


def uses_tiles(spec: BenchSpec) -> bool:
    """Whether the traced backend cuts its blocks into ``attention_tile`` tiles (False: its own blocking, flex)."""
    return attention_backend(traced_backend(spec)).uses_tiles


def trace_step(spec: BenchSpec) -> TraceResult:
    """Trace one forward + backward of ``spec`` on rank 0 (module docstring). ``spec.attention_backend``: any of
    "auto" or a registered backend (:func:`traced_backend`). Raises ValueError for a spec BenchSpec rejects."""
    from recipe.model.ttt import ttt_objective

    spec = dataclasses.replace(spec, sparse_anchors=planned_sparse(spec))  # "auto": the run's rule on this batch
    batch, rows = spec_batch(spec)
    dt = DTYPES[spec.dtype]
    hints = TraceHints(int(torch.unique(batch.target_row_KS).numel()),
                       anchor_sets(batch.valid_KBS, batch.position_ids_BS, batch.target_row_KS)
                       if spec.sparse_anchors else None)
    with fake_world(spec.tp, spec.cp) as pstate, tracing(), warnings.catch_warnings(), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")  # host-copy lookups: none here
        model = build_traced_model(spec, pstate, traced_backend(spec))
        model.trace_hints = hints
        fields = {name: mode.from_tensor(getattr(batch, name)) for name in batch.tensor_fields()}
        n_local = fields["input_ids_KBS"].shape[2]
        fields["aux_hidden_BSA"] = torch.empty(spec.batch, n_local, 3 * spec.target_hidden, dtype=dt)
        fields["target_hidden_BLH"] = torch.empty(spec.batch, rows, spec.target_hidden, dtype=dt)
        fake_batch = dataclasses.replace(batch, **fields)
        params = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                  "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
        tracker = _step_tracker()
        tracker.track_external(model, *fields.values())
        with tracker:
            base = _total(tracker.get_tracker_snapshot())
            model.zero_grad(set_to_none=True)
            out = model(fake_batch)
            ttt_objective(out, out.valid_K).backward()
            del out
        peak_snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(peak_snap.values()), {})
    peak = int(dev.get("Total", 0))
    kinds = {str(k).split(".")[-1]: int(v) for k, v in dev.items() if str(k) != "Total"}
    return TraceResult(seq_len=spec.seq_len, step_bytes=peak - base, peak_bytes=peak, base_bytes=base,
                       peak_by_kind=kinds, params=params)


def _step_tracker():
    """A ``MemTracker`` that installs no gradient hooks on parameters (its per-module hooks fail on the frozen
    embedding, which cannot take one); gradients are still counted, as the outputs of the backward's ops."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    return StepTracker()


def _total(snapshot: dict) -> int:
    return int(sum(dev.get("Total", 0) for dev in snapshot.values()))


def is_dense(spec: BenchSpec) -> bool:
    """Whether the causal block keeps [S, S] scores: untiled tiled/sdpa attention on one cp rank."""
    return spec.attention_tile is None and not spec.dims.cp_enabled and uses_tiles(spec)


def trace_lengths(spec: BenchSpec) -> list[int]:
    """The traced lengths: multiples of the unit after which the step is affine in S (the loss chunk, the attention
    tile — per zigzag chunk under CP —, the MLP tile per rank and 2·cp·tp), the smallest at least two units; three
    for dense attention."""
    chunked, _ = LAYOUTS[spec.layout]
    unit = seq_divisor(spec.cp, spec.tp)
    if chunked:
        unit = math.lcm(unit, spec.loss_chunk_size * spec.cp)
    if spec.attention_tile is not None and uses_tiles(spec):
        unit = math.lcm(unit, spec.attention_tile * 2 * spec.cp)
    if spec.mlp_tile is not None:
        unit = math.lcm(unit, spec.mlp_tile * spec.cp)  # whole MLP tiles on the rank's S/cp positions
    return [2 * unit, 4 * unit, 6 * unit] if is_dense(spec) else [2 * unit, 4 * unit]


@dataclass(frozen=True)
class ActivationFit:
    """``step_bytes(S) = a + b·S + c·S²`` (c = 0 unless dense attention), fitted to ``traces``; S = whole-sequence
    tokens. ``kind``: "linear (2 lengths)" or "quadratic (3 lengths)"."""

    a: float
    b: float
    c: float
    kind: str
    traces: tuple

    def __call__(self, seq_len: int) -> float:
        return self.a + self.b * seq_len + self.c * seq_len ** 2

    def base(self, seq_len: int) -> float:
        """Bytes live before the step (model + batch; the batch is linear in S), from the two longest traces."""
        (x0, y0), (x1, y1) = [(t.seq_len, t.base_bytes) for t in self.traces[-2:]]
        return y0 + (y1 - y0) * (seq_len - x0) / (x1 - x0)


def fit_activation(spec: BenchSpec, lengths: list[int] | None = None) -> ActivationFit:
    """Trace ``spec`` at ``lengths`` (default :func:`trace_lengths`; two, or three for dense attention) and fit the
    step peak through them (module docstring). Raises ValueError for lengths the layout cannot split."""
    lengths = trace_lengths(spec) if lengths is None else sorted(set(lengths))
    traces = tuple(trace_step(dataclasses.replace(spec, seq_len=n)) for n in lengths)
    xs = [float(t.seq_len) for t in traces]
    ys = [float(t.step_bytes) for t in traces]
    if len(traces) == 3:
        (x0, x1, x2), (y0, y1, y2) = xs, ys
        c = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)
        b = (y1 - y0) / (x1 - x0) - c * (x0 + x1)
        return ActivationFit(y0 - b * x0 - c * x0 ** 2, b, c, "quadratic (3 lengths)", traces)
    b = (ys[1] - ys[0]) / (xs[1] - xs[0])
    return ActivationFit(ys[0] - b * xs[0], b, 0.0, "linear (2 lengths)", traces)
