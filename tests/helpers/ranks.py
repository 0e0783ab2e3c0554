"""Run a function on N CPU ranks with the gloo backend and collect each rank's return value.

Usage in a test (``fn`` must be a module-level function so it can be pickled)::

    results = run_ranks(2, my_fn, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) -> picklable

Each rank has the default process group initialised (gloo, a free port on 127.0.0.1), one torch thread, and
``torch.manual_seed(1234)``, forked from a server that has torch, DeepSpeed, transformers and the training modules
imported (``recipe.bench.ranks.FORKSERVER_PRELOAD``; the caller's environment is passed on). An exception on any rank fails the call with that rank's traceback.
"""
from __future__ import annotations

from recipe.bench.ranks import spawn_gloo_ranks


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results ordered by rank."""
    return spawn_gloo_ranks(world_size, fn, *args, timeout=timeout, seed=1234,
                            start_method="forkserver")
