"""Decoding-time linear layers on the CPU with their weights pre-packed once for oneDNN (``recipe.eval`` only).

Speculative decoding runs the target over a handful of rows at a time (1 for greedy decoding, k + 1 for a chain's
verification, the tree's budget + 1), and each forward reads all of the model's weights. At such row counts a plain
``F.linear`` (the BLAS's general matmul, given the weight in PyTorch's [out, in] layout) runs far from what the
memory allows; a weight reordered once into oneDNN's own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``
then ``torch.ops.mkldnn._linear_pointwise``) is read as is. ``python -m recipe.bench decode`` measures the gain
(docs/results/decode_cpu.json).

The packed layers compute the same products in another summation order, so logits differ from ``F.linear``'s by
float32 rounding (about 1e-4 on the target's logits); greedy, chain and tree decoding all run through the same packed
layers, so the lossless check still compares like with like. The hidden-state dump and training keep ``nn.Linear`` (a
dump's forwards are thousands of rows, not the handful this layer is for, and its store must match the online
target's numbers). Only for inference: the packed weight is a snapshot taken at packing time (later changes to
``weight`` do not reach it) and no gradient flows through it. Off the CPU, or where this PyTorch build lacks the ops,
nothing is replaced.
"""
from __future__ import annotations

import torch
from torch import nn

DEFAULT_ROWS = 8
"""Row count the packing is tuned for (any row count works; a few rows is what decoding sends)."""


def packing_available() -> bool:
    """Whether this PyTorch has oneDNN and the two private ops the packed layers use."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference with its float32 weight packed once for oneDNN: [..., in] -> [..., out].

    Args: linear, a float32 CPU ``nn.Linear``; rows, the row count the packing is tuned for. ``weight`` stays the
    linear's own parameter (same tensor, so tied weights stay tied, ``.weight.dtype`` / ``.device`` still answer and
    ``state_dict`` has ``nn.Linear``'s keys); the packed copy beside it is extra memory (a non-persistent buffer), a
    snapshot of ``weight`` at construction. Input ``[..., in]`` float32, output ``[..., out]`` float32. Raises
    ValueError for another dtype or device; ``forward`` raises RuntimeError when a gradient would be needed.
    """

    def __init__(self, linear: nn.Linear, rows: int = DEFAULT_ROWS):
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight.dtype} on {weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, rows),
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            raise RuntimeError("PackedLinear is for inference: run it under torch.no_grad() (no gradient flows "
                               "through the packed weight)")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(module: nn.Module, rows: int = DEFAULT_ROWS) -> int:
    """Replace every float32 CPU ``nn.Linear`` inside ``module`` (exactly that class: a subclass may compute something
    else) by a ``PackedLinear``, in place; for inference.

    Returns how many were replaced: 0 when ``packing_available()`` is False or the first packed layer's output
    differs from ``F.linear``'s beyond float32 rounding (then nothing is replaced). Tied weights (e.g. an lm_head
    sharing the embedding) get their own packed copy; the embedding keeps its weight.
    """
    if not packing_available():
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.float32
               and child.weight.device.type == "cpu"]
    if not targets or not _agrees(targets[0][2], rows):
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, rows))
    return len(targets)


@torch.no_grad()
def _agrees(linear: nn.Linear, rows: int) -> bool:
    """The packed layer gives ``F.linear``'s output (to float32 rounding) at 1 and ``rows`` + 3 rows."""
    packed = PackedLinear(linear, rows)
    gen = torch.Generator().manual_seed(0)
    for m in (1, rows + 3):
        x = torch.randn(m, linear.in_features, generator=gen)
        want = linear(x)
        if not torch.allclose(packed(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max().clamp(min=1.0))):
            return False
    return True
