"""The conversation-data flags shared by ``run.py``, ``recipe.dump``, ``recipe.regenerate`` and ``recipe.plan``
(``--data``, ``--data-column``, ``--data-weights``, ``--chain-conversations``) and their checks; the sources
they name are read by ``recipe.data.sources``."""
from __future__ import annotations

import argparse

from recipe.arg_types import length


CONVERSATION_FIELDS = ("conversations", "messages", "document", "question", "answer")


def column_mapping(text: str) -> tuple[str, str]:
    """argparse type: ``"messages=dialog"`` -> ("messages", "dialog"): the conversation field (``conversations``:
    ShareGPT turns {from, value}; ``messages``: OpenAI turns {role, content}; ``document``, ``question``,
    ``answer``: the fields of a long-document record, ``recipe.data.conversations``) and the column that holds it.
    ArgumentTypeError for another form or field."""
    field_name, sep, column = text.partition("=")
    if not sep or field_name not in CONVERSATION_FIELDS or not column:
        raise argparse.ArgumentTypeError(f"expected FIELD=COLUMN with FIELD one of {list(CONVERSATION_FIELDS)}, "
                                         f"e.g. messages=dialog; got {text!r}")
    return field_name, column


def _weights(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"weights must be positive finite numbers, got {text!r}")
    return values


def add_data_arguments(p: argparse.ArgumentParser, required: bool = False, chain: bool = True) -> None:
    """The conversation-data flags shared by ``run.py`` and ``python -m recipe.dump`` (``recipe.data.sources``):
    ``--data`` (one or more sources), ``--data-column FIELD=COLUMN`` (repeatable), ``--data-weights W1,W2,..``
    and, with ``chain``, ``--chain-conversations TOKENS`` (``recipe.data.chain``)."""
    p.add_argument("--data", nargs="+", required=required, metavar="SOURCE",
                   help="conversations: files (.json/.jsonl/.parquet/.csv), folders of them, or Hugging Face hub "
                   "dataset names (split 'train'; needs a reachable hub); ShareGPT or OpenAI form")
    p.add_argument("--data-column", type=column_mapping, action="append", metavar="FIELD=COLUMN",
                   help="read the conversation FIELD ('conversations': ShareGPT turns, 'messages': OpenAI turns; "
                   "'document', 'question', 'answer': a long-document record) from COLUMN, e.g. messages=dialog; "
                   "applies to every source that has COLUMN; repeatable")
    p.add_argument("--data-weights", type=_weights, metavar="W1,W2,...",
                   help="mixing weights, one per --data source: the sources are interleaved with probabilities "
                   "W_i/sum(W) until the first one runs out (no sample repeats); default: all rows, in order")
    if chain:
        p.add_argument("--chain-conversations", type=length, metavar="TOKENS",
                       help="chain whole conversations of each data file (shuffled by --seed) into multi-turn "
                       "samples of up to TOKENS tokens as the chat template renders them (k = 1024, e.g. 32k); "
                       "every assistant turn supervised")


def check_data_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """parser.error for --data-weights not matching --data and for --chain-conversations without --data; turns
    --data-column pairs into a dict."""
    if ns.data_weights is not None and (ns.data is None or len(ns.data_weights) != len(ns.data)):
        parser.error(f"--data-weights has {len(ns.data_weights)} value(s) for {len(ns.data or [])} --data "
                     "source(s); give one weight per source")
    if getattr(ns, "chain_conversations", None) is not None and ns.data is None:
        parser.error("--chain-conversations chains the --data conversations; a store (--hidden-states) holds the "
                     "samples it was dumped with: chain when dumping (python -m recipe.dump --chain-conversations)")
    ns.data_column = dict(ns.data_column) if ns.data_column else None
