"""Offline store of target hidden states: sharded safetensors plus a JSON index (bf16, sharded, indexed: why in
docs/algorithm.md, "Offline hidden-state store").

Layout of a store folder::

    index.json                              the merged index (written last, atomically, by rank 0)
    shard-r{rank:03d}-{n:05d}.safetensors   many samples each; keys "{sample_id}.{field}"
    progress-r{rank:03d}.json               each rank's finished shards (lets a re-run resume)

Per sample ``i`` of length ``S``: ``input_ids`` [S] int32, ``loss_mask`` [S] uint8, ``target_argmax`` [S] int32 (the
target's greedy token at each position, argmax of its logits over the full vocabulary, computed at dump time on the
target's device so training only looks it up in the vocabulary map), ``aux_hidden`` [S, 3·H_t] and ``last_hidden``
[S, H_t] in the store dtype (bf16 by default, or fp32). The writer lives in ``recipe.data.store_writer``; this module
holds the format and the reader.

Version 2 added ``target_argmax``. A version-1 store is refused with a message naming it and the command to re-dump
(there is no fallback: recomputing the argmax from the stored bf16 ``last_hidden`` would be the full-vocabulary
matmul per step that the field exists to avoid, and would not equal the target's own argmax).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

FORMAT = "eagle3-hidden-store"
VERSION = 2
INDEX_NAME = "index.json"
FIELDS = ("input_ids", "loss_mask", "target_argmax", "aux_hidden", "last_hidden")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SAFETENSORS_DTYPE = {"bf16": "BF16", "fp32": "F32"}


class StoreError(ValueError):
    """A store folder that is missing, malformed or does not match what the caller needs."""


@dataclass(frozen=True)
class StoreMeta:
    """What a store was made from; a re-run must match it to resume, a trainer must match it to use the store.

    target_path: where the target was loaded from (informative); target_fingerprint: ``TargetModel.fingerprint``
    (``recipe.target.capture.target_fingerprint``: config + weights; a store of an older version holds another
    kind, refused by :meth:`HiddenStateStore.check_compatible`);
    hidden_size: H_t; aux_layer_ids: captured decoder layers (aux width = len(ids)·H_t); dtype: "bf16" | "fp32";
    max_length: the examples' token limit; data_hash: ``examples_hash`` of the dataset; num_samples: its length.
    """

    target_path: str
    target_fingerprint: str
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    dtype: str
    max_length: int
    data_hash: str
    num_samples: int

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise StoreError(f"store dtype {self.dtype!r} not supported; choose one of {sorted(DTYPES)}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    def to_json(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StoreMeta":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def shard_name(rank: int, n: int) -> str:
    return f"shard-r{rank:03d}-{n:05d}.safetensors"


def progress_name(rank: int) -> str:
    return f"progress-r{rank:03d}.json"


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON to a temp file next to ``path``, then ``os.replace`` it (readers never see a partial)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def examples_hash(dataset) -> str:
    """16 hex chars of sha256 over every example's ``input_ids`` and ``loss_mask`` (as int64), in order."""
    h = hashlib.sha256()
    for start in range(0, len(dataset), 1024):
        batch = dataset[start:start + 1024]
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            h.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
            h.update(b"|")
            h.update(torch.as_tensor(mask, dtype=torch.int64).numpy().tobytes())
            h.update(b";")
    return h.hexdigest()[:16]


def expected_shapes(meta: StoreMeta, length: int) -> dict[str, tuple[list[int], str]]:
    """Field → (shape, safetensors dtype name) of one sample of ``length`` tokens."""
    hidden = _SAFETENSORS_DTYPE[meta.dtype]
    return {"input_ids": ([length], "I32"), "loss_mask": ([length], "U8"), "target_argmax": ([length], "I32"),
            "aux_hidden": ([length, meta.aux_width], hidden), "last_hidden": ([length, meta.hidden_size], hidden)}


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted-or-not index tensor → list of (start, stop) contiguous runs in the given order."""
    idx = rows.tolist()
    runs, start = [], 0
    for j in range(1, len(idx) + 1):
        if j == len(idx) or idx[j] != idx[j - 1] + 1:
            runs.append((idx[start], idx[j - 1] + 1))
            start = j
    return runs


class HiddenStateStore:
    """Read-only view of a finished store folder.

    Raises StoreError if ``index.json`` is missing (dump not finished), unreadable, or of another format/version.
    """

    def __init__(self, path: str | Path, max_open_files: int = 8):
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            raise StoreError(f"{index_path}: no index; the store is missing or its dump has not finished "
                             "(re-run `python -m recipe.dump` to resume)")
        try:
            self.index = json.loads(index_path.read_text())
        except json.JSONDecodeError as err:
            raise StoreError(f"{index_path}: not valid JSON ({err})") from err
        if self.index.get("format") == FORMAT and self.index.get("version") == 1:
            raise StoreError(f"{index_path}: written by an older version of this recipe (store version 1, no "
                             f"'target_argmax' field; version {VERSION} stores the target's greedy token per position):"
                             " re-create it into a new folder: python -m "
                             f"recipe.dump --target {self.index.get('meta', {}).get('target_path', 'TARGET')} "
                             "--data CONVERSATIONS --output NEW_STORE")
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise StoreError(f"{index_path}: format {self.index.get('format')!r} version {self.index.get('version')!r}"
                             f", expected {FORMAT!r} version {VERSION}")
        self.meta = StoreMeta.from_json(self.index["meta"])
        self.shards = self.index["shards"]
        self._where: dict[int, tuple[int, int]] = {}
        for s, shard in enumerate(self.shards):
            for k, sample_id in enumerate(shard["sample_ids"]):
                self._where[int(sample_id)] = (s, k)
        self._open: dict[int, object] = {}
        self._max_open = max_open_files
        self._ids = list(range(self.meta.num_samples))  # view index -> stored sample id (see subset)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.meta.aux_layer_ids)

    @property
    def lengths(self) -> list[int]:
        """Token count of each sample of this view, in order."""
        by_id = {}
        for shard in self.shards:
            by_id.update(zip((int(i) for i in shard["sample_ids"]), (int(n) for n in shard["lengths"])))
        return [by_id[i] for i in self._ids]

    def subset(self, indices) -> "HiddenStateStore":
        """A view holding samples ``indices`` of this view, renumbered 0..len-1 (same files, no copy)."""
        view = copy.copy(self)
        view._ids = [self._ids[int(j)] for j in indices]
        view._open = {}
        return view

    def fingerprint(self) -> str:
        """16 hex chars of sha256 over the index (meta and shard list): identifies the stored content."""
        return hashlib.sha256(json.dumps(self.index, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def total_bytes(self) -> int:
        return sum(int(shard["bytes"]) for shard in self.shards)

    @property
    def bytes_per_token(self) -> float:
        """Bytes on disk (all shards, headers included) per stored token."""
        tokens = sum(sum(shard["lengths"]) for shard in self.shards)
        return self.total_bytes / max(tokens, 1)

    def _handle(self, s: int):
        if s not in self._open:
            if len(self._open) >= self._max_open:
                self._open.pop(next(iter(self._open)))
            self._open[s] = safe_open(self.path / self.shards[s]["file"], framework="pt")
        return self._open[s]

    def get(self, i: int, rows: slice | torch.Tensor | list[int] | None = None,
            fields: tuple[str, ...] = FIELDS) -> dict[str, torch.Tensor]:
        """Sample ``i`` of this view: ``input_ids`` [R] int64, ``loss_mask`` [R] int64 (0/1), ``target_argmax`` [R]
        int64, ``aux_hidden`` [R, A] and ``last_hidden`` [R, H_t] in the store dtype, where R is the full length or
        the positions ``rows`` selects; only the ``fields`` asked for are read.

        ``rows`` (a slice with step 1, or an index tensor/list) is read with ``get_slice``, one read per contiguous
        run, so a context-parallel rank reads only its chunks from disk. Raises IndexError for an unknown index,
        ValueError for an unknown field.
        """
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} not in store {self.path} ({len(self)} samples)")
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown store fields {sorted(unknown)}; known: {list(FIELDS)}")
        i = self._ids[i]
        s, _ = self._where[i]
        f = self._handle(s)
        if rows is None:
            runs = None
        elif isinstance(rows, slice):
            if rows.step not in (None, 1):
                raise ValueError(f"rows slice step must be 1, got {rows.step}")
            runs = [rows]
        else:
            rows = torch.as_tensor(rows, dtype=torch.int64)
            runs = [slice(a, b) for a, b in _runs(rows)] if rows.numel() else [slice(0, 0)]
        out = {}
        for field in fields:
            key = f"{i}.{field}"
            if runs is None:
                t = f.get_tensor(key)
            else:
                part = f.get_slice(key)
                t = torch.cat([part[r] for r in runs]) if len(runs) > 1 else part[runs[0]]
            out[field] = t.long() if field in ("input_ids", "loss_mask", "target_argmax") else t
        return out

    def check_compatible(self, target, aux_layer_ids=None) -> None:
        """Raise StoreError if this store was dumped from another target or with other aux layer ids.

        target: a fingerprint string, a ``TargetModel``, or a target path (folder or ``.gguf``; fingerprinted with
        ``recipe.target.capture.target_fingerprint``: config + a sample of every weight tensor). aux_layer_ids: None
        skips that check. A store whose fingerprint is not of this version's kind (``is_weight_fingerprint``) was
        written by an older version of this recipe: StoreError naming its index file, to re-create it.
        """
        # lazy: recipe.target.capture imports transformers, which reading a store does not need
        from recipe.target.capture import is_weight_fingerprint, target_fingerprint

        if not is_weight_fingerprint(self.meta.target_fingerprint):
            raise StoreError(f"{self.path / INDEX_NAME}: written by an older version of this recipe (target "
                             f"fingerprint {self.meta.target_fingerprint!r} of another kind): re-create it with "
                             "`python -m recipe.dump` into a new folder")
        path = getattr(target, "path", None) if hasattr(target, "fingerprint") else target
        if isinstance(path, Path) or (isinstance(path, str) and os.path.exists(path)):
            current = target_fingerprint(path)
        else:
            current = target.fingerprint if hasattr(target, "fingerprint") else str(target)
        problems = []
        if current != self.meta.target_fingerprint:
            problems.append(f"target fingerprint {self.meta.target_fingerprint} (from {self.meta.target_path}) "
                            f"!= the current target's {current}")
        if aux_layer_ids is not None and [int(i) for i in aux_layer_ids] != list(self.meta.aux_layer_ids):
            problems.append(f"aux_layer_ids {list(self.meta.aux_layer_ids)} != requested {list(aux_layer_ids)}")
        if problems:
            raise StoreError(f"store {self.path} is incompatible: " + "; ".join(problems) + ". Re-dump it.")

    def validate(self, deep: bool = False) -> None:
        """Check the store against its index; raise StoreError listing every problem, each naming its shard file.

        Shallow: every sample id 0..N-1 appears exactly once, the shard count matches, each shard file exists with
        the indexed byte size, and its header lists exactly the expected keys with the expected shapes and dtypes.
        ``deep=True`` also reads every tensor: hidden states finite, loss mask in {0, 1}, token ids >= 0.
        """
        problems = []
        if self.index.get("num_shards") != len(self.shards):
            problems.append(f"index lists {len(self.shards)} shards, expected "
                            f"num_shards={self.index.get('num_shards')}")
        seen = [int(i) for shard in self.shards for i in shard["sample_ids"]]
        if sorted(seen) != list(range(len(self))):
            problems.append(f"shards hold {len(seen)} sample ids ({len(set(seen))} distinct), expected each of "
                            f"0..{len(self) - 1} exactly once")
        for shard in self.shards:
            problems += [f"{shard['file']}: {p}" for p in self._check_shard(shard, deep)]
        if problems:
            raise StoreError(f"store {self.path} failed validation:\n  " + "\n  ".join(problems))

    def _check_shard(self, shard: dict, deep: bool) -> list[str]:
        path = self.path / shard["file"]
        if not path.is_file():
            return ["missing file"]
        size = path.stat().st_size
        if size != shard["bytes"]:
            return [f"size {size} bytes != indexed {shard['bytes']} (truncated or overwritten)"]
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                expected, problems = set(), []
                for sample_id, length in zip(shard["sample_ids"], shard["lengths"]):
                    for field, (shape, dtype) in expected_shapes(self.meta, int(length)).items():
                        key = f"{sample_id}.{field}"
                        expected.add(key)
                        if key not in keys:
                            problems.append(f"missing key {key}")
                            continue
                        part = f.get_slice(key)
                        if list(part.get_shape()) != shape or part.get_dtype() != dtype:
                            problems.append(f"key {key} has shape {list(part.get_shape())} {part.get_dtype()}, "
                                            f"expected {shape} {dtype}")
                        elif deep:
                            problems += _check_values(key, field, f.get_tensor(key))
                problems += [f"unexpected key {k}" for k in sorted(keys - expected)]
                return problems
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
            return [f"unreadable safetensors file ({type(err).__name__}: {err})"]


def _check_values(key: str, field: str, t: torch.Tensor) -> list[str]:
    if field in ("aux_hidden", "last_hidden") and not torch.isfinite(t).all():
        return [f"key {key} has non-finite values"]
    if field == "loss_mask" and t.numel() and int(t.max()) > 1:
        return [f"key {key} has loss-mask values outside {{0, 1}}"]
    if field in ("input_ids", "target_argmax") and t.numel() and int(t.min()) < 0:
        return [f"key {key} has negative token ids"]
    return []
