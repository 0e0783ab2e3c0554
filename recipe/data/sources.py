"""``--data`` sources → one ``datasets.Dataset{row, messages, reason, detail, source}`` of normalised records per
data file (``source``: the file's name).

A source (one value of ``--data``) is

- a file: ``.json`` (an array) or ``.jsonl`` (a record per line), ``.parquet`` or ``.csv`` (a record per row);
- a folder: every such file below it (recursively, sorted by path), each one a data file of its own;
- anything else that does not exist locally: a Hugging Face hub dataset name (``org/name``, split ``train``),
  loaded with ``datasets.load_dataset(name)`` when the hub is reachable. With ``HF_HUB_OFFLINE`` or
  ``HF_DATASETS_OFFLINE`` set, a ValueError says the hub is offline.

How each data file is read, all through ``datasets`` (its Arrow cache under ``cache_dir``, explicit fingerprints):

- Parquet, CSV and hub datasets: ``datasets.load_dataset("parquet"|"csv"|name, data_files=...)``, then a
  ``Dataset.map`` runs :func:`recipe.data.conversations.row_from_record` on every row; ``row`` is the 0-based row
  index of the file (for a CSV without multi-line cells, its line number minus 2). A CSV cell holds the turns as a
  JSON string.
- JSON/JSONL: ``Dataset.from_generator`` over the tolerant reader :func:`recipe.data.conversations.iter_rows`
  (``row``: 1-based line number, or 0-based array index). ``load_dataset("json")`` is not used for these: it aborts
  the whole load on the first malformed line and cannot read a truncated array (the packaged ShareGPT file), where
  the tolerant reader counts one bad row and goes on.

A record that cannot be used becomes a row with a skip ``reason`` (``conversations.SKIP_REASONS``), so the skip
report names every bad row of every file. ``columns`` (``--data-column``) maps a conversation field to the column
that holds it.
"""
from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

import datasets

from recipe.data.conversations import DOCUMENT_FIELDS, LOADERS, check_file, file_digest, iter_rows, row_from_record

READER_VERSION = "sources-v2"  # bump when the reading / normalisation semantics change
ROW_FEATURES = datasets.Features({
    "row": datasets.Value("int64"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "reason": datasets.Value("string"),
    "detail": datasets.Value("string"),
    "source": datasets.Value("string"),
})


def fingerprint(*parts: object) -> str:
    """32 hex chars of sha256 over the reprs of ``parts``: the explicit ``datasets`` fingerprints of the pipeline."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class DataFile:
    """One data file of a source: ``name`` (a local path or a hub dataset name, as reports show it) and ``kind``
    (``json``, ``parquet``, ``csv`` or ``hub``)."""

    name: str
    kind: str


def hub_offline() -> bool:
    """Whether ``datasets`` is set to work offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""
    return bool(datasets.config.HF_HUB_OFFLINE)


def resolve_source(spec: str | Path) -> list[DataFile]:
    """The data files of one ``--data`` value (module docstring), in reading order.

    Raises ValueError naming the source: a file with another extension, an empty folder, a missing ``.json`` /
    ``.jsonl`` / ``.parquet`` / ``.csv`` path, or a hub name while the hub is offline.
    """
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOADERS)
        if not files:
            raise ValueError(f"{path}: folder holds no conversation file ({', '.join(LOADERS)})")
        return [DataFile(str(f), LOADERS[f.suffix.lower()]) for f in files]
    if path.exists() or path.suffix.lower() in LOADERS:
        check_file(path)  # names the file: unknown extension, not found, empty
        return [DataFile(str(path), LOADERS[path.suffix.lower()])]
    if hub_offline():
        raise ValueError(f"--data {spec}: no such file or folder, and the Hugging Face hub is offline "
                         "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set), so it cannot be loaded as a hub dataset; "
                         "pass local .json/.jsonl/.parquet/.csv files (e.g. written by datasets' to_parquet)")
    return [DataFile(str(spec), "hub")]


def _generate_rows(path: str, digest: str, limit: int | None, columns: dict | None):
    del digest  # only part of the builder's cache key
    for row in iter_rows(path, limit=limit, columns=columns):
        yield {"row": row.row, "messages": row.messages, "reason": row.reason, "detail": row.detail, "source": path}


def _normalise_batch(batch: dict, indices: list[int], columns: dict | None, name: str) -> dict:
    out = {"row": [], "messages": [], "reason": [], "detail": [], "source": []}
    for j, index in enumerate(indices):
        row = row_from_record(index, {key: values[j] for key, values in batch.items()}, columns)
        for key, value in zip(out, (row.row, row.messages, row.reason, row.detail, name)):
            out[key].append(value)
    return out


def _load_table(item: DataFile, cache_dir: str | None) -> tuple[datasets.Dataset, str]:
    """(the raw rows of a Parquet/CSV file or hub dataset, a content key for the fingerprint)."""
    try:
        if item.kind == "hub":
            table = datasets.load_dataset(item.name, split="train", cache_dir=cache_dir)
            return table, table._fingerprint
        table = datasets.load_dataset(item.kind, data_files=[item.name], split="train", cache_dir=cache_dir)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as exc:
        where = "the Hugging Face hub dataset" if item.kind == "hub" else f"the {item.kind} file"
        raise ValueError(f"{item.name}: cannot read {where} ({type(exc).__name__}: {str(exc)[:300]})") from None
    return table, file_digest(item.name)


def check_conversation_column(item: DataFile, found: list[str], columns: dict[str, str] | None) -> None:
    """ValueError naming the file, the columns it has and the ``--data-column`` flag when a file (or hub dataset; for
    JSON/JSONL the keys of its records) has none of the columns the conversations are read from (``conversations``,
    ``messages``, or what ``columns`` maps them to) and no long-document shape (a ``document``/``context`` column, or
    ``instruction`` and ``output``; ``conversations.document_turns``): every row would otherwise be skipped as
    ``unknown_schema``."""
    columns = columns or {}
    wanted = sorted({columns.get(f, f) for f in ("conversations", "messages")})
    documents = {columns.get("document", "document"), *DOCUMENT_FIELDS}
    if set(wanted) & set(found) or documents & set(found) or {"instruction", "output"} <= set(found):
        return
    example = next((c for c in found if c not in ("id", "text")), found[0] if found else "COLUMN")
    mapped = f" (--data-column maps them to {wanted})" if columns else ""
    what = "records have the keys" if item.kind == "json" else "file has columns"
    raise ValueError(f"{item.name}: no conversation column: the {item.kind} {what} {list(found)}, the "
                     f"conversations are read from {wanted}{mapped}; name the column that holds them with "
                     f"--data-column FIELD=COLUMN, e.g. --data-column conversations={example} (ShareGPT turns "
                     f"{{from, value}}) or --data-column messages={example} (OpenAI turns {{role, content}}); a "
                     f"long-document set needs a document/context column (or --data-column document=COLUMN)")


def _record_keys(detail: str) -> list[str]:
    """The keys an ``unknown_schema`` skip's detail lists (``"found ['id', 'text']"``, the first five of a record)."""
    text = detail.removeprefix("found ").split(";")[0]
    try:
        keys = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(k) for k in keys] if isinstance(keys, list) else []


def load_rows(item: DataFile, limit: int | None = None, columns: dict[str, str] | None = None,
              cache_dir: str | None = None) -> datasets.Dataset:
    """The normalised rows (:data:`ROW_FEATURES`) of the first ``limit`` records of one data file.

    Cached by ``datasets`` under ``cache_dir`` with a fingerprint of the file's name and content (sha256; a hub
    dataset's own fingerprint), ``limit`` and ``columns``. Raises ValueError naming the file when it cannot be read,
    holds no record, or has no conversation column (:func:`check_conversation_column`; JSON/JSONL: when no record
    has the field, naming the keys the records have); a malformed record is a skip row, not an error.
    """
    key = (READER_VERSION, item.name, limit, sorted((columns or {}).items()))
    if item.kind == "json":
        digest = file_digest(item.name)
        rows = datasets.Dataset.from_generator(
            _generate_rows, features=ROW_FEATURES, cache_dir=cache_dir, fingerprint=fingerprint(*key, digest),
            gen_kwargs={"path": item.name, "digest": digest, "limit": limit, "columns": columns})
        reasons = set(rows.unique("reason")) if len(rows) else set()
        if reasons == {"unknown_schema"}:  # not one record has the conversation field: name the keys it has
            details = rows.unique("detail")
            keys = sorted({k for d in details for k in _record_keys(d)})
            if keys:
                check_conversation_column(item, keys, columns)
    else:
        table, content = _load_table(item, cache_dir)
        check_conversation_column(item, table.column_names, columns)
        if limit is not None and limit < len(table):
            table = table.select(range(limit))
        rows = table.map(_normalise_batch, batched=True, with_indices=True,
                         fn_kwargs={"columns": columns, "name": item.name},
                         remove_columns=table.column_names, features=ROW_FEATURES,
                         new_fingerprint=fingerprint(*key, content), desc=f"reading {Path(item.name).name}")
    if len(rows) == 0:
        raise ValueError(f"{item.name}: conversation file holds no records")
    return rows
