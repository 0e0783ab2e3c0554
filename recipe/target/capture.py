"""The frozen target LLM and the capture of its EAGLE-3 aux hidden states (docs/algorithm.md, "Aux hidden states").

``TargetModel.capture`` runs the target's decoder stack (``model.get_decoder()``) and records the three chosen
decoder layers' outputs with forward hooks, so only those three ``[B, S, H_t]`` activations are kept alive
(``output_hidden_states=True`` would keep all ``L + 1``); the full-vocabulary ``lm_head`` is applied in chunks of
positions only to take the argmax (the greedy token, which decides whether a position is trained), never kept.

Conventions (transformers 5.23, Llama-family decoders):
- aux layer id ``i`` is the *output* of decoder layer ``i`` (0-based), i.e. ``output_hidden_states[i + 1]`` for
  ``i < L - 1``. (For ``i = L - 1`` HF returns the final-norm output at index ``L``; the hook keeps the raw output.)
- ``last_hidden`` is the decoder's ``last_hidden_state``: the final RMSNorm output, the input of ``lm_head``, so
  ``loss.target_logits(last_hidden, lm_head_weight, registry.final_logit_softcap(config)) == CausalLM(...).logits``
  (``hidden_states[-1]`` is tied to the same tensor).
"""
from __future__ import annotations

import functools
import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from recipe.target.aux_layers import validate_aux_layer_ids
from recipe.target.files import split_gguf, weight_files
from recipe.target.head import lm_head_argmax
from recipe.target.registry import arch_facts

# Config keys that change with how a model was saved/loaded, not with which model it is.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                         "use_cache", "_attn_implementation_autoset", "attn_implementation"}


def _canonical_config(config: PretrainedConfig | dict) -> bytes:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.dumps({k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}, sort_keys=True,
                      default=str).encode()


# The weight fingerprint (target_fingerprint). Per tensor of a safetensors file: its name, dtype and shape (from the
# file's JSON header) and SAMPLES strided reads of SAMPLE_BYTES of its data, first and last bytes included (a
# tensor of at most SAMPLES·SAMPLE_BYTES bytes is read whole): a bounded read per tensor, so the cost grows with the
# tensor count (~300 for 135M parameters, ~720 for 70B), not with the model size. Tensors are hashed in name order
# and their offsets in the files are left out, so the same weights sharded differently have the same fingerprint.
# Other weight files (GGUF, .bin) are sampled as raw bytes (RAW_SAMPLES strided reads and the size).
FINGERPRINT_TAG = "w1:"  # the fingerprint's format: a store holding another was written by an older version
SAMPLES, SAMPLE_BYTES, RAW_SAMPLES = 16, 256, 1024


def is_weight_fingerprint(fingerprint: str) -> bool:
    """Whether ``fingerprint`` is in this version's :func:`target_fingerprint` format (``FINGERPRINT_TAG``)."""
    return str(fingerprint).startswith(FINGERPRINT_TAG)


def _strided_reads(f, start: int, nbytes: int, samples: int, h) -> None:
    if nbytes <= samples * SAMPLE_BYTES:
        f.seek(start)
        h.update(f.read(nbytes))
        return
    span = nbytes - SAMPLE_BYTES
    for i in range(samples):
        f.seek(start + span * i // (samples - 1))
        h.update(f.read(SAMPLE_BYTES))


def _hash_safetensors(files: list[Path], h) -> None:
    tensors = []  # (name, dtype, shape, file, absolute start, nbytes)
    for file in files:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{file}: not a safetensors file (unreadable header: {exc})") from None
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                tensors.append((name, info["dtype"], list(info["shape"]), file, 8 + header_len + begin, end - begin))
    handles = {}
    try:
        for name, dtype, shape, file, start, nbytes in sorted(tensors, key=lambda t: t[0]):
            h.update(json.dumps([name, dtype, shape]).encode())
            f = handles.get(file) or handles.setdefault(file, open(file, "rb"))
            _strided_reads(f, start, nbytes, SAMPLES, h)
    finally:
        for f in handles.values():
            f.close()


def _hash_raw(files: list[Path], h) -> None:
    for file in files:
        size = file.stat().st_size
        h.update(json.dumps([file.suffix, size]).encode())
        with open(file, "rb") as f:
            _strided_reads(f, 0, size, RAW_SAMPLES, h)


@functools.lru_cache(maxsize=16)
def _cached_fingerprint(path: str, signature: tuple) -> str:
    del signature  # only the cache key: the files' names, sizes and modification times
    files = weight_files(path)
    h = hashlib.sha256(FINGERPRINT_TAG.encode())
    if files.config is not None:
        h.update(_canonical_config(json.loads(files.config.read_text())))
    _hash_safetensors(files.safetensors, h)
    _hash_raw(files.raw, h)
    return FINGERPRINT_TAG + h.hexdigest()[:24]


def target_fingerprint(path: str | Path) -> str:
    """``"w1:"`` + 24 hex chars identifying a target's config and weights, independent of load dtype, device and
    sharding: sha256 of its canonical config (save/load-dependent keys dropped) and of every weight tensor's name,
    dtype, shape and a strided sample of its bytes (see ``SAMPLES``; read from the files, no model load). Two targets
    with the same config and other weights differ. Computed once per process for unchanged files. Raises
    FileNotFoundError for a missing target or a folder without weights, ValueError for an unreadable file."""
    found = weight_files(path)
    files = [*found.safetensors, *found.raw, *([found.config] if found.config is not None else [])]
    signature = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _cached_fingerprint(str(Path(path).resolve()), signature)


# A HF folder's tokenizer: one vocabulary file (the fast tokenizer's tokenizer.json, a sentencepiece model, a BPE
# vocab.json, a tiktoken file) and tokenizer_config.json (class, special tokens, the chat template of older saves).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def check_tokenizer_files(folder: str | Path) -> None:
    """FileNotFoundError naming ``folder`` and the missing files when it has no tokenizer vocabulary file
    (:data:`TOKENIZER_VOCAB_FILES`; tokenizer.json alone is enough): transformers would otherwise fail with "need
    sentencepiece or tiktoken", naming neither the folder nor the files."""
    folder = Path(folder)
    if any(next(folder.glob(pattern), None) is not None for pattern in TOKENIZER_VOCAB_FILES):
        return
    missing = "tokenizer.json (or tokenizer.model, vocab.json, *.tiktoken)"
    if not (folder / TOKENIZER_CONFIG_FILE).is_file():
        missing += f" and {TOKENIZER_CONFIG_FILE}"
    raise FileNotFoundError(f"target folder {folder} has no tokenizer: missing {missing}. Copy the tokenizer files "
                            "of the model the weights come from into it (tokenizer.save_pretrained writes them)")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The target's tokenizer from a HF folder or a ``*.gguf`` file (offline). Raises FileNotFoundError naming the
    folder and the missing files when a folder has no tokenizer (:func:`check_tokenizer_files`)."""
    folder, kwargs = split_gguf(path)
    if not kwargs:
        check_tokenizer_files(folder)
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


def is_right_padded(attention_mask_BS: torch.Tensor) -> bool:
    """Whether a [B, S] 0/1 (or bool) mask is right padding: in every row, ones then only zeros. Decide it on a CPU
    mask (on a device tensor this reads the device)."""
    mask = attention_mask_BS.long()
    if mask.numel() == 0:
        return True
    return bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] <= mask[:, :-1]).all())


@dataclass
class TargetCapture:
    """What the draft needs from one target forward pass.

    aux_hidden_BSA:  [B, S, 3·H_t], the aux layers' outputs concatenated in ``aux_layer_ids`` order (target dtype).
    last_hidden_BSH: [B, S, H_t], the final-norm output (input of ``lm_head``); the target's logits are
        ``recipe.model.loss.target_logits(last_hidden, lm_head_weight, final_logit_softcap(config))``.
    argmax_BS:       [B, S] int64, the target's greedy token ``argmax lm_head(last_hidden)`` over its full vocabulary
                     (computed on the target's device in its dtype, ``recipe.target.head.lm_head_argmax``).
    All on the target's device.
    """

    aux_hidden_BSA: torch.Tensor
    last_hidden_BSH: torch.Tensor
    argmax_BS: torch.Tensor


class TargetModel:
    """A frozen causal LM (eval mode, ``requires_grad=False``) with aux-hidden-state capture.

    Args:
        path: a HF model folder (config, weights, tokenizer) or a ``*.gguf`` file.
        aux_layer_ids: decoder layers to capture; default: its architecture's ``default_aux_layer_ids(num_layers)``
            (``recipe.target.registry``).
        dtype: parameter dtype; default fp32 on CPU, bf16 on CUDA.
        device: default ``cuda`` when available, else ``cpu``.
    Raises FileNotFoundError for a missing path, ValueError for aux layer ids outside the model.
    """

    def __init__(self, path: str | Path, aux_layer_ids=None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None):
        self.path = str(path)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        folder, kwargs = split_gguf(path)
        self.model = self._load_model(folder, kwargs).eval().requires_grad_(False)
        self.decoder = self.model.get_decoder()
        self.layers = self.decoder.layers
        ids = arch_facts(self.config).default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else aux_layer_ids
        self.aux_layer_ids = validate_aux_layer_ids(ids, self.num_layers)
        self._fingerprint: str | None = None

    # True when ``capture`` is a collective over all ranks (``recipe.target.partition``): every rank must then
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
            self._fingerprint = target_fingerprint(self.path)
        return self._fingerprint

    @torch.no_grad()
    def capture(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None,
                argmax_chunk_size: int = 1024, argmax_rows_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None) -> TargetCapture:
        """Run the decoder stack once; return the aux layers' outputs, the final-norm hidden states and the greedy
        token per position (the lm_head applied ``argmax_chunk_size`` positions at a time: never all [B, S, V]
        logits at once).

        input_ids_BS: [B, S] int64 token ids; attention_mask_BS: [B, S] 1 = token, 0 = padding (default all ones).
        A RIGHT-padded mask given on the CPU (``is_right_padded``: every row ones then zeros, the training batches'
        and the dump's) is not passed to the model: under causal attention a padded position comes after every real
        one, so the real rows are the same without it, and transformers then builds no dense [B, 1, S, S] mask.
        Any other mask (left padding, holes, or one on a device, which would cost a sync to inspect) is passed on.
        ``argmax_rows_BS`` ([B, S] bool, None: all): take the argmax only at these rows, 0 elsewhere
        (``recipe.target.head.validity_rows``: the rows the TTT validity reads).
        ``position_ids_BS`` ([B, S] int64, None: 0..S−1 in every row): a packed batch's positions, restarting at 0
        in every document (``recipe.data.packing``; docs/algorithm.md, "Packing"); RoPE reads them and the
        decoder's attention isolates the documents: without a 2-D mask and a cache, transformers' mask builder
        splits each row where the position does not grow by one (``masking_utils.find_packed_sequence_indices``)
        and masks every pair of positions across a split, which is exact when every document starts at 0. Such a
        batch must be right-padded with its mask on the CPU (the mask is then dropped); ValueError otherwise.
        Rows at padded positions hold whatever the model computes there (with or without the mask); callers strip
        them or mask them from the loss.
        """
        mask = attention_mask_BS
        if mask is not None and mask.device.type == "cpu" and is_right_padded(mask):
            mask = None
        if position_ids_BS is not None and mask is not None:
            raise ValueError("TargetModel.capture: packed documents (position_ids_BS) need a right-padded attention "
                             "mask on the CPU: transformers isolates them only without a 2-D mask")
        positions = None if position_ids_BS is None else position_ids_BS.to(self.device)
        with capture_layer_outputs(self.layers, self.aux_layer_ids) as captured:
            out = self.decoder(input_ids=input_ids_BS.to(self.device), position_ids=positions,
                               attention_mask=None if mask is None else mask.to(self.device), use_cache=False)
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        last = out.last_hidden_state
        with self.full_lm_head() as head_VH:
            argmax = lm_head_argmax(last, head_VH, argmax_chunk_size, argmax_rows_BS)
        return TargetCapture(aux_hidden_BSA=aux, last_hidden_BSH=last, argmax_BS=argmax)
