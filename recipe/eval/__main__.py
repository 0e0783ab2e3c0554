"""Measure an exported EAGLE-3 draft against its target: acceptance length τ, per-position acceptance, speed.

    python -m recipe.eval --target DIR --draft EXPORT_DIR [--draft EXPORT_DIR2 ...] [--prompts FILE]
        [--num-draft-tokens 5[,3]] [--max-new-tokens N] [--limit N] [--output JSON] [--draft-dtype bf16|fp32]
        [--tree-topk 4] [--tree-depth 5] [--tree-budget 16]

Chain drafting of k tokens per round and dynamic-tree drafting (EAGLE-2/3: top-k expansion per depth, a budget of
draft tokens verified in one target forward; ``--tree-depth 0`` turns it off), greedy verification; every
speculative output is checked against plain greedy decoding of the target (exit 1 naming the prompt on a
mismatch). Default prompts: the MT-Bench first turns from ``recipe.assets``. The JSON's top level has ``tau``,
``num_draft_tokens`` and ``num_prompts`` of the first draft at the first k, ``tau_tree`` of the first draft's tree
(null without trees), ``runs`` with every (draft, k) and ``tree_runs`` with every draft's tree.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from recipe.cli import positive_int_list
from recipe.eval.harness import REFERENCE_MODES
from recipe.eval.tree import add_tree_arguments, tree_from_args

DRAFT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face format)")
    p.add_argument("--draft", type=Path, action="append", required=True,
                   help="draft export folder (config.json + model.safetensors); repeat to compare several")
    p.add_argument("--prompts", type=Path, help='JSONL of {"prompt" or "turns", "category"} (default: MT-Bench)')
    p.add_argument("--num-draft-tokens", type=positive_int_list, default=[5],
                   help="k, draft tokens per round (e.g. 5 or 5,3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--limit", type=int, help="evaluate the first N prompts")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--draft-dtype", choices=sorted(DRAFT_DTYPES),
                   help="the draft's compute dtype (default: the export's own; the target always runs in fp32)")
    p.add_argument("--reference", choices=REFERENCE_MODES, default="sequential",
                   help="greedy reference of the lossless check: prompt by prompt (also times greedy decoding), or "
                        "all prompts in one batch (fewer target forwards; greedy speed timed on the shortest prompt)")
    add_tree_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rich.console import Console

    from recipe.eval.harness import evaluate
    from recipe.eval.prompts import read_prompts
    from recipe.eval.speculative import MismatchError

    console = Console(stderr=True)
    try:
        tree = tree_from_args(args)
        if args.prompts is None:
            from recipe.assets import prepare_assets

            args.prompts = prepare_assets().prompts
        prompts = read_prompts(args.prompts, args.limit)
        labels = [str(d) for d in args.draft]
        result = evaluate(args.target, dict(zip(labels, args.draft)), prompts, args.num_draft_tokens,
                          args.max_new_tokens, device=args.device, console=console,
                          draft_dtype=DRAFT_DTYPES[args.draft_dtype] if args.draft_dtype else None, tree=tree,
                          reference=args.reference)
    except MismatchError as exc:
        console.print(f"[bold red]lossless check failed[/bold red]: {exc}")
        return 1
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[bold red]error[/bold red]: {exc}")
        return 2
    head = result["runs"][0]
    tau_tree = result["tree_runs"][0]["tau"] if result.get("tree_runs") else None
    result = {"tau": head["tau"], "tau_tree": tau_tree, "num_draft_tokens": head["num_draft_tokens"],
              "num_prompts": len(prompts), "prompts": str(args.prompts), **result}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
