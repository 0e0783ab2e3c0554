import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
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
