"""Positions: the draft takes the target's RoPE and ``max_position_embeddings`` and the export keeps them, for
Llama-3.1's ``llama3`` scaling and Qwen's YaRN (the draft's rotary embedding then equals the target's: same inverse
frequencies and attention factor, same cos/sin at positions up to the serving context); the run plan's longest
sample against that context, and its warning."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from recipe.model.draft_config import Eagle3DraftConfig
from recipe.target.registry import draft_config_for
from recipe.train.positions import FAR_SHORTER, longest_sample, position_lines, position_plan

LLAMA31 = Path(__file__).parent / "data" / "llama-3.1-8b-instruct" / "config.json"
QWEN3_YARN = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
POSITIONS = torch.tensor([[0, 1, 4095, 8191, 32767, 65536, 131071]])


def _cases():
    llama = LlamaConfig(**json.loads(LLAMA31.read_text()))
    qwen = Qwen3Config(**QWEN3_YARN)
    return [("llama3", llama, LlamaRotaryEmbedding(llama), 8.0),
            ("yarn", qwen, Qwen3RotaryEmbedding(qwen), 4.0)]


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_draft_rotates_with_the_targets_rope_and_the_export_keeps_it(kind):
    name, target, target_rope, factor = next(c for c in _cases() if c[0] == kind)
    config = draft_config_for(target, 32000)
    assert config.max_position_embeddings == 131072
    assert config.rope_scaling["rope_type"] == kind and config.rope_scaling["factor"] == factor
    exported = config.to_hf_dict()
    assert exported["max_position_embeddings"] == 131072 and exported["rope_scaling"] == config.rope_scaling
    assert exported["rope_theta"] == target.rope_parameters["rope_theta"]
    back = Eagle3DraftConfig.from_hf_dict(exported)  # what recipe.eval and an --init-draft of the export read
    assert (back.rope_theta, back.rope_scaling, back.max_position_embeddings) == \
        (config.rope_theta, config.rope_scaling, config.max_position_embeddings)
    draft_rope = LlamaRotaryEmbedding(back.to_llama_config())  # the module Eagle3Draft rotates with
    assert torch.equal(draft_rope.inv_freq, target_rope.inv_freq)
    assert draft_rope.attention_scaling == pytest.approx(target_rope.attention_scaling, abs=0)
    if kind == "yarn":
        assert draft_rope.attention_scaling > 1.1  # YaRN's attention factor 0.1·ln(4) + 1 is carried, not dropped
    x = torch.zeros(1, 1, 128)
    for a, b in zip(draft_rope(x, POSITIONS), target_rope(x, POSITIONS)):
        assert torch.equal(a, b)


def test_plan_states_the_longest_sample_and_warns_when_far_shorter():
    llama = draft_config_for(LlamaConfig(**json.loads(LLAMA31.read_text())), 32000)
    short = position_plan(2048, llama)
    assert short["far_shorter"] and short["longest_sample_tokens"] == 2048
    lines = position_lines(short)
    assert lines[0].startswith("positions: longest training sample 2,048 tokens; the target serves up to "
                               "max_position_embeddings 131,072 (rope_theta 500000, llama3 scaling factor 8.0)")
    assert len(lines) == 2 and "far shorter than the context the target serves (131,072)" in lines[1]
    long = position_plan(131072 // FAR_SHORTER, llama)  # 32k on a 128k target: no warning
    assert not long["far_shorter"] and len(position_lines(long)) == 1
    assert position_plan(131072 // FAR_SHORTER - 1, llama)["far_shorter"]


def test_longest_sample_online_and_offline(tiny_target_and_store):
    from types import SimpleNamespace

    from datasets import Dataset

    from recipe.data.store import HiddenStateStore

    rows = Dataset.from_dict({"input_ids": [[1] * 5, [1] * 17, [2] * 9]}).select([0, 2])  # a held-out split's view
    assert longest_sample(SimpleNamespace(store=None, examples=rows)) == 9
    store = HiddenStateStore(tiny_target_and_store[1])
    assert longest_sample(SimpleNamespace(store=store, examples=None)) == max(store.lengths) > 0
    sub = store.subset([0])
    assert longest_sample(SimpleNamespace(store=sub, examples=None)) == store.lengths[0]
