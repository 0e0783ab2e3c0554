"""The shipped public configs (``recipe.target.named``) and the random-weight target builder
(``recipe.target.random_target``): the configs' values (RoPE scaling and max positions included) as the draft reads
them, the names the planner and run.py take, a scaled-down target written as sharded safetensors that loads like any
target folder, and (slow) one that trains 2 steps through run.py's ``--target`` with the shipped SmolLM2 tokenizer."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from helpers.training import ROOT, write_ds_config
from recipe.plan import PlanError, _read_target_config
from recipe.target.capture import TargetModel, target_fingerprint
from recipe.target.files import split_gguf, weight_files
from recipe.target.named import CONFIG_DIR, missing_target_message, resolve_config, shipped_config, shipped_names
from recipe.target.random_target import MARKER, build_random_target, parse_override, target_config
from recipe.target.registry import draft_config_for

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}


def test_every_shipped_name_has_a_config_and_nothing_else_ships():
    assert shipped_names() == ["Llama-3.1-8B-Instruct", "Llama-3.3-70B-Instruct", "Qwen3-8B"]
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.json")) == shipped_names()
    # the test suite's 8B shape is the shipped Llama-3.1 config
    shipped = json.loads((CONFIG_DIR / "Llama-3.1-8B-Instruct.json").read_text())
    assert shipped == json.loads((ROOT / "tests" / "data" / "llama-3.1-8b-instruct" / "config.json").read_text())


@pytest.mark.parametrize("name", ["Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct"])
def test_names_resolve_with_or_without_the_org_prefix(name):
    assert shipped_config(name) == CONFIG_DIR / "Llama-3.1-8B-Instruct.json" == resolve_config(name)
    assert shipped_config("meta-llama/Llama-3.1-8B") is None and shipped_config("Qwen/Qwen3-8B").stem == "Qwen3-8B"


@pytest.mark.parametrize("arch, layers, hidden, inter, heads, kv, vocab, theta, rope, max_pos", [
    ("Llama-3.1-8B-Instruct", 32, 4096, 14336, 32, 8, 128256, 500000.0, LLAMA31_ROPE, 131072),
    ("Qwen3-8B", 36, 4096, 12288, 32, 8, 151936, 1e6, None, 40960),
    ("Llama-3.3-70B-Instruct", 80, 8192, 28672, 64, 8, 128256, 500000.0, LLAMA31_ROPE, 131072),
])
def test_shipped_config_values_as_the_draft_reads_them(arch, layers, hidden, inter, heads, kv, vocab, theta, rope,
                                                       max_pos):
    config = target_config(arch)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == \
        (layers, hidden, inter, vocab)
    draft = draft_config_for(config, 32000)
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (heads, kv, 128)
    assert draft.rope_theta == theta and draft.max_position_embeddings == max_pos
    assert draft.rope_scaling == rope
    # --layers keeps everything else, RoPE and max positions included
    fewer = draft_config_for(target_config(arch, layers=8), 32000)
    assert (fewer.rope_theta, fewer.rope_scaling, fewer.max_position_embeddings) == \
        (draft.rope_theta, draft.rope_scaling, draft.max_position_embeddings)
    assert target_config(arch, layers=8).num_hidden_layers == 8


def test_bad_overrides_and_layers_are_named():
    assert parse_override("hidden_size=64") == ("hidden_size", 64)
    assert parse_override("rope_scaling=null") == ("rope_scaling", None)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_override("hidden_size")
    with pytest.raises(ValueError, match="--set hiden_size: not a field"):
        target_config("Qwen3-8B", overrides={"hiden_size": 64})
    with pytest.raises(ValueError, match="--layers 0"):
        target_config("Qwen3-8B", layers=0)
    with pytest.raises(FileNotFoundError, match="nor a shipped config"):
        target_config("Mistral-7B")


def test_planner_reads_a_shipped_name_and_refuses_an_unknown_one():
    config = _read_target_config("meta-llama/Llama-3.3-70B-Instruct")
    assert config.hidden_size == 8192 and config.num_hidden_layers == 80
    with pytest.raises(PlanError, match="--target Foo-7B: no such folder.*shipped config"):
        _read_target_config("Foo-7B")


def test_a_name_that_is_no_folder_tells_run_py_where_weights_come_from():
    with pytest.raises(FileNotFoundError) as exc:
        split_gguf("Llama-3.1-8B-Instruct")
    text = str(exc.value)
    assert "target folder not found: Llama-3.1-8B-Instruct" in text and "hf download meta-llama/" in text
    assert "python -m recipe.plan --target Llama-3.1-8B-Instruct" in text and "recipe.target.random_target" in text
    assert "shipped config" not in missing_target_message("some/other-model")


def test_scaled_down_target_is_sharded_safetensors_that_load_as_a_target(tmp_path):
    out = tmp_path / "target"
    record = build_random_target("Llama-3.1-8B-Instruct", out, None, layers=8, overrides=SMALL, dtype=torch.float32,
                                 max_shard_size="8MB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (out / "model.safetensors.index.json").is_file()
    assert record["bytes"] == sum(p.stat().st_size for p in shards) and record["layers"] == 8
    assert json.loads((out / MARKER).read_text())["note"].startswith("random weights")
    files = weight_files(out)
    assert set(files.tensor_files().values()) == set(shards)  # every tensor found through the index
    target = TargetModel(out, device="cpu")
    draft = draft_config_for(target.config, 512)
    assert draft.max_position_embeddings == 131072 and draft.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, 128256, (1, 12))
    captured = target.capture(ids)
    assert captured.aux_hidden_BSA.shape == (1, 12, 3 * 64) and captured.argmax_BS.shape == (1, 12)
    # the same seed draws the same weights; another seed others
    again = build_random_target("Llama-3.1-8B-Instruct", tmp_path / "again", None, layers=8, overrides=SMALL,
                                dtype=torch.float32, max_shard_size="8MB")
    other = build_random_target("Llama-3.1-8B-Instruct", tmp_path / "other", None, layers=8, overrides=SMALL,
                                dtype=torch.float32, seed=1)
    assert again["parameters"] == record["parameters"]
    assert target_fingerprint(tmp_path / "again") == target_fingerprint(out) != target_fingerprint(tmp_path / "other")
    with pytest.raises(FileExistsError, match="already holds a config.json"):
        build_random_target("Qwen3-8B", out, None, layers=1)
    assert other["seed"] == 1


@pytest.mark.slow  # the real SmolLM2 tokenizer (assets) and a run.py process
def test_a_scaled_down_target_with_the_shipped_tokenizer_trains_two_steps_through_run_py(tmp_path, assets):
    with pytest.raises(ValueError, match="more than the config's vocab_size 1000"):
        build_random_target("Qwen3-8B", tmp_path / "small_vocab", assets.target, layers=1,
                            overrides={**SMALL, "vocab_size": 1000})
    out = tmp_path / "target"
    record = build_random_target("Qwen3-8B", out, assets.target, layers=8, overrides=SMALL, max_shard_size="8MB")
    assert record["replaced_token_ids"]["eos_token_id"] == 151645 and (out / "chat_template.jinja").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 40960 and config["vocab_size"] == 151936
    ds = write_ds_config(tmp_path / "ds.json", "zero1.json", train_batch_size=2, train_micro_batch_size_per_gpu=2)
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "run.py", "--ds_config", str(ds), "--target", str(out), "--data",
                           str(assets.conversations), "--output", str(tmp_path / "run"), "--max-length", "128",
                           "--limit", "8", "--max-steps", "2", "--ttt-steps", "2", "--draft-vocab-size", "32000",
                           "--no-export"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    # the random target's greedy token falls in the draft vocabulary at about Vd / V of the positions: some do
    assert sum(r["valid"][0] for r in records) > 0 and records[1]["loss"] > 0
