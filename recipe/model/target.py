"""The frozen target LLM and the capture of its EAGLE-3 aux hidden states (docs/algorithm.md, "Aux hidden states").

``TargetModel.capture`` runs the target's decoder stack (``model.get_decoder()``) and records the three chosen
decoder layers' outputs with forward hooks, so only those three ``[B, S, H_t]`` activations are kept alive
(``output_hidden_states=True`` would keep all ``L + 1``); the full-vocabulary ``lm_head`` is applied in chunks of
positions only to take the argmax (the greedy token, which decides whether a position is trained), never kept.

Conventions (transformers 5.23, Llama-family decoders):
- aux layer id ``i`` is the *output* of decoder layer ``i`` (0-based), i.e. ``output_hidden_states[i + 1]`` for
  ``i < L - 1``. (For ``i = L - 1`` HF returns the final-norm output at index ``L``; the hook keeps the raw output.)
- ``last_hidden`` is the decoder's ``last_hidden_state``: the final RMSNorm output, the input of ``lm_head``, so
  ``target_head.target_logits(last_hidden, lm_head_weight, final_logit_softcap(config)) == CausalLM(...).logits``
  (``hidden_states[-1]`` is tied to the same tensor).
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from recipe.model.aux_layers import default_aux_layer_ids, validate_aux_layer_ids
from recipe.model.target_head import lm_head_argmax

# Config keys that change with how a model was saved/loaded, not with which model it is.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                         "use_cache", "_attn_implementation_autoset", "attn_implementation"}
_FINGERPRINT_ROWS = 8


def _split_gguf(path: str | Path) -> tuple[str, dict]:
    """A ``*.gguf`` file path becomes ``(folder, {"gguf_file": name})``; a folder stays as it is."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if not path.is_dir():
        raise FileNotFoundError(f"target folder not found: {path}")
    return str(path), {}


def _fingerprint(config: PretrainedConfig, embed_rows: torch.Tensor) -> str:
    cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(embed_rows.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _embed_rows_from_safetensors(folder: Path) -> torch.Tensor | None:
    """Rows 0..7 of the ``*embed_tokens.weight`` tensor in a folder's safetensors files, or None if not found."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight"):
                    return f.get_slice(key)[:_FINGERPRINT_ROWS]
    return None


def target_fingerprint(path: str | Path) -> str:
    """16 hex chars identifying a target independent of load dtype/device: sha256 of its canonical config
    (save/load-dependent keys dropped) and of the bf16 bytes of input-embedding rows 0..7.

    Reads only config and those rows from a safetensors folder; other formats (GGUF) load the model on CPU.
    """
    folder, kwargs = _split_gguf(path)
    rows = None if kwargs else _embed_rows_from_safetensors(Path(folder))
    if rows is None:
        return TargetModel(path, aux_layer_ids=[0], dtype=torch.float32, device="cpu").fingerprint
    return _fingerprint(AutoConfig.from_pretrained(folder), rows)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The target's tokenizer from a HF folder or a ``*.gguf`` file (offline)."""
    folder, kwargs = _split_gguf(path)
    return AutoTokenizer.from_pretrained(folder, **kwargs)


@contextmanager
def capture_layer_outputs(layers, layer_ids):
    """Forward hooks on ``layers[i]`` for i in ``layer_ids``, removed on exit; yields ``{i: output [B, S, H_t]}``
    filled by the forward run inside the ``with`` block (a decoder layer's output, or its first element)."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id):
        def hook(_module, _args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class TargetCapture:
    """What the draft needs from one target forward pass.

    aux_hidden_BSA:  [B, S, 3·H_t], the aux layers' outputs concatenated in ``aux_layer_ids`` order (target dtype).
    last_hidden_BSH: [B, S, H_t], the final-norm output (input of ``lm_head``); the target's logits are
        ``recipe.model.target_head.target_logits(last_hidden, lm_head_weight, final_logit_softcap(config))``.
    argmax_BS:       [B, S] int64, the target's greedy token ``argmax lm_head(last_hidden)`` over its full vocabulary
                     (computed on the target's device in its dtype, ``recipe.model.target_head.lm_head_argmax``).
    All on the target's device.
    """

    aux_hidden_BSA: torch.Tensor
    last_hidden_BSH: torch.Tensor
    argmax_BS: torch.Tensor


class TargetModel:
    """A frozen causal LM (eval mode, ``requires_grad=False``) with aux-hidden-state capture.

    Args:
        path: a HF model folder (config, weights, tokenizer) or a ``*.gguf`` file.
        aux_layer_ids: decoder layers to capture; default ``default_aux_layer_ids(num_layers)``.
        dtype: parameter dtype; default fp32 on CPU, bf16 on CUDA.
        device: default ``cuda`` when available, else ``cpu``.
    Raises FileNotFoundError for a missing path, ValueError for aux layer ids outside the model.
    """

    def __init__(self, path: str | Path, aux_layer_ids=None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None):
        self.path = str(path)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        folder, kwargs = _split_gguf(path)
        self.model = self._load_model(folder, kwargs).eval().requires_grad_(False)
        self.decoder = self.model.get_decoder()
        self.layers = self.decoder.layers
        ids = default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else aux_layer_ids
        self.aux_layer_ids = validate_aux_layer_ids(ids, self.num_layers)
        self._fingerprint: str | None = None

    # True when ``capture`` is a collective over all ranks (``recipe.model.target_partition``): every rank must then
    # call it equally often.
    partitioned = False

    def _load_model(self, folder: str, kwargs: dict) -> torch.nn.Module:
        """The causal LM from ``folder`` in ``self.dtype`` on ``self.device`` (``kwargs``: the GGUF file name)."""
        return AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, **kwargs).to(self.device)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of ``lm_head`` (may exceed the tokenizer's length when the embedding is padded)."""
        return int(self.lm_head_weight.shape[0])

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H_t] output projection (tied to the embedding in some targets)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_tokens_weight(self) -> torch.Tensor:
        """[V, H_t] input embedding (the draft reuses it, frozen)."""
        return self.model.get_input_embeddings().weight

    @contextmanager
    def full_lm_head(self):
        """``with target.full_lm_head() as head_VH``: the whole [V, H_t] lm_head for the block (a partitioned target
        gathers it for the block and frees it after: a collective there)."""
        yield self.lm_head_weight

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.path)

    @property
    def fingerprint(self) -> str:
        """``target_fingerprint`` of this model (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.config, self.embed_tokens_weight[:_FINGERPRINT_ROWS])
        return self._fingerprint

    @torch.no_grad()
    def capture(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None,
                argmax_chunk_size: int = 1024) -> TargetCapture:
        """Run the decoder stack once; return the aux layers' outputs, the final-norm hidden states and the greedy
        token per position (the lm_head applied ``argmax_chunk_size`` positions at a time: never all [B, S, V]
        logits at once).

        input_ids_BS: [B, S] int64 token ids; attention_mask_BS: [B, S] 1 = token, 0 = padding (default all ones).
        Rows at padded positions hold whatever the model computes there; callers strip them.
        """
        with capture_layer_outputs(self.layers, self.aux_layer_ids) as captured:
            out = self.decoder(input_ids=input_ids_BS.to(self.device),
                               attention_mask=None if attention_mask_BS is None else attention_mask_BS.to(self.device),
                               use_cache=False)
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        last = out.last_hidden_state
        with self.full_lm_head() as head_VH:
            argmax = lm_head_argmax(last, head_VH, argmax_chunk_size)
        return TargetCapture(aux_hidden_BSA=aux, last_hidden_BSH=last, argmax_BS=argmax)
