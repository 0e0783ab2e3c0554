"""The CPU decoding fast paths: linear layers with oneDNN-packed weights, and the batched greedy reference of the
lossless check (against prompt-by-prompt greedy decoding on the tiny random target)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recipe.eval.harness import evaluate, greedy_reference
from recipe.eval.prompts import Prompt
from recipe.eval.speculative import MismatchError, greedy_generate, greedy_generate_batched
from recipe.eval.target_runtime import CachedTarget
from recipe.model import packed_linear
from recipe.model.packed_linear import PackedLinear, pack_linear_layers, packing_available
from recipe.model.target import TargetModel

VOCAB = 96
needs_packing = pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN linear ops")


@pytest.fixture()
def target(tiny_target):
    return TargetModel(tiny_target, dtype=torch.float32, device="cpu")


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear, rows=6)
    assert packed.weight is linear.weight  # the same parameter: ties and dtype/device queries survive
    for shape in [(1, 48), (6, 48), (17, 48), (2, 5, 48)]:
        x = torch.randn(*shape)
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))


def test_packed_linear_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedLinear(nn.Linear(4, 4).bfloat16())


@needs_packing
def test_pack_linear_layers_on_a_target_keeps_its_logits(target):
    ids = torch.tensor([_prompts([20])[0]])
    with torch.no_grad():
        before = target.model(ids).logits
    linears = sum(isinstance(m, nn.Linear) for m in target.model.modules())
    assert pack_linear_layers(target.model) == linears == 8 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert not any(isinstance(m, nn.Linear) for m in target.model.modules())
    with torch.no_grad():
        after = target.model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_pack_linear_layers_leaves_what_it_cannot_pack(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).bfloat16())
    if packing_available():
        assert pack_linear_layers(model) == 1  # the fp32 layer only
        assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)
    monkeypatch.setattr(packed_linear, "packing_available", lambda: False)
    plain = nn.Sequential(nn.Linear(8, 8))
    assert pack_linear_layers(plain) == 0 and isinstance(plain[0], nn.Linear)
    monkeypatch.undo()
    monkeypatch.setattr(packed_linear, "_agrees", lambda linear, rows: False)  # a packed layer that disagrees
    assert pack_linear_layers(plain) == 0 and isinstance(plain[0], nn.Linear)


def test_batched_greedy_equals_prompt_by_prompt(target):
    prompts = _prompts([4, 11, 7, 16, 5], seed=3)
    cached = CachedTarget(target.model)
    sequential = [greedy_generate(cached, p, 24).tokens for p in prompts]
    assert greedy_generate_batched(target.model, prompts, 24) == sequential
    assert all(len(t) == 24 for t in sequential)
    # EOS: a token the second prompt emits at new position 6 ends that row (EOS included) and no other row early
    eos = sequential[1][6]
    want = [t[: t.index(eos) + 1] if eos in t else t for t in sequential]
    assert greedy_generate_batched(target.model, prompts, 24, eos_token_id=eos) == want
    assert len(want[1]) <= 7 and want != sequential
    with pytest.raises(ValueError, match="non-empty prompts"):
        greedy_generate_batched(target.model, [[5, 6], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate_batched(target.model, [[5, 6]], 0)


def test_greedy_reference_modes_agree_and_time_the_first_prompt(target):
    prompts = _prompts([6, 13, 9], seed=5)
    names = [Prompt(f"q{i}", "c", "") for i in range(len(prompts))]
    seq, seq_tps = greedy_reference(target.model, names, prompts, 20, None, "sequential", 0)
    bat, bat_tps = greedy_reference(target.model, names, prompts, 20, None, "batched", 0)
    assert [g.tokens for g in bat] == [g.tokens for g in seq]
    assert seq_tps > 0 and bat_tps > 0
    assert bat[0].seconds > 0 and all(g.seconds != g.seconds for g in bat[1:])  # only prompt 0 was timed (nan)


def test_greedy_reference_names_a_batched_disagreement(target, monkeypatch):
    import recipe.eval.harness as harness

    prompts = _prompts([6, 9], seed=6)
    names = [Prompt("first", "c", ""), Prompt("second", "c", "")]
    monkeypatch.setattr(harness, "greedy_generate_batched", lambda model, ids, n, eos, pad: [[1] * n for _ in ids])
    with pytest.raises(MismatchError, match="first.*batched vs one-prompt"):
        greedy_reference(target.model, names, prompts, 8, None, "batched", 0)


def test_evaluate_rejects_an_unknown_reference_mode(tmp_path):
    with pytest.raises(ValueError, match="reference='parallel'"):
        evaluate(tmp_path, {"d": tmp_path}, [], [5], 8, reference="parallel")


@needs_packing
def test_decode_benchmark_smoke(tiny_target, tmp_path):
    import json

    from recipe.bench import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--target", str(tiny_target), "--rows", "1,3", "--context", "8", "--threads", "1",
                        "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["forward"]] == [1, 3] and result["packed_layers"] == 8 * 7 + 1
    assert all(r["plain_ms"] > 0 and r["packed_ms"] > 0 for r in result["forward"])
    ref = result["greedy_reference"]
    assert ref["identical"] is True and ref["tokens"] == 3 * 4 and ref["prompts"] == 3
