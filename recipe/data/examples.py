"""Conversation sources → ``datasets.Dataset{input_ids, loss_mask, row, source}`` + :class:`DataReport`.

Pipeline per data file (``recipe.data.sources``: files, folders, hub datasets): its normalised rows
(``sources.load_rows``: one bad record is a counted skip, not a failed load), then ``Dataset.map`` tokenises each
conversation with the target's chat template (:func:`recipe.data.chat_mask.tokenize_conversation`, ``num_proc``
worker shards), truncates to ``max_length`` and records a skip reason per row; a ``filter`` keeps the usable rows.
Then the files are combined with ``datasets``: ``concatenate_datasets`` (in ``--data`` order, all rows) or, with
mixing weights w_i (one per ``--data`` source), ``interleave_datasets`` with probabilities w_i/Σw, the run's seed
and ``stopping_strategy="first_exhausted"``: the mix ends when one source runs out, so no sample repeats and the
source that is smallest relative to its weight bounds the size.

With ``chain`` (``--chain-conversations TOKENS``) each file's conversations are first chained into multi-turn
samples of up to TOKENS tokens (``recipe.data.chain``, shuffled by ``seed``), then tokenised the same way. The
report (``DataReport``) holds the skip table per file, what chaining built, and the samples' lengths before
truncation against ``max_length`` (``recipe.data.lengths``: histogram, truncation count, the far-above warning).

Caching: every step carries an explicit fingerprint derived from the file's sha256, ``limit``, the column mapping,
the tokenizer (its ``tokenizer.json`` serialisation and chat template), ``max_length``, ``drop_long`` and (chained)
the budget and seed, so a second call with the same inputs reuses the Arrow cache files and any change to one of
them (including the file's content under the same path) recomputes.

CLI: ``python -m recipe.data.examples --tokenizer DIR --data SOURCE.. --max-length N [--limit 200]
[--chain-conversations 32k] [--draft-vocab 8192]`` prints the skip table, the length histogram, token counts and,
optionally, draft-vocabulary statistics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import datasets
from rich.console import Console

from recipe.data.chain import ChainReport, chain_rows
from recipe.data.chat_mask import tokenize_conversation
from recipe.data.conversations import BadRow
from recipe.data.flags import add_data_arguments, check_data_arguments
from recipe.data.lengths import LengthReport
from recipe.data.report import DataReport, SkipReport
from recipe.data.sources import fingerprint as _hash
from recipe.data.sources import load_rows, resolve_source
from recipe.data.vocab import build_vocab_map, iter_token_arrays, supervised_token_counts, vocab_stats

PIPELINE_VERSION = "examples-v3"  # bump when the tokenisation / masking semantics change

TOKEN_FEATURES = datasets.Features({
    "row": datasets.Value("int64"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "reason": datasets.Value("string"),
    "detail": datasets.Value("string"),
    "truncated": datasets.Value("bool"),
    "length": datasets.Value("int64"),
    "source": datasets.Value("string"),
})

def tokenizer_fingerprint(tokenizer) -> str:
    """Stable hash of everything that decides tokenisation: vocabulary/merges, special tokens, chat template."""
    backend = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    return _hash(backend, tokenizer.chat_template, sorted(map(str, tokenizer.all_special_tokens)))


def _tokenize_batch(batch: dict, tokenizer, max_length: int, drop_long: bool) -> dict:
    out = {"input_ids": [], "loss_mask": [], "reason": [], "detail": [], "truncated": [], "length": []}
    for messages, reason, detail in zip(batch["messages"], batch["reason"], batch["detail"]):
        ids, mask, cut, length = [], [], False, 0
        if not reason:
            try:
                tokens = tokenize_conversation(messages, tokenizer)
                ids, mask = tokens.input_ids, tokens.loss_mask
                length, cut = len(ids), len(ids) > max_length
                if cut and drop_long:
                    raise BadRow("too_long", f"{len(ids)} tokens > {max_length}")
                ids, mask = ids[:max_length], mask[:max_length]
                if not any(mask):
                    raise BadRow("no_supervised_tokens", f"first assistant token beyond {max_length}")
            except BadRow as bad:
                ids, mask, cut, length, reason, detail = [], [], False, 0, bad.reason, bad.detail
        for key, value in zip(out, (ids, mask, reason, detail, cut, length)):
            out[key].append(value)
    return out


def _is_kept(reason: str) -> bool:
    return not reason


def _file_examples(rows: datasets.Dataset, name: str, tokenizer, max_length: int, num_proc: int,
                   drop_long: bool, chain: int | None = None, seed: int = 0, cache_dir: str | None = None
                   ) -> tuple[datasets.Dataset, SkipReport, ChainReport | None, list[int]]:
    """Tokenise one data file's rows, chained first with ``chain``; (its usable examples, its skip report, its
    ``ChainReport`` or None, the kept samples' lengths before truncation)."""
    bad, chained = {"row": [], "reason": [], "detail": []}, None
    if chain:
        rows, bad, chained = chain_rows(rows, name, tokenizer, tokenizer_fingerprint(tokenizer), chain, seed,
                                        cache_dir=cache_dir, num_proc=num_proc)
    tokenized = rows.map(
        _tokenize_batch, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "drop_long": drop_long},
        remove_columns=["messages"], features=TOKEN_FEATURES,
        new_fingerprint=_hash(PIPELINE_VERSION, rows._fingerprint, tokenizer_fingerprint(tokenizer), max_length,
                              drop_long),
        desc="tokenising conversations")
    outcomes = {key: list(tokenized[key]) for key in ("row", "reason", "truncated", "detail", "length")}
    reasons = outcomes["reason"]
    report = SkipReport.from_outcomes(name, bad["row"] + outcomes["row"], bad["reason"] + reasons,
                                      [False] * len(bad["row"]) + outcomes["truncated"],
                                      bad["detail"] + outcomes["detail"])
    if report.kept == 0:
        raise ValueError(f"{name}: no usable conversation left; {report.summary()}")
    lengths = [n for n, r in zip(outcomes["length"], reasons) if not r]
    kept = tokenized.filter(_is_kept, input_columns="reason", new_fingerprint=_hash(tokenized._fingerprint, "kept"))
    return kept.select_columns(["input_ids", "loss_mask", "row", "source"]), report, chained, lengths


def build_examples(data: str | Path | list, tokenizer, max_length: int, num_proc: int = 1,
                   cache_dir: str | None = None, limit: int | None = None, drop_long: bool = False,
                   columns: dict[str, str] | None = None, weights: list[float] | None = None,
                   seed: int = 0, chain: int | None = None) -> tuple[datasets.Dataset, DataReport]:
    """Read, normalise, tokenise, mask and combine conversation sources.

    Args:
        data: one source or a list of them (``recipe.data.sources.resolve_source``: files, folders, hub names)
            in ShareGPT or OpenAI form.
        tokenizer: the target's fast tokenizer with its chat template.
        max_length: examples are cut to this many tokens (or dropped with ``drop_long=True``).
        num_proc: worker processes for tokenisation (``Dataset.map``).
        cache_dir: ``datasets`` cache folder (default: the ``datasets`` default).
        limit: read only the first ``limit`` records of each data file.
        columns: conversation field -> column (``--data-column``), e.g. ``{"messages": "dialog"}``.
        weights: mixing weights, one per source (module docstring); None: all rows, in order.
        seed: the interleaving seed with ``weights``, and the chaining order with ``chain``.
        chain: chain each file's conversations into samples of up to this many tokens (``recipe.data.chain``).
    Returns:
        ``(dataset, report)``; dataset columns ``input_ids`` (list[int], length ≤ max_length), ``loss_mask``
        (list[int] of 0/1, same length, at least one 1), ``row`` (source line number for .jsonl, 0-based index
        for .json, .parquet, .csv and hub rows) and ``source`` (the data file); ``report`` has one SkipReport per
        data file, the chaining reports and the lengths (``DataReport``).
    Raises:
        ValueError: naming the file or source — missing/empty/unknown extension, a file with no usable example left
            (with the reasons), an offline hub, weights not matching the sources; naming the tokenizer when it has
            no chat template.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'tokenizer')}: the target's tokenizer has no chat "
                         "template (chat_template.jinja or tokenizer_config.json 'chat_template'); the loss mask "
                         "needs it to find the assistant turns")
    specs = [data] if isinstance(data, (str, Path)) else list(data)
    if weights is not None and len(weights) != len(specs):
        raise ValueError(f"{len(weights)} mixing weight(s) for {len(specs)} data source(s); give one per source")
    per_source, reports, chains, lengths = [], [], [], []
    for spec in specs:
        parts = []
        for item in resolve_source(spec):
            rows = load_rows(item, limit=limit, columns=columns, cache_dir=cache_dir)
            examples, report, chained, file_lengths = _file_examples(
                rows, item.name, tokenizer, max_length, num_proc, drop_long, chain=chain, seed=seed,
                cache_dir=cache_dir)
            parts.append(examples)
            reports.append(report)
            chains += [chained] if chained is not None else []
            lengths += file_lengths
        per_source.append(parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts))
    if weights is not None and len(per_source) > 1:
        total = sum(weights)
        mixed = datasets.interleave_datasets(per_source, probabilities=[w / total for w in weights], seed=seed,
                                             stopping_strategy="first_exhausted")
    elif len(per_source) > 1:
        mixed = datasets.concatenate_datasets(per_source)
    else:
        mixed = per_source[0]
    return mixed, DataReport(reports, chains=chains, lengths=LengthReport(max_length, lengths))


def token_counts(dataset: datasets.Dataset) -> tuple[int, int]:
    """``(total tokens, supervised tokens)`` over the dataset's ``input_ids`` / ``loss_mask``."""
    total = supervised = 0
    for ids, mask in iter_token_arrays(dataset):
        total += len(ids)
        supervised += int(mask.sum())
    return total, supervised


def examples_fingerprint(examples: datasets.Dataset) -> str:
    """The identity of a ``build_examples`` result: the ``datasets`` fingerprint this module chains through every
    step (source files' content, pipeline version, tokenizer, max length), the same for the same inputs on
    any machine. What a checkpoint records as its data identity (with the sample count)."""
    return examples._fingerprint


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer  # import cost: transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (the target's)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --tokenizer, if it is a GGUF folder")
    add_data_arguments(parser, required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--num-proc", type=int, default=1)
    parser.add_argument("--drop-long", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--draft-vocab", type=int, default=0, help="also build a draft vocabulary of this size")
    parser.add_argument("--seed", type=int, default=0,
                        help="interleaving seed with --data-weights, chaining order with --chain-conversations")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="samples per micro-batch: > 1 prints the padding share, padded and packed "
                        "(docs/algorithm.md, 'Packing')")
    parser.add_argument("--packing-tokens", type=int,
                        help="row budget of packing in tokens (default: one row per micro-batch)")
    args = parser.parse_args(argv)
    check_data_arguments(parser, args)
    if args.micro_batch < 1 or (args.packing_tokens is not None and args.packing_tokens < 1):
        parser.error(f"--micro-batch and --packing-tokens must be positive, got {args.micro_batch} and "
                     f"{args.packing_tokens}")

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, gguf_file=args.gguf_file)
    dataset, report = build_examples(args.data, tokenizer, args.max_length, num_proc=args.num_proc,
                                     cache_dir=args.cache_dir, limit=args.limit, drop_long=args.drop_long,
                                     columns=args.data_column, weights=args.data_weights, seed=args.seed,
                                     chain=args.chain_conversations)
    report.lengths.for_batches(args.micro_batch, "auto", args.packing_tokens)
    console = Console()
    console.print(report.table())
    total, supervised = token_counts(dataset)
    console.print(f"examples {len(dataset)}  tokens {total}  supervised {supervised} ({supervised / total:.1%})")
    if args.draft_vocab:
        vocab = build_vocab_map(dataset, len(tokenizer), args.draft_vocab, cache_dir=args.cache_dir)
        console.print(vocab_stats(vocab, supervised_token_counts(dataset, len(tokenizer))[0]))


if __name__ == "__main__":
    main()
