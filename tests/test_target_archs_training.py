"""A short online training run per supported target architecture (Llama, Qwen2, Qwen3, Mistral), with the
context-parallel target forward: tiny random targets (built locally, SmolLM2's tokenizer saved alongside so the
ShareGPT conversations tokenise) on 2 gloo ranks, the cp = 2 curve equal to the dp = 2 curve (the full-sequence
target forward on each rank) within rel ``FP32_CURVE`` (step 1: ``FP32_REORDERED``); an architecture outside the
allowlist stops the online cp = 2 run at start-up with a clear error.
"""
from __future__ import annotations

import pytest

from helpers.faults import Job, run_jobs
from helpers.ranks import run_ranks
from helpers.tiny_target import ARCHITECTURES, save_tiny_target
from helpers.training import assert_curves_close, run_training, write_ds_config
from helpers.tolerance import FP32_CURVE

pytestmark = pytest.mark.slow  # eight DeepSpeed runs on 2 ranks

STEPS = 2


@pytest.fixture(scope="module")
def curves(assets, tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("arch_training")
    tokenizer = AutoTokenizer.from_pretrained(assets.target)
    config = write_ds_config(tmp / "ds.json", train_batch_size=2, scheduler=None)
    argvs = {}
    for name in ARCHITECTURES:
        target = save_tiny_target(tmp / name, name, vocab=len(tokenizer))
        tokenizer.save_pretrained(target)

        def argv(run, *layout, target=target):
            # the full vocabulary as the draft's: a random target's argmax is rarely among a few frequent tokens
            return ["--ds_config", str(config), "--target", str(target), "--data", str(assets.conversations),
                    "--output", str(tmp / run), "--max-length", "256", "--limit", "12", "--draft-vocab-size",
                    str(len(tokenizer)), "--ttt-steps", "3", "--seed", "0", "--max-steps", str(STEPS),
                    "--lm-head-init", "random", "--cache-dir", str(tmp / "cache"), "--no-export", *layout]

        argvs[name] = [argv(f"{name}_dp2"), argv(f"{name}_cp2", "--cp-size", "2")]
    runs = run_ranks(2, run_training, [a for pair in argvs.values() for a in pair])[0]
    return {name: (runs[2 * i], runs[2 * i + 1]) for i, name in enumerate(argvs)}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_cp2_online_training_matches_dp2(curves, name):
    dp2, cp2 = curves[name]
    assert len(dp2) == STEPS and all(v > 0 for v in dp2[0]["valid"])
    assert_curves_close(dp2, cp2, FP32_CURVE, f"{name} online cp=2")


def test_online_cp2_refuses_an_unsupported_target(assets, tmp_path):
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(assets.target)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    argv = ["--ds_config", str(write_ds_config(tmp_path / "ds.json", train_batch_size=2)), "--target",
            str(tmp_path / "gemma2"), "--data", str(assets.conversations), "--output", str(tmp_path / "run"),
            "--max-length", "256", "--limit", "4", "--draft-vocab-size", "512", "--cp-size", "2",
            "--cache-dir", str(tmp_path / "cache")]
    (out,) = run_ranks(2, run_jobs, [Job(argv)])[0]
    assert out.rc == 2 and "Traceback" not in out.stderr, out.stderr
    assert "model_type 'gemma2'" in out.stderr and "python -m recipe.dump" in out.stderr, out.stderr
