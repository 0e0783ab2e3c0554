"""``python -m recipe.experiments {data,long-context,demo-gpu} ...``: run one experiment (each has its own
``--help``)."""
from __future__ import annotations

import sys

from recipe.bench.common import dispatch

COMMANDS = {"data": "recipe.experiments.data", "long-context": "recipe.experiments.long_context",
            "demo-gpu": "recipe.experiments.demo_gpu"}
USAGE = ("usage: python -m recipe.experiments {data,long-context,demo-gpu} [options]\n"
         "  data          τ per data recipe (ShareGPT or regenerated answers, samples vs epochs) at equal compute\n"
         "  long-context  τ by context length of short-, long-, warm-started and position-robust drafts (and "
         "windows)\n"
         "  demo-gpu      the demo at GPU scale (make demo with CUDA): a 2k draft, its 8k continuation, τ by length")


def main(argv: list[str] | None = None) -> int:
    return dispatch(COMMANDS, USAGE, argv, "experiment")


if __name__ == "__main__":
    sys.exit(main())
