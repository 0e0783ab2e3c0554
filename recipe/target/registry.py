"""What the recipe needs to know about each target architecture, in one place.

Everything else in ``recipe.target`` is architecture-agnostic (transformers' ``AutoModelForCausalLM``,
``get_decoder().layers``, the chat template); the facts that differ between architectures live in
:data:`ARCHITECTURES`, keyed by the Hugging Face ``model_type`` of the target's (text) config:

- ``routable_attention``: the target's attention is plain causal and can be routed through the project's causal
  block when its forward is split over the cp·tp ranks (``recipe.target.split``: the ring): it calls transformers'
  ``AttentionInterface`` with plain causal attention, RoPE from ``position_ids``, no attention-logit soft-cap, no
  sliding window shorter than the sequence, and a scale the ring handles (``scaling`` is applied to the queries). Established per architecture by
  ``tests/test_target_cp.py`` (the CP forward equals the plain model's) and
  ``tests/test_target_archs_training.py`` (online cp = 2 trains the dp = 2 curve).
- ``logit_softcap_field``: the config field of the final logit soft-cap ``c`` that the target's ``ForCausalLM``
  applies after ``lm_head`` (``c · tanh(z / c)``; Gemma 2/3), so the teacher distribution is the soft-capped one.
- ``rope``: reads the draft's RoPE fields (``rope_theta``, ``rope_scaling``) from the target config; the draft is a
  full-rotary Llama layer, so an architecture with partial rotary embeddings (Phi-3) leaves that fraction out.
- ``default_aux_layer_ids``: EAGLE-3's low/mid/high layers for a target of ``L`` decoder layers.
- ``packs_documents``: the target's forward isolates packed documents (``TargetModel.capture``'s
  ``position_ids_BS``: transformers' packed-sequence mask; ``SplitTarget``: the ring), so an online run may pack
  (``data.packing``; docs/algorithm.md, "Packing"). Established per architecture by ``tests/test_packing.py`` (the
  packed forward's aux and last hidden states equal the padded one's).

An unknown ``model_type`` gets :data:`GENERIC`: offline training, the head, the capture and the evaluation work for
any causal LM transformers loads; the online cp > 1 forward refuses it (:func:`check_split_target`). Adding an
architecture is one entry here plus its tiny config in ``tests/helpers/tiny_target.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from recipe.model.draft_config import Eagle3DraftConfig, rope_fields
from recipe.parallel.dims import ParallelDims
from recipe.target.aux_layers import default_aux_layer_ids


def _full_rotary_rope(get) -> tuple[float, dict | None]:
    """:func:`rope_fields` without the target's ``partial_rotary_factor`` (Phi-3/Phi-4: top level or in
    ``rope_parameters``): the draft is its own full-rotary Llama layer (what SGLang and vLLM load), so it takes the
    target's RoPE base and scaling but rotates its whole head. A scaling whose factor lists are sized for the rotated
    part only (Phi-4-mini's ``longrope``) does not fit a full head: such a target needs ``rope_scaling`` set with
    ``--draft-config``."""
    def without_partial(key, default=None):
        value = get(key, default)
        if key == "rope_parameters" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k != "partial_rotary_factor"}
        return value
    return rope_fields(without_partial)


@dataclass(frozen=True)
class TargetArch:
    """The per-architecture facts of one target ``model_type`` (module docstring)."""

    model_type: str
    routable_attention: bool
    logit_softcap_field: str | None = None
    rope: Callable[[Callable], tuple[float, dict | None]] = rope_fields
    default_aux_layer_ids: Callable[[int], list[int]] = default_aux_layer_ids
    packs_documents: bool = False


ARCHITECTURES: dict[str, TargetArch] = {a.model_type: a for a in (
    TargetArch("llama", routable_attention=True, packs_documents=True),
    TargetArch("mistral", routable_attention=True, packs_documents=True),
    TargetArch("qwen2", routable_attention=True, packs_documents=True),
    TargetArch("qwen3", routable_attention=True, packs_documents=True),
    TargetArch("phi3", routable_attention=True, rope=_full_rotary_rope, packs_documents=True),
    # attention-logit soft-cap and alternating sliding windows: not plain causal, so not through the ring
    TargetArch("gemma2", routable_attention=False, logit_softcap_field="final_logit_softcapping"),
    TargetArch("gemma3_text", routable_attention=False, logit_softcap_field="final_logit_softcapping"),
)}
"""Every architecture the recipe has facts for, by ``model_type``."""

GENERIC = TargetArch("generic", routable_attention=False, logit_softcap_field="final_logit_softcapping")
"""The facts of an architecture not in :data:`ARCHITECTURES` (the soft-cap read where the field exists)."""


def _getter(config: Any) -> Callable:
    """``get(key, default)`` over an HF config object or a dict (the text config of a multimodal one)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if isinstance(config, Mapping):
        return lambda key, default=None: config.get(key, default)
    return lambda key, default=None: getattr(config, key, default)


def arch_facts(config: Any) -> TargetArch:
    """The :class:`TargetArch` of a target's HF config (object or dict), :data:`GENERIC` for an unknown type."""
    return ARCHITECTURES.get(_getter(config)("model_type", None), GENERIC)


def final_logit_softcap(config: Any) -> float | None:
    """The target's final logit soft-cap ``c`` (its architecture's ``logit_softcap_field``), None without one."""
    field = arch_facts(config).logit_softcap_field
    cap = _getter(config)(field, None) if field else None
    return float(cap) if cap else None


def check_split_target(config: Any) -> None:
    """Raise ValueError unless the target's attention can run through the ring (``routable_attention``), naming its
    ``model_type``, the supported ones and the offline alternative."""
    model_type = _getter(config)("model_type", None)
    if not arch_facts(config).routable_attention:
        supported = ", ".join(name for name, arch in ARCHITECTURES.items() if arch.routable_attention)
        raise ValueError(f"the context-parallel target forward does not support model_type {model_type!r} (supported: "
                         f"{supported}): its attention cannot be routed through the ring. Train offline instead: "
                         "dump the hidden states with `python -m recipe.dump` and pass `--hidden-states <store>` to "
                         "run.py (or train with cp_size = 1)")


def splits_target(config: Any, dims: ParallelDims) -> bool:
    """Whether an online run's target forward is split over the cp·tp ranks of each dp replica of the layout ``dims``
    (``recipe.target.split.SplitTarget``): always when ``dims.cp_enabled``, and at tp > 1 when its attention runs
    through the ring (``routable_attention``; otherwise every tp rank runs it whole). The rule run.py and the
    planner share. Raises ValueError (:func:`check_split_target`) under cp for a target the ring cannot run."""
    if dims.cp_enabled:
        check_split_target(config)
        return True
    return dims.tp > 1 and arch_facts(config).routable_attention


def draft_config_for(config: Any, draft_vocab_size: int,
                     overrides: Mapping[str, Any] | None = None) -> Eagle3DraftConfig:
    """The draft geometry derived from the target's HF config (object or dict), then ``overrides`` applied.

    Taken from the target: hidden size (as both H and H_t), intermediate size, attention and KV heads, head dim
    (``head_dim`` or H / heads), RMSNorm eps, activation, RoPE (its architecture's ``rope`` reader), max positions,
    vocab size; ``aux_layer_ids`` defaults to its architecture's ``default_aux_layer_ids(L)``. Raises ValueError for
    an unknown override key (named), a target too shallow for the default aux ids without an ``aux_layer_ids``
    override, or RoPE the draft cannot represent.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(Eagle3DraftConfig.field_names()))
    if unknown:
        raise ValueError(f"unknown draft config override(s) {unknown}; known fields: {Eagle3DraftConfig.field_names()}")
    arch, get = arch_facts(config), _getter(config)
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    rope_theta, rope_scaling = arch.rope(get)
    derived = dict(
        hidden_size=hidden, intermediate_size=int(get("intermediate_size")), num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads", None) or heads),
        head_dim=int(get("head_dim", None) or hidden // heads), vocab_size=int(get("vocab_size")),
        draft_vocab_size=int(draft_vocab_size), target_hidden_size=hidden,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(get("max_position_embeddings", 2048)),
        hidden_act=str(get("hidden_act", "silu")),
    )
    if "aux_layer_ids" not in overrides:
        derived["aux_layer_ids"] = arch.default_aux_layer_ids(int(get("num_hidden_layers")))
    derived.update(overrides)
    return Eagle3DraftConfig(**derived)
