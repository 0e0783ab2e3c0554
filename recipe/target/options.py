"""Our ``"target"`` section of the DeepSpeed JSON: how the frozen target is held (removed before DeepSpeed sees the
config, recorded in ``run_config.json``).

    "target": {"partition": "zero3", "zero_optimization": {"stage3_prefetch_bucket_size": 50000000}}

``partition``: ``"none"`` (default: every rank loads the whole target, ``recipe.target.capture.TargetModel``) or
``"zero3"`` (the target's weights are partitioned over all ranks of the job with DeepSpeed ZeRO-3 and gathered layer
by layer during its forward, ``recipe.target.partition.PartitionedTargetModel``). ``zero_optimization``:
settings of DeepSpeed's ZeRO config (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``, e.g.
``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``, ``offload_param``) for the target's own
ZeRO-3 engine, validated by DeepSpeed; ``stage`` may only be 3. The draft's ``zero_optimization`` is unaffected.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

TARGET_SECTION = "target"
PARTITIONS = ("none", "zero3")
# Module-level replacement of torch.nn.functional.linear that zero.Init installs by default and never removes: it
# would change the draft's matmuls too, so the target's engine turns it off.
_ZERO_DEFAULTS = {"stage": 3, "memory_efficient_linear": False}


@dataclass(frozen=True)
class TargetOptions:
    """The parsed ``target`` section (module docstring). ``zero_optimization`` holds the user's keys only."""

    partition: str = "none"
    zero_optimization: dict = field(default_factory=dict)

    @property
    def partitioned(self) -> bool:
        return self.partition == "zero3"

    @classmethod
    def from_section(cls, section) -> "TargetOptions":
        """Parse a ``target`` section (None: the defaults). Raises ValueError naming the field (``target.partition``,
        ``target.zero_optimization.<key>``) for a non-object, an unknown key, an unknown partition, or ZeRO settings
        DeepSpeed rejects."""
        section = {} if section is None else section
        if not isinstance(section, dict):
            raise ValueError(f"'{TARGET_SECTION}' must be an object like {{\"partition\": \"zero3\"}}")
        known = ("partition", "zero_optimization")
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in '{TARGET_SECTION}'; known keys: {list(known)}")
        partition = section.get("partition", cls.partition)
        if partition not in PARTITIONS:
            raise ValueError(f"'{TARGET_SECTION}.partition' must be one of {list(PARTITIONS)}, got {partition!r}")
        zero = section.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError(f"'{TARGET_SECTION}.zero_optimization' must be an object of DeepSpeed ZeRO settings, "
                             f"got {zero!r}")
        if zero.get("stage", 3) != 3:
            raise ValueError(f"'{TARGET_SECTION}.zero_optimization.stage' must be 3 (the target is partitioned with "
                             f"ZeRO-3), got {zero['stage']!r}")
        options = cls(partition=partition, zero_optimization=dict(zero))
        options.validate_zero()
        return options

    def zero_config(self) -> dict:
        """The target engine's ``zero_optimization`` dict: stage 3, no memory-efficient linear, the user's keys."""
        return {**_ZERO_DEFAULTS, **self.zero_optimization}

    def validate_zero(self) -> None:
        """ValueError naming ``target.zero_optimization.<key>`` when DeepSpeed's ZeRO config rejects a setting."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # import cost: deepspeed
        from pydantic import ValidationError  # import cost: pydantic

        try:
            DeepSpeedZeroConfig(**self.zero_config())
        except ValidationError as exc:
            problems = "; ".join(f"'{TARGET_SECTION}.zero_optimization.{'.'.join(map(str, e['loc']))}': {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(problems) from None

    def deepspeed_config(self, bf16: bool) -> dict:
        """The DeepSpeed config of the target's inference engine (no optimizer): one micro-batch per rank, the ZeRO
        settings of :meth:`zero_config`, ``bf16.enabled`` = ``bf16`` (the dtype ``zero.Init`` casts the weights to)."""
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": self.zero_config(), "bf16": {"enabled": bool(bf16)},
                "steps_per_print": 2**62}

    def record(self) -> dict:
        """JSON-able form for ``run_config.json``."""
        return dataclasses.asdict(self)
