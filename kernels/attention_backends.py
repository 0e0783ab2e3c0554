"""Choosing the causal-block attention: one name per backend, ``auto`` per device, one factory for the three callers
(the single-device training block, each ring hop under context parallelism, the inference KV cache).

Every backend computes the same function ``(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS) -> (out,
lse)`` — query i reads key j iff ``k_valid[j]`` and ``k_pos[j] <= q_pos[i]``, GQA, out 0 and lse -inf on rows with no
readable key, differentiable in q, k, v including through lse — exactly (no approximation beyond float rounding):

  tiled  pure PyTorch (``kernels.tiled_attention``): the reference and the fallback. Any device, any float dtype
         (float64 included), memory O(S·D + tile²); ``tile_size=None`` on one device is the dense
         ``block_attention`` (O(S²) memory).
  sdpa   the fused CPU kernel of PyTorch's SDPA with its LSE (``kernels.sdpa_attention``) inside the same tile loops
         (the tiles give the causal skipping between tiles and bound the memory of a general mask). CPU only; float32,
         float64, bfloat16 inputs (computes in the accumulation dtype).
  flex   ``torch.nn.attention.flex_attention``, compiled (``kernels.flex_attention``). CUDA only (torch 2.13 has no
         flex backward on CPU); float32 and bfloat16; ``tile_size`` unused (flex's own 128-position blocks). One
         dynamic-shape compile for all lengths, never an uncompiled fallback (``FlexCompileError``), and one block
         mask per micro-batch reused by the TTT steps and the recompute.

``auto``: ``flex`` on CUDA, ``sdpa`` on CPU (measured fastest exact CPU kernel: docs/results/attention_cpu.json,
step_cpu.json), ``tiled`` elsewhere or when the installed torch lacks the fused op.
"""
from __future__ import annotations

import torch

from kernels.tiled_attention import check_tile_size

BACKENDS = ("tiled", "sdpa", "flex")
"""Backend names accepted by ``make_causal_attention`` besides ``"auto"``."""


def _device_type(device) -> str:
    return torch.device(device).type


def resolve_attention_backend(name: str, device) -> str:
    """The backend ``name`` ("auto" or one of ``BACKENDS``) stands for on ``device`` (str or torch.device).

    Raises ValueError naming the backend and the allowed values when ``name`` is unknown, and naming the device when
    the backend cannot run there (``sdpa`` off CPU or without the fused op, ``flex`` off CUDA).
    """
    allowed = ", ".join(repr(n) for n in ("auto", *BACKENDS))
    if not isinstance(name, str) or name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; allowed: {allowed}")
    kind = _device_type(device)
    from kernels.sdpa_attention import sdpa_available

    if name == "auto":
        if kind == "cuda":
            return "flex"
        return "sdpa" if kind == "cpu" and sdpa_available() else "tiled"
    if name == "sdpa" and (kind != "cpu" or not sdpa_available()):
        why = "the installed torch lacks it" if kind == "cpu" else f"got device {kind!r}"
        here = "'auto', 'tiled', 'flex'" if kind == "cuda" else "'auto', 'tiled'"
        raise ValueError(f"attention backend 'sdpa' is PyTorch's fused CPU kernel and {why}; allowed here: {here}")
    if name == "flex" and kind != "cuda":
        raise ValueError(f"attention backend 'flex' needs a CUDA device, got {kind!r} (flex attention has no "
                         "backward on CPU in this torch); use 'auto', 'sdpa' or 'tiled'")
    return name


def backend_runs_on(name: str, device) -> bool:
    """Whether backend ``name`` (one of ``BACKENDS``) runs on ``device`` as itself (``resolve_attention_backend``
    neither refuses it nor maps it to another backend)."""
    try:
        return resolve_attention_backend(name, device) == name
    except ValueError:
        return False


def make_causal_attention(backend: str, tile_size: int | None, device, cp_group=None):
    """The causal-block callable for ``midlayer.self_attn.causal_attention`` (training or inference).

    Args:
        backend: "auto" or one of ``BACKENDS`` (resolved by ``resolve_attention_backend`` for ``device``).
        tile_size: positions per query/key tile (``memory.attention_tile_size``; None: one tile per block / per
            zigzag chunk; with ``tiled`` on one device, the dense block). Unused by ``flex``.
        device: where the attention runs (str or torch.device).
        cp_group: the context-parallel process group; None or a group of one rank gives the single-device block,
            a larger group the ring over it (zigzag shards; ``kernels.ring_attention``).
    Returns ``TiledCausalAttention`` / ``block_attention`` / ``FlexCausalAttention`` on one device, a
    ``RingCausalAttention`` with the backend's per-pair kernel under CP (flex: one pair per hop).
    Raises ValueError for an unknown backend or one that cannot run on ``device`` (naming both and the allowed
    values), or a ``tile_size`` that is not a positive integer or None.
    """
    name = resolve_attention_backend(backend, device)
    check_tile_size(tile_size)
    ring = cp_group is not None and torch.distributed.get_world_size(cp_group) > 1
    if name == "tiled":
        from kernels.tiled_attention import DENSE_KERNEL as kernel
    elif name == "sdpa":
        from kernels.sdpa_attention import SDPA_KERNEL as kernel
    else:
        from kernels.flex_attention import make_flex_kernel

        kernel = make_flex_kernel()  # its own block-mask cache
    if ring:
        from kernels.ring_attention import make_ring_causal_attention

        if name == "flex":
            return make_ring_causal_attention(cp_group, num_chunks=1, tile_size=None, kernel=kernel)
        return make_ring_causal_attention(cp_group, tile_size=tile_size, kernel=kernel)
    if name == "flex":
        from kernels.flex_attention import FlexCausalAttention

        return FlexCausalAttention()
    if name == "tiled" and tile_size is None:
        from kernels.block_attention import block_attention

        return block_attention
    from kernels.tiled_attention import TiledCausalAttention

    return TiledCausalAttention(tile_size, kernel)
