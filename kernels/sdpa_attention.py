"""The fused CPU attention kernel of PyTorch's SDPA as a ``BlockKernel``: the exact (out, lse) of one block and its
backward from the final LSE, with the position-causal + key-validity mask.

``torch.nn.functional.scaled_dot_product_attention`` returns no LSE. Its CPU flash kernel is public as the ATen op
``aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out,
logsumexp)``, and ``..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, ...)`` is its backward given an LSE, so
it serves both the single-device block and every ring hop. Facts relied on (torch 2.13, checked by the tests against
the dense reference): GQA needs no key expansion; float32, float64 and bfloat16 run; the additive float mask must
have q's dtype and may broadcast ([B, 1, 1, Sk] validity); ``is_causal`` is top-left aligned (query i reads keys
j <= i); a row with no readable key gets out 0 and lse 0 (set to -inf here); the kernel skips the key blocks above
the diagonal only with ``is_causal``.

Mask per pair, cheapest first (positions are global, so a pair's layout is read from its positions):
  full     every key is at or before every query, all in one document: no mask, or the [B, 1, 1, Sk] validity mask;
  causal   q and k positions are the same strictly increasing list in one document (the single-device block, each
           cp rank's own zigzag block): ``is_causal`` plus the validity mask, with the kernel's causal skipping;
  causal-documents  the causal layout's positions spanning packed documents: ``is_causal`` (its causal skipping)
           plus the dense mask below;
  general  anything else (inference prefill, Sq != Sk, an off-diagonal tile pair of packed documents): a dense
           [B, 1, Tq, Tk] additive mask of ``kernels.documents.readable`` and the validity, so ``tile_size`` bounds
           its memory.

Backward: the kernel derives ``delta = rowsum(grad_out · out)`` from its ``out`` argument alone (the flash-attention
backward: Dao et al. 2022, Alg. 4), and the LSE's gradient enters the softmax backward as ``dS = P·(dP - (delta -
dlse))``. So the FINAL statistics go in through ``out``: ``out' = β·dout`` with ``β = (delta - dlse) / |dout|²`` per
row has ``rowsum(dout · out') = delta - dlse``; a row with ``dout = 0`` but a non-zero target (possible only when
the LSE alone carries gradient) switches the call to one extra head dimension instead: ``q, k, v`` padded with a
zero column, ``dout' = [dout | 1]``, ``out' = [0 | delta - dlse]``.
"""
from __future__ import annotations

import torch

from kernels.documents import document_start, has_readable_key, readable
from kernels.registry import AttentionBackend, BlockKernel, register_attention_backend


def sdpa_available() -> bool:
    """True when the installed torch has the fused CPU attention op and its backward."""
    ops = torch.ops.aten
    return hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward")


def pair_mask(q_pos_BS, k_pos_BS, k_valid_BS, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None, str]:
    """``(is_causal, attn_mask, layout)`` for the fused kernel on one (query tile, key tile) pair.

    q_pos [B, Tq], k_pos [B, Tk] int64; k_valid [B, Tk] bool. ``attn_mask`` is None, the [B, 1, 1, Tk] validity mask
    or the dense [B, 1, Tq, Tk] position + validity mask, additive (0 / -inf) in ``dtype``; ``layout`` is "full",
    "causal", "causal-documents" or "general" (module docstring).
    """
    all_valid = bool(k_valid_BS.all())
    one_document = k_pos_BS.shape[1] > 0 and q_pos_BS.shape[1] > 0 and bool(  # every q and k in the latest q's
        (document_start(q_pos_BS.amax(dim=1)) <= torch.minimum(k_pos_BS.amin(dim=1), q_pos_BS.amin(dim=1))).all())
    diagonal = (q_pos_BS.shape == k_pos_BS.shape and torch.equal(q_pos_BS, k_pos_BS)
                and bool((k_pos_BS[:, 1:] > k_pos_BS[:, :-1]).all()))
    if one_document and bool((q_pos_BS.amin(dim=1) >= k_pos_BS.amax(dim=1)).all()):
        layout = "full"
    elif one_document and diagonal:
        layout = "causal"
    else:  # the dense mask; on a diagonal pair of packed documents with the kernel's causal skipping as well
        allowed_BQK = readable(q_pos_BS[:, :, None], k_pos_BS[:, None, :]) & k_valid_BS[:, None, :]
        mask = torch.zeros(allowed_BQK.shape, dtype=dtype, device=q_pos_BS.device)
        return diagonal, mask.masked_fill_(~allowed_BQK, float("-inf"))[:, None], \
            "causal-documents" if diagonal else "general"
    if all_valid:
        return layout == "causal", None, layout
    mask = torch.zeros(k_valid_BS.shape, dtype=dtype, device=k_valid_BS.device)
    return layout == "causal", mask.masked_fill_(~k_valid_BS, float("-inf"))[:, None, None], layout


def sdpa_block_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale: float):
    """(out [B, H, Tq, D], lse [B, H, Tq]) of one pair through the fused CPU kernel, in q's dtype (lse float32 for
    bfloat16, else q's dtype); out 0 and lse -inf on rows with no readable key. k_valid must be a bool tensor.
    Raises RuntimeError (from the op) on a non-CPU tensor."""
    is_causal, mask, _ = pair_mask(q_pos_BS, k_pos_BS, k_valid_BS, q_BHSD.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD, k_BHkvSD, v_BHkvSD, 0.0, is_causal, attn_mask=mask, scale=scale)
    has_key = has_readable_key(q_pos_BS, k_pos_BS, k_valid_BS)[:, None, :]
    return torch.where(has_key[..., None], out, torch.zeros_like(out)), torch.where(
        has_key, lse, torch.full_like(lse, float("-inf")))


def sdpa_block_backward(dout_BHSD, dlse_BHS, delta_BHS, lse_BHS, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS,
                        k_valid_BS, scale: float):
    """(dq [B, H, Tq, D], dk, dv [B, Hkv, Tk, D]) of one pair given the FINAL lse, delta = rowsum(dout · out) and
    dlse (``BlockKernel.backward``; the way they enter the kernel is in the module docstring). All float inputs in
    one dtype (float32 or float64; the tile loops pass the accumulation dtype)."""
    is_causal, mask, _ = pair_mask(q_pos_BS, k_pos_BS, k_valid_BS, q_BHSD.dtype)
    lse = torch.where(torch.isfinite(lse_BHS), lse_BHS, torch.zeros_like(lse_BHS))  # rows read nothing: P = 0
    target_BHS = (delta_BHS - dlse_BHS).to(q_BHSD.dtype)
    norm2_BHS = (dout_BHSD * dout_BHSD).sum(-1).to(q_BHSD.dtype)
    usable = norm2_BHS >= torch.finfo(q_BHSD.dtype).tiny ** 0.5  # beta = target / |dout|^2 stays finite
    d = q_BHSD.shape[-1]
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if not bool(((~usable) & (target_BHS != 0)).any()):
        beta = torch.where(usable, target_BHS / torch.where(usable, norm2_BHS, torch.ones_like(norm2_BHS)),
                           torch.zeros_like(target_BHS))
        dout = dout_BHSD.to(q_BHSD.dtype)
        return backward(dout, q_BHSD, k_BHkvSD, v_BHkvSD, beta[..., None] * dout, lse, 0.0, is_causal,
                        attn_mask=mask, scale=scale)

    def pad(x, value):
        return torch.cat([x, x.new_full((*x.shape[:-1], 1), value)], dim=-1)

    out = pad(torch.zeros_like(q_BHSD), 0.0)
    out[..., d] = target_BHS
    dq, dk, dv = backward(pad(dout_BHSD.to(q_BHSD.dtype), 1.0), pad(q_BHSD, 0.0), pad(k_BHkvSD, 0.0),
                          pad(v_BHkvSD, 0.0), out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    return dq[..., :d], dk[..., :d], dv[..., :d]


SDPA_KERNEL = BlockKernel("sdpa", sdpa_block_forward, sdpa_block_backward)
"""The fused CPU kernel in the tile loops: CPU tensors only; computes in the accumulation dtype (float32 for
bfloat16 inputs, float64 stays float64); exact (no approximation beyond float rounding)."""


def _refusal(device_type: str) -> str | None:
    if device_type == "cpu" and sdpa_available():
        return None
    why = "the installed torch lacks it" if device_type == "cpu" else f"got device {device_type!r}"
    return f"is PyTorch's fused CPU kernel and {why}"


register_attention_backend(AttentionBackend("sdpa", lambda: SDPA_KERNEL, refusal=_refusal, auto_on=("cpu",),
                                            traced_as="tiled", order=1))
"""``sdpa``: the fused CPU kernel in the tile loops; ``auto`` on CPU. Traced by the planner as ``tiled`` (its mask
layout is chosen from position values, which fake tensors lack; the same tiles, one pair's temporaries at a time)."""
