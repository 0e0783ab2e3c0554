"""Unknown-key checks of the DeepSpeed JSON, with the nearest valid name (used by ``recipe.config``).

DeepSpeed ignores a top-level key it does not read, so a typo such as "zero_optimisation" silently trains at
ZeRO-0. The known keys come from DeepSpeed itself: the top-level keys its config parser reads (traced, see
:func:`deepspeed_top_level_keys`) and, for the sections DeepSpeed describes with a pydantic model, that model's field
names and aliases. Keys starting with "_" ("_comment") are documentation, allowed everywhere and removed by
:func:`strip_comments` before DeepSpeed sees the dict.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import typing

from recipe.parallel.dims import PARALLEL_SECTION
from recipe.target.options import TARGET_SECTION

MEMORY_SECTION = "memory"
KERNELS_SECTION = "kernels"
DATA_SECTION = "data"


class ConfigError(ValueError):
    """A configuration problem; the message names the file and field."""


OUR_SECTIONS = (PARALLEL_SECTION, MEMORY_SECTION, KERNELS_SECTION, TARGET_SECTION, DATA_SECTION)

REFUSED_LAYOUT_KEYS = {
    "sequence_parallel_size": "DeepSpeed's own sequence parallelism (Ulysses) is not what this recipe runs; the "
                              "key would be ignored and every rank train on whole sequences (dp, cp 1): set "
                              "'parallelism.cp_size' instead, which splits the sequence over context-parallel ranks "
                              "(\"parallelism\": {\"cp_size\": 2}, or run.py --cp-size 2)",
    "data_parallel_size": "not read by this recipe: dp is the world size over tp x cp; the layout is the "
                          "'parallelism' section ('parallelism.cp_size' splits the sequence, 'parallelism.tp_size' "
                          "the draft's layers, 'parallelism.dp_size' pins dp)",
}
"""DeepSpeed layout keys a DeepSpeed user writes first, refused by :func:`refuse_layout_keys` naming the setting that
does what they expect (DeepSpeed would read ``sequence_parallel_size`` and this recipe ignore it)."""


def refuse_layout_keys(cfg: dict, path) -> None:
    """Raise ConfigError naming ``path``, the key and our ``parallelism`` field for a key of
    :data:`REFUSED_LAYOUT_KEYS` at the top level of a run JSON. ``sequence_parallel_size`` next to a
    ``parallelism.cp_size`` is named with both values: the key is to be removed, not translated."""
    section = cfg.get(PARALLEL_SECTION)
    cp_size = section.get("cp_size") if isinstance(section, dict) else None
    for key, why in REFUSED_LAYOUT_KEYS.items():
        if key not in cfg:
            continue
        if key == "sequence_parallel_size" and cp_size is not None:
            size = cfg[key]
            wanted = "" if size == cp_size else f"; for a cp of {size!r} set 'parallelism.cp_size': {size!r}"
            raise ConfigError(f"{path}: '{key}': {size!r} next to 'parallelism.cp_size': {cp_size!r}; remove "
                              f"'{key}': 'parallelism.cp_size' already sets the context-parallel size (DeepSpeed's "
                              f"own sequence parallelism, Ulysses, is not what this recipe runs){wanted}")
        raise ConfigError(f"{path}: '{key}': {why}")


def did_you_mean(key: str, known) -> str | None:
    """The nearest name of ``known`` to ``key`` (difflib), quoted, or None when nothing is close."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"'{close[0]}'" if close else None


def _unknown_key(path, where: str, key: str, known, listed: bool = True) -> ConfigError:
    hint = did_you_mean(key, known)
    name = f"{where}.{key}" if where else key
    if hint:
        return ConfigError(f"{path}: '{name}': unknown key; did you mean {hint}?")
    tail = f"; known keys: {sorted(known)}" if listed else ""
    return ConfigError(f"{path}: '{name}': unknown key{tail}")


class _KeyRecorder(dict):
    """A dict that records every key looked up in it (``in``, ``get``, ``[]``, ``keys()``): what a parser reads."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: set[str] = set()

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def pop(self, key, *default):
        self.seen.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.seen.add(key)
        return super().setdefault(key, default)

    def keys(self):
        recorder = self

        class _Keys:  # ``KEY in param_dict.keys()`` is how several DeepSpeed getters ask
            def __contains__(self, key):
                recorder.seen.add(key)
                return dict.__contains__(recorder, key)

            def __iter__(self):
                return iter(dict.keys(recorder))

            def __len__(self):
                return dict.__len__(recorder)
        return _Keys()

    def __copy__(self):
        return self


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed's own config parser reads: ``DeepSpeedConfig._initialize_params`` and
    ``_do_sanity_check`` run on a recording dict (every getter of deepspeed/runtime/config.py and the sub-configs
    it builds: ZeRO, monitors, profiler, autotuning, checkpointing...), plus ``sequence_parallel_size`` (read by
    ``DeepSpeedConfig.__init__`` without an mpu). Keys DeepSpeed has removed are not in it (see
    :func:`check_config_keys`)."""
    import deepspeed.runtime.config as ds_config  # import cost: deepspeed

    recorder = _KeyRecorder({"_probe": 0})  # non-empty: some getters skip an empty dict (``if param_dict and ...``)
    probe = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
    probe.world_size, probe.global_rank, probe._param_dict = 1, 1, recorder
    traced = True
    try:
        probe._initialize_params(recorder)
    except Exception:  # noqa: BLE001 - another DeepSpeed version: fall back to its constants (more permissive)
        traced = False
    try:
        probe._do_sanity_check()
    except Exception:  # noqa: BLE001 - a sanity check of the empty probe may fail after it read its keys
        pass
    keys = {k for k in recorder.seen if isinstance(k, str) and not k.startswith("_")}
    if not traced:
        from deepspeed.runtime import constants  # import cost: deepspeed

        keys |= {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str) and v.isidentifier()}
    return frozenset(keys | {"sequence_parallel_size"})


def field_model(annotation):
    """The pydantic model class inside a field annotation (``Optional[Model]``, ``Model``), else None."""
    from pydantic import BaseModel  # import cost: pydantic

    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def model_keys(model) -> dict[str, object]:
    """Known key -> nested pydantic model (or None) of a DeepSpeed config model: its field names and aliases."""
    out = {}
    for name, info in model.model_fields.items():
        nested = field_model(info.annotation)
        for key in (name, info.alias, info.validation_alias if isinstance(info.validation_alias, str) else None):
            if key:
                out[key] = nested
    return out


def check_section_keys(section: dict, model, where: str, path, only_close: bool = False) -> None:
    """ConfigError naming ``where.key`` (and the nearest valid name) for a key of ``section`` that the DeepSpeed
    pydantic ``model`` does not know; nested sections with a model of their own are checked too. ``only_close``:
    refuse only keys with a close valid name (the caller validates the section with the model afterwards, whose
    message names the others)."""
    known = model_keys(model)
    for key, value in section.items():
        if not isinstance(key, str) or key.startswith("_"):
            continue
        if key not in known:
            if only_close and did_you_mean(key, known) is None:
                continue
            raise _unknown_key(path, where, key, known)
        if isinstance(value, dict) and known[key] is not None:
            check_section_keys(value, known[key], f"{where}.{key}", path, only_close)


def _check_plain_keys(section: dict, known, where: str, path) -> None:
    for key in section:
        if isinstance(key, str) and not key.startswith("_") and key not in known:
            raise _unknown_key(path, where, key, known)


def _section_models() -> dict[str, object]:
    """DeepSpeed sections this recipe reads or rewrites that DeepSpeed describes with a pydantic model."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # import cost: deepspeed
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # import cost: deepspeed

    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
            "fp16": DeepSpeedFP16Config}


def _scheduler_param_names(name: str) -> set[str] | None:
    """The keyword arguments of DeepSpeed's LR scheduler class ``name`` (``scheduler.params``), or None when the
    name is not one of DeepSpeed's (``lr_schedules.VALID_LR_SCHEDULES``: a torch scheduler, checked by DeepSpeed)."""
    from deepspeed.runtime import lr_schedules  # import cost: deepspeed

    if name not in getattr(lr_schedules, "VALID_LR_SCHEDULES", ()):
        return None
    params = inspect.signature(getattr(lr_schedules, name).__init__).parameters
    return {p for p in params if p not in ("self", "optimizer")}


def check_config_keys(cfg: dict, path) -> None:
    """Refuse unknown keys of the DeepSpeed JSON (our sections already removed), naming the nearest valid one.

    Top level: :func:`deepspeed_top_level_keys` (a key DeepSpeed has removed gets DeepSpeed's own message);
    ``zero_optimization`` (nested offload sections included), ``bf16``/``fp16``: DeepSpeed's pydantic models;
    ``optimizer`` and ``scheduler``: DeepSpeed's ``TYPE``/``OPTIMIZER_PARAMS``/``LEGACY_FUSION`` constants, and the
    scheduler's params the keyword arguments of DeepSpeed's scheduler class. Keys starting with "_" are allowed.
    Raises ConfigError naming the file and the key.
    """
    import deepspeed.runtime.config as ds_config  # import cost: deepspeed
    from deepspeed.runtime import constants  # import cost: deepspeed

    removed = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    known = deepspeed_top_level_keys()
    for key in cfg:
        if not isinstance(key, str) or key.startswith("_") or key in known:
            continue
        if key in removed:
            raise ConfigError(f"{path}: '{key}': {str(removed[key]).strip()}")
        hint = did_you_mean(key, known | set(OUR_SECTIONS))
        raise ConfigError(f"{path}: '{key}': unknown key; " + (f"did you mean {hint}?" if hint else
                          "neither a DeepSpeed config key nor one of this recipe's sections "
                          f"{list(OUR_SECTIONS)}"))
    for name, model in _section_models().items():
        if isinstance(cfg.get(name), dict):
            check_section_keys(cfg[name], model, name, path)
    optimizer, scheduler = cfg.get(constants.OPTIMIZER), cfg.get(constants.SCHEDULER)
    if isinstance(optimizer, dict):
        _check_plain_keys(optimizer, {constants.TYPE, constants.OPTIMIZER_PARAMS, constants.LEGACY_FUSION},
                          constants.OPTIMIZER, path)
    if isinstance(scheduler, dict):
        _check_plain_keys(scheduler, {constants.TYPE, constants.SCHEDULER_PARAMS}, constants.SCHEDULER, path)
        params, names = scheduler.get(constants.SCHEDULER_PARAMS), _scheduler_param_names(scheduler.get("type"))
        if isinstance(params, dict) and names is not None:
            _check_plain_keys(params, names, f"{constants.SCHEDULER}.{constants.SCHEDULER_PARAMS}", path)


def strip_comments(value):
    """``value`` without the keys starting with "_" of every dict in it (DeepSpeed's pydantic sections forbid
    them; at the top level DeepSpeed would ignore them)."""
    if isinstance(value, dict):
        return {k: strip_comments(v) for k, v in value.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(value, list):
        return [strip_comments(v) for v in value]
    return value
