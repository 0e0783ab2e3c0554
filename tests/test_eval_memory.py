"""The evaluation's target keeps logits only for the rows it reads: a prefill of a long prompt runs ``lm_head`` on its
last position only (the [S, V] fp32 logits of an 8B target's 128k-token prompt are 63 GiB), a verification step on
all of its k + 1 inputs, and the decoded tokens are the same either way."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from recipe.eval.speculative import greedy_generate, prefill_prompt
from recipe.target.runtime import CachedTarget

PROMPT = 4096
VOCAB = 2048


@pytest.fixture(scope="module")
def long_target():
    """A 2-layer Llama that serves 8192 positions, with a vocabulary large enough that [S, V] logits dominate."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
        return LlamaForCausalLM(config).eval()


def _lm_head_rows(model) -> tuple[list[int], object]:
    rows: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: rows.append(out.shape[-2]))
    return rows, handle


def test_prefill_of_a_long_prompt_computes_one_row_of_logits(long_target):
    target = CachedTarget(long_target, [0, 1])
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    rows, handle = _lm_head_rows(long_target)
    try:
        shared = prefill_prompt(target, prompt)
        assert rows == [1] and len(target) == PROMPT  # lm_head saw one row; the cache holds the whole prompt
        assert shared.aux_SA.shape == (PROMPT, 2 * 32)  # the draft still gets every prompt position's aux features
        rows.clear()
        step = target.forward(prompt[:8])  # what a forward without logits_rows computes: every row
        assert rows == [8] and step.logits_SV.shape == (8, VOCAB)
        rows.clear()
        target.begin()
        kept = target.forward(prompt, logits_rows=1)
        assert rows == [1] and kept.logits_SV.shape == (1, VOCAB) and kept.logits_SV.dtype == torch.float32
        full_bytes = PROMPT * VOCAB * 4
        assert kept.logits_SV.numel() * kept.logits_SV.element_size() * PROMPT == full_bytes
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="logits_rows must be >= 1"):
        target.forward(prompt[:2], logits_rows=0)


def test_the_last_row_kept_is_the_last_row_of_the_full_logits_and_decoding_is_unchanged(long_target):
    target = CachedTarget(long_target)
    prompt = torch.randint(0, VOCAB, (512,), generator=torch.Generator().manual_seed(2)).tolist()
    target.begin()
    full = target.forward(prompt).logits_SV
    target.begin()
    last = target.forward(prompt, logits_rows=1).logits_SV
    # the same hidden state through the same lm_head: one row of the same matrix product
    assert_close_rel(last[0], full[-1], FP32_REORDERED, "the kept row")
    rows, handle = _lm_head_rows(long_target)
    try:
        tokens = greedy_generate(target, prompt, 6).tokens
    finally:
        handle.remove()
    assert rows == [1] * 6  # the prompt's forward and five one-token steps: one row each
    assert tokens[0] == int(full[-1].argmax())


def test_recorded_mismatches_keep_the_lengths_memory_and_prefill_time(tiny_target, tmp_path, monkeypatch):
    """``on_mismatch="record"`` (``--on-mismatch record``): a speculative output that leaves greedy decoding goes into
    the length's ``mismatches`` and the run goes on to every length, with each length's prefill seconds (counted in
    every run's seconds) and device peaks (null on the CPU); ``"stop"`` raises at the first one."""
    from helpers.tiny_draft import target_and_draft

    import recipe.eval.by_length as by_length
    from recipe.eval.context import ContextPrompt
    from recipe.eval.speculative import Generation, MismatchError
    from recipe.export import export_tensors, write_export

    target, draft = target_and_draft(tiny_target)
    export = write_export(export_tensors(draft.state_dict()), draft.config.to_hf_dict(), tmp_path / "a")
    buckets = {length: [ContextPrompt(f"p@{length}", "all", list(range(3, 3 + length + 4)), length, length)]
               for length in (0, 32)}
    real = by_length.speculative_generate

    def off_by_one(*args, **kwargs):  # the first emitted token changed: never the greedy output
        gen = real(*args, **kwargs)
        return Generation([(gen.tokens[0] + 1) % 96, *gen.tokens[1:]], gen.seconds, gen.accepted, gen.k)

    monkeypatch.setattr(by_length, "speculative_generate", off_by_one)
    result = by_length.evaluate_by_length(tiny_target, {"a": export}, buckets, [2], 6, device="cpu",
                                          on_mismatch="record")
    for entry in result["lengths"]:
        assert len(entry["mismatches"]) == 1 and "speculative output differs" in entry["mismatches"][0]
        assert entry["device_memory"] is None and 0 < entry["prefill_seconds"] <= entry["runs"][0]["seconds"]
    with pytest.raises(MismatchError, match="p@0"):
        by_length.evaluate_by_length(tiny_target, {"a": export}, buckets, [2], 6, device="cpu")
    with pytest.raises(ValueError, match="on_mismatch='warn'"):
        by_length.evaluate_by_length(tiny_target, {"a": export}, buckets, [2], 6, device="cpu", on_mismatch="warn")
