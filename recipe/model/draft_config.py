"""Configuration of the EAGLE-3 draft (docs/algorithm.md, "The draft") and its export ``config.json``
(docs/algorithm.md, "Export format").

The draft is one Llama decoder layer whose geometry is, by default, the target's; every field can be overridden
(``--draft-config FILE`` holds a JSON object of overrides). The TTT depth K is a training argument, not a field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from transformers import LlamaConfig

EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3DraftConfig:
    """Geometry of the one-layer EAGLE-3 draft.

    Fields (units: counts unless noted): ``hidden_size`` H, ``intermediate_size`` (SwiGLU width),
    ``num_attention_heads``, ``num_key_value_heads`` (GQA; must divide the head count), ``head_dim`` (even, for
    RoPE), ``rms_norm_eps``, ``rope_theta`` (RoPE base), ``rope_scaling`` (HF rope-scaling dict such as
    ``{"rope_type": "llama3", "factor": 8.0, ...}``, or None), ``max_position_embeddings``, ``vocab_size`` V (the
    target's), ``draft_vocab_size`` Vd (<= V), ``target_hidden_size`` H_t, ``aux_layer_ids`` (three target decoder
    layer ids; ``fc`` reads ``3 * H_t``), ``hidden_act``, ``initializer_range`` (std of the normal init).
    Raises ValueError naming the field when a value is out of range.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self):
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"draft config field {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"draft config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"draft config field head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft config: draft_vocab_size={self.draft_vocab_size} exceeds the target "
                             f"vocab_size={self.vocab_size}")
        if len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0:
            raise ValueError(f"draft config field aux_layer_ids={self.aux_layer_ids} must be three non-negative "
                             "target decoder layer ids (fc reads 3 * target_hidden_size)")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"draft config field rope_scaling={self.rope_scaling!r} must be a dict or null")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"draft config field rms_norm_eps={self.rms_norm_eps!r} must be > 0")

    @classmethod
    def field_names(cls) -> list[str]:
        """Names accepted as overrides (and by ``recipe.target.registry.draft_config_for``)."""
        return [f.name for f in dataclasses.fields(cls)]

    def to_llama_config(self) -> LlamaConfig:
        """A one-layer LlamaConfig for transformers' RoPE (``LlamaRotaryEmbedding``): head_dim and RoPE fields.

        ``hidden_size`` there is ``heads * head_dim`` (the RoPE code reads only ``head_dim``), so a draft whose
        H is not a multiple of its head count still passes transformers' validation.
        """
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if "type" in rope and "rope_type" not in (self.rope_scaling or {}):
            rope["rope_type"] = rope.pop("type")
        return LlamaConfig(hidden_size=self.num_attention_heads * self.head_dim,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
                           max_position_embeddings=self.max_position_embeddings, rope_parameters=rope)

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """The export ``config.json`` (docs/algorithm.md, "Export format") read by SGLang/vLLM as
        ``LlamaForCausalLMEagle3``.

        ``target_hidden_size`` is written only when it differs from ``hidden_size``; ``torch_dtype`` (e.g.
        "bfloat16") only when given.
        """
        out = {
            "architectures": [EXPORT_ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "initializer_range": self.initializer_range,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if torch_dtype is not None:
            out["torch_dtype"] = torch_dtype
        return out

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "Eagle3DraftConfig":
        """Read an export ``config.json`` dict back; ValueError naming a missing key or a foreign architecture."""
        archs = d.get("architectures") or [EXPORT_ARCHITECTURE]
        if EXPORT_ARCHITECTURE not in archs:
            raise ValueError(f"draft config.json: architectures={archs} does not contain {EXPORT_ARCHITECTURE}")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size"):
            if key not in d:
                raise ValueError(f"draft config.json: missing key {key!r}")
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            raise ValueError("draft config.json: missing eagle_config.eagle_aux_hidden_state_layer_ids")
        get = d.get
        rope_theta, rope_scaling = rope_fields(lambda k, dflt=None: get(k, dflt))
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or int(d["hidden_size"]) // heads), vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d["draft_vocab_size"]),
            target_hidden_size=int(get("target_hidden_size") or d["hidden_size"]), aux_layer_ids=list(ids),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            hidden_act=str(get("hidden_act", "silu")), initializer_range=float(get("initializer_range", 0.02)),
        )


def rope_fields(get) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config getter: transformers-5 ``rope_parameters`` or the older keys.

    A ``rope_type`` of "default" means no scaling (None); otherwise the scaling dict is the parameters minus theta.
    """
    params = get("rope_parameters", None)
    if isinstance(params, Mapping) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", get("rope_theta", None) or 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind == "default" else params)
    scaling = get("rope_scaling", None)
    return float(get("rope_theta", None) or 10000.0), (dict(scaling) if scaling else None)


def load_draft_config_overrides(path: str | Path) -> dict:
    """Read the ``--draft-config FILE`` JSON object of draft-config overrides.

    Raises ValueError naming the file (and line/column for bad JSON) when it is not valid JSON, not an object, or has
    a key that is not an ``Eagle3DraftConfig`` field; FileNotFoundError when it does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--draft-config file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} column {err.colno}: invalid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of draft config fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(Eagle3DraftConfig.field_names()))
    if unknown:
        raise ValueError(f"{path}: unknown draft config key(s) {unknown}; known: {Eagle3DraftConfig.field_names()}")
    return data
