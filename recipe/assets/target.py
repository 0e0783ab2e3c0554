"""Convert the packaged SmolLM2-135M-Instruct GGUF into a plain Hugging Face folder (fp32 safetensors).

transformers loads a GGUF with ``from_pretrained(dir, gguf_file=...)`` (dequantising it) but refuses to
``save_pretrained`` the result, so the weights are copied into a model rebuilt from the same config and saved
from there. The build checks that the folder loads with a plain ``from_pretrained(folder)``, that the tokenizer
carries the ChatML chat template, that lm_head is tied to the embeddings, and that its logits equal the GGUF
model's on a short chat prompt.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHATML_MARKER = "<|im_start|>"
_CHECK_MESSAGES = [{"role": "user", "content": "What is speculative decoding?"}]


class TargetConversionError(RuntimeError):
    """The GGUF target could not be turned into a usable Hugging Face folder."""


@contextmanager
def _quiet_transformers():
    """Silence transformers' warnings (e.g. 'Dequantizing the whole model ... install kernels') for a block."""
    from transformers.utils import logging as hf_logging  # import cost: transformers

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_gguf(gguf_file: Path, with_tokenizer: bool = True):
    """``(model, tokenizer)`` loaded from the GGUF by transformers (fp32, dequantised); tokenizer None if not asked."""
    import torch  # import cost: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # import cost: transformers

    with _quiet_transformers():
        tokenizer = (
            AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name) if with_tokenizer else None
        )
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), tokenizer


def check_ids(tokenizer) -> torch.Tensor:
    """Token ids ``[1, S]`` (int64) of a one-turn ChatML prompt with the generation prompt, for logit checks."""
    import torch  # import cost: torch

    ids = tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def _rebuild_from_config(gguf_model):
    """A fresh fp32 model from the GGUF model's config (quantisation entry dropped) holding its exact weights."""
    import torch  # import cost: torch
    from transformers import AutoModelForCausalLM  # import cost: transformers

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    return model.eval()


def reference_logits(ids, logits) -> dict:
    """A few of ``logits`` [1, S, V] (fp32) for ``ids`` [1, S], as exact JSON floats: every position's logits of
    token ids 0..7, and the last position's top 8 ``(ids, values)``. Recorded from the GGUF model at conversion so
    tests can compare the saved folder with the GGUF without the slow GGUF load."""
    top = logits[0, -1].topk(8)
    return {
        "input_ids": ids[0].tolist(),
        "first_8_vocab_logits": logits[0, :, :8].tolist(),
        "last_top8_ids": top.indices.tolist(),
        "last_top8_logits": top.values.tolist(),
    }


def _verify_folder(folder: Path, gguf_model, tokenizer) -> dict:
    """Raise TargetConversionError unless ``folder`` reloads plainly and reproduces the GGUF model's logits.

    Returns the GGUF model's ``reference_logits`` on the check prompt."""
    import torch  # import cost: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # import cost: transformers

    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    if reloaded_tokenizer.chat_template != tokenizer.chat_template:
        raise TargetConversionError(f"{folder}: the saved tokenizer lost the chat template")
    if reloaded.config.tie_word_embeddings and (
        reloaded.lm_head.weight.data_ptr() != reloaded.get_input_embeddings().weight.data_ptr()
    ):
        raise TargetConversionError(f"{folder}: lm_head is not tied to embed_tokens after reload")
    ids = check_ids(tokenizer)
    with torch.no_grad():
        expected, got = gguf_model(ids).logits, reloaded(ids).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise TargetConversionError(f"{folder}: logits differ from the GGUF model (max |diff| {diff:.3g})")
    return reference_logits(ids, expected)


def convert_gguf_target(gguf_file: Path, out_dir: Path) -> dict:
    """Write the GGUF target as an HF folder (config, generation config, model.safetensors fp32, tokenizer).

    Returns counts: ``parameters``, ``layers``, ``hidden_size``, ``vocab_size``, and ``gguf_reference`` (the GGUF
    model's ``reference_logits`` on a short chat prompt, which the saved folder reproduces exactly).
    Raises TargetConversionError if the GGUF tokenizer has no ChatML chat template or the saved folder does not
    reproduce the GGUF model.
    """
    gguf_model, tokenizer = load_gguf(gguf_file)
    template = tokenizer.chat_template
    if not isinstance(template, str) or CHATML_MARKER not in template:
        raise TargetConversionError(
            f"{gguf_file}: the GGUF tokenizer has no ChatML chat template (tokenizer.chat_template={template!r:.80})"
        )
    model = _rebuild_from_config(gguf_model)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    reference = _verify_folder(out_dir, gguf_model, tokenizer)
    config = gguf_model.config
    return {
        "parameters": sum(p.numel() for p in gguf_model.parameters()),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "gguf_reference": reference,
    }
