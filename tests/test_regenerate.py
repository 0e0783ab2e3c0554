"""``python -m recipe.regenerate`` on the tiny random target with a character-level ChatML tokenizer: greedy output is
deterministic and independent of the batch size, a resumed run skips finished ids and ends with the same file, ranks
split the work, bad rows are counted, and the output reads back as training data."""
from __future__ import annotations

import json

from recipe.regenerate import finished_ids, main, rank_output


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


def test_greedy_is_deterministic_batch_independent_and_resumable(chat_target, tmp_path, capsys, monkeypatch):
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
    # the same source spelt relative to another working folder: the ids match, nothing is redone
    monkeypatch.chdir(data.parent)
    assert _run(chat_target, data.name, c) == 0
    assert "0 conversations to regenerate (5 already" in capsys.readouterr().err
    assert c.read_text().count("\n") == 5


def test_ranks_take_slices_and_output_is_training_data(chat_target, tmp_path, monkeypatch):
    from recipe.data.conversations import iter_rows

    data = _data(tmp_path / "chats.jsonl")
    out = tmp_path / "r.jsonl"
    # rank 0 as torchrun/deepspeed start it, rank 1 as mpirun does (recipe.lifecycle.distributed.launcher_ranks)
    launchers = [{"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
                 {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}]
    for env in launchers:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert _run(chat_target, data, out, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3") == 0
    parts = [rank_output(out, r, 2) for r in (0, 1)]
    assert [p.name for p in parts] == ["r.rank0.jsonl", "r.rank1.jsonl"]
    ids = [set(_read(p)) for p in parts]
    assert len(ids[0]) == 3 and len(ids[1]) == 2 and not ids[0] & ids[1]
    assert finished_ids(out) == ids[0] | ids[1]
    assert _read(parts[0])[min(ids[0])]["regenerated"]["top_p"] == 0.9
    rows = list(iter_rows(parts[0]))
    assert all(not r.reason for r in rows) and len(rows) == 3  # reads back as OpenAI-messages training data


def test_length_budget_keeps_prompts_whole_and_counts_cuts(chat_target, tmp_path, capsys):
    data = _data(tmp_path / "chats.jsonl")
    with data.open("a") as f:  # a long document: its prompt alone is over the budget, a counted skip, never cut
        f.write(json.dumps({"context": "long document " * 10, "question": "why?", "answer": "old"}) + "\n")
    out = tmp_path / "t.jsonl"
    # "<|im_start|>user\nquestion i<|im_end|>\n<|im_start|>assistant\n" is 29 tokens: 6 tokens of budget are left
    assert _run(chat_target, data, out, "--max-length", "35", "--max-new-tokens", "50") == 0
    err = " ".join(capsys.readouterr().err.split())  # the console wraps lines
    assert "'too_long': 1" in err and "2 assistant turns cut at the --max-length budget" in err
    records = _read(out)
    assert len(records) == 5  # the two-turn conversations keep their first exchange
    for rec in records.values():
        question, answer = (m["content"] for m in rec["messages"])  # roles user, assistant: nothing else left
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"] and len(question) == 10
        assert 1 <= len(answer) <= 35 - 29  # characters = tokens of the character-level tokenizer (EOS not kept)
        assert rec["regenerated"]["cut_turns"] == (question in ("question 1", "question 3"))


def test_max_turns_keeps_the_first_exchanges(chat_target, tmp_path):
    data = _data(tmp_path / "chats.jsonl")
    full, first = tmp_path / "full.jsonl", tmp_path / "first.jsonl"
    assert _run(chat_target, data, full) == 0 and _run(chat_target, data, first, "--max-turns", "1") == 0
    rf, r1 = _read(full), _read(first)
    assert set(rf) == set(r1) and sum(len(r["messages"]) == 4 for r in rf.values()) == 2
    for key, rec in r1.items():
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"], key
        assert rec["messages"] == rf[key]["messages"][:2]  # greedy: the first turn does not depend on the cut
        assert rec["regenerated"]["max_turns"] == 1


def test_answers_that_open_a_conversation_are_dropped(chat_target, tmp_path, capsys):
    data = _data(tmp_path / "chats.jsonl", n=2)
    with data.open("a") as f:
        for turns in ([("gpt", "hello"), ("human", "hi"), ("gpt", "old")], [("gpt", "x"), ("human", "y")]):
            f.write(json.dumps({"conversations": [{"from": a, "value": v} for a, v in turns]}) + "\n")
    out = tmp_path / "p.jsonl"
    assert _run(chat_target, data, out) == 0
    assert "'no_prompt': 1" in capsys.readouterr().err  # the second has no answer once its opening one is gone
    records = _read(out)
    assert len(records) == 3
    tail = records[f"{data}:4"]  # rows count from 1; row 3 is the bad one
    assert [m["role"] for m in tail["messages"]] == ["user", "assistant"] and tail["messages"][0]["content"] == "hi"
    assert tail["regenerated"]["dropped_leading_turns"] == 1
    assert all(r["regenerated"]["dropped_leading_turns"] == 0 for k, r in records.items() if k != f"{data}:4")


def test_bad_settings_exit_2(chat_target, tmp_path):
    data = _data(tmp_path / "chats.jsonl")
    assert _run(chat_target, data, tmp_path / "x.jsonl", "--top-p", "0") == 2
    assert _run(chat_target, data, tmp_path / "x.jsonl", "--max-turns", "0") == 2
    assert _run(chat_target, tmp_path / "missing.jsonl", tmp_path / "x.jsonl") == 2
