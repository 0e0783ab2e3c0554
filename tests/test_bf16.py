"""bf16 is real: the long-run configs carry the memory switches, bf16 ZeRO-3 training on 2 gloo ranks with the real
SmolLM2 target tracks the fp32 run, and ``python -m recipe.eval`` runs the bf16 draft it exports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.training import ROOT, run_training

STEPS = 6
MAX_LENGTH = 128


def test_long_run_configs_have_the_memory_switches():
    """Every shipped config a long run would use (bf16, or tp/cp > 1) sets all three memory switches."""
    long_run = []
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        parallel = cfg.get("parallelism", {})
        if (cfg.get("bf16") or {}).get("enabled") or parallel.get("tp_size", 1) > 1 or parallel.get("cp_size", 1) > 1:
            long_run.append(path.name)
            memory = cfg.get("memory") or {}
            assert isinstance(memory.get("loss_chunk_size"), int) and memory["loss_chunk_size"] > 0, path
            assert memory.get("checkpoint_ttt_steps") is True, path
            assert isinstance(memory.get("attention_tile_size"), int) and memory["attention_tile_size"] > 0, path
    assert {"zero0_bf16.json", "zero3_bf16.json", "zero3_tp2_cp2.json"} <= set(long_run)


def _config(path: Path, bf16: bool) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=1)  # 2 ranks × 2 micro-batches
    cfg["optimizer"]["params"]["lr"] = 1e-3
    cfg.pop("scheduler")  # constant lr: every step moves the weights
    if not bf16:
        cfg.pop("bf16")
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """fp32 and bf16 ZeRO-3 runs (2 ranks, same seed and data) on an fp32 store of 24 ShareGPT conversations dumped
    from the real target; returns (fp32 metrics, bf16 metrics, bf16 run folder)."""
    from recipe.data.examples import build_examples
    from recipe.dump import dump_hidden_states
    from recipe.model.target import TargetModel

    tmp = tmp_path_factory.mktemp("bf16")
    target = TargetModel(assets.target, dtype=torch.float32, device="cpu")
    examples, _ = build_examples(assets.conversations, target.load_tokenizer(), MAX_LENGTH, limit=24,
                                 cache_dir=str(tmp / "cache"))
    dump_hidden_states(target, examples, tmp / "store", max_length=MAX_LENGTH, dtype="fp32", batch_size=8)
    del target

    def argv(name, bf16):
        return ["--ds_config", str(_config(tmp / f"{name}.json", bf16)), "--target", str(assets.target),
                "--hidden-states", str(tmp / "store"), "--output", str(tmp / name), "--draft-vocab-size", "2048",
                "--ttt-steps", "3", "--seed", "0", "--epochs", "2", "--max-steps", str(STEPS),
                "--cache-dir", str(tmp / "cache")]

    fp32, bf16 = run_ranks(2, run_training, [argv("fp32", False), argv("bf16", True)])[0]
    return fp32, bf16, tmp / "bf16"


@pytest.mark.slow
def test_bf16_zero3_tracks_fp32_on_the_real_target(runs):
    """Tolerances from bf16's 8-bit significand (unit roundoff u = 2^-8 ≈ 3.9e-3).

    Step 1 runs the same weights: only the forward's rounding differs. Each bf16 matmul output carries a relative
    error of order u, so logits (|z| of a few units) and the fp32 soft cross-entropy built from them move by O(u) in
    relative terms: |Δloss| ≤ 2·u·loss. Later steps add the drift of updates computed from bf16 gradients (DeepSpeed
    keeps fp32 master weights, so updates themselves are not rounded away): allowed 4·u relative. Accuracy counts
    argmax agreements; an O(u) logit perturbation flips only near-ties, bounded here by 0.03 absolute (about 9 of
    the ~300 valid positions of a TTT step). Bit-level agreement would mean bf16 was not active, so the runs must differ.
    Measured (torch 2.13 CPU): relative loss difference 2.6e-5 at step 1, at most 8.3e-3 later (step 2, after the
    first Adam step, whose update is nearly lr·sign(g) and so sensitive to rounding); accuracy differences
    at most 0.0064.
    """
    fp32, bf16, _ = runs
    u = 2.0 ** -8
    assert len(fp32) == len(bf16) == STEPS
    assert fp32[-1]["loss"] < fp32[0]["loss"] and bf16[-1]["loss"] < bf16[0]["loss"]  # both learn
    for a, b in zip(fp32, bf16):
        rtol = 2 * u if a["step"] == 1 else 4 * u
        assert abs(b["loss"] - a["loss"]) <= rtol * a["loss"], (a["step"], a["loss"], b["loss"])
        assert max(abs(x - y) for x, y in zip(a["acc"], b["acc"])) <= 0.03, (a["step"], a["acc"], b["acc"])
        assert a["valid"] == b["valid"] and a["tokens"] == b["tokens"]
    assert any(a["loss"] != b["loss"] for a, b in zip(fp32, bf16))


@pytest.mark.slow
def test_eval_runs_the_bf16_draft(runs, assets, tmp_path):
    from safetensors import safe_open

    from recipe.eval import __main__ as cli

    export = runs[2] / "export"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16  # a bf16 run exports bf16
    out = tmp_path / "eval.json"
    assert cli.main(["--target", str(assets.target), "--draft", str(export), "--num-draft-tokens", "3",
                     "--max-new-tokens", "8", "--limit", "2", "--output", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["draft_dtypes"] == {str(export): "bfloat16"}  # run in the export's own dtype
    assert result["num_prompts"] == 2 and 1.0 <= result["tau"] <= 4.0
