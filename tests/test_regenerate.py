"""``python -m recipe.regenerate`` on the tiny random target with a character-level ChatML tokenizer: greedy output is
deterministic and independent of the batch size, a resumed run skips finished ids and ends with the same file, ranks
split the work, bad rows are counted, and the output reads back as training data."""
from __future__ import annotations

import json
import shutil

import pytest

from recipe.regenerate import finished_ids, main, rank_output

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\n:;-()"


@pytest.fixture(scope="module")
def chat_target(tiny_target, tmp_path_factory):
    """The tiny target (vocab 96) with a character-level tokenizer: 3 special tokens + CHARS (< 96 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat_target") / "target"
    shutil.copytree(tiny_target, folder)
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS) + ["<unk>"])}
    assert len(vocab) <= 96
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder


def _data(path, n=5):
    lines = []
    for i in range(n):
        turns = [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"old answer {i}"}]
        if i % 2:
            turns += [{"from": "human", "value": "and then?"}, {"from": "gpt", "value": "old"}]
        lines.append(json.dumps({"conversations": turns}))
    lines.insert(2, json.dumps({"conversations": [{"from": "robot", "value": "x"}]}))  # bad row: unknown_role
    path.write_text("\n".join(lines) + "\n")
    return path


def _read(path):
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines())}


def _run(target, data, out, *extra):
    return main(["--target", str(target), "--data", str(data), "--output", str(out), "--max-new-tokens", "6",
                 "--device", "cpu", *extra])


def test_greedy_is_deterministic_batch_independent_and_resumable(chat_target, tmp_path, capsys):
    data = _data(tmp_path / "chats.jsonl")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert _run(chat_target, data, a, "--batch-size", "1") == 0
    assert "unknown_role" in capsys.readouterr().err
    assert _run(chat_target, data, b, "--batch-size", "3") == 0
    ra, rb = _read(a), _read(b)
    assert len(ra) == 5 and set(ra) == set(rb)
    for key, rec in ra.items():
        assert rec["messages"] == rb[key]["messages"], key
        roles = [m["role"] for m in rec["messages"]]
        assert roles in (["user", "assistant"], ["user", "assistant"] * 2)
        assert all(m["content"] and not m["content"].startswith("old") for m in rec["messages"][1::2])
        assert rec["messages"][0]["content"].startswith("question")
        prov = rec["regenerated"]
        assert prov["target"] == str(chat_target) and prov["temperature"] == 0.0 and prov["max_new_tokens"] == 6
        assert prov["source"] == str(data) and 0 <= prov["truncated_turns"] <= 2
    # resume: keep the first two lines (and a line cut by a kill), run again: the same records, each once
    c = tmp_path / "c.jsonl"
    lines = a.read_text().splitlines()
    c.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    assert len(finished_ids(c)) == 2
    assert _run(chat_target, data, c, "--batch-size", "2") == 0
    assert "3 conversations to regenerate (2 already" in capsys.readouterr().err
    ids = [json.loads(line)["id"] for line in c.read_text().splitlines()]  # the cut line is gone, all parse
    assert len(ids) == 5 and set(ids) == set(ra)
    assert {k: v["messages"] for k, v in _read(c).items()} == {k: v["messages"] for k, v in ra.items()}


def test_ranks_take_slices_and_output_is_training_data(chat_target, tmp_path, monkeypatch):
    from recipe.data.conversations import iter_rows

    data = _data(tmp_path / "chats.jsonl")
    out = tmp_path / "r.jsonl"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert _run(chat_target, data, out, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3") == 0
    parts = [rank_output(out, r, 2) for r in (0, 1)]
    assert [p.name for p in parts] == ["r.rank0.jsonl", "r.rank1.jsonl"]
    ids = [set(_read(p)) for p in parts]
    assert len(ids[0]) == 3 and len(ids[1]) == 2 and not ids[0] & ids[1]
    assert finished_ids(out) == ids[0] | ids[1]
    assert _read(parts[0])[min(ids[0])]["regenerated"]["top_p"] == 0.9
    rows = list(iter_rows(parts[0]))
    assert all(not r.reason for r in rows) and len(rows) == 3  # reads back as OpenAI-messages training data


def test_too_long_prompts_are_counted_skips(chat_target, tmp_path, capsys):
    data = _data(tmp_path / "chats.jsonl")
    out = tmp_path / "t.jsonl"
    # "<|im_start|>user\nquestion i<|im_end|>\n<|im_start|>assistant\n" is 29 tokens; second turns are longer
    assert _run(chat_target, data, out, "--max-length", "30") == 0
    assert "'too_long': 2" in capsys.readouterr().err
    assert len(_read(out)) == 3  # the single-turn conversations


def test_bad_settings_exit_2(chat_target, tmp_path):
    data = _data(tmp_path / "chats.jsonl")
    assert _run(chat_target, data, tmp_path / "x.jsonl", "--top-p", "0") == 2
    assert _run(chat_target, tmp_path / "missing.jsonl", tmp_path / "x.jsonl") == 2
