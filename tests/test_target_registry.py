"""The per-architecture registry (``recipe.target.registry``): each entry's facts against a config of that type.

Whether an entry's attention really runs through the ring is proven elsewhere, per tiny target of
``helpers.tiny_target.ARCHITECTURES``: the CP forward equals the plain model's (``tests/test_target_cp.py``) and
online cp = 2 trains the dp = 2 curve (``tests/test_target_archs_training.py``). Here: every ring entry has such a
tiny target, and the facts the code reads (soft-cap, RoPE, aux ids, the CP refusal) are the config's.
"""
from __future__ import annotations

import pytest
from helpers.tiny_target import ARCHITECTURES as TINY
from transformers import Gemma2Config, LlamaConfig, Phi3Config, Qwen3Config

from recipe.parallel.dims import ParallelDims
from recipe.target.registry import (ARCHITECTURES, GENERIC, arch_facts, check_split_target, draft_config_for,
                                    final_logit_softcap, splits_target)


def test_every_ring_architecture_has_a_tiny_target_that_the_cp_tests_train():
    ring = {name for name, arch in ARCHITECTURES.items() if arch.routable_attention}
    assert ring == set(TINY) == {"llama", "mistral", "qwen2", "qwen3", "phi3"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_entry_matches_its_config(name):
    config_cls, _, extra = TINY[name]
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        rope_theta=123456.0, **extra)
    arch = arch_facts(config)
    assert arch is ARCHITECTURES[name] and arch.model_type == config.model_type == name
    check_split_target(config)  # no error
    assert final_logit_softcap(config) is None
    draft = draft_config_for(config, 64)
    assert draft.rope_theta == 123456.0 and draft.rope_scaling is None
    assert draft.aux_layer_ids == [1, 3, 4] and draft.head_dim == (extra.get("head_dim") or 32 // 4)
    assert (draft.hidden_size, draft.num_key_value_heads, draft.vocab_size) == (32, 2, 96)


def test_rope_scaling_and_soft_cap_are_read_from_the_config():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    llama = LlamaConfig(num_hidden_layers=32, rope_theta=500000.0, rope_scaling=scaling)
    draft = draft_config_for(llama, 32000)
    assert draft.rope_theta == 500000.0 and draft.rope_scaling["factor"] == 8.0
    assert draft.rope_scaling["rope_type"] == "llama3" and draft.aux_layer_ids == [1, 15, 28]
    assert final_logit_softcap(Gemma2Config(final_logit_softcapping=25.0)) == 25.0
    assert final_logit_softcap(Gemma2Config(final_logit_softcapping=None)) is None
    assert final_logit_softcap({"model_type": "qwen3", "final_logit_softcapping": 7.0}) is None  # not its field
    assert final_logit_softcap({"model_type": "somenewlm", "final_logit_softcapping": 7.0}) == 7.0  # GENERIC


def test_a_partial_rotary_phi3_gives_a_full_rotary_draft_with_its_rope_base():
    config = Phi3Config(num_hidden_layers=8, partial_rotary_factor=0.5, rope_theta=250000.0)
    draft = draft_config_for(config, 64)
    assert draft.rope_theta == 250000.0 and draft.rope_scaling is None
    assert draft.to_llama_config().head_dim == config.hidden_size // config.num_attention_heads  # whole head rotated


def test_architectures_outside_the_ring_are_refused_at_cp_with_the_offline_way():
    assert arch_facts({"model_type": "somenewlm"}) is GENERIC
    for config in (Gemma2Config(), {"model_type": "somenewlm"}):
        with pytest.raises(ValueError, match="python -m recipe.dump") as err:
            check_split_target(config)
        assert repr(config["model_type"] if isinstance(config, dict) else config.model_type) in str(err.value)
        assert "llama, mistral, qwen2, qwen3, phi3" in str(err.value)
    check_split_target(Qwen3Config())


def test_the_target_forward_is_split_at_cp_and_at_tp_only_through_the_ring():
    llama, gemma = LlamaConfig(), Gemma2Config()

    def dims(cp, tp):
        return ParallelDims(world_size=cp * tp, cp=cp, tp=tp)

    layouts = ((1, 1), (2, 1), (1, 2), (2, 2))
    assert [splits_target(llama, dims(cp, tp)) for cp, tp in layouts] == [False, True, True, True]
    assert [splits_target(gemma, dims(1, tp)) for tp in (1, 2)] == [False, False]  # every tp rank runs it whole
    with pytest.raises(ValueError, match="'gemma2'.*python -m recipe.dump"):
        splits_target(gemma, dims(2, 1))
