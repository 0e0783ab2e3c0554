"""Our ``"memory"`` section of the DeepSpeed JSON (:class:`MemoryOptions`) and the one place its ``"auto"`` values
are resolved (:meth:`MemoryOptions.resolve`), for the run, the planner and the benchmarks alike.

``"auto"`` is accepted by ``loss_chunk_size``, ``checkpoint_ttt_steps``, ``attention_tile_size``, ``mlp_tile_size``,
``teacher_logits_once`` (:data:`PLANNED`) and ``sparse_anchors``. The first five trade compute for memory; the run
resolves them once at start (``recipe.train.memory_plan``) for its longest sample and this device's free memory:
the cheapest candidate that fits, in hardware FLOPs (``recipe.model.flops``: model FLOPs plus what the switches
recompute), of the settings :meth:`MemoryOptions.candidates` lists, each predicted by the planner's trace
(``recipe.plan.PlanFacts``). On the CPU (no ``free_bytes``: no device memory to plan against) ``"auto"`` is
:data:`CPU_AUTO`, the values a section without these keys has (the dataclass defaults). ``sparse_anchors: "auto"``
is decided per micro-batch by share, length and the time measured on this kind of device
(``recipe.model.sparse_anchors.sparse_pays``); resolving fixes the kind (``"auto:cpu"``, ``"auto:h200"``).
docs/training.md, "Memory switches chosen for you", states the order and why.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from recipe.config_keys import MEMORY_SECTION, ConfigError, did_you_mean
from recipe.model.sparse_anchors import SPARSE_ANCHORS_MODES, check_sparse_mode, sparse_timing_kind

if TYPE_CHECKING:  # annotations only
    import torch

AUTO = "auto"
ARGMAX_LOGITS_BYTES = 128 * 1024 ** 2
"""The default budget of one argmax chunk's [chunk, V] target logits (``MemoryOptions.argmax_positions``)."""
PLANNED = ("checkpoint_ttt_steps", "loss_chunk_size", "teacher_logits_once", "mlp_tile_size", "attention_tile_size")
"""The switches whose ``"auto"`` the planner resolves, in the order reports list them."""
AUTO_LOSS_CHUNK = 4096
"""``loss_chunk_size`` when "auto" chunks the loss (the shipped recipes' value)."""
AUTO_MLP_TILE = 4096
"""``mlp_tile_size`` when "auto" tiles the MLP (the long-context recipes' value: GEMMs of 4096 rows fill a GPU)."""
AUTO_ATTENTION_TILE = 1024
"""``attention_tile_size`` for "auto" everywhere: every tiled kernel recomputes its scores in backward whatever the
tile (``recipe.model.flops.FLASH_BACKWARD``), so the size changes memory, not FLOPs; flex does its own blocking."""
CPU_AUTO = {"checkpoint_ttt_steps": False, "loss_chunk_size": None, "teacher_logits_once": True,
            "mlp_tile_size": None, "attention_tile_size": AUTO_ATTENTION_TILE}
"""What "auto" is without device memory to plan against (the CPU): the values of an absent key."""
SIZE = {"kind": "size"}
"""A :class:`MemoryOptions` field's metadata: a positive integer or null ("auto" too when it is :data:`PLANNED`)."""
FLAG = {"kind": "flag"}
"""A :class:`MemoryOptions` field's metadata: true or false ("auto" too when it is :data:`PLANNED`)."""
SPARSE = {"kind": "sparse"}
"""``sparse_anchors``' metadata: one of ``recipe.model.sparse_anchors.SPARSE_ANCHORS_MODES``."""


class MemoryFacts(Protocol):
    """What :meth:`MemoryOptions.resolve` asks of a run (``recipe.plan.PlanFacts`` answers it with the planner):
    ``length`` (tokens of the longest sample, padded), ``rank_tokens`` (its positions on one cp rank),
    ``hardware_flops(memory)`` (the step's FLOPs with those switches) and ``peak_bytes(memory)`` (the planner's
    per-rank total with them, bytes)."""

    length: int
    rank_tokens: int

    def hardware_flops(self, memory: "MemoryOptions") -> int: ...

    def peak_bytes(self, memory: "MemoryOptions") -> int: ...


@dataclass(frozen=True)
class MemoryOptions:
    """Our ``"memory"`` section of the DeepSpeed JSON (removed before DeepSpeed sees the config).

    ``loss_chunk_size``: positions per chunk of the soft cross-entropy (None: whole sequence at once); one chunk's
    [chunk, Vd] logits are alive at a time and are recomputed in backward. ``checkpoint_ttt_steps``: recompute each
    TTT step's draft layer in backward (activation checkpointing). ``attention_tile_size``: positions per query/key
    tile of the causal block attention (``kernels.tiled_attention``; under CP, tiles within each zigzag chunk of the
    ring); score memory is O(H·tile²) and nothing of size S² is kept for backward. Absent: 1024;
    null: no tiling: on one cp rank the dense block (O(H·S²) scores kept for backward; short sequences only), under
    CP one tile per zigzag chunk of the ring. ``mlp_tile_size``: positions per sequence tile of the draft's MLP
    and the norm before it (``recipe.model.tiled_mlp``): each tile's [tile, I/tp] intermediates and fp32 norm copy
    exist one tile at a time, in forward and again (recomputed) in backward; None (absent): the whole sequence at
    once. ``argmax_chunk_size``: positions per lm_head matmul of the online target's argmax
    (``recipe.target.head.lm_head_argmax``); None (absent): sized from the target's vocabulary and dtype, the most
    positions whose [chunk, V] logits fit :data:`ARGMAX_LOGITS_BYTES` (:meth:`argmax_positions`).
    ``sparse_anchors``: compute each TTT step only at the anchors some step's loss reads
    (``recipe.model.sparse_anchors``; step 0's keys/values still at every position): the same numbers as false (the
    dense path) up to float rounding. ``"auto"`` (absent): per micro-batch and rank, sparse where it pays in memory
    and in the time measured on this kind of device at this length (``sparse_pays``); true/false force one path.
    ``teacher_logits_once``: true (absent): the target head's logits over the draft vocabulary are computed once per
    micro-batch for every label row and kept until the backward ([B, U, Vd] in the head's dtype, U ~ S/cp + K rows:
    1.95 GiB for an 8B target's Vd = 32000 in bf16 at 32k, 7.8 GiB at 128k on one rank); with ``loss_chunk_size``
    they are built that many rows at a time and every chunk of every TTT step reads its rows there, so the chunked
    loss recomputes only the draft's lm_head. false: the chunked loss computes each chunk's teacher rows in every
    step and again in the backward (2·K head matmuls per row, nothing of size [B, U, Vd] kept), the unchunked path
    each step's ([B, S, Vd] once per step).
    ``"auto"`` for the :data:`PLANNED` switches: resolved once at start by :meth:`resolve` (module docstring).
    Which kernel computes the causal block is not a memory trade-off: it is the ``kernels`` section
    (``recipe.config.KernelOptions``). DeepSpeed's own ``activation_checkpointing`` section configures
    ``deepspeed.checkpointing`` only, which this recipe does not use, so it is not read.
    """

    loss_chunk_size: int | None | str = field(default=None, metadata=SIZE)
    checkpoint_ttt_steps: bool | str = field(default=False, metadata=FLAG)
    attention_tile_size: int | None | str = field(default=1024, metadata=SIZE)
    mlp_tile_size: int | None | str = field(default=None, metadata=SIZE)
    argmax_chunk_size: int | None = field(default=None, metadata=SIZE)
    sparse_anchors: bool | str = field(default="auto", metadata=SPARSE)
    teacher_logits_once: bool | str = field(default=True, metadata=FLAG)

    def argmax_positions(self, vocab_size: int, dtype: torch.dtype) -> int:
        """Positions per argmax matmul for a target of ``vocab_size`` logits of ``dtype``: ``argmax_chunk_size`` if
        set, else ``max(1, ARGMAX_LOGITS_BYTES // (vocab_size · itemsize))`` (e.g. 682 for SmolLM2's 49152 fp32
        logits, 523 for a 128256-token vocabulary in bf16)."""
        if self.argmax_chunk_size is not None:
            return self.argmax_chunk_size
        return max(1, ARGMAX_LOGITS_BYTES // (vocab_size * dtype.itemsize))

    @property
    def auto_switches(self) -> tuple[str, ...]:
        """The :data:`PLANNED` switches set to ``"auto"``."""
        return tuple(k for k in PLANNED if getattr(self, k) == AUTO)

    @property
    def resolved(self) -> bool:
        """Whether no switch is a bare ``"auto"`` (``"auto:KIND"`` of ``sparse_anchors`` is resolved)."""
        return not self.auto_switches and self.sparse_anchors != AUTO

    def check_resolved(self) -> "MemoryOptions":
        """``self`` when :attr:`resolved`; ValueError naming the ``"auto"`` switches otherwise (a consumer that builds
        a model or a plan needs values: call :meth:`resolve` first)."""
        if not self.resolved:
            names = [*self.auto_switches, *(["sparse_anchors"] if self.sparse_anchors == AUTO else [])]
            raise ValueError(f"memory switches {names} are still \"auto\": resolve them first (MemoryOptions.resolve)")
        return self

    def switches(self) -> dict:
        """The :data:`PLANNED` switches as a dict (the report's and the run plan's view)."""
        return {k: getattr(self, k) for k in PLANNED}

    @classmethod
    def pop_from(cls, cfg: dict, path: Path | str) -> "MemoryOptions":
        """Remove and parse the ``memory`` section of ``cfg``; ConfigError names the file and field."""
        section = cfg.pop(MEMORY_SECTION, None)
        section = {} if section is None else section
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: '{MEMORY_SECTION}' must be an object like "
                              '{"loss_chunk_size": 4096, "checkpoint_ttt_steps": true, "attention_tile_size": 1024}')
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in set(section) - set(known) if not k.startswith("_"))
        if unknown:
            hint = did_you_mean(unknown[0], known)
            raise ConfigError(f"{path}: unknown key(s) {unknown} in '{MEMORY_SECTION}'"
                              f"{'; did you mean ' + hint + '?' if hint else ''}; known keys: {list(known)}")
        values = {key: section.get(key, getattr(cls, key)) for key in known}
        for f in dataclasses.fields(cls):
            _check_value(f.name, f.metadata.get("kind"), values[f.name], path)
        return cls(**values)

    def candidates(self, rank_tokens: int) -> list["MemoryOptions"]:
        """Every setting "auto" may resolve to, explicit switches kept: each ``"auto"`` of ``checkpoint_ttt_steps``
        (false, true), ``loss_chunk_size`` (null, :data:`AUTO_LOSS_CHUNK`), ``teacher_logits_once`` (true; false
        only with a chunked loss: unchunked, each step's loss holds its teacher logits for the backward anyway, so
        false saves nothing) and ``mlp_tile_size`` (null; :data:`AUTO_MLP_TILE` only when a rank's
        ``rank_tokens`` exceed it, else it tiles nothing); ``attention_tile_size`` "auto" is
        :data:`AUTO_ATTENTION_TILE`. Listed in the documented ladder order (nothing, step checkpointing, chunked
        loss, teacher table off, MLP tiles, and their combinations), which breaks ties of cost."""
        def options(key, values):
            return values if getattr(self, key) == AUTO else (getattr(self, key),)

        tile = AUTO_ATTENTION_TILE if self.attention_tile_size == AUTO else self.attention_tile_size
        out = []
        for mlp, teacher, chunk, ckpt in itertools.product(
                options("mlp_tile_size", (None, AUTO_MLP_TILE) if rank_tokens > AUTO_MLP_TILE else (None,)),
                options("teacher_logits_once", (True, False)), options("loss_chunk_size", (None, AUTO_LOSS_CHUNK)),
                options("checkpoint_ttt_steps", (False, True))):
            if teacher is False and chunk is None and self.teacher_logits_once == AUTO:
                continue
            out.append(dataclasses.replace(self, checkpoint_ttt_steps=ckpt, loss_chunk_size=chunk,
                                           teacher_logits_once=teacher, mlp_tile_size=mlp, attention_tile_size=tile))
        return out

    def most_saving(self) -> "MemoryOptions":
        """Every "auto" switch at its memory-saving value (step checkpointing, loss chunks of
        :data:`AUTO_LOSS_CHUNK`, the teacher table off with them, MLP tiles of :data:`AUTO_MLP_TILE`, attention tiles
        of :data:`AUTO_ATTENTION_TILE`): the least memory "auto" can reach, for the longest length a config fits."""
        chunk = AUTO_LOSS_CHUNK if self.loss_chunk_size == AUTO else self.loss_chunk_size
        values = {"checkpoint_ttt_steps": True, "loss_chunk_size": chunk, "mlp_tile_size": AUTO_MLP_TILE,
                  "attention_tile_size": AUTO_ATTENTION_TILE, "teacher_logits_once": chunk is None}
        return dataclasses.replace(self, **{k: values[k] for k in self.auto_switches})

    def savings(self) -> frozenset:
        """The memory-saving settings on: step checkpointing, a chunked loss, the teacher table off, MLP tiles.
        Every one only lowers the peak, so the candidate with the most saves the most (:meth:`resolve` predicts it
        first: when it does not fit, nothing does)."""
        on = {"checkpoint_ttt_steps": self.checkpoint_ttt_steps is True, "loss_chunk_size": self.loss_chunk_size
              is not None, "teacher_logits_once": self.teacher_logits_once is False,
              "mlp_tile_size": self.mlp_tile_size is not None}
        return frozenset(k for k, v in on.items() if v)

    def resolve(self, facts: MemoryFacts | None, device_name: str | None,
                free_bytes: int | None) -> tuple["MemoryOptions", "MemoryReport"]:
        """The options with every ``"auto"`` replaced, and the :class:`MemoryReport` of the choice.

        ``sparse_anchors`` "auto" becomes ``"auto:KIND"`` for ``device_name`` (``sparse_timing_kind``). The
        :data:`PLANNED` switches: without ``free_bytes`` (the CPU), :data:`CPU_AUTO`; with it, the cheapest of
        :meth:`candidates` (hardware FLOPs from ``facts``, ties in ladder order) whose ``facts.peak_bytes`` is at most
        ``free_bytes``, tried cheapest first; when not even the candidate saving the most fits, that one (the report
        says it does not fit). Explicit values are never changed. Raises ValueError when ``free_bytes`` is given
        without ``facts``."""
        sparse = f"{AUTO}:{sparse_timing_kind(device_name)}" if self.sparse_anchors == AUTO else self.sparse_anchors
        base = dataclasses.replace(self, sparse_anchors=sparse)
        device = str(device_name or "cpu")
        if not self.auto_switches:
            return base, MemoryReport("explicit", device, sparse, base.switches())
        if free_bytes is None:
            chosen = dataclasses.replace(base, **{k: CPU_AUTO[k] for k in self.auto_switches})
            return chosen, MemoryReport("cpu", device, sparse, chosen.switches())
        if facts is None:
            raise ValueError("MemoryOptions.resolve: free_bytes given without the run's facts to plan with")
        return _plan(base, facts, device, int(free_bytes))


def _check_value(key: str, kind: str | None, value, path: Path | str) -> None:
    """The one validation of a ``memory`` switch by its field's ``kind`` (:data:`SIZE`, :data:`FLAG`,
    :data:`SPARSE`; "auto" allowed for the :data:`PLANNED` switches). Raises ConfigError naming the file and field."""
    auto = key in PLANNED and value == AUTO
    if kind == "size" and not auto and value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                                              or value <= 0):
        also = ', null or "auto"' if key in PLANNED else " or null"
        raise ConfigError(f"{path}: '{MEMORY_SECTION}.{key}' must be a positive integer{also}, got {value!r}")
    if kind == "flag" and not isinstance(value, bool) and not auto:
        also = ' or "auto"' if key in PLANNED else ""
        raise ConfigError(f"{path}: '{MEMORY_SECTION}.{key}' must be true{',' if also else ' or'} false{also}, "
                          f"got {value!r}")
    if kind == "sparse":
        try:
            check_sparse_mode(value)
        except ValueError:
            choices = ", ".join(str(m).lower() if isinstance(m, bool) else f'"{m}"' for m in SPARSE_ANCHORS_MODES)
            raise ConfigError(f"{path}: '{MEMORY_SECTION}.{key}' must be one of {choices}, got {value!r}") from None


@dataclass(frozen=True)
class MemoryReport:
    """How :meth:`MemoryOptions.resolve` chose. ``rule``: "explicit" (no "auto" to plan), "cpu" (:data:`CPU_AUTO`)
    or "planned"; ``device``; ``sparse_anchors`` (resolved); ``chosen`` (the :data:`PLANNED` switches). Planned
    only: ``length`` (tokens planned), ``budget_bytes`` (the free memory planned against), ``predicted_peak_bytes``
    and ``hardware_flops`` of the choice, ``fits``, ``rejected`` (the next cheaper candidate, which did not fit:
    ``{"switches", "predicted_peak_bytes", "hardware_flops"}``; None when the cheapest fitted or nothing did) and
    ``candidates`` (every candidate in cost order: switches, hardware FLOPs, predicted peak and whether it fits, None
    for those not predicted)."""

    rule: str
    device: str
    sparse_anchors: bool | str
    chosen: dict
    length: int | None = None
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    hardware_flops: int | None = None
    fits: bool | None = None
    rejected: dict | None = None
    candidates: tuple = ()

    def record(self) -> dict:
        """The JSON-able report (``run_config.json``'s ``"memory_auto"``)."""
        return {**dataclasses.asdict(self), "candidates": [dict(c) for c in self.candidates]}

    def line(self) -> str:
        """The run plan's line: what was chosen, its predicted peak against the budget and the rejected
        alternative."""
        gib = 1024 ** 3
        chosen = _switch_text(self.chosen)
        if self.rule == "explicit":
            return f"memory: {chosen} (as configured); sparse_anchors {_value(self.sparse_anchors)}"
        if self.rule == "cpu":
            return (f"memory auto on {self.device} (no device memory to plan against): {chosen}, the defaults; "
                    f"sparse_anchors {_value(self.sparse_anchors)}")
        text = (f"memory auto for {self.length:,} tokens on {self.device} against {self.budget_bytes / gib:.1f} GiB: "
                f"{chosen}; predicted peak {self.predicted_peak_bytes / gib:.1f} GiB"
                f"{'' if self.fits else ' (does not fit: the least auto can reach)'}")
        if self.rejected is not None:
            text += (f"; rejected {_switch_text(self.rejected['switches'])} "
                     f"({self.rejected['predicted_peak_bytes'] / gib:.1f} GiB)")
        return text + f"; sparse_anchors {_value(self.sparse_anchors)}"


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _switch_text(switches: dict) -> str:
    return ", ".join(f"{k} {_value(v)}" for k, v in switches.items())


def _plan(base: MemoryOptions, facts: MemoryFacts, device: str, budget: int) -> tuple[MemoryOptions, MemoryReport]:
    """:meth:`MemoryOptions.resolve` with a budget: the candidate saving the most is predicted first (when even it
    does not fit, it is the choice and nothing else is traced); then the candidates by (hardware FLOPs, ladder
    order), the first whose predicted peak fits."""
    ranked = sorted(enumerate(base.candidates(facts.rank_tokens)),
                    key=lambda item: (facts.hardware_flops(item[1]), item[0]))
    rows = [{"switches": c.switches(), "hardware_flops": int(facts.hardware_flops(c)), "predicted_peak_bytes": None,
             "fits": None} for _, c in ranked]

    def predict(i: int) -> bool:
        if rows[i]["fits"] is None:
            rows[i]["predicted_peak_bytes"] = int(facts.peak_bytes(ranked[i][1]))
            rows[i]["fits"] = rows[i]["predicted_peak_bytes"] <= budget
        return rows[i]["fits"]

    most = max(range(len(ranked)), key=lambda i: len(ranked[i][1].savings()))
    chosen, rejected = most, None
    if predict(most):
        chosen = next(i for i in range(len(ranked)) if predict(i))
        rejected = next((rows[i] for i in reversed(range(chosen)) if rows[i]["fits"] is False), None)
    cand, row = ranked[chosen][1], rows[chosen]
    report = MemoryReport("planned", device, cand.sparse_anchors, cand.switches(), length=facts.length,
                          budget_bytes=budget, predicted_peak_bytes=row["predicted_peak_bytes"],
                          hardware_flops=row["hardware_flops"], fits=row["fits"],
                          rejected=None if rejected is None else {k: rejected[k] for k in
                                                                   ("switches", "predicted_peak_bytes",
                                                                    "hardware_flops")},
                          candidates=tuple(rows))
    return cand, report
