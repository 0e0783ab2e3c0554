"""Fake-tensor trace of one rank's real TTT training step: the draft activations' transient peak, in bytes.

What is traced: ``recipe.model.ttt.TTTModel`` forward + ``ttt_objective(...).backward()`` built exactly as
``recipe.bench.measure.build_model`` builds it (``Eagle3Draft`` from the seed, the target-head rows, the memory
switches of the spec, ``recipe.parallel.parallelize.parallelize`` with the rank's ``ParallelState``), on a
``recipe.bench.measure.random_batch``-shaped batch (every position a valid label; zigzag-split under CP), inside
``torch._subclasses.fake_tensor.FakeTensorMode`` on the CPU (nothing is allocated: an 8B-shaped step at any length
traces in seconds) with ``torch.distributed._tools.mem_tracker.MemTracker`` counting every live storage. Under
tp·cp > 1 the trace runs in this one process on PyTorch's fake process group (``FakeStore``; collectives move no
data), so the shapes are exactly rank 0's. ``step_bytes`` = tracker peak − what was live when the step began (the
model and the batch): the gradients plus the activations, what ``measure.time_step`` reports as ``step_bytes``.

Where the real code cannot run on fake tensors, the trace substitutes (inside :func:`trace_step` only):
- ``readable_pairs`` (kernels.tiled_attention, and any kernels module that defines one) reads positions on the host;
  fake tensors have no values, so the wrapper computes EVERY (query tile, key tile) pair when the original cannot
  run. Tiles have equal sizes and one pair's temporaries live at a time, so the peak is the same as with the real
  skipping (the trace only does up to 2× the pairs). Host CPU position tensors the original can read are used as is.
- ``recipe.model.ttt.teacher_logits`` (full-logits layout) calls ``torch.unique`` (a data-dependent shape): the
  wrapper takes U, the number of distinct label rows, from the real index tensor the trace built on the host.
- ``recipe.model.ttt.anchor_sets`` (``memory.sparse_anchors``) reads the validity's values: the sets are computed
  from the real host batch (the spec's supervision ``mask``) before the trace and handed to the traced model.
- flex attention (CUDA only): the project's own flex code path is built (``make_causal_attention("flex", ...)``, the
  ring's ``FLEX_KERNEL`` under CP) and only the ``flex_attention`` call is replaced by a memory-equivalent stand-in
  (:class:`FlexStandIn`): forward saves q, k, v, out, lse and returns out [B, H, S, D] (q dtype) and lse [B, H, S]
  fp32; backward allocates dq, dk, dv and delta [B, H, S] fp32. The block mask is built for real (O((S/128)²)).
Fit (:func:`fit_activation`): the step peak is affine in the rank's tokens, ``a + b·S``, once S is past the loss
chunk and the attention tile (every per-position tensor then grows linearly; chunk and tile temporaries are
constant), so two traced lengths determine it (linear). Dense attention (``attention_tile_size`` null, tiled
backend, cp = 1) keeps [S, S] scores: three lengths, ``a + b·S + c·S²``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from recipe.parallel.dims import seq_divisor
from recipe.plan.spec import DTYPES, LAYOUTS, BenchSpec, supervised_mask

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


class FlexStandIn(torch.autograd.Function):
    """Memory-equivalent stand-in of one flex attention call: ``apply(q, k, v) -> (out, lse)``; q [B, H, S, D],
    k/v [B, Hkv, Sk, D]; out like q, lse [B, H, S] float32. Values are unspecified (``empty``)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, _, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)  # rowsum(dout · out), fp32, alive while dq, dk, dv are written
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv


class _Aux:
    def __init__(self, lse):
        self.lse = lse


def _flex_standin(q, k, v, block_mask=None, scale=None, enable_gqa=False, return_aux=None, **_):
    out, lse = FlexStandIn.apply(q, k, v)
    return out, _Aux(lse)


@contextlib.contextmanager
def _patched(attr_owner, name, value):
    had = hasattr(attr_owner, name)
    old = getattr(attr_owner, name, None)
    setattr(attr_owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(attr_owner, name, old)
        else:
            delattr(attr_owner, name)


def _all_pairs_fallback(original):
    def readable_pairs(q_tiles, k_tiles, *args, **kwargs):
        try:
            return original(q_tiles, k_tiles, *args, **kwargs)
        except Exception:  # noqa: BLE001 - fake tensors have no values: every pair (module docstring)
            return [[True] * len(k_tiles) for _ in q_tiles]
    readable_pairs.planner_fallback = True
    return readable_pairs


@contextlib.contextmanager
def trace_patches(unique_rows: dict, host=None):
    """The substitutions of the module docstring, undone on exit. ``unique_rows`` maps ``id(target_row_KS)`` of the
    batch's (fake) index tensor to its real host copy; ``host``: the real host batch whose sparse anchors' sets the
    traced model uses (``recipe.model.sparse_anchors.anchor_sets`` reads index values, which fake tensors lack)."""
    import kernels.tiled_attention  # noqa: F401 - make sure it is loaded before its modules are scanned
    from recipe.model import ttt

    with contextlib.ExitStack() as stack:
        for mod_name, mod in list(sys.modules.items()):
            fn = getattr(mod, "readable_pairs", None) if mod_name.startswith("kernels") else None
            if callable(fn) and not getattr(fn, "planner_fallback", False):
                stack.enter_context(_patched(mod, "readable_pairs", _all_pairs_fallback(fn)))
        original_teacher = ttt.teacher_logits

        def teacher_logits(target_hidden_BLH, target_row_KS, target_head_VdH, target_softcap=None):
            real = unique_rows.get(id(target_row_KS))
            if real is None:
                return original_teacher(target_hidden_BLH, target_row_KS, target_head_VdH, target_softcap)
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            from recipe.model.loss import target_logits

            with unset_fake_temporarily():
                u = int(torch.unique(real).numel())
            rows_U = torch.zeros(u, dtype=torch.int64, device=target_row_KS.device)
            with torch.no_grad():
                logits = target_logits(target_hidden_BLH[:, rows_U], target_head_VdH, target_softcap)
            return logits, torch.zeros_like(target_row_KS)
        stack.enter_context(_patched(ttt, "teacher_logits", teacher_logits))
        if host is not None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                sets = ttt.anchor_sets(host.valid_KBS, host.position_ids_BS, host.target_row_KS)
            stack.enter_context(_patched(ttt, "anchor_sets", lambda *args: sets))
        import torch.nn.attention.flex_attention as flex_mod

        stack.enter_context(_patched(flex_mod, "flex_attention", _flex_standin))
        import kernels.flex_attention as kflex

        stack.enter_context(_patched(kflex, "_COMPILED", {"flex": _flex_standin}))
        yield


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
    """``recipe.bench.measure.build_model`` under the active fake mode (same construction; ``cast_module`` instead
    of ``.to``); ``backend`` "flex" builds the CUDA flex path (device "cuda" is only named, never touched)."""
    from recipe.config import KernelOptions, MemoryOptions
    from recipe.model.draft import Eagle3Draft
    from recipe.model.ttt import TTTModel
    from recipe.parallel.parallelize import parallelize
    from recipe.plan.spec import spec_draft_config

    draft = Eagle3Draft(spec_draft_config(spec), seed=spec.seed)
    head = torch.empty(spec.draft_vocab, spec.target_hidden)
    chunked, ckpt = LAYOUTS[spec.layout]
    model = TTTModel(draft, head, loss_chunk_size=spec.loss_chunk_size if chunked else None, checkpoint_steps=ckpt,
                     sparse_anchors=spec.sparse_anchors)
    parallelize(model, pstate, MemoryOptions(attention_tile_size=spec.attention_tile, mlp_tile_size=spec.mlp_tile),
                "cuda" if backend == "flex" else "cpu", KernelOptions(attention=backend))
    return cast_module(model, DTYPES[spec.dtype])


def host_batch(spec: BenchSpec, cp_rank: int = 0):
    """The ``random_batch`` of ``spec`` with real host index tensors (zeros for the tokens) and float fields of
    zero width: ``(batch, num_label_rows)``; the trace replaces the float fields by fake tensors of full width."""
    from recipe.model.ttt import make_ttt_batch
    from recipe.parallel.cp_shard import shard_ttt_batch


    b, s = spec.batch, spec.seq_len
    ones = torch.ones(b, s, dtype=torch.bool)
    empty = torch.empty(b, s, 0)
    batch = make_ttt_batch(torch.zeros(b, s, dtype=torch.int64), supervised_mask(spec.mask, b, s), ones, empty, empty,
                           ones, spec.ttt_steps)
    if spec.cp > 1:
        batch = shard_ttt_batch(batch, spec.cp, cp_rank)
    return batch, batch.target_hidden_BLH.shape[1]


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
    """The backend the trace builds for ``spec.attention_backend``: "auto" is flex for a CUDA spec, else tiled;
    "sdpa" (whose kernel picks its mask layout from position values, which fake tensors lack) is traced as its
    tile loops with the tiled reference pair kernel: the same tiles, one pair's temporaries at a time."""
    name = spec.attention_backend
    if name == "auto":
        return "flex" if str(spec.device).startswith("cuda") else "tiled"
    return "tiled" if name == "sdpa" else name


def trace_step(spec: BenchSpec) -> TraceResult:
    """Trace one forward + backward of ``spec`` on rank 0 (module docstring). ``spec.attention_backend``: any of
    "auto", "tiled", "sdpa", "flex" (:func:`traced_backend`). Raises ValueError for a spec BenchSpec rejects."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from recipe.model.ttt import ttt_objective

    batch, rows = host_batch(spec)
    unique_rows = {}
    dt = DTYPES[spec.dtype]
    with fake_world(spec.tp, spec.cp) as pstate, trace_patches(unique_rows, batch), warnings.catch_warnings(), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")  # host-copy lookups: none here
        model = build_traced_model(spec, pstate, traced_backend(spec))
        fields = {f.name: mode.from_tensor(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        n_local = fields["input_ids_KBS"].shape[2]
        fields["aux_hidden_BSA"] = torch.empty(spec.batch, n_local, 3 * spec.target_hidden, dtype=dt)
        fields["target_hidden_BLH"] = torch.empty(spec.batch, rows, spec.target_hidden, dtype=dt)
        unique_rows[id(fields["target_row_KS"])] = batch.target_row_KS
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
    return spec.attention_tile is None and spec.cp == 1 and traced_backend(spec) != "flex"


def trace_lengths(spec: BenchSpec) -> list[int]:
    """The traced lengths: multiples of the unit after which the step is affine in S (the loss chunk, the attention
    tile — per zigzag chunk under CP —, the MLP tile per rank and 2·cp·tp), the smallest at least two units; three
    for dense attention."""
    chunked, _ = LAYOUTS[spec.layout]
    unit = seq_divisor(spec.cp, spec.tp)
    if chunked:
        unit = math.lcm(unit, spec.loss_chunk_size * spec.cp)
    if spec.attention_tile is not None and traced_backend(spec) != "flex":
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
