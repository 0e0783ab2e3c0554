"""Packing end to end through ``run.py`` (docs/algorithm.md, "Packing"), fp32 on CPU gloo ranks: the same run with
``--packing`` and ``--no-packing`` gives the same curve (``helpers.training.assert_curves_close``: step 1 within
``FP32_REORDERED``, later steps ``FP32_CURVE``; token, sample and valid counts exactly):

- offline, ZeRO-1, one process, 8 steps of micro-batches of 4 real ShareGPT conversations (the SmolLM2 store);
- offline, ZeRO-3 over two data-parallel ranks with the sparse anchors (their packed micro-batches of different
  shapes: the call extents from the packed layouts), against the single-process padded run (the tiny target);
- online, cp 2 (the split target forward and the draft's ring over packed rows) against the online cp 1 run with
  ``--no-packing`` (the tiny target with a character tokenizer).

``run_config.json`` records the ``data`` section, the flag applied."""
from __future__ import annotations

import json

import pytest

from helpers.ranks import run_ranks
from helpers.tolerance import FP32_CURVE
from helpers.training import assert_curves_close, run_training, train_argv, write_ds_config

pytestmark = pytest.mark.slow  # DeepSpeed training runs


def _recorded(output) -> dict:
    return json.loads((output / "run_config.json").read_text())["data"]


def test_offline_curve_with_packing_equals_padded(real_store, tmp_path):
    store_dir, flags = real_store
    cfg = write_ds_config(tmp_path / "z1.json", base="zero1.json", train_batch_size=4,
                          train_micro_batch_size_per_gpu=4, scheduler=None)

    def argv(name, flag):
        return ["--ds_config", str(cfg), "--output", str(tmp_path / name), "--max-steps", "8", "--no-export",
                "--max-length", "128", flag, *flags]
    padded, packed = run_ranks(1, run_training, [argv("padded", "--no-packing"), argv("packed", "--packing")])[0]
    assert len(padded) == 8 and padded[-1]["loss"] < padded[0]["loss"]
    assert_curves_close(padded, packed, FP32_CURVE, "offline, packed vs padded")
    for a, b in zip(padded, packed):  # what was packed is in the metrics: one micro-batch a step, packed or not
        assert (a["micro_batches"], a["packed_micro_batches"], b["micro_batches"], b["packed_micro_batches"]) == (
            1, 0, 1, 1) and 0 <= b["padding_share"] <= a["padding_share"] < 1
    assert _recorded(tmp_path / "packed") == {"packing": True, "packing_tokens": None}
    assert _recorded(tmp_path / "padded")["packing"] is False


def _chats(path, count=16):
    """A JSONL of ``count`` ShareGPT-form conversations of random character text, 1 to 40 characters a turn."""
    import random

    rng = random.Random(3)
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFG.,!?"
    with open(path, "w") as f:
        for i in range(count):
            turns = [{"from": role, "value": "".join(rng.choice(chars) for _ in range(rng.randint(1, 40)))}
                     for role in ("human", "gpt") * rng.randint(1, 2)]
            f.write(json.dumps({"id": str(i), "conversations": turns}) + "\n")
    return path


def test_zero3_dp2_and_online_cp2_packed_equal_padded(tiny_target_and_store, chat_target, tmp_path):
    target, store = tiny_target_and_store
    z3 = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4,
                         train_micro_batch_size_per_gpu=2, scheduler=None, memory={"sparse_anchors": True})
    ref_cfg = write_ds_config(tmp_path / "ref.json", train_batch_size=4, train_micro_batch_size_per_gpu=4,
                              scheduler=None)
    online = write_ds_config(tmp_path / "online.json", train_batch_size=4, train_micro_batch_size_per_gpu=4,
                             scheduler=None)
    chats = _chats(tmp_path / "chats.jsonl")

    def online_argv(name, *extra):
        return ["--ds_config", str(online), "--target", str(chat_target), "--data", str(chats), "--output",
                str(tmp_path / name), "--max-length", "96", "--draft-vocab-size", "64", "--ttt-steps", "3",
                "--seed", "0", "--lm-head-init", "random", "--max-steps", "3", "--no-export", "--cache-dir",
                str(tmp_path / "cache"), *extra]
    ref_offline, ref_online = run_ranks(1, run_training, [
        train_argv(ref_cfg, target, store, tmp_path / "ref", "--max-steps", "3", "--no-packing"),
        online_argv("online_ref", "--no-packing")])[0]
    zero3, online_cp2 = run_ranks(2, run_training, [
        train_argv(z3, target, store, tmp_path / "z3", "--max-steps", "3", "--packing"),
        online_argv("online_cp2", "--packing", "--cp-size", "2")])[0]
    assert_curves_close(ref_offline, zero3, FP32_CURVE, "ZeRO-3 dp2 packed + sparse vs one process padded")
    assert_curves_close(ref_online, online_cp2, FP32_CURVE, "online cp2 packed vs cp1 padded")
    assert min(ref_online[0]["valid"]) > 0
    assert _recorded(tmp_path / "z3") == _recorded(tmp_path / "online_cp2") == {"packing": True, "packing_tokens": None}
    assert _recorded(tmp_path / "online_ref") == {"packing": False, "packing_tokens": None}
