"""The CPU decoding fast paths: linear layers with oneDNN-packed weights, and the batched greedy reference of the
lossless check (against prompt-by-prompt greedy decoding on the tiny random target)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from recipe.eval.by_length import GreedyReference, evaluate_by_length
from recipe.eval.context import ContextPrompt
from recipe.eval.prompts import Prompt
from recipe.eval.report import summarise_run
from recipe.eval.speculative import (
    Generation,
    MismatchError,
    greedy_generate,
    greedy_generate_batched,
    prefill_prompt,
)
from recipe.model import packed_linear
from recipe.model.packed_linear import PackedLinear, pack_linear_layers, packing_available
from recipe.target.capture import TargetModel
from recipe.target.runtime import CachedTarget

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
    for shape in [(48,), (1, 48), (6, 48), (17, 48), (2, 5, 48)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            got, want = packed(x), F.linear(x, linear.weight, linear.bias)
        assert got.shape == want.shape
        assert_close_rel(got, want, FP32_REORDERED, f"packed linear {shape}")
        assert not torch.equal(got, torch.zeros_like(got))
    assert list(packed.state_dict()) == list(linear.state_dict())  # nn.Linear's keys
    with pytest.raises(RuntimeError, match="inference"):  # the parameter wants a gradient, the packed copy has none
        packed(torch.randn(2, 48))


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
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert pack_linear_layers(tied) == 1 and tied[1].weight is tied[0].weight  # still one tensor
    with torch.no_grad():
        after = target.model(ids).logits
    assert_close_rel(after, before, FP32_REORDERED, "packed target logits")
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


def test_batched_greedy_ignores_the_pad_id(target):
    prompts = _prompts([3, 12, 8], seed=4)
    assert greedy_generate_batched(target.model, prompts, 10, pad_token_id=0) == \
        greedy_generate_batched(target.model, prompts, 10, pad_token_id=5)


def _reference(target, names, prompts, mode, n=20):
    """A ``GreedyReference`` over ``prompts`` with every prompt's reference asked for from its own prefill."""
    cached = CachedTarget(target.model)
    context = [ContextPrompt(name, "c", ids, 0, 0) for name, ids in zip(names, prompts)]
    refs = GreedyReference(cached, context, n, None, mode)
    for i, ids in enumerate(prompts):
        refs.of(i, prefill_prompt(cached, ids))
    return refs, cached


def test_reference_modes_agree_and_batched_times_the_shortest_prompt(target):
    prompts = _prompts([9, 13, 5, 11], seed=5)
    names = [f"q{i}" for i in range(len(prompts))]
    seq, _ = _reference(target, names, prompts, "sequential")
    bat, cached = _reference(target, names, prompts, "batched")
    assert [g.tokens for g in bat.gens] == [g.tokens for g in seq.gens]
    assert all(g.seconds > 0 for g in seq.gens)
    assert [g.seconds == g.seconds for g in bat.gens] == [False, False, True, False]  # prompt 2 (5 tokens) alone
    shared = prefill_prompt(cached, prompts[1])
    gen = Generation(tokens=list(seq.gens[1].tokens), seconds=1.0, accepted=[0] * 20, k=1)
    assert bat.check(1, gen, shared, None) is gen
    with pytest.raises(MismatchError, match="'q1'"):
        bat.check(1, Generation(tokens=[0] * 20, seconds=1.0), shared, None)
    recorded = []
    bat.check(1, Generation(tokens=[0] * 20, seconds=1.0), shared, recorded)
    assert len(recorded) == 1 and recorded[0].startswith("prompt 'q1'")


def test_batched_reference_errors_name_the_prompt_or_recover(target, monkeypatch):
    import recipe.eval.by_length as by_length

    prompts = _prompts([9, 6], seed=6)
    cached = CachedTarget(target.model)
    truth = [greedy_generate(cached, p, 8).tokens for p in prompts]
    monkeypatch.setattr(by_length, "greedy_generate_batched", lambda model, ids, n, eos: [[1] * n for _ in ids])
    with pytest.raises(MismatchError, match="'short': batched greedy decoding differs from decoding it alone"):
        _reference(target, ["long", "short"], prompts, "batched", 8)
    # a batched row that is wrong for a prompt not decoded alone: re-decoded alone before blaming the speculative one
    monkeypatch.setattr(by_length, "greedy_generate_batched", lambda model, ids, n, eos: [[1] * n, truth[1]])
    refs, cached = _reference(target, ["long", "short"], prompts, "batched", 8)
    assert refs.gens[0].tokens == [1] * 8 != truth[0]
    refs.check(0, Generation(tokens=truth[0], seconds=1.0), prefill_prompt(cached, prompts[0]), None)
    assert refs.gens[0].tokens == truth[0] and refs.gens[0].seconds != refs.gens[0].seconds


def test_speedup_counts_only_the_timed_prompts():
    prompts = [Prompt("a", "c", ""), Prompt("b", "c", "")]
    greedy = [Generation(tokens=[1] * 10, seconds=2.0), Generation(tokens=[1] * 10, seconds=float("nan"))]
    spec = [Generation(tokens=[1] * 10, seconds=1.0, accepted=[1] * 5, k=2),
            Generation(tokens=[1] * 10, seconds=5.0, accepted=[1] * 5, k=2)]
    run = summarise_run("d", 2, prompts, spec, greedy)
    assert run["greedy_tokens_per_s"] == 5.0 and run["speedup"] == 2.0
    assert run["tokens_per_s"] == pytest.approx(20 / 6)
    untimed = summarise_run("d", 2, prompts, spec, [greedy[1], greedy[1]])
    assert untimed["speedup"] != untimed["speedup"]  # nan: nothing was timed


def test_eval_cli_passes_the_reference_mode(tmp_path, monkeypatch):
    from recipe.eval import __main__ as cli
    from recipe.eval.__main__ import main

    seen = {}

    def fake_evaluate(*args, **kwargs):
        seen.update(kwargs)
        return {"runs": [{"tau": 1.5, "num_draft_tokens": 5}], "mismatches": []}

    monkeypatch.setattr(cli, "evaluate", fake_evaluate)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "category": "c"}\n')
    base = ["--target", str(tmp_path), "--draft", str(tmp_path), "--prompts", str(prompts), "--tree-depth", "0"]
    assert main(base + ["--reference", "batched"]) == 0 and seen["reference"] == "batched"
    assert main(base) == 0 and seen["reference"] == "sequential" and seen["on_mismatch"] == "stop"
    assert main(base + ["--context-request", "about-context"]) == 2  # needs --context-lengths


def test_evaluate_rejects_an_unknown_reference_mode(tmp_path):
    with pytest.raises(ValueError, match="reference='parallel'"):
        evaluate_by_length(tmp_path, {"d": tmp_path}, {}, [5], 8, reference="parallel")


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
