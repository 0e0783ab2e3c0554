"""The integrity manifest of a checkpoint folder (``manifest.json``, written last by ``recipe.lifecycle.checkpoint``):
the size and sha256 of every file in it, DeepSpeed's per-rank files included, so that a resume can name a
truncated, emptied, missing or swapped file before anything of the checkpoint is loaded (:func:`verify`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from recipe.io_errors import cause

MANIFEST = "manifest.json"  # size and sha256 of every file of the checkpoint folder, written last
MANIFEST_FORMAT = "eagle3-recipe-checkpoint-manifest"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file (``hashlib.file_digest``: streamed, never the whole file in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_listing(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths, sorted), the manifest and temporary files excluded."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def manifest_dict(tag: str, files: dict[str, dict] | None = None, folder: Path | None = None) -> dict:
    """The ``manifest.json`` content of checkpoint ``tag``: ``files`` (name -> ``{"size", "sha256"}``), or, given
    ``folder`` instead, every file in it hashed here (one process)."""
    if files is None:
        files = {name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
                 for name in manifest_listing(folder)}
    return {"format": MANIFEST_FORMAT, "version": 1, "tag": tag, "algorithm": "sha256",
            "files": {name: files[name] for name in sorted(files)}}


def verify(path: Path) -> str | None:
    """Check checkpoint folder ``path`` against its ``manifest.json``: None when every listed file is there with
    its size and sha256, else what is wrong, naming the file (``rng-rank00001.safetensors: missing``,
    ``zero_pp_rank_0_mp_rank_00_optim_states.pt: size 123 != 4567``, ``...: sha256 differs``). Sizes are checked
    before any file is hashed. Raises FileNotFoundError when the folder has no manifest (see :func:`resolve`)."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not path.is_dir():
        return f"{path}: missing"
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{manifest_file}: missing")
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("algorithm") != "sha256" \
                or not isinstance(files, dict):
            return f"{MANIFEST}: not a checkpoint manifest"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST}: unreadable ({cause(exc)})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name}: missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name}: size {size} != {entry['size']}"
    for name, entry in files.items():
        try:
            digest = file_sha256(path / name)
        except OSError as exc:
            return f"{name}: unreadable ({cause(exc)})"
        if digest != entry["sha256"]:
            return f"{name}: sha256 {digest[:12]}… != {entry['sha256'][:12]}… (same size, other contents)"
    return None
