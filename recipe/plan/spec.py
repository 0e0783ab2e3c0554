"""The one draft training step that ``recipe.bench`` measures and ``recipe.plan`` predicts: its geometry, length,
layout, parallel degrees and dtype (:class:`BenchSpec`), the draft config it stands for."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.model.flops import DraftShape, Recompute, StepFlops, speed_fields, step_flops
from recipe.model.sparse_anchors import check_sparse_mode, sparse_pays
from recipe.model.ttt import make_ttt_batch
from recipe.parallel.cp_shard import shard_ttt_batch
from recipe.parallel.dims import ParallelDims, check_tp_divides, seq_divisor

LAYOUTS = {"full": (False, False), "chunked": (True, False), "ckpt": (False, True), "chunked+ckpt": (True, True)}
"""Layout name -> (chunked loss, checkpointed TTT steps)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

MASKS = ("full", "sharegpt", "long10")
"""Named supervision masks of a measured batch (``supervised_mask``): every position; ShareGPT-like turns (prompt 60
tokens, answer 135: 69 % supervised, the share SmolLM2's template gives ShareGPT); a long prompt and a short answer
(the last 10 % supervised). Besides these, ``fraction_mask(F)`` names the long-prompt/short-answer mask with the
last F of the positions supervised ("last0.25"; ``long10`` is "last0.1")."""

_FRACTION_MASK = re.compile(r"last(\d*\.?\d+(?:e-?\d+)?)")


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float when 0 < fraction ≤ 1 (a supervised fraction); ValueError naming it otherwise."""
    try:
        value = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"supervised fraction {fraction!r} is not a number") from None
    if isinstance(fraction, bool) or not 0 < value <= 1:
        raise ValueError(f"supervised fraction {fraction!r} must be in (0, 1]")
    return value


def fraction_mask(fraction: float) -> str:
    """The name of the long-prompt/short-answer mask whose last ``fraction`` (0 < F ≤ 1) of the positions are
    supervised: ``"last"`` + the float's shortest round-trip text (``repr``), e.g. 0.1 -> "last0.1"."""
    return f"last{check_fraction(fraction)!r}"


def mask_fraction(mask: str) -> float | None:
    """F of a ``fraction_mask`` name ("last0.1" -> 0.1); None for a named mask (``MASKS``); ValueError for any other
    name."""
    if mask in MASKS:
        return None
    match = _FRACTION_MASK.fullmatch(mask) if isinstance(mask, str) else None
    if match is None:
        raise ValueError(f"unknown mask {mask!r}; choose from {', '.join(MASKS)} or lastF (0 < F <= 1, e.g. "
                         "last0.25: the last quarter supervised)")
    return check_fraction(match.group(1))


def supervised_mask(mask: str, batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len] bool loss mask of ``mask`` (one of ``MASKS`` or a ``fraction_mask`` name; ValueError
    otherwise). A fraction mask "lastF" supervises the last max(1, ⌊F·seq_len⌋) positions, F read as the decimal it
    is written as (so "last0.1" is ``long10``: the last max(1, seq_len // 10))."""
    pos = torch.arange(seq_len)
    fraction = mask_fraction(mask)
    if fraction is not None:
        supervised = max(1, math.floor(Fraction(mask[len("last"):]) * seq_len))
        row = pos >= seq_len - supervised
    elif mask == "full":
        row = torch.ones(seq_len, dtype=torch.bool)
    elif mask == "sharegpt":
        row = pos % 195 >= 60
    else:  # long10
        row = pos >= seq_len - max(1, seq_len // 10)
    return row.expand(batch, seq_len).clone()


@dataclass(frozen=True)
class BenchSpec:
    """One measurement: draft geometry (hidden, heads, KV heads, head dim, MLP width, draft vocab Vd, target vocab
    V, target hidden H_t), sequence length, TTT steps K, batch, layout (``LAYOUTS``), parallel degrees tp/cp, dtype,
    device, loss chunk and attention tile sizes, the causal-block backend (``kernels.attention_backends``;
    "tiled" is the reference) and the MLP tile (``memory.mlp_tile_size``: positions per sequence tile of the draft's
    norm + MLP, ``recipe.model.tiled_mlp``; None: untiled), the supervision ``mask`` (``MASKS`` or a
    ``fraction_mask`` name), whether the step runs on the needed anchors only (``sparse_anchors``,
    ``memory.sparse_anchors``: true, false, or "auto" / "auto:KIND", decided for the step's batch as the run decides
    every micro-batch, :func:`planned_sparse`) and whether the teacher logits are computed once per micro-batch
    (``memory.teacher_logits_once``). ``memory``: the run's ``memory`` section this spec stands for
    (``recipe.config_memory.MemoryOptions``, as :func:`spec_for_memory` received it, "auto:KIND" of
    ``sparse_anchors`` intact; None for a benchmark's spec: the defaults): the fields above override the switches they
    name, and every other switch of the section (``argmax_chunk_size``, a new one) reaches the step's model from it
    (:func:`spec_memory`). ``recipe.plan.predict_step`` predicts its memory."""

    seq_len: int
    layout: str = "full"
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 896
    draft_vocab: int = 32000
    vocab: int = 32000
    target_hidden: int = 256
    ttt_steps: int = 7
    batch: int = 1
    tp: int = 1
    cp: int = 1
    dtype: str = "fp32"
    device: str = "cpu"
    loss_chunk_size: int = 1024
    attention_tile: int | None = 1024
    attention_backend: str = "tiled"
    mlp_tile: int | None = None
    steps: int = 1
    seed: int = 0
    mask: str = "full"
    sparse_anchors: bool | str = False
    teacher_logits_once: bool = True
    memory: MemoryOptions | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose from {sorted(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        mask_fraction(self.mask)  # ValueError for an unknown mask
        check_sparse_mode(self.sparse_anchors)
        if isinstance(self.memory, dict):  # dataclasses.asdict of a spec, as the benchmarks hand it to their ranks
            object.__setattr__(self, "memory", MemoryOptions(**self.memory))
        if self.mlp_tile is not None and (isinstance(self.mlp_tile, bool) or not isinstance(self.mlp_tile, int)
                                          or self.mlp_tile < 1):
            raise ValueError(f"mlp tile {self.mlp_tile!r} must be None or a positive integer")
        check_tp_divides(self.tp, {"num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                                   "intermediate_size": self.intermediate, "draft_vocab_size": self.draft_vocab})
        divisor = seq_divisor(self.cp, self.tp)
        if self.seq_len % divisor:
            raise ValueError(f"length {self.seq_len} is not a multiple of {divisor} (2·cp·tp with cp={self.cp}, "
                             f"tp={self.tp})")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def dims(self) -> ParallelDims:
        """The layout of the step's ranks (dp 1): ``dims.cp_enabled`` says whether its sequence is split."""
        return ParallelDims(world_size=self.world_size, tp=self.tp, cp=self.cp)


def spec_draft_config(spec: BenchSpec):
    """The ``Eagle3DraftConfig`` of ``spec``'s draft geometry (aux layers [1, 2, 3], RoPE table covering the length)."""
    from recipe.model.draft_config import Eagle3DraftConfig  # import cost: pulls in transformers

    return Eagle3DraftConfig(
        hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab,
        draft_vocab_size=spec.draft_vocab, target_hidden_size=spec.target_hidden, aux_layer_ids=[1, 2, 3],
        max_position_embeddings=max(2048, spec.seq_len + spec.ttt_steps))


def spec_memory(spec: BenchSpec) -> MemoryOptions:
    """The ``memory`` section the step of ``spec`` runs with: ``spec.memory`` (None: the defaults) with the loss chunk
    and checkpointed steps of its layout (``LAYOUTS``), its attention and MLP tiles, ``sparse_anchors`` (the path
    this step takes) and ``teacher_logits_once``."""
    chunked, ckpt = LAYOUTS[spec.layout]
    base = MemoryOptions() if spec.memory is None else spec.memory
    return dataclasses.replace(base, loss_chunk_size=spec.loss_chunk_size if chunked else None,
                               checkpoint_ttt_steps=ckpt, attention_tile_size=spec.attention_tile,
                               mlp_tile_size=spec.mlp_tile, sparse_anchors=spec.sparse_anchors,
                               teacher_logits_once=spec.teacher_logits_once)


def spec_batch(spec: BenchSpec, cp_rank: int = 0):
    """The ``recipe.bench.measure.random_batch`` of ``spec`` with real host index tensors (zeros for the tokens) and
    float fields of zero width, as cp rank ``cp_rank`` holds it (zigzag shard under CP): ``(TTTBatch,
    num_label_rows)``. The planner's trace replaces the float fields by fake tensors of full width."""
    b, s = spec.batch, spec.seq_len
    ones = torch.ones(b, s, dtype=torch.bool)
    empty = torch.empty(b, s, 0)
    batch = make_ttt_batch(torch.zeros(b, s, dtype=torch.int64), supervised_mask(spec.mask, b, s), ones, empty, empty,
                           ones, spec.ttt_steps)
    if spec.dims.cp_enabled:
        batch = shard_ttt_batch(batch, spec.cp, cp_rank)
    return batch, batch.target_hidden_BLH.shape[1]


def planned_sparse(spec: BenchSpec) -> bool:
    """The path a run's model takes for the micro-batch of ``spec`` (its supervision ``mask`` at ``seq_len``, cp rank
    0's shard) with ``memory.sparse_anchors`` = ``spec.sparse_anchors``: itself when a bool; for ``"auto"`` /
    ``"auto:KIND"`` the rule the model applies to every micro-batch (``recipe.model.sparse_anchors.sparse_pays``;
    a fully supervised batch runs dense)."""
    if isinstance(spec.sparse_anchors, bool):
        return spec.sparse_anchors
    return sparse_pays(spec.sparse_anchors, spec_batch(spec)[0].valid_KBS)


def spec_for_memory(spec: BenchSpec, memory: MemoryOptions) -> BenchSpec:
    """``spec`` planning a resolved ``memory`` section (held whole as ``spec.memory``): its layout from
    ``loss_chunk_size`` and ``checkpoint_ttt_steps`` (``LAYOUTS``; an unchunked spec keeps its ``loss_chunk_size``
    field, unused), the attention and MLP tiles, ``sparse_anchors`` as it is ("auto:KIND" included: the step decides
    it for its batch, :func:`planned_sparse`) and ``teacher_logits_once``. The one mapping from a memory section to the
    planned step. Raises ValueError for a switch of ``recipe.config_memory.PLANNED`` still "auto"."""
    if memory.auto_switches:
        raise ValueError(f"memory switches {list(memory.auto_switches)} are still \"auto\": resolve them first "
                         "(MemoryOptions.resolve)")
    chunked, ckpt = memory.loss_chunk_size is not None, bool(memory.checkpoint_ttt_steps)
    layout = next(name for name, switches in LAYOUTS.items() if switches == (chunked, ckpt))
    return dataclasses.replace(spec, layout=layout, loss_chunk_size=memory.loss_chunk_size or spec.loss_chunk_size,
                               attention_tile=memory.attention_tile_size, mlp_tile=memory.mlp_tile_size,
                               sparse_anchors=memory.sparse_anchors,
                               teacher_logits_once=bool(memory.teacher_logits_once), memory=memory)


def spec_kernels(spec: BenchSpec, attention: str | None = None) -> KernelOptions:
    """The run config's ``kernels`` section ``spec`` stands for (``attention``: another backend in its place)."""
    return KernelOptions(attention=spec.attention_backend if attention is None else attention)


def spec_flops(spec: BenchSpec) -> StepFlops:
    """The FLOP model of ``spec``'s step (``recipe.model.flops.step_flops``): ``spec.batch`` samples of ``seq_len``
    positions, model FLOPs and hardware FLOPs with its memory switches and its attention backend ("auto" resolved for
    its device), the whole step over all ``spec.world_size`` ranks. Dense: a sparse-anchor step computes less."""
    from kernels.attention_backends import resolve_attention_backend  # import cost: every attention backend

    shape = DraftShape(hidden=spec.hidden, intermediate=spec.intermediate, heads=spec.heads, kv_heads=spec.kv_heads,
                       head_dim=spec.head_dim, draft_vocab=spec.draft_vocab, target_hidden=spec.target_hidden,
                       ttt_steps=spec.ttt_steps)
    backend = resolve_attention_backend(spec.attention_backend, spec.device.split(":")[0])
    return step_flops(shape, [spec.seq_len] * spec.batch, Recompute.of_memory(spec_memory(spec), backend), cp=spec.cp)


def spec_speed(spec: BenchSpec, seconds: float, peak_tflops: float | None) -> dict:
    """The speed fields of one measured step of ``spec`` taking ``seconds``: ``positions_per_s`` (every token of
    the batch), ``supervised_tokens_per_s`` (``spec.mask``'s), the step's ``model_flops`` and ``hardware_flops``
    (:func:`spec_flops`), ``model_tflops_per_gpu``, ``hardware_tflops_per_gpu`` and ``mfu`` (None without a
    peak; ``recipe.model.flops.speed_fields``)."""
    flops = spec_flops(spec)
    supervised = int(supervised_mask(spec.mask, spec.batch, spec.seq_len).sum())
    hardware = speed_fields(flops.hardware_total, seconds, spec.world_size, None)["model_tflops_per_gpu"]
    return {"positions_per_s": spec.batch * spec.seq_len / seconds, "supervised_tokens_per_s": supervised / seconds,
            "model_flops": flops.model_total, "hardware_flops": flops.hardware_total,
            **speed_fields(flops.model_total, seconds, spec.world_size, peak_tflops),
            "hardware_tflops_per_gpu": hardware}
