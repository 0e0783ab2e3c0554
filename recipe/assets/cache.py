"""Build-once cache entries with a manifest: atomic writes, and cheap checks that catch half-written outputs.

An entry is one output (a file or a folder) plus ``<name>.manifest.json`` next to it, written last. The manifest
records the source file's size and mtime (ns), the per-entry counts, and every output file's size and sha256.
``check_entry`` trusts an entry only when the manifest parses, the source is unchanged, every output file has its
recorded size, each ``*.safetensors`` header parses with the recorded tensor count and each ``*.jsonl`` ends with
a newline. That costs a few ``stat`` calls and one header read; ``deep=True`` also re-hashes every output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

# Bump when the layout or content of any entry changes: every cached entry is then rebuilt.
MANIFEST_VERSION = 2
_HASH_CHUNK_BYTES = 1 << 22


def manifest_path(output: Path) -> Path:
    """``<dir>/<name>.manifest.json`` for the output ``<dir>/<name>``."""
    return output.with_name(output.name + ".manifest.json")


def source_fingerprint(source: Path) -> dict:
    """Identity of a source file without reading it: ``{"path", "size" (bytes), "mtime_ns"}``."""
    stat = source.stat()
    return {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _output_files(output: Path) -> dict[str, Path]:
    """Relative name → path of every file of an output (the file itself, or a folder's files, recursively)."""
    if output.is_file():
        return {output.name: output}
    return {str(p.relative_to(output)): p for p in sorted(output.rglob("*")) if p.is_file()}


def _safetensors_tensor_count(path: Path) -> int:
    """Number of tensors in a safetensors file; parsing the header raises on a corrupt or truncated file."""
    with safe_open(str(path), framework="numpy") as handle:  # header only; "pt" would import torch
        return len(list(handle.keys()))


def describe_outputs(output: Path) -> dict[str, dict]:
    """Per output file: ``size`` (bytes), ``sha256``, and ``tensors`` for safetensors files."""
    records = {}
    for name, path in _output_files(output).items():
        record = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if path.suffix == ".safetensors":
            record["tensors"] = _safetensors_tensor_count(path)
        records[name] = record
    return records


def write_manifest(output: Path, source: Path, counts: dict, build_seconds: float) -> dict:
    """Describe ``output`` and write its manifest atomically (temp file + rename). Returns the manifest."""
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "source": source_fingerprint(source),
        "counts": counts,
        "outputs": describe_outputs(output),
        "build_seconds": round(build_seconds, 3),
    }
    path = manifest_path(output)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return manifest


def _file_problem(name: str, path: Path, record: dict, deep: bool) -> str | None:
    """Why one output file does not match its manifest record, or None."""
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != record.get("size"):
        return f"{name}: {size} bytes on disk, manifest says {record.get('size')}"
    if path.suffix == ".safetensors":
        try:
            tensors = _safetensors_tensor_count(path)
        except Exception as error:  # safetensors raises its own SafetensorError on a bad header
            return f"{name}: safetensors header does not parse ({error})"
        if tensors != record.get("tensors"):
            return f"{name}: {tensors} tensors, manifest says {record.get('tensors')}"
    if path.suffix == ".jsonl" and size > 0:
        with open(path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                return f"{name}: last line is incomplete (no final newline)"
    if deep and sha256_file(path) != record.get("sha256"):
        return f"{name}: sha256 differs from the manifest"
    return None


def check_entry(output: Path, source: Path, deep: bool = False) -> tuple[dict | None, str]:
    """Validate a cache entry against its manifest.

    Returns ``(manifest, "")`` when the entry can be used, else ``(None, reason)`` with a one-line reason
    (manifest missing or unreadable, source changed, an output file missing, resized or corrupt).
    """
    path = manifest_path(output)
    if not path.is_file():
        return None, "no manifest (not built yet, or interrupted)"
    try:
        manifest = json.loads(path.read_text())
        outputs = manifest["outputs"]
    except (ValueError, KeyError, TypeError) as error:
        return None, f"{path.name} unreadable ({error})"
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        return None, f"manifest version {manifest.get('manifest_version')} != {MANIFEST_VERSION}"
    if manifest.get("source") != source_fingerprint(source):
        return None, f"source {source} changed since the build"
    if not outputs:
        return None, "manifest lists no output files"
    root = output if output.is_dir() else output.parent
    for name, record in outputs.items():
        problem = _file_problem(name, root / name, record, deep)
        if problem:
            return None, problem
    return manifest, ""


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def build_entry(output: Path, source: Path, build: Callable[[Path], dict]) -> dict:
    """(Re)build one entry atomically and return its manifest.

    ``build(tmp_path)`` writes the output at ``tmp_path`` (a file or a folder, in the same directory as
    ``output``) and returns the counts to record. The old manifest is removed first, the finished output is
    renamed into place, and the manifest is written last, so an interrupted build is never taken as valid.
    The caller must hold the cache lock.
    """
    for stale in output.parent.glob(f".{output.name}.tmp-*"):
        _remove(stale)  # left by a build that was killed
    _remove(manifest_path(output))
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    start = time.perf_counter()
    counts = build(tmp)
    if output.exists() or output.is_symlink():
        old = output.with_name(f".{output.name}.tmp-{os.getpid()}-old")
        os.replace(output, old)
        os.replace(tmp, output)
        _remove(old)
    else:
        os.replace(tmp, output)
    return write_manifest(output, source, counts, time.perf_counter() - start)
