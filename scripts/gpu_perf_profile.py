"""The profile rows and the attention rows of ``scripts/gpu_perf_check.py``.

Profile (``profile_row``): one of our steps (after a warm one) under ``torch.profiler``, its phases marked
(``perf::forward``, ``perf::backward``, ``perf::optimizer``; the device synchronised at each phase's end so a
kernel runs inside the phase that launched it). Every device kernel (on the CPU: every operator's self time) is
put in one category by its name (:func:`category`) and its phase:

- ``flex_forward`` / ``flex_backward``: flex attention's kernels (Inductor's template kernels, ``triton_tem*``: flex
  is the only template the default Inductor settings generate; an eager ``flex_attention`` by name);
- ``matmul``: cuBLAS/CUTLASS GEMMs (``gemm``, ``nvjet``, ``cutlass``, ``xmma``, ``sm80_``/``sm90_``) and ATen's
  ``mm``/``bmm``/``addmm``;
- ``loss``: kernels named for a softmax, log-softmax, logsumexp or cross-entropy outside flex (the soft CE and the
  teacher's softmax; the TTT merge's softmax, when fused into such a kernel, counts here too);
- ``optimizer``: everything in the optimizer phase (DeepSpeed's fp32 gradient copies, clipping, AdamW);
- ``elementwise_other``: the rest (norms, RoPE, SwiGLU, copies, fills, reductions);
- ``idle``: the phases' wall time no kernel covers (launch gaps, host syncs, Python) on CUDA; on the CPU the time
  no operator's self time accounts for.

Shares are of the profiled step's wall time (the phases' sum). The whole ``key_averages`` table is written to
``OUT/profile_<row>.txt`` (sorted by device time); the JSON keeps the categories and the top operators.

Attention (``attention_row``): ``recipe.bench.attention.time_attention`` of one backend's causal block (one
sample, the draft's 32/8 heads of 128, bf16; median of 2 runs after a warm-up that also compiles), with its TFLOP/s
by the FLOP model's attention term (``recipe.model.flops``): forward ``4·d·n(n+1)/2`` (d = heads·head dim), model
forward + backward 3× that, hardware 1 + the backend's backward factor (``FLASH_BACKWARD``: 3.5×).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from scripts.gpu_perf_rows import SMOKE_BACKENDS, Row, Switches, row_length

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = ("flex_forward", "flex_backward", "matmul", "loss", "elementwise_other", "optimizer", "idle")
MATMUL_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "sm80_", "sm90_", "sm100_", "aten::mm", "aten::bmm",
                "aten::addmm", "aten::baddbmm", "aten::_scaled_mm")
LOSS_NAMES = ("softmax", "logsumexp", "cross_entropy", "nll_loss")
TOP_OPS = 25


def category(name: str, phase: str) -> str:
    """The breakdown category (module docstring) of a kernel or operator ``name`` run in ``phase``."""
    n = name.lower()
    if phase == "optimizer":
        return "optimizer"
    if "flex_attention" in n or n.startswith("triton_tem"):
        return "flex_backward" if phase == "backward" else "flex_forward"
    if any(k in n for k in MATMUL_NAMES):
        return "matmul"
    if any(k in n for k in LOSS_NAMES):
        return "loss"
    return "elementwise_other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(spans: list[tuple[str, float, float]], windows: dict[str, tuple[float, float]],
              overlapping: bool) -> dict:
    """Milliseconds and shares per category of ``spans`` = [(name, start µs, duration µs)] put in the phase window
    (``windows``: phase -> (start, end) µs) their start falls in. ``overlapping``: the spans are device kernels whose
    union is the busy time (idle = wall − union); else operators' self times (idle = wall − their sum)."""
    wall = sum(end - start for start, end in windows.values())
    ms = dict.fromkeys(CATEGORIES, 0.0)
    busy = 0.0
    for phase, (start, end) in windows.items():
        inside = [(n, s, d) for n, s, d in spans if start <= s < end]
        for name, _, dur in inside:
            ms[category(name, phase)] += dur / 1e3
        busy += _union_us([(s, min(s + d, end)) for _, s, d in inside]) if overlapping else sum(d for *_, d in inside)
    ms["idle"] = max(0.0, wall - busy) / 1e3
    return {"wall_ms": wall / 1e3, "ms": ms, "share": {k: (v * 1e3 / wall if wall else None) for k, v in ms.items()}}


def _profiled_step(bench, batch):
    from torch.profiler import ProfilerActivity, profile, record_function

    from recipe.model.ttt import ttt_objective

    cuda = bench.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function("perf::forward"):
            out = bench.engine(batch)
            loss = ttt_objective(out, out.valid_K)
            sync()
        with record_function("perf::backward"):
            bench.engine.backward(loss)
            sync()
        with record_function("perf::optimizer"):
            bench.engine.step()
            sync()
    return prof


def _table(prof, cuda: bool) -> tuple[str, str]:
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            return key, prof.key_averages().table(sort_by=key, row_limit=-1, max_name_column_width=120)
        except (AttributeError, KeyError, ValueError):
            continue
    return "", prof.key_averages().table(row_limit=-1)


def profile_row(bench, row: Row, switches: Switches, out: Path) -> dict:
    """Our step with ``switches`` under the profiler (module docstring): the breakdown, the top operators, the
    table file. Errors are the caller's to record."""
    from torch.autograd import DeviceType

    bench.apply(switches)
    batch = bench.ttt_batch(bench.raw_batch(row))
    bench.our_step(batch)  # warm: compiled, allocator primed
    cuda = bench.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof = _profiled_step(bench, batch)
    seconds = time.perf_counter() - t0
    events = prof.events()
    windows = {e.name.removeprefix("perf::"): (e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("perf::") and e.device_type == DeviceType.CPU}
    if cuda:
        spans = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events
                 if e.device_type == DeviceType.CUDA]
    else:
        spans = [(e.name, e.time_range.start, e.self_cpu_time_total) for e in events
                 if e.device_type == DeviceType.CPU and not e.name.startswith("perf::")]
    sort_key, table = _table(prof, cuda)
    path = out / f"profile_{row.name}.txt"
    path.write_text(f"# {row.name}: {row.batch} x {row_length(row, bench.smoke)} tokens, {switches}\n"
                    f"# sorted by {sort_key or 'default'}\n{table}\n")
    averages = sorted([a for a in prof.key_averages() if not a.key.startswith("perf::")],
                      key=lambda a: -(getattr(a, "self_device_time_total", 0) if cuda else a.self_cpu_time_total))
    top = [{"name": a.key[:160], "calls": a.count,
            "self_ms": (getattr(a, "self_device_time_total", 0) if cuda else a.self_cpu_time_total) / 1e3}
           for a in averages[:TOP_OPS]]
    return {"status": "ok", "attention": bench.attention_name(switches), "seconds_profiled": seconds,
            "breakdown": breakdown(spans, windows, cuda),
            "top_ops": top, "table_file": path.name, "kernels": len(spans)}


def attention_row(bench, row: Row) -> dict:
    """One backend's causal block alone (module docstring): seconds and TFLOP/s; errors the caller's to record."""
    from kernels.attention_backends import make_causal_attention
    from recipe.bench.attention import time_attention
    from recipe.model.flops import FLASH_BACKWARD, run_peak_tflops

    backend = SMOKE_BACKENDS[row.backend] if bench.smoke else row.backend
    n, shape = row_length(row, bench.smoke), bench.shape
    attention = make_causal_attention(backend, 32 if bench.smoke else 1024, bench.device)
    result = time_attention(attention, n, bench.dtype, bench.device, shape["heads"], shape["kv_heads"],
                            shape["head_dim"], repeats=2)
    forward = 4 * shape["heads"] * shape["head_dim"] * n * (n + 1) / 2
    hardware = 1 + FLASH_BACKWARD.get(backend, 2.0)
    peak = run_peak_tflops(bench.device, bench.dtype)
    fb = 3 * forward / result["forward_backward_seconds"] / 1e12
    return {"status": "ok", "backend": backend, **result, "forward_flops": forward, "heads": shape["heads"],
            "kv_heads": shape["kv_heads"], "head_dim": shape["head_dim"],
            "forward_tflops": forward / result["forward_seconds"] / 1e12, "forward_backward_model_tflops": fb,
            "forward_backward_hardware_tflops": hardware * forward / result["forward_backward_seconds"] / 1e12,
            "mfu": fb / peak if peak else None}
