"""τ by context length (``recipe.eval --context-lengths``): the inserted context (length, seed, never the prompt's
own), about-context requests, bucketed prompts, the draft's sliding window against an explicitly masked reference,
the shared prefill, the standard error of τ, and one short CLI run on the real SmolLM2 target (slow)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.tiny_draft import target_and_draft

from recipe.arg_types import context_length_list
from recipe.eval.by_length import evaluate_by_length
from recipe.eval.context import (
    ABOUT_CONTEXT_REQUESTS,
    bucket_prompts,
    context_prompts,
    read_context_data,
)
from recipe.eval.draft_runtime import EagleDrafter
from recipe.eval.length_report import tau_standard_error
from recipe.eval.prompts import Prompt
from recipe.eval.speculative import Generation, greedy_generate, prefill_prompt, speculative_generate
from recipe.eval.tree import TreeSpec
from recipe.export import export_tensors, write_export
from recipe.model.draft import Eagle3Draft
from recipe.target.registry import draft_config_for
from recipe.target.runtime import CachedTarget

VOCAB = 96


class WordTokenizer:
    """A chat template and tokenizer stand-in: ChatML-like rendering, one id in [3, VOCAB) per word."""

    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}> {m['content']} </turn> " for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + sum(map(ord, w)) % (VOCAB - 3) for w in text.split()]}


def _words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """A ShareGPT JSONL and an OpenAI JSONL of conversations of 2-3 turn pairs, 5-35 words a turn."""
    tmp = tmp_path_factory.mktemp("context")
    sharegpt, openai = tmp / "sharegpt.jsonl", tmp / "openai.jsonl"
    rows_s, rows_o = [], []
    for c in range(30):
        turns = [(_words(5 + (7 * c) % 20, f"q{c}x"), _words(5 + (11 * c) % 30, f"a{c}x")) for _ in range(2 + c % 2)]
        conv = [t for u, a in turns for t in ({"from": "human", "value": u}, {"from": "gpt", "value": a})]
        rows_s.append(json.dumps({"id": c, "conversations": conv}))
        rows_o.append(json.dumps({"messages": [{"role": "system", "content": "be brief"}] + [
            {"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in conv]}))
    rows_s.append(json.dumps({"conversations": [{"from": "human", "value": "What is the capital of France?"},
                                                {"from": "gpt", "value": "Paris."}]}))  # the prompt's own
    rows_s.append(json.dumps({"conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "ok"},
                                                {"from": "gpt", "value": "fine"}]}))  # opens with the assistant
    rows_s.append("{broken")
    sharegpt.write_text("\n".join(rows_s) + "\n")
    openai.write_text("\n".join(rows_o) + "\n")
    return sharegpt, openai


PROMPTS = [Prompt("p0", "writing", "What is the capital of France?"), Prompt("p1", "math", "Add two and three."),
           Prompt("p2", "coding", "Write a loop.")]


def test_context_lengths_syntax():
    assert context_length_list("0,1k,4k") == [0, 1024, 4096]
    assert context_length_list("2k, 512,2048") == [512, 2048]
    for bad in ("-1", "1.3", "x", ","):
        with pytest.raises(Exception, match="length"):
            context_length_list(bad)


def test_inserted_context_length_seed_and_never_the_prompts_own(conversations):
    sharegpt, openai = conversations
    data = read_context_data([sharegpt, openai])
    assert len(data.pairs) == 62 and data.skipped == {"invalid_json": 1}
    assert [u["content"] for u, _ in data.pairs[31]] == ["ok"]  # the leading assistant turn left out
    tok = WordTokenizer()
    lengths = [0, 150, 400]
    out = context_prompts(tok, PROMPTS, data, lengths, seed=0)
    assert [p.messages for p in out[0]] == [[{"role": "user", "content": p.text}] for p in PROMPTS]
    assert [p.context_tokens for p in out[0]] == [0, 0, 0]
    for length in (150, 400):
        assert sum(p.context_tokens for p in out[length]) >= 0.9 * length * len(PROMPTS)
        for p, prompt in zip(out[length], PROMPTS):
            assert 0.75 * length <= p.context_tokens <= length, (length, p.context_tokens)
            assert p.messages[-1] == {"role": "user", "content": prompt.text} and p.category == prompt.category
            assert [m["role"] for m in p.messages[:-1]] == ["user", "assistant"] * ((len(p.messages) - 1) // 2)
            assert p.ids == tok(tok.apply_chat_template(p.messages))["input_ids"]
            if prompt.name == "p0":  # never its own conversation (the one holding its text)
                assert "Paris." not in [m["content"] for m in p.messages]
            assert "be brief" not in [m["content"] for m in p.messages]
    again = context_prompts(tok, PROMPTS, data, lengths, seed=0)
    other = context_prompts(tok, PROMPTS, data, lengths, seed=1)
    assert [p.messages for p in again[400]] == [p.messages for p in out[400]]
    assert [p.messages for p in other[400]] != [p.messages for p in out[400]]
    # every prompt gets its own draw
    assert out[400][0].messages[:-1] != out[400][1].messages[:-1]


def test_about_context_requests_are_about_the_inserted_text_and_chosen_by_seed(conversations):
    data = read_context_data(list(conversations))
    tok = WordTokenizer()
    prompts = [Prompt(f"p{i}", "x", f"Question number {i}?") for i in range(12)]
    unrelated = context_prompts(tok, prompts, data, [200], seed=3)[200]
    about = context_prompts(tok, prompts, data, [200], seed=3, request="about-context")[200]
    texts = {name: t.split("{")[0] for name, t in ABOUT_CONTEXT_REQUESTS.items()}
    seen = set()
    for u, a, prompt in zip(unrelated, about, prompts):
        assert u.messages[-1]["content"] == prompt.text  # unrelated: unchanged
        assert a.messages[:-1] == u.messages[:-1]  # the same inserted context
        request = a.messages[-1]["content"]
        assert a.category in ABOUT_CONTEXT_REQUESTS and request.startswith(texts[a.category])
        assert prompt.text not in request and "conversation above" in request
        if a.category == "question":  # quotes the start of the inserted context's first user turn
            first_user = a.messages[0]["content"]
            excerpt = request.split('"')[1].removesuffix(" ...")
            assert excerpt and first_user.startswith(excerpt)
        seen.add(a.category)
    assert seen == set(ABOUT_CONTEXT_REQUESTS)  # 12 draws reach every request
    again = context_prompts(tok, prompts, data, [200], seed=3, request="about-context")[200]
    other = context_prompts(tok, prompts, data, [200], seed=4, request="about-context")[200]
    assert [p.messages for p in again] == [p.messages for p in about]
    assert [p.category for p in other] != [p.category for p in about]
    with pytest.raises(ValueError, match="lengths > 0"):
        context_prompts(tok, prompts, data, [0, 200], seed=3, request="about-context")


def test_bucketed_prompts_by_measured_length():
    tok = WordTokenizer()
    prompts = [Prompt(f"p{n}", "all", _words(n, "w")) for n in (3, 40, 90, 150, 500)]
    buckets, skipped = bucket_prompts(tok, prompts, [50, 100], max_tokens=300)
    measured = {p.name: len(tok(tok.apply_chat_template([{"role": "user", "content": p.text}]))["input_ids"])
                for p in prompts}
    assert [p.name for p in buckets[50]] == ["p90"] and [p.name for p in buckets[100]] == ["p150"]
    assert buckets[100][0].context_tokens == measured["p150"] and measured["p40"] < 50
    assert skipped == {"shorter_than_lengths": 2, "too_long_for_target": 1}


def test_tau_standard_error_over_prompts():
    gens = [Generation([], 0.0, accepted=[1, 1]), Generation([], 0.0, accepted=[0, 2, 1, 1]),
            Generation([], 0.0, accepted=[0])]
    e, s = [4, 8, 1], [2, 4, 1]
    tau = sum(e) / sum(s)
    expected = math.sqrt(sum((ei - tau * si) ** 2 for ei, si in zip(e, s)) / (3 * 2)) / (sum(s) / 3)
    assert tau_standard_error(gens) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(tau_standard_error(gens[:1]))


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return target_and_draft(tiny_target)


def test_shared_prefill_decodes_as_a_fresh_prefill(tiny):
    target, draft = tiny
    cached = CachedTarget(target.model, target.aux_layer_ids)
    drafter = EagleDrafter(draft)
    prompt = list(range(3, 40))
    fresh = speculative_generate(cached, drafter, prompt, 3, 12)
    fresh_greedy = greedy_generate(cached, prompt, 12)
    shared = prefill_prompt(cached, prompt)
    for _ in range(2):  # the cache is cropped back to the prompt each time
        again = speculative_generate(cached, drafter, prompt, 3, 12, shared=shared)
        assert (again.tokens, again.accepted) == (fresh.tokens, fresh.accepted)
        assert greedy_generate(cached, prompt, 12, shared=shared).tokens == fresh_greedy.tokens == fresh.tokens
    with pytest.raises(ValueError, match="shared prefill"):
        speculative_generate(cached, drafter, prompt[:-1], 3, 12, shared=shared)


def test_evaluate_by_length_prefills_once_per_prompt_for_all_drafts(tiny, tiny_target, tmp_path, monkeypatch):
    """Two drafts (one with other aux layers), two k, a tree, two lengths: one prefill per prompt, the greedy check at
    every length, one JSON entry per length with τ, its standard error, the prompt count and the mean context."""
    import recipe.eval.by_length as by_length
    from recipe.eval.context import ContextPrompt

    target, draft = tiny
    first = write_export(export_tensors(draft.state_dict()), draft.config.to_hf_dict(), tmp_path / "a")
    config = draft_config_for(target.config, 64, {"aux_layer_ids": [0, 3, 5]})
    other = Eagle3Draft(config, seed=2)
    other.load_target_embeddings(target.embed_tokens_weight)
    second = write_export(export_tensors(other.state_dict()), config.to_hf_dict(), tmp_path / "b")
    gen = torch.Generator().manual_seed(0)
    buckets = {length: [ContextPrompt(f"p{i}@{length}", "all", torch.randint(3, VOCAB, (length + 5,),
                                                                              generator=gen).tolist(), length, length)
                        for i in range(3)] for length in (0, 40)}
    calls = []
    real = by_length.prefill_prompt
    monkeypatch.setattr(by_length, "prefill_prompt", lambda t, ids: calls.append(len(ids)) or real(t, ids))
    result = evaluate_by_length(tiny_target, {"a": first, "b": second}, buckets, [1, 3], 10, device="cpu",
                                tree=TreeSpec(2, 2, 3), window=8)
    assert calls == [5, 5, 5, 45, 45, 45]
    assert result["draft_window_size"] == 8 and result["target_dtype"] == "float32"
    assert [e["context_length"] for e in result["lengths"]] == [0, 40]
    for entry in result["lengths"]:
        assert entry["num_prompts"] == 3 and entry["mean_context_tokens"] == entry["context_length"]
        assert entry["mean_prompt_tokens"] == entry["context_length"] + 5
        assert [(r["draft"], r["num_draft_tokens"]) for r in entry["runs"]] == [("a", 1), ("a", 3), ("b", 1),
                                                                                 ("b", 3)]
        assert [r["draft"] for r in entry["tree_runs"]] == ["a", "b"]
        assert entry["tau"] == entry["runs"][0]["tau"] and entry["tau_se"] == entry["runs"][0]["tau_se"]
        assert entry["tau_tree"] == entry["tree_runs"][0]["tau"]
        for r in entry["runs"] + entry["tree_runs"]:
            assert r["new_tokens"] == 30 and 1.0 <= r["tau"] <= 1 + r["num_draft_tokens"]
    too_long = {0: [ContextPrompt("long", "all", [3] * 250, 250, 0)]}
    with pytest.raises(ValueError, match="max_position_embeddings 256"):
        evaluate_by_length(tiny_target, {"a": first}, too_long, [3], 10, device="cpu")


@pytest.mark.slow
def test_cli_by_context_length_on_real_target(assets, tmp_path, monkeypatch):
    """``python -m recipe.eval --context-lengths 0,1k`` on SmolLM2 with MT-Bench prompts and ShareGPT context, a
    random export: exit 0 without preparing assets, one entry per length, the 1k entry's mean context within 10 % of
    1024, the greedy check passing at both lengths; conflicting flags exit 2."""
    from transformers import AutoConfig

    from recipe.eval import __main__ as cli

    config = draft_config_for(AutoConfig.from_pretrained(assets.target), 512)
    export = write_export(export_tensors(Eagle3Draft(config, seed=0).state_dict()), config.to_hf_dict(),
                          tmp_path / "export")

    def no_assets(*_a, **_k):
        raise AssertionError("prepare_assets called")
    monkeypatch.setattr(cli, "prepare_assets", no_assets)
    out = tmp_path / "by_length.json"
    argv = ["--target", str(assets.target), "--draft", str(export), "--num-draft-tokens", "2", "--max-new-tokens",
            "4", "--limit", "2", "--output", str(out), "--device", "cpu", "--tree-topk", "2", "--tree-depth", "2",
            "--tree-budget", "3", "--prompts", str(assets.prompts), "--context-data", str(assets.conversations),
            "--context-lengths", "0,1k", "--draft-window-size", "512"]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert [e["context_length"] for e in result["lengths"]] == [0, 1024]
    zero, one_k = result["lengths"]
    assert zero["mean_context_tokens"] == 0 and abs(one_k["mean_context_tokens"] - 1024) <= 0.1 * 1024
    for entry in result["lengths"]:
        assert entry["num_prompts"] == 2 and 1.0 <= entry["tau"] <= 3.0 and entry["tau_se"] >= 0
        assert entry["runs"][0]["new_tokens"] == 8 and entry["tau_tree"] is not None
    assert result["context_request"] == "unrelated" and result["draft_window_size"] == 512
    assert cli.main(argv[:-4] + ["--context-request", "about-context"]) == 2  # no context lengths
    bucketed = [a for a in argv if a not in ("--context-data", str(assets.conversations))]
    assert cli.main(bucketed + ["--context-request", "about-context"]) == 2


def test_plot_of_tau_by_length_and_the_note_without_matplotlib(tmp_path, monkeypatch):
    """One line per draft and k / tree with the entries' mean context as x; without matplotlib nothing is written."""
    import sys

    from recipe.eval.length_report import plot_tau_by_length, tau_by_length_figure

    pytest.importorskip("matplotlib", reason="the plot extra (pip install -e '.[plot]')")
    run = {"draft": "out/export", "num_draft_tokens": 3, "tau": 1.5, "tau_se": 0.1}
    entries = [{"mean_context_tokens": m, "runs": [dict(run, tau=t)], "tree_runs": [dict(run, tree={}, tau=t + 0.2)]}
               for m, t in ((0.0, 1.5), (1000.0, 1.4))]
    fig = tau_by_length_figure(entries)
    lines = fig.axes[0].get_lines()
    xs = sorted({tuple(line.get_xdata()) for line in lines if len(line.get_xdata()) == 2})
    assert xs == [(0.0, 1000.0)]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["export k=3", "export tree d=3"]
    assert plot_tau_by_length(entries, tmp_path / "a.png") == tmp_path / "a.png" and (tmp_path / "a.png").stat().st_size
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert plot_tau_by_length(entries, tmp_path / "b.png") is None and not (tmp_path / "b.png").exists()


def test_cli_buckets_prompts_alone_and_inserts_context_data_without_assets(conversations, tiny_target, tmp_path,
                                                                           monkeypatch):
    """``--prompts`` alone: bucketed by length; with ``--context-data``: context inserted; neither prepares assets."""
    from recipe.eval import __main__ as cli

    calls = []

    def fake_evaluate(target, drafts, buckets, ks, max_new_tokens, **kw):
        calls.append((buckets, kw))
        return {"lengths": []}

    def no_assets(*_a, **_k):
        raise AssertionError("prepare_assets called")
    monkeypatch.setattr(cli, "load_tokenizer", lambda _path: WordTokenizer())
    monkeypatch.setattr(cli, "evaluate_by_length", fake_evaluate)
    monkeypatch.setattr(cli, "prepare_assets", no_assets)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": _words(n, "w"), "id": f"n{n}"}) + "\n" for n in (5, 30, 80, 300)))
    base = ["--target", str(tiny_target), "--draft", str(tmp_path), "--prompts", str(prompts), "--max-new-tokens",
            "8", "--num-draft-tokens", "3", "--tree-depth", "0", "--context-lengths", "20,50",
            "--draft-window-size", "16", "--dtype", "fp32", "--output", str(tmp_path / "r.json")]
    assert cli.main(base) == 0
    buckets, kw = calls[-1]
    assert {n: [p.name for p in b] for n, b in buckets.items()} == {20: ["n30"], 50: ["n80"]}
    assert kw["window"] == {str(tmp_path): 16} and kw["target_dtype"] == torch.float32
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["bucketed_by_prompt_length"] and result["skipped_prompts"] == {"shorter_than_lengths": 1,
                                                                                 "too_long_for_target": 1}
    assert cli.main(base + ["--context-data", str(conversations[0]), "--context-request", "about-context"]) == 0
    buckets, _ = calls[-1]
    assert [len(b) for b in buckets.values()] == [4, 4]
    assert all(p.category in ABOUT_CONTEXT_REQUESTS and 0 < p.context_tokens <= p.length
               for b in buckets.values() for p in b)
    assert json.loads((tmp_path / "r.json").read_text())["context_data"] == [str(conversations[0])]
    assert cli.main(base + ["--reference", "batched"]) == 0 and calls[-1][1]["reference"] == "batched"
    assert cli.main(base + ["--draft", f"{tmp_path}@4"]) == 0  # the same folder again, served with a window of 4
    assert calls[-1][1]["window"] == {str(tmp_path): 16, f"{tmp_path}@4": 4}
    assert cli.main(base + ["--draft", str(tmp_path)]) == 2  # the same label twice
