"""Benchmarks of the training step, run as ``python -m recipe.bench {tp,cp,memory} ...``:

- ``tp``: per-rank parameter, gradient and optimizer bytes and step peak memory for tp = 1, 2, 4 (``recipe.bench.tp``);
- ``cp``: per-rank activation memory, step time, longest length within a memory budget and attention work of the
  zigzag vs a contiguous split for cp = 1, 2, 4 (``recipe.bench.cp``);
- ``memory``: memory and time vs sequence length per loss/checkpointing layout (``recipe.bench.memory``).
"""
