"""Benchmarks of the training step: ``python -m recipe.bench.memory`` (memory and time vs sequence length)."""
