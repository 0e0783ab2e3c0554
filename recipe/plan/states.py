"""Analytic parts of the per-rank memory plan: draft parameter counts, ZeRO states, the online target, fixed
CUDA/NCCL overheads and GPU sizes. All values in bytes; parameter counts are elements.

ZeRO (the draft's DeepSpeed engine; ``recipe.parallel.topology``: ZeRO partitions over the dp×cp group, D = dp·cp;
TP-split parameters are already 1/tp on the rank):
- bf16: 16-bit weights (2 B/param, every parameter incl. the frozen embedding), 16-bit grads (2 B per trainable
  param), fp32 master + Adam m + v (12 B per trainable param). fp32: the weights are the master (4 B), grads 4 B,
  Adam m + v 8 B. bf16 with ``data_types.grad_accum_dtype`` fp32 (the shipped bf16 configs at ZeRO 1-3): stage 1
  runs DeepSpeed's BF16_Optimizer, which keeps fp32 gradients beside the bf16 ones on every rank (6 B, not
  partitioned); stages 2-3 accumulate the gradient partitions in fp32 (4 B). The reduce bucket has the width of
  ``communication_data_type`` (fp32: 4 B).
- stage 0: nothing partitioned; 1: optimizer states / D; 2: + grads / D; 3: + weights / D (and, during the step,
  the gathered draft weights: all of them, the draft is one layer). Stage ≥ 2 adds the gradient reduce bucket
  (``zero_optimization.reduce_bucket_size`` elements, DeepSpeed's default 5e8, at most the trainable count).
- The frozen target-head rows ``target_head_d`` [Vd/tp, H_t] are a buffer (never partitioned), in the training dtype.
- ``--freeze-lm-head`` (run.py: ``lm_head.weight.requires_grad_(False)`` after ``parallelize``, and only
  ``requires_grad`` parameters reach ``deepspeed.initialize``): lm_head then counts as a frozen weight, no grads, no
  optimizer states.
The gradients also appear in the traced step (autograd creates them at the rank's full shard size); the plan
subtracts them from the trace and counts them here, as ZeRO holds them.

Online target (``recipe.target.partition.build_target``: bf16 on CUDA): weights replicated, or ZeRO-3
partitioned over the world (the JSON's ``target.partition: "zero3"``, ``recipe.target.options``) plus the
largest gathered piece (a decoder layer, the embedding or the lm_head) during its forward. Its no-grad forward at
the rank's m positions (``recipe.target.split``: m = B·S/(cp·tp) when split over the cp·tp ranks, the ring-routable
architectures; else B·S/cp): one layer's larger live set, attention m·(3H + (Hq + 2Hkv)·D + Hq·D) or MLP
m·(2H + 3I), in bf16, the argmax chunk [c, V] in bf16 (``memory.argmax_chunk_size``; by default sized from the
vocabulary, ``MemoryOptions.argmax_positions``), plus the captured aux [n, 3H_t] and last hidden states [n, H_t]
(n = B·S/cp, after the tp all-gather) — which an offline run reads from its store instead (the batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.parallel.apply_tp import COLUMN, LM_HEAD, ROW
from recipe.parallel.dims import ParallelDims

GIB = 1024 ** 3
MIB = 1024 ** 2

# ---- fixed overheads, from public measurements until a GPU calibrates them (scripts/gpu_check.py records
# mem_get_info beside the allocator's peaks for that) ---------------------------------------------------------------
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
"""CUDA context + cuBLAS/cuDNN workspaces of one process (until a GPU calibrates it)."""
NCCL_BYTES_PER_COMMUNICATOR = int(0.75 * GIB)
"""NCCL buffers of one communicator this rank runs collectives on. Public measurements, PyTorch front end: 544 MB
for a 2-rank and 688 MB for a 3-4-rank group after a 4 MB all-reduce, 4×A100 with NVLink (NVIDIA/nccl issue 964);
about 1.6 GB for one communicator after an all-reduce and about 6 GB for three or more (issue 864). NCCL's
maintainer there: the buffers grow with the channels NCCL opens for the link's bandwidth (more on H100/H200
NVLink than A100) and with point-to-point traffic. 0.75 GiB: the 688 MB rounded up."""
NCCL_P2P_BYTES_PER_COMMUNICATOR = int(1.5 * GIB)
"""A communicator that also carries point-to-point traffic (the ring attention's ``batch_isend_irecv`` over the cp
group, a split online target's ring over cp·tp): send/receive opens its own channels per peer (NVIDIA/nccl issue
1685: an 8×H100 all-to-all took 3.3 GB more on each GPU, 32 channels per peer pair; the ring talks to 2 peers);
1.5 GiB, issue 864's 1.6 GB for one communicator in use."""
ALLOCATOR_SLACK = 0.05
"""Fraction of the tensor bytes lost to the caching allocator's fragmentation, with expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which ``run.py`` sets on CUDA unless the user set the
allocator: ``recipe.lifecycle.distributed.default_cuda_alloc_conf``): freed blocks are then unmapped pages of one
growing segment instead of fixed-size segments that a larger request cannot reuse (PyTorch's CUDA memory notes,
"Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). Without them the gap between ``max_memory_reserved`` and
``max_memory_allocated`` can be far larger; the GPU check records both per row."""
DEFAULT_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""

GPUS_MIB = {"h200": 143771, "h100": 81559, "a100-80g": 81920}
"""Total memory per GPU as nvidia-smi reports it (MiB): H200 141 GB HBM3e, H100 SXM 80 GB, A100 80 GB."""


def gpu_bytes(name: str) -> int:
    """Bytes of the GPU ``name`` (a key of ``GPUS_MIB``, case-insensitive) or of a number of GiB ("100", "79.5").
    Raises ValueError naming the input and the known names."""
    key = str(name).strip().lower()
    if key in GPUS_MIB:
        return GPUS_MIB[key] * MIB
    try:
        gib = float(key)
    except ValueError:
        raise ValueError(f"unknown --gpu {name!r}: choose from {sorted(GPUS_MIB)} or give a size in GiB") from None
    if not gib > 0:
        raise ValueError(f"bad --gpu {name!r}: a size in GiB must be > 0")
    return int(gib * GIB)


@dataclass(frozen=True)
class DraftParams:
    """Parameters of the draft on one TP rank (elements): ``trainable`` (what the optimizer sees), ``frozen``
    (the target embedding, and lm_head under --freeze-lm-head) and ``head_buffer`` (``target_head_d`` rows)."""

    trainable: int
    frozen: int
    head_buffer: int

    @property
    def weights(self) -> int:
        """Every parameter (trainable + frozen)."""
        return self.trainable + self.frozen


def count_draft_params(draft_config, tp: int = 1, freeze_lm_head: bool = False) -> DraftParams:
    """Count the parameters of the real ``recipe.model.draft.Eagle3Draft`` for ``draft_config`` (built on fake
    tensors: nothing allocated), the tensor-parallel ones (``recipe.parallel.apply_tp``: q/k/v/o, gate/up/down,
    lm_head) divided by ``tp``."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # import cost: torch._subclasses.fake_tensor

    from recipe.model.draft import Eagle3Draft  # import cost: pulls in transformers

    with FakeTensorMode():
        draft = Eagle3Draft(draft_config, seed=0)
    split = tuple(f"{name}." for name in (*COLUMN, *ROW, LM_HEAD))
    trainable = frozen = 0
    for name, p in draft.named_parameters():
        n = p.numel() // tp if name.startswith(split) else p.numel()
        if not p.requires_grad or (freeze_lm_head and name.startswith(f"{LM_HEAD}.")):
            frozen += n
        else:
            trainable += n
    head = draft_config.draft_vocab_size // tp * draft_config.target_hidden_size
    return DraftParams(trainable=trainable, frozen=frozen, head_buffer=head)


def zero_states(params: DraftParams, stage: int, dp_cp: int, bf16: bool,
                reduce_bucket: int = DEFAULT_REDUCE_BUCKET, fp32_grad_accum: bool = False,
                fp32_comm: bool = False) -> dict[str, int]:
    """Bytes per rank of the draft's persistent states under ZeRO ``stage`` (0–3) over ``dp_cp`` ranks (module
    docstring): ``weights`` (16-bit or fp32 weights + the head buffer), ``grads``, ``optimizer``, and the step's
    transient ``zero_buffers`` (stage 3 gathered weights, stage ≥ 2 reduce bucket). ``fp32_grad_accum`` /
    ``fp32_comm``: bf16 with ``data_types.grad_accum_dtype`` / ``communication_data_type`` fp32 (module
    docstring). Raises ValueError on a stage outside 0–3 or dp_cp < 1."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp_cp < 1:
        raise ValueError(f"dp·cp must be >= 1, got {dp_cp}")
    w = 2 if bf16 else 4
    opt = 12 if bf16 else 8
    d = dp_cp

    def part(nbytes: int, partitioned: bool) -> int:
        return -(-nbytes // d) if partitioned else nbytes
    g = w
    if bf16 and fp32_grad_accum and stage >= 1:
        g = 2 + 4 if stage == 1 else 4  # stage 1: BF16_Optimizer's fp32 grads beside the bf16 ones
    out = {"weights": part(params.weights * w, stage >= 3) + params.head_buffer * w,
           "grads": part(params.trainable * g, stage >= 2),
           "optimizer": part(params.trainable * opt, stage >= 1)}
    buffers = 0
    if stage >= 3 and d > 1:
        buffers += params.weights * w - part(params.weights * w, True)
    if stage >= 2:
        buffers += min(reduce_bucket, params.trainable) * (4 if fp32_comm or not bf16 else 2)
    out["zero_buffers"] = buffers
    return out


@dataclass(frozen=True)
class TargetShape:
    """What the plan needs of the target (HF config): hidden H, layers, heads, KV heads, head dim, MLP width,
    vocabulary V, and its parameter count (elements)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    layer_params: int
    embed_params: int


def target_shape(hf_config) -> TargetShape:
    """Read ``hf_config`` (a transformers config) and count its parameters on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM  # import cost: transformers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    embed = model.get_input_embeddings().weight.numel()
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    return TargetShape(hidden=hidden, layers=int(text.num_hidden_layers), heads=heads,
                       kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                       head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
                       intermediate=int(text.intermediate_size), vocab=int(text.vocab_size), params=int(total),
                       layer_params=int(layer), embed_params=int(embed))


def batch_bytes(t: TargetShape, tokens: int, dtype_bytes: int, ttt_steps: int) -> int:
    """The micro-batch on the rank: aux states [n, 3H_t] and last hidden rows [n, H_t] in the training dtype, the
    K-step ids/valid [K, n] int64/bool, positions/key validity [n] (n = ``tokens`` = B·S/cp)."""
    return tokens * (4 * t.hidden * dtype_bytes + ttt_steps * (8 + 1 + 8) + 8 + 1)


def target_bytes(t: TargetShape, tokens: int, world: int, partitioned: bool, offline: bool,
                 dtype_bytes: int = 2, argmax_chunk: int = 1024) -> dict[str, int]:
    """The online target on one rank: ``target_weights`` (replicated, or / world under ZeRO-3 plus the largest
    gathered piece) and ``target_forward`` (no-grad forward transient at the ``tokens`` positions the rank's forward
    runs on, with ``argmax_chunk`` positions of [·, V] logits; module docstring). Offline: both 0 (the store's aux
    states are the batch)."""
    if offline:
        return {"target_weights": 0, "target_forward": 0}
    w = dtype_bytes
    weights = t.params * w
    if partitioned and world > 1:
        weights = -(-weights // world) + max(t.layer_params, t.embed_params) * w
    attention_phase = 3 * t.hidden + (t.heads + 2 * t.kv_heads) * t.head_dim + t.heads * t.head_dim
    mlp_phase = 2 * t.hidden + 3 * t.intermediate  # residual, norm; up, act(gate), act·up
    layer_live = tokens * max(attention_phase, mlp_phase) * w
    argmax = min(argmax_chunk, tokens) * t.vocab * w
    return {"target_weights": weights, "target_forward": layer_live + argmax}


def communicators(dims: ParallelDims, split_target: bool = False) -> int:
    """NCCL communicators one rank of the layout ``dims`` joins: the world and each of its tp, cp, dp and dp×cp
    groups, and the cp·tp group of a split online target (``split_target``; at tp = 1 its ring is the cp group, no
    new communicator), those of > 1 rank."""
    ring = dims.tp * dims.cp if split_target and dims.tp > 1 else 1
    return sum(1 for size in (dims.world_size, dims.tp, dims.cp, dims.dp, dims.dp_cp, ring) if size > 1)


def p2p_communicators(dims: ParallelDims, split_target: bool = False) -> int:
    """Those of ``communicators`` that carry point-to-point traffic: the cp group when ``dims.cp_enabled`` (the
    ring attention, and a split target's ring at tp = 1) and a split target's cp·tp group at tp > 1."""
    return int(dims.cp_enabled) + int(split_target and dims.tp > 1)


def overheads(dims: ParallelDims, tensor_bytes: int, split_target: bool = False) -> dict[str, int]:
    """The fixed overheads of one rank of the layout ``dims`` (constants from public measurements):
    ``cuda_context``, ``nccl`` (per communicator, those with point-to-point traffic at
    ``NCCL_P2P_BYTES_PER_COMMUNICATOR``) and ``allocator_slack`` (``ALLOCATOR_SLACK`` of ``tensor_bytes``)."""
    p2p = p2p_communicators(dims, split_target)
    collective = communicators(dims, split_target) - p2p
    return {"cuda_context": CUDA_CONTEXT_BYTES,
            "nccl": collective * NCCL_BYTES_PER_COMMUNICATOR + p2p * NCCL_P2P_BYTES_PER_COMMUNICATOR,
            "allocator_slack": int(ALLOCATOR_SLACK * tensor_bytes)}
