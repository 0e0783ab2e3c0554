"""Every rank's RNG state in a checkpoint, without pickle (``rng-rankNNNNN.safetensors``).

The byte tensors of torch's CPU and CUDA generators and numpy's MT19937 key array are stored as safetensors tensors;
python's ``random`` state and numpy's scalars as JSON in the file's metadata (:func:`save_rng_file`); nothing is
ever unpickled (:func:`load_rng_file`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from recipe.io_errors import cause

RNG_FORMAT = "eagle3-recipe-rng"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.safetensors"


def save_rng_file(state: dict, path: Path) -> None:
    """Write an :func:`rng_state` dict without pickle: the byte tensors (``torch``, ``cuda.<i>``) and numpy's MT19937
    key array (``numpy.keys``, int64) as safetensors, python's ``random`` state and numpy's scalars as JSON in its
    metadata."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    tensors = {"torch": state["torch"].contiguous(), "numpy.keys": torch.from_numpy(np.asarray(keys, np.int64))}
    for i, t in enumerate(state.get("cuda", [])):
        tensors[f"cuda.{i}"] = t.contiguous()
    meta = {"format": RNG_FORMAT, "version": "1",
            "python": json.dumps([version, list(internal), gauss_next]),
            "numpy": json.dumps({"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                                 "cached_gaussian": float(cached)})}
    save_file(tensors, str(path), metadata=meta)


def _numpy_state(name, keys, pos, has_gauss, cached, file) -> tuple:
    keys = np.asarray(keys)
    if name != "MT19937" or keys.shape != (624,) or keys.min() < 0 or keys.max() >= 2 ** 32:
        raise ValueError(f"--resume: {file}: not a numpy MT19937 state")
    return name, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)


def load_rng_file(path: Path) -> dict:
    """The :func:`rng_state` dict of an RNG file (:func:`save_rng_file`); never unpickles anything.
    Raises ValueError naming the file when it is unreadable or not an RNG state.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != RNG_FORMAT:
            raise ValueError(f"metadata format {meta.get('format')!r}, expected {RNG_FORMAT!r}")
        version, internal, gauss_next = json.loads(meta["python"])
        npy = json.loads(meta["numpy"])
        state = {"python": (int(version), tuple(int(v) for v in internal), gauss_next),
                 "numpy": _numpy_state(npy["name"], tensors["numpy.keys"].numpy(), npy["pos"], npy["has_gauss"],
                                       npy["cached_gaussian"], path),
                 "torch": tensors["torch"]}
    except ValueError as exc:
        if str(exc).startswith("--resume:"):
            raise
        raise ValueError(f"--resume: {path}: not an RNG state file ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types (truncated, corrupt header)
        raise ValueError(f"--resume: {path}: unreadable RNG file ({cause(exc)})") from None
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda:
        state["cuda"] = [tensors[k] for k in cuda]
    return state
