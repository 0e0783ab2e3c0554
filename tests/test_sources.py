"""``--data`` through ``datasets``: a JSONL and a Parquet file with a column mapping, folders, CSV cells holding JSON,
mixing weights (interleaving), the offline hub error, and the flags of run.py that carry them."""
from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from recipe.data.examples import build_examples
from recipe.data.sources import resolve_source
from recipe.train.flags import parse_args

MAX_LENGTH = 64


def _openai(k):
    return [{"role": "user", "content": f"question {k}"}, {"role": "assistant", "content": f"answer {k}"}]


def _sharegpt(k):
    return {"conversations": [{"from": "human", "value": f"hi {k}"}, {"from": "gpt", "value": f"hello {k}"}]}


@pytest.fixture(scope="module")
def tokenizer(chat_target):
    return AutoTokenizer.from_pretrained(chat_target)


@pytest.fixture
def files(tmp_path):
    """a.jsonl: ShareGPT, line 3 broken; b.parquet: OpenAI turns in column 'dialog', row 1 without an assistant."""
    jsonl = tmp_path / "data" / "a.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("\n".join([json.dumps(_sharegpt(0)), json.dumps(_sharegpt(1)), "{broken",
                                json.dumps(_sharegpt(3))]) + "\n", encoding="utf-8")
    dialogs = [_openai(0), [{"role": "user", "content": "alone"}], _openai(2), _openai(3), _openai(4)]
    parquet = tmp_path / "data" / "b.parquet"
    datasets.Dataset.from_dict({"dialog": dialogs, "id": list(range(5))}).to_parquet(str(parquet))
    return jsonl, parquet


def _templated(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def _as_openai(record):
    roles = {"human": "user", "gpt": "assistant"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]


def test_jsonl_and_parquet_with_a_column_mapping(tokenizer, files, tmp_path):
    jsonl, parquet = files
    dataset, report = build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"),
                                     columns={"messages": "dialog"})
    assert list(zip(dataset["source"], dataset["row"])) == [(str(jsonl), 1), (str(jsonl), 2), (str(jsonl), 4),
                                                            (str(parquet), 0), (str(parquet), 2),
                                                            (str(parquet), 3), (str(parquet), 4)]
    expected = [_as_openai(_sharegpt(k)) for k in (0, 1, 3)] + [_openai(k) for k in (0, 2, 3, 4)]
    assert dataset["input_ids"] == [_templated(tokenizer, m) for m in expected]
    a, b = report.files
    assert (a.path, a.kept, a.skipped, a.example_rows) == (str(jsonl), 3, {"invalid_json": 1}, {"invalid_json": [3]})
    assert (b.path, b.kept, b.skipped, b.example_rows) == (str(parquet), 4, {"no_assistant_turn": 1},
                                                           {"no_assistant_turn": [1]})
    assert (report.kept, report.total) == (7, 9)
    # without the mapping the Parquet file has no conversation column: an error naming it, its columns and the flag
    with pytest.raises(ValueError) as err:
        build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"))
    assert str(err.value).startswith(f"{parquet}: no conversation column: the parquet file has columns [")
    assert "'dialog'" in str(err.value) and "--data-column messages=dialog" in str(err.value)


def test_folder_equals_its_files_and_limit_applies_per_file(tokenizer, files, tmp_path):
    jsonl, parquet = files
    assert [f.name for f in resolve_source(jsonl.parent)] == [str(jsonl), str(parquet)]  # sorted, recursive
    by_files, _ = build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"),
                                 columns={"messages": "dialog"}, limit=3)
    by_folder, report = build_examples(jsonl.parent, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"),
                                       columns={"messages": "dialog"}, limit=3)
    assert by_folder.to_dict() == by_files.to_dict()
    assert [r.total for r in report.files] == [3, 3] and by_folder["row"] == [1, 2, 0, 2]


def test_csv_cells_hold_json_turns(tokenizer, tmp_path):
    path = tmp_path / "c.csv"
    datasets.Dataset.from_dict({"messages": [json.dumps(_openai(k)) for k in range(3)] + ["[oops"]}).to_csv(
        str(path), index=False)
    dataset, report = build_examples(path, tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"))
    assert dataset["row"] == [0, 1, 2]
    assert dataset["input_ids"] == [_templated(tokenizer, _openai(k)) for k in range(3)]
    assert report.files[0].skipped == {"invalid_json": 1} and report.files[0].example_rows == {"invalid_json": [3]}


def test_mixing_weights_interleave_without_repeats(tokenizer, files, tmp_path):
    jsonl, parquet = files
    kwargs = dict(cache_dir=str(tmp_path / "c"), columns={"messages": "dialog"})
    plain, _ = build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, **kwargs)
    mixed, _ = build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, weights=[1, 3], seed=5, **kwargs)
    again, _ = build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, weights=[1, 3], seed=5, **kwargs)
    assert mixed.to_dict() == again.to_dict()  # the seed fixes the mix
    keys = list(zip(mixed["source"], mixed["row"]))
    assert len(set(keys)) == len(keys) and len(keys) < len(plain)  # no sample twice, not all of them
    counts = [sum(source == str(f) for source, _ in keys) for f in (jsonl, parquet)]
    # 'first_exhausted': the mix stops as soon as one source has given all its rows (3 from a, 4 from b)
    assert counts[0] == 3 or counts[1] == 4, counts
    # the documented rule, applied by hand to the unmixed sources: probabilities w_i / sum(w), the run's seed
    per_source = [plain.filter(lambda s, f=str(f): s == f, input_columns="source") for f in (jsonl, parquet)]
    rule = datasets.interleave_datasets(per_source, probabilities=[0.25, 0.75], seed=5,
                                        stopping_strategy="first_exhausted")
    assert keys == list(zip(rule["source"], rule["row"]))
    assert mixed["input_ids"] == rule["input_ids"]
    with pytest.raises(ValueError, match="1 mixing weight\\(s\\) for 2 data source\\(s\\)"):
        build_examples([jsonl, parquet], tokenizer, MAX_LENGTH, weights=[1], **kwargs)


def test_hub_names_fail_clearly_offline(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        build_examples("someorg/some-chats", tokenizer, MAX_LENGTH, cache_dir=str(tmp_path / "c"))
    assert "--data someorg/some-chats: no such file or folder" in str(err.value)
    assert "hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)" in str(err.value)
    with pytest.raises(ValueError, match="missing.parquet: conversation file not found"):
        build_examples(tmp_path / "missing.parquet", tokenizer, MAX_LENGTH)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: folder holds no conversation file"):
        build_examples(tmp_path / "empty", tokenizer, MAX_LENGTH)


def test_run_flags_carry_sources_mapping_and_weights(capsys):
    base = ["--ds_config", "x.json", "--target", "t", "--output", "o"]
    args = parse_args(base + ["--data", "a.jsonl", "b.parquet", "--data-column", "messages=dialog",
                              "--data-column", "conversations=turns", "--data-weights", "2,1"])
    assert args.data == ["a.jsonl", "b.parquet"] and args.data_weights == [2.0, 1.0]
    assert args.data_column == {"messages": "dialog", "conversations": "turns"}
    for extra, message in ((["--data-weights", "1"], "--data-weights has 1 value(s) for 2 --data source(s)"),
                           (["--data-column", "text=dialog"], "expected FIELD=COLUMN with FIELD one of"),
                           (["--data-weights", "1,-1"], "weights must be positive")):
        with pytest.raises(SystemExit):
            parse_args(base + ["--data", "a.jsonl", "b.parquet", *extra])
        assert message in capsys.readouterr().err
