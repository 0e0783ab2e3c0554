import json

import pytest

from recipe.data.conversations import BadRow, iter_rows, normalise_record


def test_sharegpt_roles_are_normalised_and_system_field_leads():
    record = {"system": "Be terse.", "conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
        {"from": "user", "value": "c"}, {"from": "chatgpt", "value": "d"},
        {"from": "Human", "value": "e"}, {"from": "bard", "value": "f"}]}
    assert normalise_record(record) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]


def test_openai_messages_keep_system_and_all_turns():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"}]
    assert normalise_record({"messages": messages, "extra": 1}) == messages


@pytest.mark.parametrize("record, reason", [
    ({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ["y"]}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
                   {"role": "assistant", "content": "y"}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "text", "text": " "}]}]}, "bad_content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]}, "no_assistant_turn"),
    ({"conversations": []}, "no_assistant_turn"),
    ({"text": "hello"}, "unknown_schema"),
    ({"messages": "hello"}, "unknown_schema"),
    ([1, 2], "unknown_schema"),
    ({"messages": ["hello"]}, "unknown_schema"),
])
def test_bad_records_raise_their_reason(record, reason):
    with pytest.raises(BadRow) as err:
        normalise_record(record)
    assert err.value.reason == reason


def _good(k):
    return {"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}]}


def test_jsonl_bad_lines_are_counted_with_line_numbers(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(_good(1)).encode(), b"{not json", b"", json.dumps({"x": 1}).encode(),
             '{"messages": "\u00e9"}'.encode("latin-1"), json.dumps(_good(2)).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = list(iter_rows(path))
    assert [(r.row, r.reason) for r in rows] == [
        (1, ""), (2, "invalid_json"), (4, "unknown_schema"), (5, "non_utf8"), (6, "")]
    assert rows[0].messages == _good(1)["messages"] and rows[4].messages == _good(2)["messages"]
    assert [r.row for r in iter_rows(path, limit=2)] == [1, 2]


def test_truncated_json_array_yields_complete_records_then_one_invalid_row(tmp_path):
    path = tmp_path / "c.json"
    text = json.dumps([_good(0), _good(1), _good(2)])
    path.write_text(text[: text.rindex("q2") + 1], encoding="utf-8")
    rows = list(iter_rows(path))
    assert [(r.row, r.reason) for r in rows] == [(0, ""), (1, ""), (2, "invalid_json")]
    path.write_text(json.dumps([_good(0), {"bad": 1}]), encoding="utf-8")
    assert [(r.row, r.reason) for r in iter_rows(path)] == [(0, ""), (1, "unknown_schema")]


@pytest.mark.parametrize("name, content, message", [
    ("c.jsonl", "", "empty"),
    ("c.jsonl", "\n  \n", "empty"),
    ("c.json", " [ ] ", "empty"),
    ("c.txt", "{}", "unknown conversation file extension"),
    ("c.json", '{"messages": []}', "must hold a JSON array"),
])
def test_whole_file_problems_name_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        list(iter_rows(path))
    assert str(path) in str(err.value)


def test_missing_file_and_non_utf8_json_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="not found") as err:
        list(iter_rows(tmp_path / "absent.jsonl"))
    assert "absent.jsonl" in str(err.value)
    path = tmp_path / "latin.json"
    path.write_bytes(b'[{"messages": "\xe9"}]')
    with pytest.raises(ValueError, match="not valid UTF-8 at byte 15") as err:
        list(iter_rows(path))
    assert str(path) in str(err.value)
