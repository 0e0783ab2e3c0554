"""``run.py --init-draft PATH``: start a new run from an existing EAGLE-3 draft (docs/training.md, "Warm start").

The draft is read by ``recipe.export.import_draft`` (this project's export, SpecForge's and the EAGLE repository's
layouts; safetensors, or a PyTorch pickle through ``torch.load(weights_only=True)`` only). Then, before anything
is built from it:

- its vocabulary map is the run's: ``--draft-vocab-size`` defaults to its size and a different value is refused;
  the map is never recomputed from the data (row i of its lm_head means its draft id i);
- its aux layer ids (``eagle_config`` of its config.json) are the run's; a draft without them gets the target's
  defaults, as SGLang and vLLM do, and a different ``--aux-layer-ids`` is refused;
- its geometry is checked against the run's draft config (the target's geometry with ``--draft-config`` applied,
  ``recipe.target.registry.draft_config_for``), every field from the weight shapes and the fields its config
  states: hidden size, target hidden size, intermediate size, heads, KV heads, head dim, vocabulary sizes,
  activation, aux layers within the target's depth. One error lists every mismatch, naming the field and both
  values; missing or unexpected keys are named the same way;
- RoPE (``rope_theta``, ``rope_scaling``), ``max_position_embeddings`` and ``rms_norm_eps`` are the run's (the
  target's, unless ``--draft-config`` sets them): a draft whose config states others is trained and exported with
  the run's, and the run plan says so.

The weights go into the single-device model before ``parallelize`` (as ``recipe.lifecycle.reshard.load_master_weights``
does for a resharded resume), so every layout (tp, cp, dp, ZeRO stage) cuts its shards from them; the embedding is
the target's. The optimizer starts fresh at step 0. With ``--resume`` the checkpoint's weights are used and the
draft is only compared (:func:`check_resume`): resuming the run it started (same file contents) is the normal
restart after an interruption; another draft is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from recipe.data.vocab import VocabMap
from recipe.export import check_tensors, expected_shapes
from recipe.export.import_draft import ImportedDraft, load_draft
from recipe.model.draft_config import Eagle3DraftConfig, rope_fields

SETTING_FIELDS = ("rope_theta", "rope_scaling", "max_position_embeddings", "rms_norm_eps")


@dataclass
class InitDraft:
    """The draft a run starts from: what was read, the draft vocabulary size and the draft-config ``overrides`` the
    run must use (its aux layer ids), and the notes for the run plan."""

    imported: ImportedDraft
    draft_vocab_size: int
    overrides: dict
    notes: list[str] = field(default_factory=list)

    @property
    def vocab(self) -> VocabMap:
        return VocabMap(self.imported.tensors["d2t"], self.imported.tensors["t2d"])

    def record(self) -> dict:
        return self.imported.record()


def prepare(path: Path, requested_vocab: int | None, target_vocab: int, overrides: dict) -> InitDraft:
    """Read the draft at ``path`` and settle what the run takes from it: the draft vocabulary size (its lm_head
    rows; ``requested_vocab``, ``--draft-vocab-size`` capped at the target's ``target_vocab``, must agree when
    given) and the aux layer ids (``overrides["aux_layer_ids"]``, from ``--aux-layer-ids`` or an offline store,
    must agree with the ones its config states). Returns the :class:`InitDraft` with ``overrides`` completed.
    Raises ValueError naming the path and both values on a disagreement, and what ``load_draft`` raises."""
    imported = load_draft(path, target_vocab)
    if "lm_head.weight" not in imported.tensors:
        raise ValueError(f"--init-draft {imported.weights}: no lm_head.weight (keys: "
                         f"{', '.join(sorted(imported.tensors)) or 'none'})")
    vd = int(imported.tensors["lm_head.weight"].shape[0])
    if requested_vocab is not None and min(requested_vocab, target_vocab) != vd:
        raise ValueError(f"--draft-vocab-size {requested_vocab} disagrees with the draft {path}: its vocabulary map "
                         f"has {vd} tokens (lm_head rows, d2t). The draft's map is kept (its lm_head row i means "
                         f"its draft id i): drop --draft-vocab-size or pass {vd}")
    overrides = dict(overrides)
    notes = [f"starting from the draft {path} ({imported.layout} layout, {imported.file_format}, sha256 "
             f"{imported.sha256[:12]}…, {vd} draft tokens): its weights and vocabulary map; fresh optimizer"]
    stated = imported.stated_aux_layer_ids
    if stated is not None:
        given = overrides.get("aux_layer_ids")
        if given is not None and list(given) != stated:
            raise ValueError(f"aux_layer_ids: the draft {path} reads target layers {stated} "
                             f"(eagle_config.eagle_aux_hidden_state_layer_ids), this run asks for {list(given)} "
                             "(--aux-layer-ids, --draft-config or the offline store)")
        overrides["aux_layer_ids"] = stated
    else:
        notes.append(f"note: the draft {path} does not state its aux layers (eagle_config); taking the target's "
                     "default ids, as SGLang and vLLM do")
    if imported.dropped:
        notes.append(f"note: the draft's {', '.join(imported.dropped)} is not used: the draft embeds with the "
                     "target's embedding")
    return InitDraft(imported=imported, draft_vocab_size=vd, overrides=overrides, notes=notes)


def _shape_geometry(t: dict[str, torch.Tensor], n_aux: int) -> list[tuple[str, int, str]]:
    """(field, value, tensor it was read from) of the geometry the weight shapes fix."""
    out = [("hidden_size", t["norm.weight"].shape[0], "norm.weight"),
           ("target_hidden_size", t["fc.weight"].shape[1] // n_aux, f"fc.weight columns / {n_aux}"),
           ("intermediate_size", t["midlayer.mlp.gate_proj.weight"].shape[0], "midlayer.mlp.gate_proj.weight"),
           ("draft_vocab_size", t["lm_head.weight"].shape[0], "lm_head.weight"),
           ("vocab_size", t["t2d"].shape[0], "t2d")]
    return [(name, int(value), source) for name, value, source in out]


def check_geometry(init: InitDraft, config: Eagle3DraftConfig, target_layers: int) -> None:
    """Refuse a draft that does not fit the run's draft ``config`` (module docstring) or a target of
    ``target_layers`` decoder layers: one ValueError naming the draft and, per problem, the missing/unexpected keys
    or the field with the draft's value (and where it was read) and the run's. Then the export checker
    (``recipe.export.check_tensors``: shapes, finiteness, a consistent vocabulary map) must pass too."""
    imported, tensors = init.imported, init.imported.tensors
    expected = expected_shapes(config.to_hf_dict())
    problems = [f"missing key {name!r}" for name in expected if name not in tensors]
    problems += [f"unexpected key {name!r} (not part of an EAGLE-3 draft)"
                 for name in sorted(set(tensors) - set(expected))]
    if problems:
        raise ValueError(f"--init-draft {imported.weights} ({imported.layout} layout) is not an EAGLE-3 draft:\n  "
                         + "\n  ".join(problems))
    run_source = "the run's: the target's config, or --draft-config"
    mismatches = [f"{name}: draft {value} ({source}), run {getattr(config, name)} ({run_source})"
                  for name, value, source in _shape_geometry(tensors, len(config.aux_layer_ids))
                  if value != getattr(config, name)]
    stated = imported.config
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_size",
                 "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if name in stated and stated[name] is not None and stated[name] != getattr(config, name) \
                and not any(m.startswith(name + ":") for m in mismatches):
            mismatches.append(f"{name}: draft {stated[name]!r} (config.json), run {getattr(config, name)!r} "
                              f"({run_source})")
    for name, proj, heads in (("num_attention_heads", "q", config.num_attention_heads),
                              ("num_key_value_heads", "k", config.num_key_value_heads)):
        rows = int(tensors[f"midlayer.self_attn.{proj}_proj.weight"].shape[0])
        if rows != heads * config.head_dim and not any(m.startswith((name + ":", "head_dim:")) for m in mismatches):
            mismatches.append(f"{name} × head_dim: draft {rows} (rows of midlayer.self_attn.{proj}_proj.weight), run "
                              f"{heads} × {config.head_dim} = {heads * config.head_dim} ({run_source})")
    if max(config.aux_layer_ids) >= target_layers:
        mismatches.append(f"aux_layer_ids: draft {config.aux_layer_ids}, but the target has {target_layers} decoder "
                          "layers")
    if stated.get("norm_before_residual"):
        mismatches.append("norm_before_residual: draft true (config.json), run false (this recipe's layer keeps the "
                          "un-normed hidden state as the residual)")
    if mismatches:
        raise ValueError(f"--init-draft {imported.path} does not fit this run's draft geometry:\n  "
                         + "\n  ".join(mismatches))
    problems = check_tensors(tensors, config.to_hf_dict(), imported.weights.name)
    if problems:
        raise ValueError(f"--init-draft {imported.weights}:\n  " + "\n  ".join(problems))


def setting_notes(init: InitDraft, config: Eagle3DraftConfig) -> list[str]:
    """One note when the draft's config.json states RoPE / max positions / norm eps other than the run's (which
    the run trains and exports with)."""
    stated, theirs = init.imported.config, {}
    if any(k in stated for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        theta, theirs["rope_scaling"] = rope_fields(lambda k, d=None: stated.get(k, d))
        params = stated.get("rope_parameters")
        if "rope_theta" in stated or (isinstance(params, dict) and "rope_theta" in params):
            theirs["rope_theta"] = theta
    theirs.update({k: stated[k] for k in ("max_position_embeddings", "rms_norm_eps") if k in stated})
    differ = [name for name in SETTING_FIELDS if name in theirs and theirs[name] != getattr(config, name)]
    if not differ:
        return []
    return [f"note: the draft {init.imported.path} was configured with "
            + ", ".join(f"{n} {theirs[n]!r}" for n in differ) + "; this run trains and exports it with "
            + ", ".join(f"{n} {getattr(config, n)!r}" for n in differ)
            + " (the target's unless --draft-config sets them; docs/algorithm.md, \"Positions\")"]


@torch.no_grad()
def load_into(model: torch.nn.Module, init: InitDraft) -> None:
    """Copy the draft's weights into the single-device ``model`` (a ``recipe.model.ttt.TTTModel``, before
    ``parallelize``), each cast to the parameter's dtype, and install its vocabulary map. Call after
    :func:`check_geometry`."""
    draft = model.draft
    for name, value in init.imported.tensors.items():
        if name in ("d2t", "t2d"):
            continue
        param = draft.get_parameter(name)
        param.copy_(value.to(param.dtype))
    draft.set_vocab_map(init.imported.tensors["d2t"], init.imported.tensors["t2d"])


def check_resume(saved_state: dict, init: InitDraft, checkpoint: Path) -> str:
    """``--init-draft`` with ``--resume``: the checkpoint continues (its weights, optimizer and step) when it is the
    run that started from this very draft (same sha256 of the weights file), so rerunning the first command with
    ``--resume`` works. Raises ValueError naming both when the checkpoint's run started from another draft or from
    fresh weights. Returns the note for the run plan."""
    saved = saved_state.get("init_draft")
    if saved is None:
        raise ValueError(f"--init-draft {init.imported.path} with --resume: the run in {checkpoint} did not start "
                         "from a draft; drop --init-draft to resume it, or start a new run (new --output or "
                         "--overwrite) from the draft")
    if saved.get("sha256") != init.imported.sha256:
        raise ValueError(f"--init-draft {init.imported.path} with --resume: the run in {checkpoint} started from "
                         f"another draft ({saved.get('path')}, sha256 {saved.get('sha256', '?')[:12]}…, now "
                         f"{init.imported.sha256[:12]}…); drop --init-draft to resume it, or start a new run")
    return (f"note: resuming from {checkpoint}: the run started from {init.imported.path}; its weights are the "
            "checkpoint's, the draft file is only compared")
