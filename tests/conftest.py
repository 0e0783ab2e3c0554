import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the helpers package: ``from helpers.ranks import run_ranks``
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def assets():
    """The real embedded assets (SmolLM2 target folder, ShareGPT JSONL, MT-Bench JSONL), prepared once.

    Returns recipe.assets.Assets; the cache lives in ``$RECIPE_CACHE`` or ``<repo>/.cache/recipe``.
    """
    from recipe.assets import prepare_assets

    return prepare_assets()


# The tiny target and its store are shared by every test of the session and must stay as built: a test that edits
# one (adds files, corrupts a shard) works on its own copy (``shutil.copytree``).
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Folder of a tiny random fp32 Llama target (vocab 96, hidden 32, 8 layers, 4 / 2 KV heads, seed 0), saved once
    (``helpers.tiny_target.save_tiny_llama``)."""
    from helpers.tiny_target import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_target") / "target")


@pytest.fixture(scope="session")
def other_tiny_target(tmp_path_factory) -> Path:
    """Folder of a second tiny target, the same architecture as ``tiny_target`` with weights of seed 1."""
    from helpers.tiny_target import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("other_tiny_target") / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_target_and_store(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """(``tiny_target``, folder of its fp32 offline hidden-state store of 24 random chats), dumped once
    (``helpers.tiny_target.dump_random_chats``)."""
    from helpers.tiny_target import dump_random_chats

    return tiny_target, dump_random_chats(tiny_target, tmp_path_factory.mktemp("tiny_store") / "store")
