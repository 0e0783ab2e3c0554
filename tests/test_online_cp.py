"""End to end, online (the target runs during training): the real SmolLM2 target on ShareGPT, fp32 on CPU gloo ranks.

The curve at cp = 2 (the context-parallel target forward, ``recipe.target.split``), at tp = 2 and at tp2 × cp2 (the
target forward split over the tp ranks too: each of the cp·tp ranks runs 1/(cp·tp) of the sequence) equals the online
cp = 1 curve (the full-sequence target forward) within rel ``helpers.tolerance.FP32_CURVE``: the same samples, the same
draft initialisation, only the sharding of the target and the draft differ. ``run_config.json`` records the split.
"""
from __future__ import annotations

import json

import pytest
from helpers.ranks import run_ranks
from helpers.training import assert_curves_close, run_training, write_ds_config
from helpers.tolerance import FP32_CURVE

pytestmark = pytest.mark.slow  # four DeepSpeed runs with the 135M target on 1, 2, 2 and 4 ranks

STEPS = 3


@pytest.fixture(scope="module")
def curves(assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("online_cp")
    config = write_ds_config(tmp / "ds.json", train_batch_size=2, scheduler=None)
    heads = tmp / "heads.json"  # SmolLM2's 9 heads / 3 KV heads do not split over tp = 2
    heads.write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')

    def argv(name, *layout):
        return ["--ds_config", str(config), "--target", str(assets.target), "--data", str(assets.conversations),
                "--output", str(tmp / name), "--max-length", "96", "--limit", "8", "--draft-vocab-size", "512",
                "--draft-config", str(heads), "--ttt-steps", "3", "--seed", "0", "--max-steps", str(STEPS),
                "--lm-head-init", "random", "--cache-dir", str(tmp / "cache"), "--no-export", *layout]

    ref = run_ranks(1, run_training, [argv("cp1")])[0][0]
    cp2, tp2 = run_ranks(2, run_training, [argv("cp2", "--cp-size", "2"), argv("tp2", "--tp-size", "2")])[0]
    tp2cp2 = run_ranks(4, run_training, [argv("tp2cp2", "--cp-size", "2", "--tp-size", "2")])[0][0]
    split = {name: json.loads((tmp / name / "run_config.json").read_text())["online_target"]["forward_split"]
             for name in ("cp1", "cp2", "tp2", "tp2cp2")}
    return ref, cp2, tp2, tp2cp2, split


def test_online_cp2_curve_equals_cp1(curves):
    ref, cp2, _, _, split = curves
    assert len(ref) == STEPS and ref[0]["valid"][0] > 0
    assert_curves_close(ref, cp2, FP32_CURVE, "online cp=2")
    assert split["cp1"] == 1 and split["cp2"] == 2


def test_online_tp2_curve_equals_cp1(curves):
    ref, _, tp2, _, split = curves
    assert split["tp2"] == 2  # the two tp ranks share the target forward
    assert_curves_close(ref, tp2, FP32_CURVE, "online tp=2 (target split over tp)")


def test_online_tp2_cp2_curve_equals_cp1(curves):
    ref, _, _, tp2cp2, split = curves
    assert split["tp2cp2"] == 4
    assert_curves_close(ref, tp2cp2, FP32_CURVE, "online tp2 x cp2 (target split over cp·tp)")
