"""The files of a target: a Hugging Face folder or a ``*.gguf`` file, its weight files and the safetensors file that
holds each tensor. One listing for the target's head (``recipe.target.head``: two tensors read by name) and its
weight fingerprint (``recipe.target.capture.target_fingerprint``: every weight file sampled).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from recipe.target.named import missing_target_message

RAW_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
"""Weight files other than safetensors: read by transformers, sampled as raw bytes by the fingerprint."""


def split_gguf(path: str | Path) -> tuple[str, dict]:
    """A ``*.gguf`` file path becomes ``(folder, {"gguf_file": name})``; a folder stays as it is. Raises
    FileNotFoundError naming the path when it does not exist (for the public name of a shipped config, where its
    weights come from: ``recipe.target.named.missing_target_message``)."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if not path.is_dir():
        raise FileNotFoundError(missing_target_message(path))
    return str(path), {}


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of one target (``folder``): its ``safetensors`` files (sorted), else its ``raw`` ones
    (``RAW_WEIGHT_SUFFIXES``, sorted; the GGUF file of a ``*.gguf`` target), and its ``config`` (config.json, None
    for a GGUF target or a folder without one)."""

    folder: Path
    safetensors: list[Path]
    raw: list[Path]
    config: Path | None

    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it: from ``model.safetensors.index.json`` when the folder has
        one, else from each file's header. Raises FileNotFoundError naming the folder when it has no safetensors
        files (the head is read from Hugging Face safetensors only)."""
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.folder / file for name, file in weight_map.items()}
        if not self.safetensors:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors or model.safetensors.index.json (target "
                                    "folders must be in Hugging Face safetensors format)")
        files = {}
        for file in self.safetensors:
            with safe_open(str(file), framework="pt") as f:
                files.update((name, file) for name in f.keys())
        return files


def weight_files(path: str | Path) -> WeightFiles:
    """The :class:`WeightFiles` of a target folder or ``*.gguf`` file. Raises FileNotFoundError naming the path
    when it does not exist or a folder holds no weight files."""
    folder, kwargs = split_gguf(path)
    folder = Path(folder)
    if kwargs:
        return WeightFiles(folder, [], [folder / kwargs["gguf_file"]], None)
    safetensors = sorted(folder.glob("*.safetensors"))
    raw = [] if safetensors else sorted(p for p in folder.iterdir() if p.suffix in RAW_WEIGHT_SUFFIXES)
    if not safetensors and not raw:
        kinds = ", ".join(f"*{suffix}" for suffix in (".safetensors", *RAW_WEIGHT_SUFFIXES))
        raise FileNotFoundError(f"target folder {folder} holds no weight files ({kinds})")
    config = folder / "config.json"
    return WeightFiles(folder, safetensors, raw, config if config.is_file() else None)
