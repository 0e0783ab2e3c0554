"""The suite's numeric bounds, each set from the arithmetic it covers, not from one machine's result.

Two computations of the same function that differ only in the order of their floating-point sums (another attention
kernel, tile or chunk size, the sparse anchors against the dense path, a tp/cp/dp layout and its collectives, ZeRO's
reductions, the teacher logits once or per step) do not agree bit for bit, and how far apart they land depends on the
CPU: the BLAS picks its blocking by instruction set and vendor (MKL takes other code paths on AMD than on Intel), and
ATen's vectorised reductions group terms by the SIMD width (8 floats with AVX2, 16 with AVX-512). So:

- **Bitwise** (``torch.equal``) only where both sides run the same sequence of operations by construction: the same
  kernels on the same shapes, or extra terms that are exact zeros added by a left fold (``x + 0 = x``), or integer
  and boolean results (counts, masks, indices, argmax of identical logits).
- **Relative** bounds elsewhere, measured on the whole tensor against its scale (``helpers.parity.max_rel``: max
  error over max magnitude, or ``helpers.cases.assert_rel_close``: norm over norm), never elementwise: an entry that
  is a sum with cancellation carries the absolute error of its large terms.

Float32's unit roundoff is u = 2⁻²⁴ ≈ 6.0e-8. A sum of n terms reordered moves by at most (n − 1)·u·Σ|terms| and
typically by √n·u of it. The draft's gradients are sums over B·S positions and K TTT steps of products of matmuls
(widths 16–96 in the tiny geometries), softmaxes over the draft vocabulary and RMS norms: a few hundred terms deep,
with a few such sums chained. That puts reordered results 1e-7 to a few 1e-6 apart relative to the tensor; the
largest seen by the suite on any machine (an AMD EPYC and an Intel Xeon, AVX2 and AVX-512 dispatch, MKL's AVX2 and
compatible paths) is 2.3e-6 (the sparse anchors under cp, every gather of the compacted path a new order).
:data:`FP32_REORDERED` = 1e-5 ≈ 170·u is the field's usual fp32 parity bound, over 4× that; what it must catch is
≥ 1e-3 (a missing gradient term, a wrong mask, a dropped collective, a weight shard used twice).
"""
from __future__ import annotations

import json
import os

import torch

FP32_UNIT_ROUNDOFF = 2.0 ** -24

# Same function, another summation order, one forward + backward in float32 (kernels, tiles, chunks, sparse/dense,
# tp/cp/dp layouts, ZeRO stages): relative to the tensor's scale. See the module docstring.
FP32_REORDERED = 1e-5

# Metrics of a few float32 training steps of runs that differ in summation order (losses, grad norms). Step 1 reads
# the same weights, so its metrics differ like one forward/backward (FP32_REORDERED, ``assert_curves_close`` holds
# step 1 to it). From step 2 on the weights differ: Adam's first updates are nearly lr·sign(g), so the order noise
# in a gradient entry near zero can flip that entry's whole update, and the trajectories drift apart by a factor of
# a few per step. Seen over the ≤ 8 steps at lr ≤ 5e-3 of these tests: losses ≤ 1.3e-5 apart, grad norms
# ≤ 1.8e-5 (the sparse anchors against the dense path, resharded resumes, AVX2 and AVX-512). 1e-4 is 5× that; a
# wrong gradient, update, moment or learning rate moves a metric by ≥ 1e-3 at the step it happens.
FP32_CURVE = 1e-4

# Parameters after AdamW steps from gradients that differ by ~FP32_REORDERED: Adam's update g/(√v + ε) amplifies
# a relative gradient difference on an entry whose gradient is near zero (where √v ~ |g|), up to ~1e-2 of that
# entry's step; relative to the tensor's largest weight that is ≤ 1e-5 after a couple of steps at lr ≤ 1e-2
# (seen ≤ 3e-6), so a bound of 1e-4 still fails on a wrong update (lr-sized, ≥ 1e-3 relative).
FP32_AFTER_ADAM = 1e-4

# Float64 references (the attention kernels' exact tests): u = 2⁻⁵³ ≈ 1.1e-16, the same few-hundred-term depth gives
# ~1e-13; 1e-10 is far above it and far below any real error.
FP64_REORDERED = 1e-10

# bfloat16 against a float32/float64 reference of the same inputs: u = 2⁻⁸ ≈ 3.9e-3 per rounding; outputs that pass
# through a few bf16 roundings (inputs, a matmul's output, the gradient's) land within a few u of the reference,
# relative to the tensor: 2e-2 ≈ 5·u. (Statistics kept in float32 inside bf16 kernels, such as the attention's LSE,
# are compared at FP32_REORDERED·10 = 1e-4 where their inputs were bf16-rounded first: see each test.)
BF16_ROUNDED = 2e-2


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, bound: float, label: str) -> None:
    """``max_rel(got, ref) <= bound`` over the finite entries through :func:`within`; the shapes equal, infinities
    (an LSE of a row that reads no key is -inf) at the same places with the same signs, no NaN in ``ref``."""
    assert got.shape == ref.shape, (label, tuple(got.shape), tuple(ref.shape))
    assert not ref.isnan().any(), f"{label}: NaN in the reference"
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite], ref[~finite]), \
        f"{label}: non-finite entries differ"
    within(max_rel(got[finite], ref[finite]), bound, label)


def within(observed: float, bound: float, label: str) -> None:
    """Assert ``observed <= bound`` (AssertionError naming ``label`` and both numbers). With ``RECIPE_TOLERANCE_LOG``
    set to a file path, each comparison is also appended there as a JSON line (the test, ``label``, ``observed``,
    ``bound``), so a run of the suite on a new machine shows how close every bound came to failing."""
    log = os.environ.get("RECIPE_TOLERANCE_LOG")
    if log:
        entry = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "label": label,
                 "observed": float(observed), "bound": float(bound)}
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")
    assert observed <= bound, f"{label}: {observed:.3g} > bound {bound:g}"
