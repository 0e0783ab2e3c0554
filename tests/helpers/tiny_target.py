"""A tiny random target (Llama, Qwen2, Qwen3 or Mistral) saved as a HF folder, and an fp32 offline hidden-state store
of random chats made with it, for fast target/store/dump/training tests (the Llama ones built once per session by the
fixtures in ``tests/conftest.py``)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# config class, model class and architecture-specific settings of each tiny target architecture
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16, "use_sliding_window": False}),  # q/k norms, wide heads
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": None, "pad_token_id": 0, "bos_token_id": 1,
                                           "eos_token_id": 2, "partial_rotary_factor": 0.5}),  # fused qkv, gate_up
}


def save_tiny_target(folder: Path, model_type: str = "llama", num_layers: int = 8, hidden: int = 32, vocab: int = 96,
                     seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """Write a random fp32 causal LM of ``model_type`` (a key of ``ARCHITECTURES``; ``num_layers`` layers, hidden
    ``hidden``, 4 heads / 2 KV heads) to ``folder``.

    The weights are drawn from ``torch.manual_seed(seed)`` inside a forked RNG, so the caller's global RNG is untouched.
    """
    config_cls, model_cls, extra = ARCHITECTURES[model_type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings, **extra)
        model = model_cls(config).eval()
    model.save_pretrained(folder)
    return Path(folder)


def save_tiny_llama(folder: Path, num_layers: int = 8, hidden: int = 32, vocab: int = 96, seed: int = 0,
                    tie_word_embeddings: bool = False) -> Path:
    """``save_tiny_target`` of a Llama."""
    return save_tiny_target(folder, "llama", num_layers, hidden, vocab, seed, tie_word_embeddings)


def random_chats(num_samples: int = 24, seed: int = 0):
    """A ``datasets.Dataset`` of ``num_samples`` random chats: ``input_ids`` (10-22 ids in [1, 96)), ``loss_mask``
    (the first 2..n/2 tokens unsupervised) and ``row``."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": [], "row": []}
    for i in range(num_samples):
        n = int(torch.randint(10, 23, (1,), generator=gen))
        ids = torch.randint(1, 96, (n,), generator=gen).tolist()
        start = int(torch.randint(2, n // 2, (1,), generator=gen))
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * start + [1] * (n - start))
        rows["row"].append(i)
    return Dataset.from_dict(rows)


def dump_random_chats(target_dir: Path, store: Path, num_samples: int = 24, seed: int = 0) -> Path:
    """An fp32 store at ``store`` of :func:`random_chats` run through the target at ``target_dir`` (max length 64,
    batches of 8); returns ``store``."""
    from recipe.dump import dump_hidden_states
    from recipe.target.capture import TargetModel

    target = TargetModel(target_dir, dtype=torch.float32, device="cpu")
    dump_hidden_states(target, random_chats(num_samples, seed), store, max_length=64, dtype="fp32", batch_size=8)
    return store
