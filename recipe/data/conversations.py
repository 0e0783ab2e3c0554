"""Conversation files → normalised turns ``[{"role": "system"|"user"|"assistant", "content": str}]``.

Two on-disk schemas are accepted, one record per JSONL line or one element of a top-level JSON array:

- ShareGPT: ``{"conversations": [{"from": "human"|"user"|"gpt"|"assistant"|"chatgpt"|"bard"|"system",
  "value": str}, ...]}`` (an optional top-level ``"system": str`` becomes a leading system turn);
- OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``; ``content`` may also be
  a list of text parts ``[{"type": "text", "text": str}, ...]``, joined with newlines (other part types, e.g.
  images, make the row ``bad_content``).

Records without either list are read in the single-turn shapes long-context SFT sets publish
(:func:`document_turns`): a long document + a question + an answer (LongBench ``context``/``input``/``answers``,
LongBench-v2 ``context``/``question``/``choice_A..D``/``answer``, ``document``/``question``/``answer``) becomes a user
turn ``document + "\n\n" + question`` and an assistant turn with the answer; an instruction record (Alpaca,
LongAlpaca: ``instruction``/``input``/``output``) becomes ``instruction (+ "\n\n" + input)`` and ``output``.
LongWriter's long answers come as OpenAI ``messages`` and need nothing else.

A column mapping (``run.py --data-column messages=dialog``, likewise ``document=``, ``question=``, ``answer=``)
names another field; a field holding a JSON string of the list (a CSV cell) is decoded. Parquet, CSV and hub
datasets are read by ``datasets`` (``recipe.data.sources``) and each of their rows goes through
:func:`row_from_record` like a JSON record.

Reading is tolerant: :func:`iter_rows` yields one :class:`Row` per source record, either with its normalised turns or
with a skip ``reason`` (one of :data:`SKIP_REASONS`) and a short ``detail``. A bad record never stops the read. Row
numbers are 1-based line numbers for ``.jsonl`` and 0-based array indices for ``.json``. Whole-file problems (missing
file, unknown extension, empty file, a ``.json`` file that is not an array) raise ``ValueError`` naming the file.

A ``.json`` array is decoded element by element, so a file truncated mid-record (the packaged ShareGPT file,
docs/environment.md, "Offline assets") yields every complete record and one ``invalid_json`` row for the broken
tail.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
}

SKIP_REASONS = {
    "invalid_json": "line is not valid JSON",
    "non_utf8": "line is not valid UTF-8",
    "unknown_schema": "record has no 'conversations' or 'messages' list, nor a document or instruction shape",
    "unknown_role": "a turn has a role outside system/user/assistant (and ShareGPT aliases)",
    "bad_content": "a turn's content is empty, not a string, or holds a part that is not text",
    "no_assistant_turn": "no assistant turn to supervise",
    "no_question": "a document record has no question text (question/input/instruction)",
    "no_answer": "a document or instruction record has no answer text (answer/answers/output)",
    "template_error": "the chat template could not render the conversation",
    "too_long": "longer than max_length (drop_long policy)",
    "no_prompt": "no user turn before an assistant turn (nothing to chain or to regenerate from)",
    "no_supervised_tokens": "no assistant token left after truncation",
}

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""The conversation file suffixes ``--data`` reads and the ``datasets`` loader of each (``recipe.data.sources``)."""


class BadRow(Exception):
    """A record that cannot be used; ``reason`` is a key of :data:`SKIP_REASONS`, ``detail`` a short explanation."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Row:
    """One source record: ``row`` (line number / array index), ``messages`` or a skip ``reason`` + ``detail``."""

    row: int
    messages: list[dict[str, str]] = field(default_factory=list)
    reason: str = ""
    detail: str = ""


def _turn_list(record: dict, column: str) -> list | None:
    """``record[column]`` when it is a list or a JSON string of one (CSV cells); None otherwise. BadRow
    ``invalid_json`` for a string that starts like a JSON list but does not parse."""
    value = record.get(column)
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise BadRow("invalid_json", f"column {column!r}: {err}"[:80]) from None
    return value if isinstance(value, list) else None


def _text_parts(content: object, k: int, role: str) -> object:
    """OpenAI content parts ``[{"type": "text", "text": str}, ...]`` -> their texts joined with ``"\n"``; any other
    value is returned unchanged. BadRow ``bad_content`` for a list with a part that is not a text part."""
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content) or not content:
        return content
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRow("bad_content", f"turn {k} ({role}) content part {j} is not a text part: {part!r:.40}")
    return "\n".join(part["text"] for part in content)


def normalise_record(record: object, columns: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Return the record's turns as ``[{"role", "content"}]`` with roles in {system, user, assistant}.

    ``columns`` maps a conversation field (``conversations`` / ``messages``) to the key that holds it in this
    record (e.g. ``{"messages": "dialog"}``); unmapped fields are read under their own name.

    Raises:
        BadRow: ``unknown_schema``, ``unknown_role``, ``bad_content``, ``no_assistant_turn`` or ``invalid_json``
        (a JSON-string field that does not parse).
    """
    columns = columns or {}
    conversations, messages = columns.get("conversations", "conversations"), columns.get("messages", "messages")
    turns = _turn_list(record, conversations) if isinstance(record, dict) else None
    if turns is not None:
        role_key, content_key = "from", "value"
    else:
        turns = _turn_list(record, messages) if isinstance(record, dict) else None
        role_key, content_key = "role", "content"
    if turns is None and isinstance(record, dict) and (single := document_turns(record, columns)) is not None:
        return single
    if turns is None:
        keys = sorted(record)[:5] if isinstance(record, dict) else type(record).__name__
        wanted = f"; looked for {sorted({conversations, messages})}" if columns else ""
        raise BadRow("unknown_schema", f"found {keys}{wanted}")
    messages = []
    if role_key == "from" and isinstance(record.get("system"), str) and record["system"].strip():
        messages.append({"role": "system", "content": record["system"]})
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow("unknown_schema", f"turn {k} is a {type(turn).__name__}, not an object")
        raw_role = turn.get(role_key)
        role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise BadRow("unknown_role", f"turn {k} has {role_key}={raw_role!r}")
        content = _text_parts(turn.get(content_key), k, role)
        if not isinstance(content, str) or not content.strip():
            raise BadRow("bad_content", f"turn {k} ({role}) has {content_key}={content!r:.40}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn", f"{len(messages)} turns, none from the assistant")
    return messages


DOCUMENT_FIELDS = ("document", "context")
QUESTION_FIELDS = ("question", "input", "instruction")
ANSWER_FIELDS = ("answer", "answers", "output")
CHOICE_FIELDS = ("choice_A", "choice_B", "choice_C", "choice_D")  # LongBench-v2 multiple choice


def _field(record: dict, names: tuple[str, ...], mapped: str | None) -> tuple[str | None, object]:
    """(the first of ``mapped``, ``names`` present in ``record`` and not None, its value), or (None, None)."""
    for name in ((mapped,) if mapped else ()) + names:
        if record.get(name) is not None:
            return name, record[name]
    return None, None


def _text(value: object) -> str:
    """A string field's text, or a list's first non-empty string (LongBench's ``answers``); else ``""``."""
    if isinstance(value, list):
        value = next((v for v in value if isinstance(v, str) and v.strip()), "")
    return value.strip() if isinstance(value, str) else ""


def document_turns(record: dict, columns: dict[str, str] | None = None) -> list[dict[str, str]] | None:
    """The turns of a single-turn long-context record, or None when the record has neither shape.

    - document shape (a ``document`` or ``context`` field, or the column ``columns["document"]``): user turn
      ``document + "\n\n" + question`` (question: ``question``, ``input`` or ``instruction``; with LongBench-v2's
      ``choice_A..D`` the choices follow as ``A. ...`` lines), assistant turn: ``answer``, ``answers`` (a list: its
      first non-empty string) or ``output``;
    - instruction shape (``instruction`` and ``output``, no document field): user turn ``instruction`` (+
      ``"\n\n" + input`` when ``input`` is a non-empty string), assistant turn ``output``.

    A top-level ``system`` string becomes a leading system turn. The document is kept whole: cutting it to a length
    is the tokenizer's step (counted there).

    Raises:
        BadRow: ``bad_content`` (the document or instruction is not a non-empty string), ``no_question``,
        ``no_answer``.
    """
    columns = columns or {}
    doc_key, document = _field(record, DOCUMENT_FIELDS, columns.get("document"))
    if doc_key is None:
        if record.get("instruction") is None or record.get("output") is None:
            return None
        prompt = _text(record["instruction"]) if isinstance(record["instruction"], str) else ""
        if not prompt:
            raise BadRow("bad_content", f"instruction={record['instruction']!r:.40}")
        if _text(record.get("input")):
            prompt += "\n\n" + record["input"].strip()
    else:
        if not isinstance(document, str) or not document.strip():
            raise BadRow("bad_content", f"{doc_key}={document!r:.40}")
        q_key, question = _field(record, QUESTION_FIELDS, columns.get("question"))
        question = _text(question) if isinstance(question, str) else ""
        if not question:
            raise BadRow("no_question", f"{doc_key!r} of {len(document)} chars, no question/input/instruction text")
        choices = [f"{name[-1]}. {record[name]}" for name in CHOICE_FIELDS if isinstance(record.get(name), str)]
        prompt = document.strip() + "\n\n" + question + ("\n\n" + "\n".join(choices) if choices else "")
    a_key, answer = _field(record, ANSWER_FIELDS, columns.get("answer"))
    answer = _text(answer)
    if not answer:
        raise BadRow("no_answer", f"{a_key or 'answer/answers/output'}={record.get(a_key or 'answer')!r:.40}")
    system = record.get("system")
    lead = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return lead + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def check_file(path: str | Path) -> Path:
    """Validate that ``path`` exists, has a suffix of :data:`LOADERS` and is not empty; return it as a Path.

    Raises:
        ValueError: naming the file, for a missing file, an unknown extension or an empty file.
    """
    path = Path(path)
    if path.suffix.lower() not in LOADERS:
        raise ValueError(f"{path}: unknown conversation file extension {path.suffix!r}; expected one of "
                         f"{', '.join(LOADERS)}")
    if not path.is_file():
        raise ValueError(f"{path}: conversation file not found")
    with open(path, "rb") as f:
        head = f.read(1 << 16).strip()
    if not head or (path.suffix.lower() == ".json" and head.startswith(b"[") and head[1:].strip().startswith(b"]")):
        raise ValueError(f"{path}: conversation file is empty (no records)")
    return path


def file_digest(path: str | Path) -> str:
    """sha256 hex digest of the file's bytes (cache keys depend on content, never on the path alone)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def row_from_record(row: int, record: object, columns: dict[str, str] | None = None) -> Row:
    """A :class:`Row` numbered ``row``: the record's normalised turns, or the reason it cannot be used."""
    try:
        return Row(row, messages=normalise_record(record, columns))
    except BadRow as bad:
        return Row(row, reason=bad.reason, detail=bad.detail)


def _iter_jsonl(path: Path, columns: dict[str, str] | None) -> Iterator[Row]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Row(line_no, reason="non_utf8", detail=str(err)[:80])
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                yield Row(line_no, reason="invalid_json", detail=str(err)[:80])
                continue
            yield row_from_record(line_no, record, columns)


def _iter_json_array(path: Path, columns: dict[str, str] | None) -> Iterator[Row]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 at byte {err.start}; convert it or use JSONL") from None
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: a .json conversation file must hold a JSON array of records")
    pos += 1
    index = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            # The array cannot be resynchronised after a broken element: count it and stop.
            yield Row(index, reason="invalid_json", detail=f"element {index}: {err}"[:80])
            return
        yield row_from_record(index, record, columns)
        index += 1


def iter_rows(path: str | Path, limit: int | None = None, columns: dict[str, str] | None = None) -> Iterator[Row]:
    """Yield one :class:`Row` per source record of the ``.json``/``.jsonl`` file ``path`` (at most ``limit``
    records; ``columns`` as in :func:`normalise_record`).

    Raises:
        ValueError: naming the file, for the whole-file problems listed in the module docstring.
    """
    path = check_file(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: iter_rows reads .json/.jsonl; {suffix} files are read by recipe.data.sources")
    reader = _iter_jsonl if suffix == ".jsonl" else _iter_json_array
    for count, row in enumerate(reader(path, columns)):
        if limit is not None and count >= limit:
            return
        yield row
