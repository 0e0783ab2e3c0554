"""Read an existing EAGLE-3 draft in any of the layouts SGLang and vLLM serve, as this project's export tensors
(docs/training.md, "Warm start"; the export format: docs/algorithm.md, "Export format").

Accepted sources (``PATH`` of ``run.py --init-draft`` and of ``python -m recipe.eval --draft``):

- a folder holding ``model.safetensors`` or ``pytorch_model.bin`` (the first found wins, safetensors first), with
  an optional ``config.json``: this project's export, a SpecForge checkpoint, the EAGLE repository's release;
- a single ``.safetensors`` file, or a PyTorch ``.bin`` / ``.pt`` file (a ``config.json`` beside it is read).

Key layouts, mapped to the export names: the layer under ``midlayer.`` (this project, SpecForge, the EAGLE
repository) or ``layers.0.`` (the name SGLang and vLLM give it internally, and the one some converters write); an
optional ``model.`` prefix on any key; ``fc``, ``norm``, ``lm_head``, ``d2t`` / ``t2d`` as they are. The target's
``embed_tokens.weight``, which SpecForge and the EAGLE repository may save, is dropped (the run uses the target's
own). Any other key, or a missing one, is an error naming it.

A PyTorch file is read only through ``torch.load(weights_only=True)``: a pickle that would construct anything but
tensors and plain containers is refused before any of its code runs.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from recipe.export import CONFIG_FILE, WEIGHTS_FILE

PICKLE_FILE = "pytorch_model.bin"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
IGNORED_KEYS = ("embed_tokens.weight",)  # the target's embedding: the run takes the target's own
LAYER_PREFIXES = {"midlayer.": "midlayer.", "layers.0.": "midlayer."}


@dataclass
class ImportedDraft:
    """A draft read from ``path``: ``tensors`` under the export names (CPU, as stored; ``d2t`` int64 and ``t2d``
    bool when present), its ``config`` dict ({} without a config.json), the ``weights`` file read, its ``sha256``,
    ``layout`` ("midlayer" or "layers.0", plus "+model. prefix" when there was one), ``file_format``
    ("safetensors" or "pytorch (weights_only)") and the ``dropped`` keys (the target embedding)."""

    path: Path
    weights: Path
    tensors: dict[str, torch.Tensor]
    config: dict
    sha256: str
    layout: str
    file_format: str
    dropped: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """Where the draft came from, for ``run_config.json``, the run plan and every checkpoint's run state."""
        return {"path": str(self.path), "weights": str(self.weights), "sha256": self.sha256, "layout": self.layout,
                "format": self.file_format, "draft_vocab_size": int(self.tensors["lm_head.weight"].shape[0])
                if "lm_head.weight" in self.tensors else None}

    @property
    def stated_aux_layer_ids(self) -> list[int] | None:
        """The aux layer ids its config.json states (``eagle_config.eagle_aux_hidden_state_layer_ids``); None when
        it states none: a run or an evaluation then takes the target's default ids, as SGLang and vLLM do."""
        eagle = self.config.get("eagle_config")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        return [int(i) for i in ids] if ids else None


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _run_folder_hint(path: Path) -> str:
    """The hint for a training run's output folder (``run.py --output``: ``run_config.json``, ``checkpoints/``,
    the exported draft in ``export/``) passed where a draft is read; "" for any other folder."""
    export = path / "export"
    if (export / WEIGHTS_FILE).is_file():
        return f" (a training run's output folder: pass {export}, the exported draft)"
    if (path / "run_config.json").is_file() or (path / "checkpoints").is_dir():
        return (f" (a training run's output folder, with no exported draft in {export} yet: the run writes it when "
                f"it finishes, or python -m recipe.export {path / 'checkpoints'} {export} writes it from the latest "
                "checkpoint)")
    return ""


def find_files(path: Path, flag: str = "--init-draft") -> tuple[Path, Path | None]:
    """``(weights file, config.json or None)`` of a draft folder or file. Raises ValueError naming ``flag`` and the
    path when there is no weights file, or when the folder holds only a sharded checkpoint (``*.index.json``); for a
    training run's output folder the message names its ``export/`` folder."""
    path = Path(path)
    if path.is_dir():
        for name in (WEIGHTS_FILE, PICKLE_FILE):
            if (path / name).is_file():
                config = path / CONFIG_FILE
                return path / name, config if config.is_file() else None
        sharded = sorted(p.name for p in path.glob("*.index.json"))
        hint = (f" (it holds a sharded checkpoint, {', '.join(sharded)}: merge it into one file first)"
                if sharded else _run_folder_hint(path))
        raise ValueError(f"{flag} {path}: no {WEIGHTS_FILE} or {PICKLE_FILE} in the folder{hint}")
    if path.is_file():
        if path.suffix != ".safetensors" and path.suffix not in PICKLE_SUFFIXES:
            raise ValueError(f"{flag} {path}: not a .safetensors or PyTorch ({', '.join(PICKLE_SUFFIXES)}) "
                             "file")
        config = path.parent / CONFIG_FILE
        return path, config if config.is_file() else None
    raise ValueError(f"{flag} {path}: no such file or folder")


def read_weights(file: Path, flag: str = "--init-draft") -> tuple[dict[str, torch.Tensor], str]:
    """``(tensors by stored key, file format)``: safetensors through ``safe_open``; a PyTorch pickle through
    ``torch.load(weights_only=True)`` only. Raises ValueError naming the file when it is unreadable, when the
    pickle asks for anything ``weights_only`` does not allow (the message says so: nothing of it ran), or when it
    is not a flat dict of tensors."""
    if file.suffix == ".safetensors":
        try:
            with safe_open(str(file), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, "safetensors"
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt headers
            raise ValueError(f"{flag} {file}: unreadable safetensors file ({exc})") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{flag} {file}: refused: the pickle needs more than tensors and plain containers, "
                         f"and it is read only with torch.load(weights_only=True) so that no code in it runs "
                         f"({first}). Convert it to safetensors where you trust it") from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise ValueError(f"{flag} {file}: unreadable PyTorch file ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{flag} {file}: expected a flat dict of tensors (a state dict), got "
                         f"{type(state).__name__}" + (" with non-tensor values" if isinstance(state, dict) else ""))
    return dict(state), "pytorch (weights_only)"


def normalise_keys(stored: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str, list[str]]:
    """``(tensors under export names, layout name, dropped keys)``: strips a ``model.`` prefix, maps ``layers.0.``
    to ``midlayer.`` and drops the target embedding. Raises ValueError when both layer prefixes occur, or when one
    key maps to a name another key already has."""
    prefixed = any(k.startswith("model.") for k in stored)
    layers = {p for k in stored for p in LAYER_PREFIXES if k.removeprefix("model.").startswith(p)}
    if len(layers) > 1:
        raise ValueError(f"draft keys mix the layer prefixes {sorted(layers)}; expected one of them")
    out, dropped = {}, []
    for key, tensor in stored.items():
        name = key.removeprefix("model.")
        for prefix, ours in LAYER_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
        if name in IGNORED_KEYS:
            dropped.append(key)
            continue
        if name in out:
            raise ValueError(f"draft keys: '{key}' maps to '{name}', which another key already gave")
        out[name] = tensor
    layout = (next(iter(layers)).rstrip(".") if layers else "no layer keys") + (" +model. prefix" if prefixed else "")
    return out, layout, dropped


def complete_vocab_map(tensors: dict[str, torch.Tensor], vocab_size: int | None) -> None:
    """Add the missing half of the vocabulary map in place: ``t2d`` [V] from ``d2t`` (True at ``i + d2t[i]``;
    ``vocab_size`` V from the config), or ``d2t`` from ``t2d``; both absent means the draft scores the whole
    vocabulary (identity map, Vd = V, from lm_head's rows). Casts ``d2t`` to int64 and ``t2d`` to bool. Raises
    ValueError when ``t2d`` is missing and V is unknown, or when both are missing and lm_head is not V rows."""
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
    if "t2d" in tensors:
        tensors["t2d"] = tensors["t2d"].to(torch.bool)
    if "d2t" in tensors and "t2d" not in tensors:
        if vocab_size is None:
            raise ValueError("the draft has d2t but no t2d, and no config.json vocab_size to size t2d with")
        ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"the draft's d2t names target ids outside the vocabulary of {vocab_size}")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    elif "t2d" in tensors and "d2t" not in tensors:
        ids = torch.nonzero(tensors["t2d"]).flatten()
        tensors["d2t"] = ids - torch.arange(len(ids))
    elif "d2t" not in tensors and "lm_head.weight" in tensors:
        rows = tensors["lm_head.weight"].shape[0]
        if vocab_size is not None and rows != vocab_size:
            raise ValueError(f"the draft has neither d2t nor t2d, and its lm_head scores {rows} tokens, not the "
                             f"whole vocabulary of {vocab_size}: its vocabulary map is missing")
        tensors["d2t"] = torch.zeros(rows, dtype=torch.int64)
        tensors["t2d"] = torch.ones(rows, dtype=torch.bool)


def load_draft(path: Path, vocab_size: int | None = None, flag: str = "--init-draft") -> ImportedDraft:
    """Read the draft at ``path`` (module docstring) into an :class:`ImportedDraft` whose tensors carry the export
    names, with the vocabulary map completed (:func:`complete_vocab_map`; V from its config.json, else
    ``vocab_size``, the target's). Key names and shapes are not checked here (``recipe.train.init_draft`` checks them
    against the run). Raises ValueError naming ``flag`` (the option that named the draft) and the path or file."""
    path = Path(path)
    weights, config_file = find_files(path, flag)
    config = {}
    if config_file is not None:
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {config_file}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{flag} {config_file}: expected a JSON object")
    stored, file_format = read_weights(weights, flag)
    try:
        tensors, layout, dropped = normalise_keys(stored)
        vocab = config.get("vocab_size", vocab_size)
        complete_vocab_map(tensors, int(vocab) if vocab is not None else None)
    except ValueError as exc:
        raise ValueError(f"{flag} {weights}: {exc}") from None
    return ImportedDraft(path=path, weights=weights, tensors=tensors, config=config, sha256=file_sha256(weights),
                         layout=layout, file_format=file_format, dropped=dropped)
