"""The DeepSpeed JSON of a training run (the flags of ``run.py`` are ``recipe.train.flags``).

:func:`load_sections` reads the JSON once and parses each of our sections into its one typed object, which holds
the section's defaults and its validation (``parallelism``: ``recipe.parallel.dims.ParallelismOptions``, ``memory``:
``recipe.config_memory.MemoryOptions``, ``kernels``: :class:`KernelOptions`, ``target``:
``recipe.target.options.TargetOptions``, ``data``: ``recipe.config_data.DataOptions``), and DeepSpeed's monitor
sections (written by the training loop, see :func:`pop_monitor_sections`), all removed before DeepSpeed sees the
rest: a :class:`RunSections`. :meth:`RunSections.resolve` (:func:`load_run_config`: both steps at once) makes the
:class:`RunConfig` of a world size: the parallel layout, the batch plan, the dtype. ``run.py`` and ``python -m
recipe.plan`` both take these two steps, and everything downstream (set-up, model, planner, benchmarks) receives
the objects, never the JSON. The scheduler's ``"auto"`` values need the run's
optimizer steps, which only the data determines; :meth:`RunConfig.with_total_steps` fills them, and
:meth:`RunConfig.deepspeed_config` refuses to hand DeepSpeed a config before that. Unknown keys are refused with the
nearest valid name (:func:`check_config_keys`; the known keys come from DeepSpeed's own parser and pydantic models);
keys starting with "_" are comments, allowed anywhere and removed before DeepSpeed sees the dict.

Batch sizes in the JSON are in **samples**: ``train_batch_size`` is the global batch of one optimizer step and
``train_micro_batch_size_per_gpu`` the samples one data-parallel rank reads per micro-batch. Context-parallel ranks
share a sample, so DeepSpeed (whose data-parallel group is dp×cp, see ``recipe.parallel.topology``) is handed
``train_batch_size · cp``; ``resolve_batch`` does that arithmetic.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kernels.attention_backends import backend_names
from kernels.registry import DEFAULT_SEQUENCE_PARALLEL, sequence_parallel_names
from recipe.config_keys import (
    KERNELS_SECTION,
    ConfigError,
    check_config_keys,
    check_section_keys,
    did_you_mean,
    field_model,
    model_keys,
    refuse_layout_keys,
    strip_comments,
)
from recipe.config_data import DataOptions
from recipe.config_memory import MemoryOptions, MemoryReport
from recipe.parallel.dims import PARALLEL_SECTION, ParallelDims, ParallelismOptions
from recipe.target.options import TARGET_SECTION, TargetOptions

if TYPE_CHECKING:  # annotations only: reading a config does not import torch
    import torch

# DeepSpeed's monitor sections and the package each one's writer imports (csv_monitor needs none)
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "csv_monitor": None, "wandb": "wandb", "comet": "comet_ml"}
MONITOR_INSTALL = {"tensorboard": "pip install -e '.[monitor]' (or pip install tensorboard)",
                   "wandb": "pip install wandb", "comet": "pip install 'comet_ml>=3.41.0'"}


def read_ds_config(path: Path) -> tuple[dict, dict]:
    """Read a DeepSpeed JSON; return (DeepSpeed dict without our section, our 'parallelism' section).

    Raises ConfigError naming the file for a missing file, invalid JSON (with line/column), a non-object or a
    DeepSpeed layout key this recipe does not read (``sequence_parallel_size``, ``data_parallel_size``:
    :func:`recipe.config_keys.refuse_layout_keys`, naming ``parallelism.cp_size``).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read DeepSpeed config ({exc.strerror})") from exc
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    refuse_layout_keys(cfg, path)
    section = cfg.pop(PARALLEL_SECTION, None)
    section = {} if section is None else section
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: '{PARALLEL_SECTION}' must be an object like {{\"tp_size\": 2, \"cp_size\": 1}}")
    return cfg, section


@dataclass(frozen=True)
class KernelOptions:
    """Our ``"kernels"`` section of the DeepSpeed JSON (removed before DeepSpeed sees the config): which kernel
    computes what, where the choice changes speed and not the numbers (every kernel computes the same function).

    ``attention``: the kernel of the draft's causal block attention, on one rank and in every hop across a split
    sequence, and of the online target's split forward (``kernels.attention_backends``): ``"auto"`` (default: flex
    on CUDA, the fused CPU kernel sdpa on CPU) or a registered backend (``kernels.registry``): ``"tiled"`` (pure
    PyTorch, the reference), ``"sdpa"`` (CPU only), ``"flex"`` (CUDA only). ``sequence_parallel``: the strategy of
    that attention across a sequence split over a cp group (the draft's) or a cp·tp group (the target's), a
    registered name (``kernels.registry.sequence_parallel_names``); ``"ring"`` (default: ring attention over the
    zigzag shards).
    ``compile_small_ops``: the draft's norms, RoPE, SwiGLU, TTT merge and soft CE under ``torch.compile``
    (``recipe.model.small_ops``): ``"auto"`` (default: on for CUDA, off on the CPU), true or false.
    The run resolves ``attention`` and ``compile_small_ops`` for its device (:meth:`RunConfig.for_device`) and records
    all three in ``run_config.json``. The tile size stays a memory switch (``memory.attention_tile_size``).
    """

    attention: str = "auto"
    sequence_parallel: str = DEFAULT_SEQUENCE_PARALLEL
    compile_small_ops: bool | str = "auto"

    @classmethod
    def pop_from(cls, cfg: dict, path: Path | str) -> "KernelOptions":
        """Remove and parse the ``kernels`` section of ``cfg``. Raises ConfigError naming the file and field for a
        section that is not an object, an unknown key (with the nearest valid name) or a name that is not
        registered (listing the registered ones)."""
        section = cfg.pop(KERNELS_SECTION, None)
        section = {} if section is None else section
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: '{KERNELS_SECTION}' must be an object like {{\"attention\": \"auto\"}}")
        known = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(k for k in set(section) - set(known) if not k.startswith("_"))
        if unknown:
            hint = did_you_mean(unknown[0], known)
            raise ConfigError(f"{path}: unknown key(s) {unknown} in '{KERNELS_SECTION}'"
                              f"{'; did you mean ' + hint + '?' if hint else ''}; known keys: {list(known)}")
        values = {}
        for key, names in (("attention", ("auto", *backend_names())), ("sequence_parallel", sequence_parallel_names())):
            values[key] = section.get(key, getattr(cls, key))
            if values[key] not in names:
                raise ConfigError(f"{path}: '{KERNELS_SECTION}.{key}' must be one of {list(names)}, "
                                  f"got {values[key]!r}")
        values["compile_small_ops"] = section.get("compile_small_ops", cls.compile_small_ops)
        if not isinstance(values["compile_small_ops"], bool) and values["compile_small_ops"] != "auto":
            raise ConfigError(f"{path}: '{KERNELS_SECTION}.compile_small_ops' must be true, false or \"auto\", "
                              f"got {values['compile_small_ops']!r}")
        return cls(**values)


def pop_monitor_sections(cfg: dict, path: Path | str) -> dict:
    """Remove DeepSpeed's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``) from ``cfg`` and
    return them, validated by DeepSpeed's own ``deepspeed.monitor.config.get_monitor_config``.

    The training loop writes them through DeepSpeed's monitor classes with the optimizer step as x value
    (``recipe.train.monitor``). The engine does not get them: by itself it would log only the learning rate after
    each step against its sample count, which under context parallelism counts every sample cp times.
    Raises ConfigError naming the file and section for a section that is not an object, a field DeepSpeed
    rejects, or an enabled section whose writer package is not installed (with the install command).
    """
    sections = {name: cfg.pop(name) for name in MONITOR_PACKAGES if name in cfg}
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: '{name}' must be an object like {{\"enabled\": true, \"output_path\": ...}}")
    from deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config  # import cost: deepspeed
    from pydantic import ValidationError  # import cost: pydantic

    sections = {name: strip_comments(section) for name, section in sections.items()}
    try:
        get_monitor_config(sections)
    except ValidationError as exc:
        def problem(e) -> str:
            text = f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            if e.get("type") == "extra_forbidden" and len(e["loc"]) == 2 and e["loc"][0] in sections:
                known = model_keys(field_model(DeepSpeedMonitorConfig.model_fields[e["loc"][0]].annotation))
                hint = did_you_mean(str(e["loc"][1]), known)
                text += f"; did you mean {hint}?" if hint else f"; known keys: {sorted(known)}"
            return text

        raise ConfigError(f"{path}: bad monitor section ({'; '.join(map(problem, exc.errors()))})") from None
    for name, section in sections.items():
        package = MONITOR_PACKAGES[name]
        if section.get("enabled") and package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{path}: '{name}.enabled' is true but the '{package}' package is not installed: "
                              f"{MONITOR_INSTALL[name]}, or set it to false")
    return sections


@dataclass(frozen=True)
class BatchPlan:
    """Samples per optimizer step and how they are read. ``global_batch = micro_batch · grad_accum · dp``."""

    global_batch: int
    micro_batch: int
    grad_accum: int
    dp: int


def resolve_batch(ds_cfg: dict, dp: int, cp: int, path: Path | str = "ds_config") -> BatchPlan:
    """Resolve the batch sizes (in samples) and write DeepSpeed's view of them into ``ds_cfg`` (in place).

    DeepSpeed's data-parallel world is dp·cp, so it gets ``train_batch_size = global_batch · cp``.
    Raises ConfigError when the sizes are missing, non-positive, or the global batch is not divisible.
    """
    g = ds_cfg.get("train_batch_size")
    m = ds_cfg.get("train_micro_batch_size_per_gpu")
    a = ds_cfg.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", g), ("train_micro_batch_size_per_gpu", m),
                       ("gradient_accumulation_steps", a)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    m = m or 1
    if g is None:
        g = m * (a or 1) * dp
    if a is None:
        if g % (m * dp):
            raise ConfigError(f"{path}: train_batch_size={g} is not divisible by train_micro_batch_size_per_gpu={m}"
                              f" × dp={dp}")
        a = g // (m * dp)
    if g != m * a * dp:
        raise ConfigError(f"{path}: train_batch_size={g} != micro {m} × gradient_accumulation_steps {a} × dp {dp}")
    ds_cfg.update(train_batch_size=g * cp, train_micro_batch_size_per_gpu=m, gradient_accumulation_steps=a)
    return BatchPlan(global_batch=g, micro_batch=m, grad_accum=a, dp=dp)


def resolve_scheduler(ds_cfg: dict, total_steps: int) -> None:
    """Fill ``"auto"`` in the scheduler params: ``total_num_steps`` = the run's optimizer steps,
    ``warmup_num_steps`` = max(1, 3% of them). Other values are left as the user wrote them."""
    params = (ds_cfg.get("scheduler") or {}).get("params")
    if not isinstance(params, dict):
        return
    if params.get("total_num_steps") == "auto":
        params["total_num_steps"] = max(1, total_steps)
    if params.get("warmup_num_steps") == "auto":
        params["warmup_num_steps"] = max(1, math.ceil(0.03 * total_steps))


@dataclass(frozen=True)
class RunConfig:
    """A run's DeepSpeed JSON resolved against its world size and layout flags (:func:`load_run_config`).

    Fields:
        path: the JSON file (error messages name it).
        dims: the parallel layout (``parallelism`` section and the ``--tp-size``/``--cp-size`` overrides).
        plan: samples per optimizer step and how they are read (:func:`resolve_batch`).
        memory: the ``memory`` section (``recipe.config_memory.MemoryOptions``); after :meth:`with_memory`, its
            "auto" values resolved for the run (``MemoryOptions.resolve``).
        memory_report: how they were resolved (``recipe.config_memory.MemoryReport``; None before).
        kernels: the ``kernels`` section (:class:`KernelOptions`); after :meth:`for_device`, a kernel name for
            the device instead of "auto".
        bf16: ``bf16.enabled`` of the JSON; the draft's inputs are then bfloat16 (:attr:`dtype`).
        deepspeed: the dict DeepSpeed receives: the JSON without our sections, batch sizes in DeepSpeed's view
            (``train_batch_size · cp``), scheduler ``"auto"`` values filled by :meth:`with_total_steps`.
        total_steps: the run's optimizer steps; None until :meth:`with_total_steps`.
        monitor: DeepSpeed's monitor sections of the JSON (:func:`pop_monitor_sections`), written by the loop.
        target: the ``target`` section (:class:`~recipe.target.options.TargetOptions`): replicated or ZeRO-3
            partitioned target.
        data: the ``data`` section (``recipe.config_data.DataOptions``: packing; ``run.py --packing`` applied by
            ``recipe.train.setup``).
    """

    path: Path
    dims: ParallelDims
    plan: BatchPlan
    memory: MemoryOptions
    bf16: bool
    deepspeed: dict
    total_steps: int | None = None
    monitor: dict = field(default_factory=dict)
    target: TargetOptions = field(default_factory=TargetOptions)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    memory_report: MemoryReport | None = None
    data: DataOptions = field(default_factory=DataOptions)

    @property
    def dtype(self):
        """``torch.bfloat16`` with ``bf16.enabled``, else ``torch.float32``: the dtype of the draft's inputs."""
        import torch  # import cost: torch

        return torch.bfloat16 if self.bf16 else torch.float32

    def with_total_steps(self, total_steps: int) -> "RunConfig":
        """A copy for a run of ``total_steps`` optimizer steps, with the scheduler's ``"auto"`` values filled
        (:func:`resolve_scheduler`). Raises ValueError on ``total_steps < 1``."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        ds_cfg = copy.deepcopy(self.deepspeed)
        resolve_scheduler(ds_cfg, total_steps)
        return dataclasses.replace(self, deepspeed=ds_cfg, total_steps=total_steps)

    def for_device(self, device) -> "RunConfig":
        """A copy whose ``kernels.attention`` is what the configured name stands for on ``device``
        (``kernels.attention_backends.resolve_attention_backend``: "auto" becomes a backend name) and whose
        ``compile_small_ops`` is a bool (``kernels.compile_policy.compile_on``). Raises ConfigError naming the file
        when the configured kernel cannot run on ``device``."""
        from kernels.attention_backends import resolve_attention_backend  # import cost: pulls in torch
        from kernels.compile_policy import compile_on  # import cost: pulls in torch

        try:
            backend = resolve_attention_backend(self.kernels.attention, device)
        except ValueError as exc:
            raise ConfigError(f"{self.path}: '{KERNELS_SECTION}.attention': {exc}") from None
        kernels = dataclasses.replace(self.kernels, attention=backend,
                                      compile_small_ops=compile_on(self.kernels.compile_small_ops, device))
        return dataclasses.replace(self, kernels=kernels)

    def with_memory(self, memory: MemoryOptions, report: MemoryReport) -> "RunConfig":
        """A copy with the resolved ``memory`` section and its report (``MemoryOptions.resolve``). Raises ValueError
        when ``memory`` still holds "auto"."""
        return dataclasses.replace(self, memory=memory.check_resolved(), memory_report=report)

    def deepspeed_config(self) -> dict:
        """The dict for ``deepspeed.initialize(config=...)``. Raises ValueError before :meth:`with_total_steps`
        (the scheduler's ``"auto"`` values would reach DeepSpeed unresolved)."""
        if self.total_steps is None:
            raise ValueError(f"{self.path}: the run's total steps are not resolved yet (RunConfig.with_total_steps)")
        return self.deepspeed

    def record(self) -> dict:
        """The resolved settings as JSON-able values (the ``run_config.json`` keys ``deepspeed``, ``parallelism``,
        ``batch``, ``memory``, ``memory_auto`` (the report of its resolution, once resolved), ``kernels``,
        ``dtype``, ``total_steps``, ``monitor``, ``target``, ``data``)."""
        d = self.dims
        report = None if self.memory_report is None else self.memory_report.record()
        return {"deepspeed": self.deepspeed, "parallelism": {"tp": d.tp, "cp": d.cp, "dp": d.dp},
                "batch": dataclasses.asdict(self.plan), "memory": dataclasses.asdict(self.memory),
                "memory_auto": report,
                "kernels": dataclasses.asdict(self.kernels),
                "dtype": "bfloat16" if self.bf16 else "float32", "total_steps": self.total_steps,
                "monitor": self.monitor, "target": self.target.record(), "data": self.data.record()}


@dataclass(frozen=True)
class RunSections:
    """The run JSON parsed once (:func:`load_sections`), before the world size is known: each of our sections as its
    one typed object, which holds the section's defaults and validation (``parallelism``:
    ``recipe.parallel.dims.ParallelismOptions``, ``memory``: ``recipe.config_memory.MemoryOptions``, ``kernels``:
    :class:`KernelOptions`, ``target``: ``recipe.target.options.TargetOptions``, ``data``:
    ``recipe.config_data.DataOptions``), DeepSpeed's ``monitor`` sections and ``deepspeed``, the rest (keys checked,
    comments stripped, batch sizes as written). ``run.py`` and ``python -m recipe.plan`` both read the JSON through
    it; :meth:`resolve` makes the :class:`RunConfig` of a world size."""

    path: Path
    parallelism: ParallelismOptions
    memory: MemoryOptions
    kernels: KernelOptions
    target: TargetOptions
    data: DataOptions
    monitor: dict
    deepspeed: dict

    def resolve(self, world_size: int | None = None, overrides: dict | None = None) -> RunConfig:
        """The :class:`RunConfig` of ``world_size`` processes (None: the section's own, tp·cp·dp with dp 1 when not
        given: ``ParallelismOptions.world_size``). ``overrides``: parallelism keys from the command line
        (``{"tp_size": 2, "cp_size": None}``; None values are ignored). Raises ConfigError naming the file for a
        bad override, a layout that does not fit ``world_size`` or inconsistent batch sizes (:func:`resolve_batch`)."""
        try:
            dims = self.parallelism.with_overrides(overrides).dims(world_size)
        except ValueError as exc:
            raise ConfigError(f"{self.path}: {exc}") from None
        ds_cfg = copy.deepcopy(self.deepspeed)
        plan = resolve_batch(ds_cfg, dims.dp, dims.cp, self.path)
        bf16 = bool((ds_cfg.get("bf16") or {}).get("enabled"))
        return RunConfig(path=self.path, dims=dims, plan=plan, memory=self.memory, bf16=bf16, deepspeed=ds_cfg,
                         monitor=self.monitor, target=self.target, kernels=self.kernels, data=self.data)


def load_sections(path: Path) -> RunSections:
    """Read the DeepSpeed JSON at ``path`` once and parse every section into its one object (:class:`RunSections`):
    ours removed before DeepSpeed sees the dict, the monitor sections (:func:`pop_monitor_sections`), the rest checked
    key by key (:func:`check_config_keys`, with the nearest valid name). No world size, no process group: ``run.py``
    calls it before any work. Raises ConfigError naming the file (and the field) for an unreadable file, invalid
    JSON, an unknown or refused key (:func:`read_ds_config`), or a bad section (or a monitor whose package is
    missing)."""
    ds_cfg, section = read_ds_config(path)
    memory = MemoryOptions.pop_from(ds_cfg, path)
    kernels = KernelOptions.pop_from(ds_cfg, path)
    data = DataOptions.pop_from(ds_cfg, path)
    monitor = pop_monitor_sections(ds_cfg, path)
    target_section = ds_cfg.pop(TARGET_SECTION, None)
    check_config_keys(ds_cfg, path)
    if isinstance(target_section, dict) and isinstance(target_section.get("zero_optimization"), dict):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # import cost: deepspeed

        check_section_keys(target_section["zero_optimization"], DeepSpeedZeroConfig,  # TargetOptions validates it
                           f"{TARGET_SECTION}.zero_optimization", path, only_close=True)
    try:
        target = TargetOptions.from_section(strip_comments(target_section))
        parallelism = ParallelismOptions.from_section(strip_comments(section))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return RunSections(path=Path(path), parallelism=parallelism, memory=memory, kernels=kernels, target=target,
                       data=data, monitor=monitor, deepspeed=strip_comments(ds_cfg))


def load_run_config(path: Path, world_size: int | None = None, overrides: dict | None = None) -> RunConfig:
    """``load_sections(path).resolve(world_size, overrides)``: the JSON read once and resolved for ``world_size``
    processes (the layout, :class:`ParallelDims`; the batch plan, :func:`resolve_batch`; the dtype); the scheduler's
    ``"auto"`` values wait for :meth:`RunConfig.with_total_steps`. Raises ConfigError as those do."""
    return load_sections(path).resolve(world_size, overrides)
