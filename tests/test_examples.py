import copy
import json

import pytest
from rich.console import Console
from transformers import AutoTokenizer

from recipe.data.examples import build_examples, token_counts

MAX_LENGTH = 64
SYSTEM_TURN = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"},
               {"role": "assistant", "content": "Hi there!"}]


def _sharegpt(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def _lines():
    """Line k+1 of the file is entry k; the comment says what becomes of it."""
    return [
        json.dumps({"messages": SYSTEM_TURN}).encode(),                              # 1 kept
        b'{"messages": [',                                                            # 2 invalid_json
        b'{"conversations": "caf\xe9"}',                                              # 3 non_utf8
        json.dumps(_sharegpt(("human", "2+2?"), ("gpt", "4"))).encode(),              # 4 kept
        json.dumps(_sharegpt(("human", "x"), ("robot", "y"))).encode(),               # 5 unknown_role
        json.dumps(_sharegpt(("human", "x"), ("gpt", ""))).encode(),                  # 6 bad_content
        json.dumps(_sharegpt(("system", "s"), ("human", "x"))).encode(),              # 7 no_assistant_turn
        json.dumps(_sharegpt(("human", "word " * 200), ("gpt", "ok"))).encode(),      # 8 no_supervised_tokens
        json.dumps(_sharegpt(("human", "Tell"), ("gpt", "story " * 200))).encode(),   # 9 kept, truncated
        json.dumps({"text": "plain"}).encode(),                                       # 10 unknown_schema
    ]


@pytest.fixture(scope="module")
def tokenizer(chat_target):
    return AutoTokenizer.from_pretrained(chat_target)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(_lines()) + b"\n")
    return path


def test_rows_masks_and_skip_reasons(tokenizer, data_file, tmp_path):
    dataset, data_report = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "cache"))
    assert dataset.column_names == ["input_ids", "loss_mask", "row", "source"]
    assert dataset["row"] == [1, 4, 9] and set(dataset["source"]) == {str(data_file)}
    assert (data_report.kept, data_report.truncated, data_report.total) == (3, 1, 10)
    (report,) = data_report.files
    assert report.skipped == {"invalid_json": 1, "non_utf8": 1, "unknown_role": 1, "bad_content": 1,
                              "no_assistant_turn": 1, "no_supervised_tokens": 1, "unknown_schema": 1}
    assert report.example_rows == {"invalid_json": [2], "non_utf8": [3], "unknown_role": [5], "bad_content": [6],
                                   "no_assistant_turn": [7], "no_supervised_tokens": [8], "unknown_schema": [10]}
    ids, mask = dataset[0]["input_ids"], dataset[0]["loss_mask"]
    assert ids == tokenizer.apply_chat_template(SYSTEM_TURN, tokenize=True)["input_ids"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Hi there!<|im_end|>"
    long_ids, long_mask = dataset[2]["input_ids"], dataset[2]["loss_mask"]
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Tell"},
                                          {"role": "assistant", "content": "story " * 200}], tokenize=True)
    assert long_ids == full["input_ids"][:MAX_LENGTH] and len(long_mask) == MAX_LENGTH
    assert set(long_mask) == {0, 1} and long_mask[-1] == 1
    total, supervised = token_counts(dataset)
    assert total == sum(len(x) for x in dataset["input_ids"])
    assert supervised == sum(sum(x) for x in dataset["loss_mask"])
    console = Console(record=True, width=200)
    console.print(data_report.table())
    text = console.export_text()
    assert "skipped: no_supervised_tokens" in text and "of which truncated" in text
    assert report.first_detail["unknown_role"] == "turn 1 has from='robot'"
    assert "first: turn 1 has from='robot'" in text


def test_drop_long_policy_and_limit(tokenizer, data_file, tmp_path):
    dataset, data_report = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"),
                                          drop_long=True)
    (report,) = data_report.files
    assert dataset["row"] == [1, 4]
    assert report.skipped["too_long"] == 2 and report.example_rows["too_long"] == [8, 9]
    assert report.truncated == 0 and "no_supervised_tokens" not in report.skipped
    dataset, report = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"), limit=4)
    assert dataset["row"] == [1, 4] and report.total == 4


def _arrow_files(folder):
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*.arrow")}


def test_second_call_hits_the_cache_and_content_changes_miss_it(tokenizer, data_file, tmp_path):
    cache = tmp_path / "cache"
    first, _ = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(cache))
    files = _arrow_files(cache)
    second, report = build_examples(data_file, copy.deepcopy(tokenizer), MAX_LENGTH, cache_dir=str(cache))
    assert second._fingerprint == first._fingerprint
    assert [f["filename"] for f in second.cache_files] == [f["filename"] for f in first.cache_files]
    assert _arrow_files(cache) == files  # nothing rewritten, nothing added
    assert report.kept == 3
    other, _ = build_examples(data_file, tokenizer, MAX_LENGTH + 1, cache_dir=str(cache))
    assert other._fingerprint != first._fingerprint
    # Same path, new content: the cache is keyed by content, so the new row is seen.
    data_file.write_text(json.dumps({"messages": SYSTEM_TURN[1:]}) + "\n", encoding="utf-8")
    changed, report = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(cache))
    assert changed["row"] == [1] and report.total == 1
    assert changed[0]["input_ids"] == tokenizer.apply_chat_template(SYSTEM_TURN[1:], tokenize=True)["input_ids"]


@pytest.mark.slow
def test_num_proc_gives_the_same_examples(tokenizer, data_file, tmp_path):
    serial, _ = build_examples(data_file, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "a"))
    parallel, report = build_examples(data_file, tokenizer, MAX_LENGTH, num_proc=2, cache_dir=str(tmp_path / "b"))
    assert parallel.to_dict() == serial.to_dict()
    assert report.kept == 3
    assert len({f["filename"] for f in parallel.cache_files}) >= 2  # one tokenised shard per worker


def test_nothing_usable_and_empty_files_name_the_file(tokenizer, tmp_path):
    path = tmp_path / "wrong_schema.jsonl"
    path.write_text('{"text": "a"}\n{"prompt": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="no conversation column") as err:  # no record has the field: its keys named
        build_examples(path, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"))
    assert str(path) in str(err.value) and "records have the keys ['prompt', 'text']" in str(err.value)
    assert "--data-column messages=prompt" in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="empty") as err:
        build_examples(empty, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"))
    assert str(empty) in str(err.value)
    (tmp_path / "data.txt").write_text(json.dumps({"messages": SYSTEM_TURN}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown conversation file extension '.txt'"):
        build_examples(tmp_path / "data.txt", tokenizer, MAX_LENGTH)
