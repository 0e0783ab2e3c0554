"""The environment of the command lines the recipe runs as subprocesses (``recipe.demo``, the experiments,
``scripts/gpu_check.py``). No project imports, nothing heavy: a launcher can build it before torch or
transformers are known to import."""
from __future__ import annotations

import os
from pathlib import Path


def subprocess_env(threads: int) -> dict:
    """The environment for the recipe's command lines run as subprocesses: this one, offline Hugging Face, ``threads``
    OpenMP threads, the repository on ``PYTHONPATH`` (used by ``recipe.demo`` and ``scripts/gpu_check.py``; this
    module imports nothing heavy, so a launcher can build it before torch or transformers are known to import)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
