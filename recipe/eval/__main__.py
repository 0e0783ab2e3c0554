"""Measure EAGLE-3 drafts against their target: acceptance length τ, per-position acceptance, speed.

    python -m recipe.eval --target DIR --draft PATH [--draft PATH2 ...] [--prompts FILE]
        [--num-draft-tokens 5[,3]] [--max-new-tokens N] [--limit N] [--output JSON] [--draft-dtype bf16|fp32]
        [--tree-topk 4] [--tree-depth 5] [--tree-budget 16] [--dtype fp32|bf16] [--draft-window-size N]
        [--reference sequential|batched] [--on-mismatch stop|record]
        [--context-lengths 0,1k,4k [--context-data FILE ...] [--context-request unrelated|about-context] [--seed S]]

One engine (``recipe.eval.by_length``): a draft is any layout ``run.py --init-draft`` reads (this project's export,
SpecForge's and the EAGLE repository's, ``midlayer.*`` or ``layers.0.*`` keys, safetensors or a pickle). Chain
drafting of k tokens per round and dynamic-tree drafting (EAGLE-2/3: top-k expansion per depth, a budget of draft
tokens verified in one target forward; ``--tree-depth 0`` turns it off), greedy verification; every speculative
output is checked against plain greedy decoding of the target (exit 1 naming the prompt on a mismatch). Default
prompts: the MT-Bench first turns from ``recipe.assets``. The JSON's top level has ``tau``, ``num_draft_tokens`` and
``num_prompts`` of the first draft at the first k, ``tau_tree`` of the first draft's tree (null without trees),
``runs`` with every (draft, k) and ``tree_runs`` with every draft's tree.

``--context-lengths``: τ by context length (``recipe.eval.context``); the JSON then has one entry per length under
``lengths`` (docs/evaluation.md, "Acceptance by context length"); plain evaluation is the one-length case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console

from recipe.arg_types import context_length_list, positive_int_list
from recipe.assets import prepare_assets
from recipe.eval.by_length import (
    ON_MISMATCH,
    REFERENCE_MODES,
    evaluate,
    evaluate_by_length,
    prompt_token_limit,
    target_config,
)
from recipe.eval.context import CONTEXT_REQUESTS, bucket_prompts, context_prompts, read_context_data
from recipe.eval.length_report import NO_MATPLOTLIB, plot_tau_by_length
from recipe.eval.prompts import read_prompts
from recipe.eval.speculative import MismatchError
from recipe.eval.tree import add_tree_arguments, tree_from_args
from recipe.target.capture import load_tokenizer

DRAFT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face format)")
    p.add_argument("--draft", type=draft_spec, action="append", required=True, metavar="PATH[@N]",
                   help="a draft: an export folder or any layout --init-draft reads (SpecForge or EAGLE folders, a "
                        ".safetensors or .bin file); repeat to compare several; PATH@N serves that draft with a "
                        "sliding window of N positions (as --draft-window-size, for that entry only)")
    p.add_argument("--prompts", type=Path, help='JSONL of {"prompt" or "turns", "category"} (default: MT-Bench)')
    p.add_argument("--num-draft-tokens", type=positive_int_list, default=[5],
                   help="k, draft tokens per round (e.g. 5 or 5,3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--limit", type=int, help="evaluate the first N prompts")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--draft-dtype", choices=sorted(DRAFT_DTYPES),
                   help="the draft's compute dtype (default: the export's own)")
    p.add_argument("--dtype", choices=sorted(DRAFT_DTYPES),
                   help="the target's dtype (default: fp32 on every device; bf16 is faster, but its batched "
                        "verification and one-token decoding round differently, so the lossless check can fail at "
                        "near-tied logits)")
    p.add_argument("--draft-window-size", type=_positive, metavar="N",
                   help="the draft attends only to its last N positions (chain and tree drafting), as SGLang's "
                        "--speculative-draft-window-size serves it (default: full attention)")
    p.add_argument("--context-lengths", type=context_length_list, metavar="L[,L...]",
                   help="τ by context length, e.g. 0,1k,4k (k = 1024 tokens): each prompt is preceded by about L "
                        "tokens of earlier conversation from --context-data; with --prompts and no --context-data "
                        "the prompts (long by themselves) are instead bucketed by their measured token length, each "
                        "into the largest L at or below it")
    p.add_argument("--context-data", type=Path, nargs="+", metavar="FILE",
                   help="conversations (ShareGPT or OpenAI form, .json/.jsonl) whose whole earlier turns are "
                        "inserted as context (default: the packaged ShareGPT conversations)")
    p.add_argument("--context-request", choices=CONTEXT_REQUESTS, default="unrelated",
                   help="the final user turn after the inserted context: the prompt itself (unrelated), or a "
                        "request about the inserted context drawn by --seed (about-context: summarise, list points, "
                        "quote, answer a question)")
    p.add_argument("--seed", type=int, default=0, help="seed of the context drawn for each prompt and length")
    p.add_argument("--reference", choices=REFERENCE_MODES, default="sequential",
                   help="greedy reference of the lossless check: prompt by prompt (also times greedy decoding), or "
                        "all prompts in one batch (fewer target forwards; greedy speed timed on the shortest prompt)")
    p.add_argument("--on-mismatch", choices=ON_MISMATCH, default="stop",
                   help="a speculative output that differs from greedy decoding stops the run (exit 1), or is "
                        "recorded in 'mismatches' and decoding goes on (exit 1 once the JSON is written): for a bf16 "
                        "target, whose near-ties can round apart, when memory and time are what is measured")
    add_tree_arguments(p)
    return p


def draft_spec(text: str) -> tuple[str, Path, int | None]:
    """``--draft`` value ``DIR`` or ``DIR@N`` -> (label, folder, window): the label is the text as given, the window
    N positions (None: ``--draft-window-size``'s, or full attention). Raises ArgumentTypeError for an N that is not
    a positive integer."""
    folder, at, window = text.rpartition("@") if "@" in text else (text, "", "")
    if not at:
        return text, Path(text), None
    try:
        return text, Path(folder), _positive(window)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: the window after '@' must be a positive integer "
                                         f"(DIR@N, e.g. export@256)") from None


def _drafts(args) -> tuple[dict[str, Path], dict[str, int | None]]:
    """(label -> folder, label -> window) of the ``--draft`` values; a draft without ``@N`` gets
    ``--draft-window-size`` (None: full attention). Raises ValueError for a label given twice."""
    folders, windows = {}, {}
    for label, folder, window in args.draft:
        if label in folders:
            raise ValueError(f"--draft {label} is given twice")
        folders[label] = folder
        windows[label] = window if window is not None else args.draft_window_size
    return folders, windows


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _engine_args(args) -> dict:
    """The engine's keyword arguments from the flags (``recipe.eval.by_length.evaluate_by_length``)."""
    folders, windows = _drafts(args)
    return {"drafts": folders, "ks": args.num_draft_tokens, "max_new_tokens": args.max_new_tokens,
            "device": args.device, "draft_dtype": DRAFT_DTYPES[args.draft_dtype] if args.draft_dtype else None,
            "target_dtype": DRAFT_DTYPES[args.dtype] if args.dtype else None, "window": windows,
            "on_mismatch": args.on_mismatch, "reference": args.reference}


def _plain_run(args, console, tree) -> dict:
    """Plain evaluation: the engine at one length (``evaluate``) on ``--prompts`` (default: MT-Bench)."""
    if args.context_data is not None or args.context_request != "unrelated":
        raise ValueError("--context-data and --context-request need --context-lengths")
    args.prompts = args.prompts or prepare_assets().prompts
    prompts = read_prompts(args.prompts, args.limit)
    return {**evaluate(args.target, prompts=prompts, console=console, tree=tree, **_engine_args(args)),
            "prompts": str(args.prompts)}


def _context_run(args, console, tree) -> dict:
    """The ``--context-lengths`` run: prompts per length (inserted context or bucketed prompts), then
    ``evaluate_by_length``. Calls ``prepare_assets`` only for a default it needs (MT-Bench prompts, ShareGPT)."""
    bucketed = args.prompts is not None and args.context_data is None
    if bucketed and args.context_request != "unrelated":
        raise ValueError("--context-request about-context needs inserted context (--context-data); prompts given "
                         "alone are bucketed by their own length")
    if args.prompts is None or (args.context_data is None and not bucketed):
        assets = prepare_assets()
        args.prompts = args.prompts or assets.prompts
        args.context_data = args.context_data or [assets.conversations]
    prompts = read_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.target)
    skipped = {}
    if bucketed:  # prompts too long for the target are skipped (counted)
        most = prompt_token_limit(target_config(args.target), args.max_new_tokens, args.num_draft_tokens, tree)
        buckets, skipped = bucket_prompts(tokenizer, prompts, args.context_lengths, most)
        console.print(f"{len(prompts)} prompts bucketed by their token length; skipped: {dict(skipped) or 'none'}")
    else:
        data = read_context_data(args.context_data)
        console.print(f"context data: {len(data.pairs)} conversations with turn pairs (skipped rows: "
                      f"{data.skip_note()})")
        buckets = context_prompts(tokenizer, prompts, data, args.context_lengths, args.seed, args.context_request)
    result = evaluate_by_length(args.target, buckets=buckets, console=console, tree=tree,
                                eos_token_id=tokenizer.eos_token_id, **_engine_args(args))
    result["draft_window_size"] = args.draft_window_size  # the flag; each draft's own: draft_window_sizes
    return {"context_lengths": args.context_lengths, "context_request": args.context_request, "seed": args.seed,
            "prompts": str(args.prompts), "bucketed_by_prompt_length": bucketed,
            "context_data": None if bucketed else [str(f) for f in args.context_data],
            "skipped_prompts": dict(skipped), **result}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    console = Console(stderr=True)
    try:
        tree = tree_from_args(args)
        result = (_plain_run if args.context_lengths is None else _context_run)(args, console, tree)
    except MismatchError as exc:
        console.print(f"[bold red]lossless check failed[/bold red]: {exc}")
        return 1
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[bold red]error[/bold red]: {exc}")
        return 2
    _finish(args, console, result)
    mismatches = [m for entry in result.get("lengths", [result]) for m in entry.get("mismatches", [])]
    for message in mismatches:
        console.print(f"[bold red]lossless check failed[/bold red] (recorded): {message}")
    return 1 if mismatches else 0


def _finish(args, console, result: dict) -> None:
    """Write the JSON to ``--output`` and, for a ``--context-lengths`` run, the plot of τ against context length
    beside it (same name, ``.png``; a one-line note instead without matplotlib)."""
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"results written to {args.output}")
        if "lengths" in result:
            plot = plot_tau_by_length(result["lengths"], args.output.with_suffix(".png"),
                                      title=f"τ by context length ({result['context_request']} requests)")
            console.print(f"plot written to {plot}" if plot is not None else NO_MATPLOTLIB)


if __name__ == "__main__":
    sys.exit(main())
