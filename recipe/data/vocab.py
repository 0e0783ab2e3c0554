"""Draft vocabulary map (docs/algorithm.md, "Draft vocabulary (d2t / t2d)"): the Vd target tokens the draft's
``lm_head`` predicts.

Selection: count target token ids where ``loss_mask == 1``; keep the Vd most frequent, ties broken by the smaller id
(so when fewer than Vd distinct ids occur, the rest is filled with the smallest unused ids); sort the kept ids.
Encoding (EAGLE-3 / SGLang / vLLM convention): ``d2t[i] = draft_id_i − i`` (int64 [Vd], target id = i + d2t[i]) and
``t2d`` a bool mask [V] that is True on the kept ids. The map is saved with every checkpoint and must be reused on
resume: rebuilding it from other data silently misaligns ``lm_head``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def iter_token_arrays(dataset, batch_size: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(input_ids, loss_mask)`` as flat int64 numpy arrays, one pair per batch of examples."""
    for batch in dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow").iter(batch_size):
        ids = batch.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        mask = batch.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        yield ids.astype(np.int64, copy=False), mask.astype(np.int64, copy=False)


@dataclass(frozen=True)
class VocabMap:
    """``d2t`` [Vd] int64 offsets (target id = i + d2t[i]); ``t2d`` [V] bool, True on the Vd draft tokens."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __post_init__(self):
        _validate(self.d2t, self.t2d, "VocabMap")

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] int64 target ids of the draft tokens, strictly increasing: ``arange(Vd) + d2t``."""
        return torch.arange(len(self.d2t), dtype=torch.int64) + self.d2t

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    @property
    def target_vocab_size(self) -> int:
        return len(self.t2d)

    @classmethod
    def from_draft_ids(cls, draft_ids, target_vocab_size: int) -> "VocabMap":
        """Build from sorted target ids [Vd]."""
        ids = torch.as_tensor(np.asarray(draft_ids), dtype=torch.int64)
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(d2t=ids - torch.arange(len(ids), dtype=torch.int64), t2d=t2d)

    def save(self, path: str | Path) -> None:
        """Write ``{"d2t", "t2d"}`` to a safetensors file."""
        save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "VocabMap":
        """Read and validate a map written by :meth:`save` (or an exported draft's ``model.safetensors``).

        Raises:
            ValueError: naming the file, if it is unreadable, lacks d2t/t2d, or they are inconsistent.
        """
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as err:
            raise ValueError(f"{path}: cannot read vocabulary map: {err}") from None
        missing = {"d2t", "t2d"} - set(tensors)
        if missing:
            raise ValueError(f"{path}: vocabulary map lacks {sorted(missing)}")
        _validate(tensors["d2t"], tensors["t2d"], str(path))
        return cls(d2t=tensors["d2t"], t2d=tensors["t2d"])


def _validate(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"{where}: d2t must be a 1-D int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"{where}: t2d must be a 1-D bool tensor, got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(len(d2t), dtype=torch.int64) + d2t
    if len(ids) == 0 or len(ids) > len(t2d):
        raise ValueError(f"{where}: draft vocab size {len(ids)} must be in [1, target vocab size {len(t2d)}]")
    if ids.min() < 0 or ids.max() >= len(t2d) or (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError(f"{where}: draft ids (arange + d2t) must be strictly increasing within [0, {len(t2d)})")
    if not bool(t2d[ids].all()) or int(t2d.sum()) != len(ids):
        raise ValueError(f"{where}: t2d marks {int(t2d.sum())} ids but must mark exactly the {len(ids)} draft ids")


def supervised_token_counts(dataset, target_vocab_size: int) -> tuple[np.ndarray, str]:
    """Count supervised target ids: returns (counts [V] int64, sha256 hex of the token data).

    Raises:
        ValueError: a token id outside [0, target_vocab_size).
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    digest = hashlib.sha256()
    for ids, mask in iter_token_arrays(dataset):
        digest.update(ids.tobytes())
        digest.update(mask.tobytes())
        if len(ids) and (ids.min() < 0 or ids.max() >= target_vocab_size):
            raise ValueError(f"token id {int(ids.max())} outside the target vocabulary [0, {target_vocab_size})")
        counts += np.bincount(ids[mask == 1], minlength=target_vocab_size)
    return counts, digest.hexdigest()


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The ``draft_vocab_size`` most frequent ids (ties → smaller id), sorted by id: int64 [Vd]."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # last key is primary: count descending, then id
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def build_vocab_map(dataset, target_vocab_size: int, draft_vocab_size: int,
                    cache_dir: str | Path | None = None) -> VocabMap:
    """Build the draft vocabulary map from a dataset with ``input_ids`` / ``loss_mask`` columns.

    With ``cache_dir``, the map is stored as ``vocab_<hash>.safetensors`` where the hash covers the token data
    (input_ids and loss_mask contents), V and Vd — never the file path — and reused when present.

    Raises:
        ValueError: ``draft_vocab_size`` not in [1, target_vocab_size]; a token id outside the target vocabulary.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, target vocab size {target_vocab_size}]")
    counts, data_hash = supervised_token_counts(dataset, target_vocab_size)
    cache_file = None
    if cache_dir is not None:
        key = hashlib.sha256(f"{data_hash}|{target_vocab_size}|{draft_vocab_size}".encode()).hexdigest()[:32]
        cache_file = Path(cache_dir) / f"vocab_{key}.safetensors"
        if cache_file.is_file():
            return VocabMap.load(cache_file)
    vocab = VocabMap.from_draft_ids(select_draft_ids(counts, draft_vocab_size), target_vocab_size)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        vocab.save(tmp)
        tmp.replace(cache_file)
    return vocab


def vocab_stats(vocab: VocabMap, counts: np.ndarray) -> dict[str, float]:
    """Coverage figures: distinct supervised ids, draft ids never seen (filled), share of supervised tokens covered."""
    seen = counts > 0
    draft = vocab.draft_ids.numpy()
    total = int(counts.sum())
    return {
        "draft_vocab_size": vocab.draft_vocab_size,
        "distinct_supervised_ids": int(seen.sum()),
        "filled_unseen_ids": int((~seen[draft]).sum()),
        "supervised_tokens": total,
        "coverage": float(counts[draft].sum() / total) if total else 0.0,
    }


def target_argmax_coverage(samples, t2d: torch.Tensor) -> dict[str, float]:
    """How many of the target's greedy predictions of supervised tokens the draft vocabulary holds.

    ``samples``: iterable of ``(loss_mask [S], target_argmax [S])`` per sample (tensors or arrays of ints; the
    store's fields). The argmax at position q predicts token q+1, so the positions counted are those with
    ``loss_mask[q+1] == 1``. Returns ``{"predictions", "in_draft_vocab", "argmax_coverage"}`` (coverage = in / all,
    0.0 without predictions): 1 - coverage is the share of supervised positions that every accuracy over all
    supervised positions counts as a miss whatever the draft does.
    """
    t2d_np = t2d.numpy()
    total = inside = 0
    for mask, argmax in samples:
        mask, argmax = np.asarray(mask, dtype=np.int64), np.asarray(argmax, dtype=np.int64)
        predicted = argmax[:-1][mask[1:] == 1]
        total += len(predicted)
        inside += int(t2d_np[predicted].sum())
    return {"predictions": total, "in_draft_vocab": inside, "argmax_coverage": inside / total if total else 0.0}


def vocab_coverage_report(dataset, vocab: VocabMap, store=None) -> str:
    """One line for the run's log: the share of the supervised tokens of ``dataset`` (``input_ids``/``loss_mask``,
    the data trained on) the draft vocabulary covers and, with the offline ``store`` (a ``HiddenStateStore`` of
    the same samples), the share of the target's argmax tokens at supervised positions it covers."""
    stats = vocab_stats(vocab, supervised_token_counts(dataset, vocab.target_vocab_size)[0])
    line = (f"draft vocabulary: {stats['draft_vocab_size']} ids cover {stats['coverage']:.1%} of the "
            f"{stats['supervised_tokens']} supervised tokens ({stats['distinct_supervised_ids']} distinct ids, "
            f"{stats['filled_unseen_ids']} filled unseen)")
    if store is not None:
        fields = ("loss_mask", "target_argmax")
        cov = target_argmax_coverage(((s["loss_mask"], s["target_argmax"]) for s in
                                      (store.get(i, fields=fields) for i in range(len(store)))), vocab.t2d)
        line += (f"; {cov['argmax_coverage']:.1%} of the target's {cov['predictions']} argmax tokens at supervised "
                 "positions (out-of-vocabulary ones are misses in acc_all_supervised)")
    return line
