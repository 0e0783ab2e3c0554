"""``python -m recipe.bench {tp,cp,memory,attention,step,target,data,decode,long-context,demo-gpu} ...``: run one
benchmark (each has its own ``--help``)."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {"tp": "recipe.bench.tp", "cp": "recipe.bench.cp", "memory": "recipe.bench.memory",
            "attention": "recipe.bench.attention", "step": "recipe.bench.step", "target": "recipe.bench.target",
            "data": "recipe.bench.data", "decode": "recipe.bench.decode",
            "long-context": "recipe.bench.long_context", "demo-gpu": "recipe.bench.demo_gpu"}
USAGE = ("usage: python -m recipe.bench {tp,cp,memory,attention,step,target,data,decode,long-context,demo-gpu} "
         "[options]\n"
         "  tp         per-rank parameter/gradient/optimizer bytes and step peak memory for tp = 1, 2, 4\n"
         "  cp         per-rank activation memory, step time, longest length in a budget and attention work per cp\n"
         "  memory     peak memory and time of a TTT step vs sequence length, per loss/checkpointing layout\n"
         "  attention  time and peak memory of the causal-block attention per backend, vs length and dtype\n"
         "  step       whole-draft TTT step time per attention backend, relative to the tiled reference\n"
         "  target     per-rank peak memory and time of the online target forward per cp\n"
         "  data       τ per data recipe (ShareGPT or regenerated answers, samples vs epochs) at equal compute\n"
         "  decode     CPU decoding: target forward with plain vs packed linear layers, batched greedy reference\n"
         "  long-context  τ by context length of short-, long-, warm-started and position-robust drafts (and "
         "windows)\n"
         "  demo-gpu   the demo at GPU scale (make demo with CUDA): a 2k draft, its 8k continuation, τ by length")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: unknown benchmark {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])  # lazily: memory is another module's CLI
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
