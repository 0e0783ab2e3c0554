"""``python -m recipe.bench {tp,cp,memory,attention,step,target,decode} ...``: run one
benchmark (each has its own ``--help``); the experiments are ``python -m recipe.experiments``."""
from __future__ import annotations

import sys

from recipe.bench.common import dispatch

COMMANDS = {"tp": "recipe.bench.tp", "cp": "recipe.bench.cp", "memory": "recipe.bench.memory",
            "attention": "recipe.bench.attention", "step": "recipe.bench.step", "target": "recipe.bench.target",
            "decode": "recipe.bench.decode"}
USAGE = ("usage: python -m recipe.bench {tp,cp,memory,attention,step,target,decode} "
         "[options]\n"
         "  tp         per-rank parameter/gradient/optimizer bytes and step peak memory for tp = 1, 2, 4\n"
         "  cp         per-rank activation memory, step time, longest length in a budget and attention work per cp\n"
         "  memory     peak memory and time of a TTT step vs sequence length, per loss/checkpointing layout\n"
         "  attention  time and peak memory of the causal-block attention per backend, vs length and dtype\n"
         "  step       whole-draft TTT step time per attention backend, relative to the tiled reference\n"
         "  target     per-rank peak memory and time of the online target forward per cp\n"
         "  decode     CPU decoding: target forward with plain vs packed linear layers, batched greedy reference\n"
         "The experiments that train drafts and measure τ (data, long-context, demo-gpu): "
         "python -m recipe.experiments")


def main(argv: list[str] | None = None) -> int:
    return dispatch(COMMANDS, USAGE, argv, "benchmark")


if __name__ == "__main__":
    sys.exit(main())
