"""Draft config (derivation, overrides, export round trip) and the draft module (names, init, loading, heads)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from kernels.ttt_attention import TTTKVCache
from recipe.export import export_tensors
from recipe.model.draft import EXPORT_EXCLUDED_KEYS, Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig, load_draft_config_overrides
from recipe.target.registry import draft_config_for

EXPORT_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def smollm2_config() -> LlamaConfig:
    """The SmolLM2-135M geometry (docs/environment.md, "Offline assets") as transformers builds it."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, max_position_embeddings=8192,
                       rope_theta=100000.0, tie_word_embeddings=True)


def tiny_config(**kw) -> Eagle3DraftConfig:
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=100, draft_vocab_size=40, target_hidden_size=24, aux_layer_ids=[1, 2, 4])
    base.update(kw)
    return Eagle3DraftConfig(**base)


# ------------------------------------------------------------------------------------------------------ config
def test_config_derived_from_smollm2():
    cfg = draft_config_for(smollm2_config(), draft_vocab_size=8192)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size) == (576, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.max_position_embeddings) == (49152, 8192, 8192)
    assert cfg.aux_layer_ids == [1, 14, 26]
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.hidden_act == "silu"


def test_config_overrides_apply_and_unknown_key_is_named():
    cfg = draft_config_for(
        smollm2_config(), 4096, {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 64, "aux_layer_ids": [2, 10, 20]})
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads) == (256, 576, 4)
    assert cfg.aux_layer_ids == [2, 10, 20] and cfg.draft_vocab_size == 4096
    with pytest.raises(ValueError, match="hiden_size"):
        draft_config_for(smollm2_config(), 4096, {"hiden_size": 256})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        draft_config_for(smollm2_config(), 4096, {"num_key_value_heads": 4})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_config_for(smollm2_config(), 50000)


def test_config_shallow_target_needs_explicit_aux_ids_and_old_style_rope_dict():
    shallow = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
               "vocab_size": 100, "rope_theta": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(ValueError, match="aux_layer_ids"):
        draft_config_for(shallow, 40)
    cfg = draft_config_for(shallow, 40, {"aux_layer_ids": [0, 1, 3]})
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 8
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # the scaling reaches transformers' RoPE: linear factor 2 halves the inverse frequencies
    plain = Eagle3Draft(tiny_config(rope_theta=5000.0)).rotary_emb.inv_freq
    scaled = Eagle3Draft(tiny_config(rope_theta=5000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    torch.testing.assert_close(scaled.rotary_emb.inv_freq, plain / 2)


def test_to_hf_dict_has_the_export_fields_and_round_trips():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 2048}
    cfg = draft_config_for(
        smollm2_config(), 8192, {"hidden_size": 512, "head_dim": 64, "num_attention_heads": 8,
                                 "num_key_value_heads": 2, "rope_scaling": llama3})
    d = json.loads(json.dumps(cfg.to_hf_dict(torch_dtype="bfloat16")))
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["model_type"] == "llama"
    assert d["num_hidden_layers"] == 1 and d["vocab_size"] == 49152 and d["draft_vocab_size"] == 8192
    assert d["target_hidden_size"] == 576 and d["hidden_size"] == 512 and d["head_dim"] == 64
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert d["rope_theta"] == 100000.0 and d["rope_scaling"] == llama3 and d["torch_dtype"] == "bfloat16"
    assert Eagle3DraftConfig.from_hf_dict(d) == cfg
    same = draft_config_for(smollm2_config(), 8192)
    assert "target_hidden_size" not in same.to_hf_dict()
    assert Eagle3DraftConfig.from_hf_dict(same.to_hf_dict()) == same
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3DraftConfig.from_hf_dict({k: v for k, v in d.items() if k != "eagle_config"})
    with pytest.raises(ValueError, match="architectures"):
        Eagle3DraftConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"]})


def test_load_draft_config_overrides_reports_file_problems(tmp_path):
    good = tmp_path / "draft.json"
    good.write_text('{"hidden_size": 256, "aux_layer_ids": [2, 10, 20]}')
    assert load_draft_config_overrides(good) == {"hidden_size": 256, "aux_layer_ids": [2, 10, 20]}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "hidden_size": 256,\n  oops\n}')
    with pytest.raises(ValueError, match=r"bad\.json: line 3"):
        load_draft_config_overrides(bad)
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"hidden_sise": 1}')
    with pytest.raises(ValueError, match=r"unknown\.json.*hidden_sise"):
        load_draft_config_overrides(unknown)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_draft_config_overrides(listing)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_draft_config_overrides(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------------------ module
def test_module_names_are_the_export_keys_and_embedding_is_frozen():
    draft = Eagle3Draft(tiny_config())
    assert set(draft.state_dict()) == EXPORT_KEYS | set(EXPORT_EXCLUDED_KEYS)
    assert set(export_tensors(draft.state_dict())) == EXPORT_KEYS
    assert not draft.embed_tokens.weight.requires_grad
    assert draft.fc.weight.shape == (32, 72) and draft.lm_head.weight.shape == (40, 32)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (32, 64)
    assert draft.midlayer.self_attn.k_proj.weight.shape == (16, 64)
    assert draft.d2t.dtype == torch.int64 and draft.d2t.shape == (40,)
    assert draft.t2d.dtype == torch.bool and draft.t2d.shape == (100,) and draft.t2d.sum() == 40
    assert all(m.bias is None for m in draft.modules() if isinstance(m, torch.nn.Linear))


def test_init_is_deterministic_from_the_seed():
    a, b, c = Eagle3Draft(tiny_config(), seed=3), Eagle3Draft(tiny_config(), seed=3), Eagle3Draft(tiny_config(), seed=4)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.fc.weight, c.fc.weight)
    c.init_weights(generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.midlayer.mlp.down_proj.weight, c.midlayer.mlp.down_proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(32))
    assert 0.015 < a.midlayer.self_attn.q_proj.weight.std().item() < 0.025
    with pytest.raises(ValueError, match="exactly one"):
        a.init_weights()


def test_loading_target_weights_and_vocab_map():
    draft = Eagle3Draft(tiny_config(target_hidden_size=32))
    emb = torch.randn(100, 32)
    draft.load_target_embeddings(emb)
    assert torch.equal(draft.embed_tokens.weight, emb) and not draft.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="embed_tokens"):
        draft.load_target_embeddings(torch.randn(99, 32))
    ids = torch.arange(0, 80, 2)
    t2d = torch.zeros(100, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(40), t2d)
    assert torch.equal(draft.draft_token_ids(), ids)
    head = torch.randn(100, 32)
    draft.init_lm_head_from_target(head)
    assert torch.equal(draft.lm_head.weight, head[ids])
    t2d[1] = True
    with pytest.raises(ValueError, match="inconsistent"):
        draft.set_vocab_map(ids - torch.arange(40), t2d)
    with pytest.raises(ValueError, match="target_hidden_size=24"):
        Eagle3Draft(tiny_config()).init_lm_head_from_target(torch.randn(100, 24))
    with pytest.raises(ValueError, match="lm_head shape"):
        draft.init_lm_head_from_target(torch.randn(100, 31))


def test_step_shapes_and_cache_bookkeeping():
    draft = Eagle3Draft(tiny_config())
    aux = torch.randn(2, 5, 72)
    ids = torch.randint(0, 100, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    hidden = draft.project_aux(aux.bfloat16())
    assert hidden.dtype == torch.float32 and hidden.shape == (2, 5, 32)
    hidden, cache = draft.step(hidden, ids, pos)
    assert cache.num_steps == 1 and torch.equal(cache.rope_positions(pos), pos + 1)
    hidden, cache = draft.step(hidden, ids, pos, None, cache)
    assert cache.num_steps == 2 and len(cache.diag_k) == 1 and cache.diag_k[0].shape == (2, 2, 5, 8)
    assert draft.logits(hidden).shape == (2, 5, 40)


def test_attention_heads_shard_from_outside():
    """Slicing q/k/v by heads and o_proj by columns (as TP does) needs no code change: shard outputs sum to the full."""
    torch.manual_seed(0)
    attn = Eagle3Draft(tiny_config()).midlayer.self_attn
    x = torch.randn(2, 6, 64)
    pos = torch.arange(6).expand(2, 6)
    cos = torch.randn(2, 6, 8)
    sin = torch.randn(2, 6, 8)
    full = attn(x, cos, sin, pos, None, TTTKVCache())
    total = torch.zeros_like(full)
    for shard in range(2):
        part = Eagle3Draft(tiny_config()).midlayer.self_attn
        q_rows, kv_rows = slice(16 * shard, 16 * shard + 16), slice(8 * shard, 8 * shard + 8)
        part.q_proj = torch.nn.Linear(64, 16, bias=False)
        part.k_proj, part.v_proj = torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(64, 8, bias=False)
        part.o_proj = torch.nn.Linear(16, 32, bias=False)
        with torch.no_grad():
            part.q_proj.weight.copy_(attn.q_proj.weight[q_rows])
            part.k_proj.weight.copy_(attn.k_proj.weight[kv_rows])
            part.v_proj.weight.copy_(attn.v_proj.weight[kv_rows])
            part.o_proj.weight.copy_(attn.o_proj.weight[:, q_rows])
        total = total + part(x, cos, sin, pos, None, TTTKVCache())
    assert_close_rel(total, full, FP32_REORDERED, "sum of the head groups")


def test_bf16_cast_keeps_rope_frequencies_in_float32_and_runs():
    draft = Eagle3Draft(tiny_config())
    inv = draft.rotary_emb.inv_freq.clone()
    draft.bfloat16()
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.t2d.dtype == torch.bool and draft.d2t.dtype == torch.int64
    assert draft.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(draft.rotary_emb.inv_freq, inv)
    hidden, _ = draft.step(draft.project_aux(torch.randn(1, 4, 72)), torch.randint(0, 100, (1, 4)),
                           torch.arange(4)[None])
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(draft.logits(hidden)).all()
