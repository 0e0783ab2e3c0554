"""What a resume must keep and what it may change, checked before anything of the checkpoint is loaded.

- :data:`COMPAT_KEYS` must match the checkpoint's run state (``run_state.json``): global batch, data, TTT steps,
  draft vocabulary and geometry, aux layers, max length, seed, ``--freeze-lm-head``, ``--position-offset-max``, the
  target's weights (:func:`check_compatible`); the run length only with ``--extend`` (:func:`check_length`).
- :data:`LAYOUT_KEYS` may change: world size, dp, tp, cp, ZeRO stage and the dtypes that choose DeepSpeed's optimizer
  wrapper; a change is resharded (``recipe.lifecycle.reshard``) and announced (:func:`describe_change`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from recipe.export import DRAFT_CONFIG_FILE

# what a resume must match; the layout (LAYOUT_KEYS) may change, the checkpoint is then resharded
COMPAT_KEYS = ("global_batch", "data_fingerprint", "ttt_steps", "draft_vocab_size", "aux_layer_ids", "max_length",
               "seed", "freeze_lm_head", "position_offset_max", "target_fingerprint", "draft_config")
# keys added after checkpoints were first written: the value a checkpoint (or state) without the key means
COMPAT_DEFAULTS = {"freeze_lm_head": False, "position_offset_max": 0}
# keys added later whose value an older checkpoint cannot supply: a checkpoint without one is resumed unchecked for
# it, with a one-line note (refusing would strand every run started before the key existed; the key still guards
# every checkpoint written since). ``draft_config`` of such a checkpoint is read from its draft_config.json.
UNRECORDED_KEYS = ("target_fingerprint", "draft_config")


def _saved_draft_config(path: Path) -> dict | None:
    """The draft geometry (``dataclasses.asdict(Eagle3DraftConfig)``) of a checkpoint without ``draft_config`` in
    its run state, from its ``draft_config.json``; None when that file is missing or unreadable."""
    from recipe.model.draft_config import Eagle3DraftConfig  # import cost: pulls in transformers

    try:
        config = Eagle3DraftConfig.from_hf_dict(json.loads((Path(path) / DRAFT_CONFIG_FILE).read_text()))
        return dataclasses.asdict(config)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _difference(key: str, saved, current) -> str:
    if isinstance(saved, dict) and isinstance(current, dict):  # name only the fields that differ
        fields = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        saved, current = ({k: d.get(k) for k in fields} for d in (saved, current))
    return f"{key}: checkpoint {saved!r}, now {current!r}"


def check_compatible(saved: dict, current: dict, path: Path, keys: tuple[str, ...] = COMPAT_KEYS) -> str | None:
    """Refuse to resume when the global batch, data, target weights, draft geometry or key settings differ (the
    layout may change: ``recipe.lifecycle.reshard``).

    A key missing on either side reads as its :data:`COMPAT_DEFAULTS` value (older checkpoints predate it); a key
    of :data:`UNRECORDED_KEYS` the checkpoint lacks is not compared (``draft_config`` is then taken from the
    checkpoint's draft_config.json where it can be). ``keys``: the subset to compare (default all of
    :data:`COMPAT_KEYS`). Raises ValueError listing every differing key (checkpoint value, current value; for a
    dict, the differing fields). Returns a one-line note naming the keys left unchecked, or None.
    """
    saved, current = {**COMPAT_DEFAULTS, **saved}, {**COMPAT_DEFAULTS, **current}
    if "draft_config" not in saved and "draft_config" in keys:
        recovered = _saved_draft_config(path)
        if recovered is not None:
            saved["draft_config"] = recovered
    unchecked = [k for k in UNRECORDED_KEYS if k in keys and k not in saved and k in current]
    diffs = [_difference(k, saved.get(k), current.get(k)) for k in keys
             if k not in unchecked and saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpoint in\n  " + "\n  ".join(diffs)
                         + "\n(a resumed run must match these; the layout, world size and ZeRO stage may change. Start "
                         "a new run or match them)")
    if unchecked:
        return (f"note: {path} predates the {' and '.join(unchecked)} check(s) (written by an earlier version); "
                "resuming without verifying them")
    return None


# run-state keys a resume may change: the layout, and the dtypes that decide which DeepSpeed optimizer wrapper holds
# the state (``dtype``: the JSON's bf16; ``grad_accum_dtype``: its ``data_types.grad_accum_dtype``, None if unset)
LAYOUT_KEYS = ("world_size", "tp", "cp", "dp", "zero_stage", "dtype", "grad_accum_dtype")
ADDED_KEYS = ("dtype", "grad_accum_dtype")  # recorded since layout-free state: an older checkpoint has none


def layout_name(state: dict) -> str:
    """``"tp2 cp1 dp2 ZeRO-3 bfloat16 (4 ranks)"`` from a run state's :data:`LAYOUT_KEYS` (the dtype where
    recorded; fp32 gradient accumulation of a bf16 run as ``bfloat16/fp32-accum``)."""
    dtype = state.get("dtype")
    if dtype and state.get("grad_accum_dtype"):
        dtype += f"/{state['grad_accum_dtype']}-accum"
    return (f"tp{state.get('tp')} cp{state.get('cp')} dp{state.get('dp')} ZeRO-{state.get('zero_stage')}"
            + (f" {dtype}" if dtype else "")
            + f" ({state.get('world_size')} rank{'s' if state.get('world_size') != 1 else ''})")


def describe_change(saved: dict, current: dict) -> str | None:
    """None when the run state ``saved`` (a checkpoint's) has the layout of ``current``, else the run-plan line
    ``resuming a <layout> checkpoint on <layout>: resharding``. An :data:`ADDED_KEYS` key that ``saved`` lacks (an
    older checkpoint) is not compared."""
    keys = [k for k in LAYOUT_KEYS if k in saved or k not in ADDED_KEYS]
    if all(saved.get(k) == current.get(k) for k in keys):
        return None
    return f"resuming a {layout_name(saved)} checkpoint on {layout_name(current)}: resharding"



def check_optimizer(saved: dict, current: dict, path: Path) -> None:
    """Refuse a resume from DeepSpeed's own files (the same layout) by another optimizer class than the one that
    wrote them (``optimizer`` of the run states, e.g. torch's AdamW vs DeepSpeed's FusedAdam: ``torch_adam``
    changed); a checkpoint that predates the key is not checked. Raises ValueError naming both."""
    now = current.get("optimizer")
    if saved.get("optimizer", now) != now:
        raise ValueError(f"cannot resume from {path}: {_difference('optimizer', saved['optimizer'], now)}; on its own "
                         "layout a checkpoint resumes from DeepSpeed's files, which hold that optimizer's state: keep "
                         "the checkpoint's optimizer settings (e.g. torch_adam), or resume on another layout "
                         "(resharded)")


def check_length(saved: dict, total_steps: int, extend: bool, path: Path) -> bool:
    """Whether resuming the checkpoint ``path`` (its run state ``saved``) in a run of ``total_steps`` optimizer
    steps re-plans the LR schedule (``--extend``, ``recipe.train.loop.Trainer._replan_schedule``).

    False when the planned length is unchanged. Raises ValueError naming the planned and requested lengths when it
    differs without ``extend`` (the schedule would change under a resumed run), and with ``extend`` when the new
    length leaves no step to run after the saved one.
    """
    planned, step = saved.get("total_steps"), saved.get("step", 0)
    if planned == total_steps:
        return False
    was = f"planned for {planned} optimizer steps" if planned is not None else "of a run of unrecorded length"
    if not extend:
        raise ValueError(f"cannot resume from {path}: the checkpoint (step {step}) is {was}, this run asks for "
                         f"{total_steps} (--max-steps/--epochs); resuming would mix two learning-rate schedules. Pass "
                         f"--extend to re-plan the schedule for {total_steps} steps from step {step} "
                         "(docs/training.md, 'Extending a run'), or resume with the original --max-steps/--epochs")
    if total_steps <= step:
        raise ValueError(f"cannot extend the run in {path}: it is at step {step} and --max-steps/--epochs ask for "
                         f"{total_steps} steps in all; give a length above {step}")
    return True
