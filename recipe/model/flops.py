"""The FLOP model of one draft training step and the device peaks MFU divides by (docs/benchmarks.md, "FLOP model
and MFU").

A multiply-add is 2 FLOPs; a linear map of N weights costs 2N per row forward, and its backward 2N for the weight
gradient plus 2N for the input gradient. Per trained position (a token of a sample; P positions in a step) and
TTT step (K of them):

- ``fc``: 4·N_fc per position, once: forward and weight gradient, no input gradient (the target's aux hidden
  states are data). N_fc = 3·H_t·H.
- ``layer``: 6·N_layer per position and step: q/k/v/o and the gated MLP, forward and both gradients.
  N_layer = 2H·(h_q + 2·h_kv)·D + h_q·D·H + 3·H·I.
- ``lm_head``: 6·N_lm per position and step (4·N_lm when it is frozen: no weight gradient). N_lm = H·Vd.
- ``target_head``: 2·N_t per position, once: the frozen target head over the draft vocabulary, no gradient (the
  teacher logits computed once per micro-batch). N_t = H_t·Vd.
- ``attention``: per step k, the causal block over step 0's keys (n(n+1)/2 readable pairs in a sample of n
  positions: S/2 + 1/2 per position) plus k diagonal keys per position; forward 4·d per pair (QKᵀ and PV,
  d = h_q·D), backward 2× the forward, so 3 × 4·d·(n(n+1)/2 + k·n).
- ``target_forward`` (online runs only): the target's own forward, 2·N_target per position (its decoder layers'
  matmul weights, active experts only for a mixture of experts) plus its causal attention forward
  4·d_t·n(n+1)/2 per layer, plus its lm_head argmax 2·H_t·V per row the validity reads (the supervised tokens).

Model FLOPs count each of these once: no recompute. Hardware FLOPs add what the memory switches and the attention
kernel recompute (:class:`Recompute`), as torch runs it: a non-reentrant checkpoint stops its recompute after the
last tensor the backward needs, and the layer's last matmul (down_proj, whose output only joins the residual) is
not one. So step checkpointing reruns each step's layer forward but down_proj (+2·(N_layer − H·I) per position and
step), attention included; the tiled MLP reruns gate and up in every tile (+2·2·H·I), and with step checkpointing
the step's recompute then runs the MLP's tiles whole but the last (+2·3·H·I at their positions, in place of gate
and up); the chunked loss reruns lm_head's forward (+2·N_lm); when the teacher logits are not kept once per
micro-batch, every step projects its own rows (K·2·N_t per position, twice with the chunked loss: forward and its
backward recompute); a flash-style attention kernel (tiled, sdpa, flex) recomputes the scores QKᵀ in its backward
(backward 2.5× its forward instead of 2×). The sparse-anchor path (``memory.sparse_anchors``) computes less than
the dense step counted here.

Layouts: these are the FLOPs of the whole step, all ranks together; per GPU is that divided by the world size
(tp, cp and dp split the work; under tp, ``fc`` is replicated, so each tp rank computes all of it, and under cp the
online target's boundary rows overlap a little: the work done exceeds total / world by that much).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

PARTS = ("fc", "layer", "lm_head", "target_head", "attention", "target_forward")
"""The parts of a step's FLOPs, in the order reports list them."""


@dataclass(frozen=True)
class DraftShape:
    """The draft geometry a step's FLOPs depend on: hidden H, MLP width I, query heads h_q and key/value heads h_kv
    of dim D, draft vocabulary Vd, target hidden H_t, TTT steps K, and whether lm_head is frozen (no weight
    gradient, ``--freeze-lm-head``)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    target_hidden: int
    ttt_steps: int
    freeze_lm_head: bool = False

    @classmethod
    def of_config(cls, config, ttt_steps: int, freeze_lm_head: bool = False) -> "DraftShape":
        """From an ``Eagle3DraftConfig`` (or anything with its field names)."""
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   draft_vocab=config.draft_vocab_size, target_hidden=config.target_hidden_size,
                   ttt_steps=ttt_steps, freeze_lm_head=freeze_lm_head)

    @property
    def attention_width(self) -> int:
        """d = h_q·D, the width of the queries (and of the attention output)."""
        return self.heads * self.head_dim

    @property
    def fc_params(self) -> int:
        return 3 * self.target_hidden * self.hidden

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        """q/k/v read the 2H concatenation [input_layernorm(emb), hidden_norm(h)]; o_proj and the MLP."""
        qkv = 2 * self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.attention_width * self.hidden + self.mlp_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.draft_vocab

    @property
    def target_head_params(self) -> int:
        return self.target_hidden * self.draft_vocab


@dataclass(frozen=True)
class TargetShape:
    """The online target's forward: ``layers`` decoder layers of ``layer_params`` matmul weights each (the active
    experts' for a mixture of experts), attention width d_t = heads·head_dim, hidden H_t and vocabulary V."""

    layers: int
    layer_params: int
    attention_width: int
    hidden: int
    vocab: int

    @classmethod
    def of_config(cls, config) -> "TargetShape":
        """From a Hugging Face causal-LM config (its text config when it has one): q/k/v/o of its heads and a gated
        MLP of ``intermediate_size``, or, with ``num_experts_per_tok``, that many experts of
        ``moe_intermediate_size`` (plus ``shared_expert_intermediate_size`` when set) and the router."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        h, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        attention = h * (heads + 2 * kv) * head_dim + heads * head_dim * h
        active = getattr(cfg, "num_experts_per_tok", None)
        if active:
            experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)
            mlp = 3 * h * int(cfg.moe_intermediate_size) * int(active) + h * experts
            mlp += 3 * h * int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        else:
            mlp = 3 * h * int(cfg.intermediate_size)
        return cls(layers=int(cfg.num_hidden_layers), layer_params=attention + mlp,
                   attention_width=heads * head_dim, hidden=h, vocab=int(cfg.vocab_size))


@dataclass(frozen=True)
class Recompute:
    """What a step computes beyond its model FLOPs: the memory switches (``recipe.config.MemoryOptions``) and the
    attention kernel's backward. ``checkpoint_steps``: ``memory.checkpoint_ttt_steps``; ``chunked_loss``:
    ``memory.loss_chunk_size`` set; ``teacher_once``: ``memory.teacher_logits_once``; ``mlp_tile``:
    ``memory.mlp_tile_size`` (tiles only a rank's sequence longer than it); ``attention_backward``: the
    causal-block kernel's backward in units of its forward (2: autograd of the dense block; 2.5: a flash-style
    kernel that recomputes the scores, see :data:`FLASH_BACKWARD`)."""

    checkpoint_steps: bool = False
    chunked_loss: bool = False
    teacher_once: bool = True
    mlp_tile: int | None = None
    attention_backward: float = 2.0

    @classmethod
    def of_memory(cls, memory, attention_backend: str) -> "Recompute":
        """From a ``MemoryOptions`` and the resolved attention backend's name."""
        return cls(checkpoint_steps=bool(memory.checkpoint_ttt_steps), chunked_loss=memory.loss_chunk_size is not None,
                   teacher_once=bool(memory.teacher_logits_once), mlp_tile=memory.mlp_tile_size,
                   attention_backward=FLASH_BACKWARD.get(attention_backend, 2.0))


FLASH_BACKWARD = {"tiled": 2.5, "sdpa": 2.5, "flex": 2.5}
"""Backends whose backward recomputes the scores from the saved LSE (dS needs P): QKᵀ again, then dV, dP, dQ, dK,
five matmuls per pair against the forward's two."""


@dataclass(frozen=True)
class StepFlops:
    """A step's FLOPs by part (:data:`PARTS`): ``model`` (no recompute) and ``hardware`` (with it), over
    ``positions`` token positions. Totals: :attr:`model_total`, :attr:`hardware_total`."""

    model: dict[str, int]
    hardware: dict[str, int]
    positions: int

    @property
    def model_total(self) -> int:
        return sum(self.model.values())

    @property
    def hardware_total(self) -> int:
        return sum(self.hardware.values())


def causal_pairs(lengths: Sequence[int]) -> int:
    """Σ n(n+1)/2: the (query, key) pairs a causal attention reads in samples of these lengths."""
    return sum(n * (n + 1) // 2 for n in lengths)


def step_flops(shape: DraftShape, lengths: Sequence[int], recompute: Recompute = Recompute(), *,
               target: TargetShape | None = None, supervised: int | None = None, teacher_rows: int | None = None,
               pairs: int | None = None, cp: int = 1) -> StepFlops:
    """The FLOPs of one training step (forward + backward, no optimizer) on samples of ``lengths`` positions
    (module docstring: the formula and its source).

    ``target``: the online target whose forward the step also runs (None: offline, hidden states read from a
    store). ``supervised``: the rows the target's argmax reads (default: every position). ``teacher_rows``: the rows
    the target head projects once (default: every position; the code projects the U distinct label rows, one fewer
    per sample). ``pairs``: the causal block's (query, key) pairs of one step (default :func:`causal_pairs`; a
    kernel that computes masked pairs too does more: the dense block computes n² per sample). ``cp``: the context
    parallel degree (each rank's sequence is n / cp: whether, and in how many tiles, the MLP is tiled). Integers
    throughout; raises ValueError for a negative length.
    """
    if any(n < 0 for n in lengths):
        raise ValueError(f"sample lengths must be >= 0, got {list(lengths)}")
    s, k = shape, shape.ttt_steps
    p = sum(lengths)
    pairs = causal_pairs(lengths) if pairs is None else pairs
    rows = p if teacher_rows is None else teacher_rows
    block_fwd = 4 * s.attention_width * k * pairs  # the causal block of every step
    diag_fwd = 4 * s.attention_width * p * (k * (k - 1) // 2)  # step k reads k diagonal keys
    lm_factor = 4 if s.freeze_lm_head else 6
    model = {"fc": 4 * s.fc_params * p, "layer": 6 * k * s.layer_params * p,
             "lm_head": lm_factor * k * s.lm_head_params * p, "target_head": 2 * s.target_head_params * rows,
             "attention": 3 * (block_fwd + diag_fwd), "target_forward": 0}
    if target is not None:
        argmax_rows = p if supervised is None else supervised
        model["target_forward"] = (2 * target.layers * target.layer_params * p
                                   + 4 * target.attention_width * target.layers * causal_pairs(lengths)
                                   + 2 * target.hidden * target.vocab * argmax_rows)
    r, hardware = recompute, dict(model)
    ckpt = 1 if r.checkpoint_steps else 0
    hardware["layer"] += _layer_recompute(s, lengths, r, cp)
    if r.chunked_loss:
        hardware["lm_head"] += 2 * k * s.lm_head_params * p
    if not r.teacher_once:  # every step projects its own rows; the chunked loss again in its backward recompute
        hardware["target_head"] = (2 if r.chunked_loss else 1) * k * 2 * s.target_head_params * p
    hardware["attention"] = round(block_fwd * (1 + r.attention_backward + ckpt)) + diag_fwd * (3 + ckpt)
    return StepFlops(model=model, hardware=hardware, positions=p)


def _layer_recompute(s: DraftShape, lengths: Sequence[int], r: Recompute, cp: int) -> int:
    """The decoder layer's hardware FLOPs beyond the model's (module docstring), summed over the samples."""
    two_k, hi = 2 * s.ttt_steps, s.hidden * s.intermediate
    extra = 0
    for n in lengths:
        local = -(-n // cp)
        if r.mlp_tile is not None and local > r.mlp_tile:
            last = local - (-(-local // r.mlp_tile) - 1) * r.mlp_tile
            extra += two_k * 2 * hi * n  # every tile reruns gate and up
            if r.checkpoint_steps:  # the step's recompute: attention, then the tiles whole but the last
                extra += two_k * ((s.layer_params - s.mlp_params) * n + 3 * hi * (n - last * cp))
        elif r.checkpoint_steps:
            extra += two_k * (s.layer_params - hi) * n
    return extra


# ---- device peaks ------------------------------------------------------------------------------------------------
PEAK_TFLOPS = (
    # (pattern on torch.cuda.get_device_name, dtype, dense tensor-core TFLOP/s), first match wins
    (r"H100.*(PCIE|PCI-E)", torch.bfloat16, 756.0),
    (r"H100.*NVL|H200.*NVL", None, None),  # the NVL cards: lower clocks, not listed
    (r"H100|GH200|H200", torch.bfloat16, 989.0),  # SXM ("H100 80GB HBM3"), GH200 and H200: 989.4
    (r"A100", torch.bfloat16, 312.0),
    (r"L40S", torch.bfloat16, 362.0),
    (r"B200", torch.bfloat16, 2250.0),  # HGX B200 (1000 W)
)
"""Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets. Only bf16: an fp32 step runs on the
fp32 (or TF32) units, whose peak is another number; pass ``--peak-tflops`` for it."""


def device_peak_tflops(device_name: str | None, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of ``device_name`` (``torch.cuda.get_device_name``) for matmuls in ``dtype``, or None
    when unknown (the CPU, a device not in :data:`PEAK_TFLOPS`, a dtype whose peak is not listed)."""
    if not device_name:
        return None
    for pattern, peak_dtype, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return tflops if peak_dtype == dtype else None
    return None


def run_peak_tflops(device: torch.device | str, dtype: torch.dtype, override: float | None = None) -> float | None:
    """The peak a run divides by: ``override`` (``--peak-tflops``) when given, else :func:`device_peak_tflops` of
    a CUDA ``device``'s name; None on the CPU."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device_peak_tflops(torch.cuda.get_device_name(device), dtype)


def speed_fields(flops: float, seconds: float, world_size: int, peak_tflops: float | None) -> dict:
    """``{"model_tflops_per_gpu": flops / seconds / world_size / 1e12, "mfu": that / peak (None without a
    peak)}``; ``flops``: the model FLOPs of the whole timed work, all ranks."""
    tflops = flops / max(seconds, 1e-12) / max(world_size, 1) / 1e12
    return {"model_tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None}
