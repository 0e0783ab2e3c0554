"""Long training samples (docs/data.md, "Long-context data"): the long-document record shapes, conversations chained
up to a token budget (``--chain-conversations``), and the length histogram / far-above warning of the data report.
Fixtures: ``tests/data/long_context/`` (small); the cases that count SmolLM2's real tokens (and the real ShareGPT
rows) are slow."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from transformers import AutoTokenizer

from recipe.data.chain import join_chain, plan_chains, trim_for_chain
from recipe.data.chat_mask import tokenize_conversation
from recipe.data.conversations import iter_rows
from recipe.data.examples import build_examples, examples_fingerprint
from recipe.data.lengths import LengthReport

FIXTURES = Path(__file__).resolve().parent / "data" / "long_context"
DOC = ("The harbour town of Kessel kept its lighthouse lit for two hundred years. " * 6).strip()


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.target)


def _text(console_renderable) -> str:
    console = Console(record=True, width=300)
    console.print(console_renderable)
    return " ".join(console.export_text().split())


def test_long_document_shapes_and_bad_rows():
    rows = list(iter_rows(FIXTURES / "long_documents.jsonl"))
    good = {r.row: r.messages for r in rows if not r.reason}
    assert good[1] == [{"role": "user", "content": DOC + "\n\nHow long was the lighthouse kept lit?"},
                       {"role": "assistant", "content": "Two hundred years."}]
    assert good[2] == [{"role": "user", "content": DOC + "\n\nWhat did the town keep lit?\n\nA. A bonfire\n"
                                                   "B. A lighthouse\nC. A lantern\nD. Nothing"},
                       {"role": "assistant", "content": "B"}]
    assert good[3] == [{"role": "system", "content": "Answer from the document only."},
                       {"role": "user", "content": DOC + "\n\nName the town."},
                       {"role": "assistant", "content": "Kessel."}]
    assert good[4] == [{"role": "user", "content": "Below is a paper. " + DOC + "\nSummarise it."},
                       {"role": "assistant", "content": "A town kept a light."}]
    assert good[5] == [{"role": "user", "content": "Translate to French.\n\nThe lighthouse."},
                       {"role": "assistant", "content": "Le phare."}]
    assert good[6][1]["content"].startswith("Chapter one. ") and len(good[6][1]["content"]) > 2 * len(DOC)
    assert {r.row: r.reason for r in rows if r.reason} == {7: "no_question", 8: "no_answer", 9: "bad_content",
                                                           10: "unknown_schema"}


@pytest.mark.slow
def test_long_documents_tokenised_truncation_counted(tokenizer, tmp_path):
    """The document records train like any conversation; at a --max-length below the document the answer is gone
    (a counted no_supervised_tokens skip, never a silent loss), and the cut samples are counted."""
    path, cache = FIXTURES / "long_documents.jsonl", str(tmp_path / "cache")
    data, report = build_examples(path, tokenizer, 200, cache_dir=cache)
    assert list(data["row"]) == [1, 2, 3, 4, 5, 6] and report.lengths.lengths == [136, 153, 121, 139, 46, 228]
    assert report.lengths.truncated == report.truncated == 1  # row 6, LongWriter's long answer, cut at 200
    row1 = data[0]
    assert tokenizer.decode([t for t, m in zip(row1["input_ids"], row1["loss_mask"]) if m]) == \
        "Two hundred years.<|im_end|>"
    short, short_report = build_examples(path, tokenizer, 64, cache_dir=cache)
    (skips,) = short_report.files
    assert skips.skipped["no_supervised_tokens"] == 4 and list(short["row"]) == [5, 6]  # answers beyond 64 tokens
    assert short_report.lengths.truncated == 1 and dict(short_report.lengths.bins())["> 64 (cut)"] == 1


def test_document_columns_of_parquet_and_the_column_mapping(tmp_path):
    import datasets

    from recipe.data.sources import load_rows, resolve_source

    path = tmp_path / "qa.parquet"
    datasets.Dataset.from_dict({"article": [DOC, DOC], "query": ["Name the town.", ""],
                                "reply": ["Kessel.", "x"]}).to_parquet(path)
    with pytest.raises(ValueError, match="document/context column"):
        load_rows(resolve_source(path)[0], cache_dir=str(tmp_path / "c"))
    rows = load_rows(resolve_source(path)[0], cache_dir=str(tmp_path / "c"),
                     columns={"document": "article", "question": "query", "answer": "reply"})
    assert list(rows["reason"]) == ["", "no_question"]
    assert rows[0]["messages"] == [{"role": "user", "content": DOC + "\n\nName the town."},
                                   {"role": "assistant", "content": "Kessel."}]


def test_plan_chains_is_a_seeded_greedy_partition():
    lengths = [5, 3, 9, 4, 12, 1, 6]
    groups = plan_chains(lengths, budget=10, seed=7)
    order = np.random.default_rng(7).permutation(len(lengths)).tolist()
    assert [i for g in groups for i in g] == order  # consecutive groups of the seeded order, each index once
    for g, nxt in zip(groups, groups[1:] + [None]):
        assert sum(lengths[i] for i in g) <= 10 or len(g) == 1  # 12 > budget stands alone
        if nxt is not None:  # greedy: the next conversation did not fit
            assert sum(lengths[i] for i in g) + lengths[nxt[0]] > 10
    assert plan_chains(lengths, 10, 7) == groups and plan_chains(lengths, 10, 8) != groups
    with pytest.raises(ValueError, match="positive"):
        plan_chains(lengths, 0, 0)


def test_trim_and_join():
    sys_ = {"role": "system", "content": "S"}
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}
    assert trim_for_chain([a, u, a, u]) == ([u, a], 2)
    assert trim_for_chain([sys_, u, a]) == ([sys_, u, a], 0)
    assert trim_for_chain([a]) == ([], 1)
    assert join_chain([[sys_, u, a], [sys_, u, a], [u, a]]) == ([sys_, u, a, u, a, u, a], 1)


def _reference_chains(path, tokenizer, budget, seed, limit=None):
    """The chained conversations computed from the public helpers alone (no datasets plumbing)."""
    trimmed = [trim_for_chain(r.messages)[0] for r in iter_rows(path, limit=limit) if not r.reason]
    trimmed = [t for t in trimmed if t]
    lengths = [len(tokenizer.apply_chat_template(t, tokenize=True, return_dict=True)["input_ids"]) for t in trimmed]
    return [join_chain([trimmed[i] for i in g])[0] for g in plan_chains(lengths, budget, seed)]


def _check_supervised(ids, mask, messages, tokenizer):
    """Every assistant turn of the chain, and nothing else, is under the loss mask (ChatML: answer + <|im_end|>)."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "".join(a + "<|im_end|>" for a in answers)


@pytest.mark.slow
def test_chained_examples_render_with_the_template_and_are_cached(tokenizer, tmp_path):
    path, cache = FIXTURES / "chats.jsonl", str(tmp_path / "cache")
    data, report = build_examples(path, tokenizer, 512, cache_dir=cache, chain=90, seed=3)
    expected = _reference_chains(path, tokenizer, 90, 3)
    assert len(data) == len(expected) >= 3
    for sample, messages in zip(data, expected):
        tokens = tokenize_conversation(messages, tokenizer)
        assert sample["input_ids"] == tokens.input_ids and sample["loss_mask"] == tokens.loss_mask
        _check_supervised(sample["input_ids"], sample["loss_mask"], messages, tokenizer)
        assert len(sample["input_ids"]) <= 90 or sum(m["role"] == "user" for m in messages) == 1
    (chained,) = report.chains
    assert (chained.conversations, chained.samples) == (8, len(expected)) and chained.multi >= 2
    assert chained.dropped_turns == 2 + (0 if expected[0][0]["role"] == "system" else 1)
    (skips,) = report.files
    assert skips.skipped == {"no_prompt": 1, "unknown_role": 1} and skips.kept == len(expected)
    text = _text(report.table())
    assert "8 conversations -> " in text and "chained samples" in text
    again, _ = build_examples(path, tokenizer, 512, cache_dir=cache, chain=90, seed=3)
    assert examples_fingerprint(again) == examples_fingerprint(data) and again["input_ids"] == data["input_ids"]
    other_seed, _ = build_examples(path, tokenizer, 512, cache_dir=cache, chain=90, seed=4)
    other_budget, _ = build_examples(path, tokenizer, 512, cache_dir=cache, chain=200, seed=3)
    plain, _ = build_examples(path, tokenizer, 512, cache_dir=cache, seed=3)
    assert len({examples_fingerprint(d) for d in (data, other_seed, other_budget, plain)}) == 4
    assert len(other_budget) < len(data) < len(plain)


@pytest.mark.slow
def test_chaining_is_per_file_and_mixes_by_weight(tokenizer, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    lines = (FIXTURES / "chats.jsonl").read_text().splitlines()
    a.write_text("\n".join(lines[:5]) + "\n")
    b.write_text("\n".join(lines[5:]) + "\n")
    data, report = build_examples([a, b], tokenizer, 512, cache_dir=str(tmp_path / "c"), chain=90, seed=0,
                                  weights=[1.0, 1.0])
    assert [c.path for c in report.chains] == [str(a), str(b)]
    assert set(data["source"]) <= {str(a), str(b)} and len(data) >= 2


def test_length_report_bins_truncation_and_warning():
    report = LengthReport(max_length=2048, lengths=[100, 256, 257, 1500, 2048, 5000])
    assert report.bins() == [("0-256", 2), ("256-512", 1), ("512-1k", 0), ("1k-2k", 2), ("> 2k (cut)", 1)]
    assert report.truncated == 1 and report.longest == 5000 and report.warning() is None
    assert LengthReport(max_length=4096, lengths=[1024]).warning() is None  # longest = max_length / 4
    assert LengthReport(max_length=4096, lengths=[1024] + [10] * 99).warning() is None  # 1 % reach it
    assert "1 of 101 reach 1024 tokens" in LengthReport(max_length=4096, lengths=[1024] + [10] * 100).warning()
    warn = LengthReport(max_length=4096, lengths=[1023, 10])
    assert "--max-length 4096 is far above the samples: 0 of 2 reach 1024 tokens" in warn.warning()
    assert "the longest is 1023 tokens" in warn.warning()
    text = _text(warn.table())
    assert "warning: --max-length 4096" in text and "truncated at --max-length: 0" in text
    assert LengthReport(max_length=4096).warning() is None


@pytest.mark.slow
def test_real_sharegpt_rows_warn_at_128k_and_chain(tokenizer, assets, tmp_path):
    """ShareGPT's conversations are short: the 128k recipe's --max-length draws the warning; chaining them at the
    run's length builds samples near the budget, every answer supervised as the template renders the chain."""
    cache = str(tmp_path / "cache")
    data, report = build_examples(assets.conversations, tokenizer, 131072, cache_dir=cache, limit=300)
    assert report.lengths.longest < 131072 // 4 and len(report.lengths.lengths) == len(data)
    assert "--max-length 131072 is far above the samples: 0 of" in _text(report.table())
    chained, chain_report = build_examples(assets.conversations, tokenizer, 32768, cache_dir=cache, limit=300,
                                           chain=32768, seed=0)
    (info,) = chain_report.chains
    assert info.conversations > 250 and info.samples == len(chained) < info.conversations // 10
    assert max(info.lengths) <= 32768 or info.samples == 1
    assert chain_report.lengths.warning() is None and chain_report.lengths.truncated == 0
    assert chain_report.lengths.lengths == [len(x) for x in chained["input_ids"]]
    expected = _reference_chains(assets.conversations, tokenizer, 32768, 0, limit=300)
    for sample, messages in list(zip(chained, expected))[:3]:
        assert sample["input_ids"] == tokenize_conversation(messages, tokenizer).input_ids
        _check_supervised(sample["input_ids"], sample["loss_mask"], messages, tokenizer)


def test_chain_flag_is_parsed_with_the_length_syntax(capsys):
    from recipe.dump import _parse
    from recipe.train.flags import parse_args

    args = parse_args(["--ds_config", "x.json", "--target", "t", "--output", "o", "--data", "d.jsonl",
                       "--chain-conversations", "32k"])
    assert args.chain_conversations == 32768
    dump = _parse(["--target", "t", "--data", "d.jsonl", "--output", "o", "--chain-conversations", "1.5k"])
    assert dump.chain_conversations == 1536
    with pytest.raises(SystemExit):
        parse_args(["--ds_config", "x.json", "--target", "t", "--output", "o", "--data", "d.jsonl",
                    "--chain-conversations", "0"])
    json.dumps(args.chain_conversations)  # recorded in run_config.json like every flag
    with pytest.raises(SystemExit):  # an offline store was chained when it was dumped
        parse_args(["--ds_config", "x.json", "--target", "t", "--output", "o", "--hidden-states", "s",
                    "--chain-conversations", "4k"])
    assert "python -m recipe.dump --chain-conversations" in capsys.readouterr().err


def test_dump_writes_the_chained_samples(chat_target, tmp_path):
    """``recipe.dump --chain-conversations`` stores the chained samples: the store's tokens and loss masks are
    those ``build_examples`` chains with the same flags (tiny target, character-level ChatML tokenizer)."""
    from transformers import AutoTokenizer

    from recipe.data.store import HiddenStateStore
    from recipe.dump import main as dump_main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                                          {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
                            for i in range(7)))
    cache = str(tmp_path / "cache")
    dump_main(["--target", str(chat_target), "--data", str(data), "--output", str(tmp_path / "store"),
               "--max-length", "256", "--chain-conversations", "150", "--seed", "5", "--dtype", "fp32",
               "--cache-dir", cache])
    expected, report = build_examples(data, AutoTokenizer.from_pretrained(chat_target), 256, cache_dir=cache,
                                      chain=150, seed=5)
    store = HiddenStateStore(tmp_path / "store")
    assert len(store) == len(expected) == report.chains[0].samples == 3  # 7 conversations of 39 tokens: 3 + 3 + 1
    stored = sorted(store.get(i, fields=("input_ids", "loss_mask"))["input_ids"].tolist() for i in range(len(store)))
    assert stored == sorted(expected["input_ids"])
