"""A tiny random Llama target saved as a HF folder, for fast target/store/dump tests."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(folder: Path, num_layers: int = 8, hidden: int = 32, vocab: int = 96, seed: int = 0) -> Path:
    """Write a random fp32 Llama (``num_layers`` layers, hidden ``hidden``, 4 heads / 2 KV heads) to ``folder``."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return Path(folder)
