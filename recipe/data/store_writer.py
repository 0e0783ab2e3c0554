"""Writing a hidden-state store (format: ``recipe.data.store``), one writer per rank, resumable.

Sample ``i`` belongs to rank ``i % world_size``. Each rank sorts its samples by length (longest first, ties by id)
and cuts them into shards of ``shard_size_samples``: the plan depends only on the lengths, so a re-run recomputes
the same shards and skips those its progress file lists as finished. Shards and progress files are written to a
temp name and renamed; rank 0 merges all progress files into ``index.json`` once every rank is done.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from recipe.data.store import (DTYPES, FORMAT, INDEX_NAME, VERSION, StoreError, StoreMeta, progress_name,
                               shard_name, write_json_atomic)


@dataclass(frozen=True)
class ShardPlan:
    """One shard of a rank: its number ``n`` and the sample ids it holds (longest first)."""

    n: int
    sample_ids: tuple[int, ...]


def shard_plan(lengths, rank: int, world_size: int, shard_size_samples: int) -> list[ShardPlan]:
    """The shards rank ``rank`` writes for a dataset whose sample ``i`` has ``lengths[i]`` tokens."""
    if shard_size_samples < 1:
        raise ValueError(f"shard_size_samples must be >= 1, got {shard_size_samples}")
    mine = sorted(range(rank, len(lengths), world_size), key=lambda i: (-int(lengths[i]), i))
    return [ShardPlan(n, tuple(mine[k:k + shard_size_samples]))
            for n, k in enumerate(range(0, len(mine), shard_size_samples))]


class StoreWriter:
    """Writes one rank's shards of a store folder and (rank 0) the merged index.

    Raises StoreError when the folder holds progress from a run with another ``meta``, world size or shard size
    (resuming it would mix incompatible samples); delete the folder or pass the same settings.
    """

    def __init__(self, out_dir: str | Path, meta: StoreMeta, rank: int = 0, world_size: int = 1,
                 shard_size_samples: int = 64):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.out_dir = Path(out_dir)
        self.meta, self.rank, self.world_size = meta, rank, world_size
        self.shard_size_samples = shard_size_samples
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._progress_path = self.out_dir / progress_name(rank)
        self._settings = {"meta": meta.to_json(), "world_size": world_size, "shard_size_samples": shard_size_samples}
        self.finished: dict[int, dict] = {}
        if self._progress_path.is_file():
            progress = json.loads(self._progress_path.read_text())
            if {k: progress.get(k) for k in self._settings} != self._settings:
                diff = [k for k in ("world_size", "shard_size_samples") if progress.get(k) != self._settings[k]]
                diff += [f"meta.{k}" for k, v in self._settings["meta"].items() if progress["meta"].get(k) != v]
                raise StoreError(f"{self._progress_path}: store was started with different settings ({', '.join(diff)}"
                                 "); use the same settings to resume or write to a new folder")
            self.finished = {int(n): info for n, info in progress["shards"].items()}

    def is_finished(self, n: int) -> bool:
        """True when shard ``n`` is in this rank's progress file and its file is on disk with the recorded size."""
        info = self.finished.get(n)
        if info is None:
            return False
        path = self.out_dir / info["file"]
        return path.is_file() and path.stat().st_size == info["bytes"]

    def write_shard(self, plan: ShardPlan, samples: dict[int, dict[str, torch.Tensor]]) -> dict:
        """Write shard ``plan.n`` holding ``samples[i]`` for each ``i`` in ``plan.sample_ids``; record it as finished.

        Each sample: ``input_ids`` [S] int, ``loss_mask`` [S] 0/1, ``target_argmax`` [S] int (the target's greedy
        token per position), ``aux_hidden`` [S, A], ``last_hidden`` [S, H_t] (any float dtype; cast to the store
        dtype). Raises StoreError for a missing sample or a wrong shape.
        Returns the shard's index entry: file, sample_ids, lengths, bytes.
        """
        dtype = DTYPES[self.meta.dtype]
        tensors, lengths = {}, []
        for i in plan.sample_ids:
            if i not in samples:
                raise StoreError(f"shard {plan.n} of rank {self.rank}: sample {i} not provided")
            s = samples[i]
            length = int(s["input_ids"].shape[0])
            want = {"aux_hidden": (length, self.meta.aux_width), "last_hidden": (length, self.meta.hidden_size)}
            for field, shape in want.items():
                if tuple(s[field].shape) != shape:
                    raise StoreError(f"sample {i}: {field} has shape {tuple(s[field].shape)}, expected {shape}")
            for field in ("loss_mask", "target_argmax"):
                if tuple(s[field].shape) != (length,):
                    raise StoreError(f"sample {i}: {field} has shape {tuple(s[field].shape)}, expected {(length,)}")
            tensors[f"{i}.input_ids"] = s["input_ids"].to("cpu", torch.int32).contiguous()
            tensors[f"{i}.loss_mask"] = s["loss_mask"].to("cpu", torch.uint8).contiguous()
            tensors[f"{i}.target_argmax"] = s["target_argmax"].to("cpu", torch.int32).contiguous()
            tensors[f"{i}.aux_hidden"] = s["aux_hidden"].to("cpu", dtype).contiguous()
            tensors[f"{i}.last_hidden"] = s["last_hidden"].to("cpu", dtype).contiguous()
            lengths.append(length)
        name = shard_name(self.rank, plan.n)
        tmp = self.out_dir / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(VERSION)})
        os.replace(tmp, self.out_dir / name)
        info = {"file": name, "sample_ids": list(plan.sample_ids), "lengths": lengths,
                "bytes": (self.out_dir / name).stat().st_size}
        self.finished[plan.n] = info
        write_json_atomic(self._progress_path, {**self._settings, "shards": {str(n): v for n, v in
                                                                            sorted(self.finished.items())}})
        return info

    def finalize(self, comm=None, group=None) -> Path | None:
        """Wait for all ranks (``comm.barrier(group)`` when world_size > 1; ``comm``: a
        ``recipe.parallel.collectives.Collectives``), then rank 0 merges every rank's progress into ``index.json``
        (atomic) and returns its path; other ranks return None.

        Raises ValueError when world_size > 1 and ``comm`` is None; StoreError (rank 0) when a rank's progress is
        missing or the shards don't hold every sample id ``0..num_samples-1`` exactly once.
        """
        if self.world_size > 1:
            if comm is None:
                raise ValueError(f"StoreWriter.finalize: world_size={self.world_size} needs comm for the barrier")
            comm.barrier(group)
        if self.rank != 0:
            return None
        shards = []
        for r in range(self.world_size):
            path = self.out_dir / progress_name(r)
            if not path.is_file():
                raise StoreError(f"{path}: missing; rank {r} did not finish its shards")
            progress = json.loads(path.read_text())
            shards += [progress["shards"][n] for n in sorted(progress["shards"], key=int)]
        ids = sorted(int(i) for s in shards for i in s["sample_ids"])
        if ids != list(range(self.meta.num_samples)):
            raise StoreError(f"{self.out_dir}: shards hold {len(ids)} sample ids ({len(set(ids))} distinct), expected "
                             f"each of 0..{self.meta.num_samples - 1} once; a rank has not finished")
        index = {"format": FORMAT, "version": VERSION, "meta": self.meta.to_json(), "world_size": self.world_size,
                 "num_shards": len(shards), "shards": shards}
        index_path = self.out_dir / INDEX_NAME
        write_json_atomic(index_path, index)
        return index_path
