"""Our top-level ``kernels`` package must never pass for the PyPI ``kernels`` (Hugging Face hub kernels).

transformers probes it with ``is_kernels_available()`` (version in [KERNELS_MIN_VERSION, KERNELS_MAX_VERSION))
and, when it answers yes, imports ``kernels.get_kernel`` & co. Each check runs in a fresh interpreter (the probe
is cached per process) with cwd = repo root and the repo root first on sys.path, as in every run of the recipe.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # every case starts a fresh interpreter

PROBE = """
import importlib.metadata, importlib.util, json, sys
from transformers.utils import import_utils
if sys.argv[1] == "no-metadata":  # as if the repo were only on sys.path, without the editable install's dist-info
    _version = importlib.metadata.version
    def _without_ours(name):
        if name in ("kernels", "eagle3-recipe", "eagle3_recipe"):
            raise importlib.metadata.PackageNotFoundError(name)
        return _version(name)
    importlib.metadata.version = _without_ours
spec = importlib.util.find_spec("kernels")
exists, version = import_utils._is_package_available("kernels", return_version=True)
print(json.dumps({
    "origin": spec.origin,
    "version": version,
    "available": import_utils.is_kernels_available(),
    "min_version": import_utils.KERNELS_MIN_VERSION,
}))
"""

LOAD_LLAMA = """
import json, sys, tempfile
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=128, max_position_embeddings=64)
model = AutoModelForCausalLM.from_config(config)
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    logits = model(torch.tensor([[1, 2, 3]])).logits
from transformers.integrations import hub_kernels
print(json.dumps({
    "kernels_imported": "kernels" in sys.modules,
    "hub_kernels_available": hub_kernels.is_kernels_available(),
    "attn_implementation": model.config._attn_implementation,
    "logits_shape": list(logits.shape),
}))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("metadata", ["installed", "no-metadata"])
def test_transformers_does_not_take_our_kernels_for_hub_kernels(metadata):
    probe = _run(PROBE, metadata)
    assert Path(probe["origin"]) == ROOT / "kernels" / "__init__.py"  # the probe really sees our package
    assert probe["available"] is False, probe
    if metadata == "no-metadata":
        assert probe["version"] == "N/A"  # transformers imported ours and found no __version__


def test_llama_load_does_not_import_our_kernels():
    loaded = _run(LOAD_LLAMA)
    assert loaded["logits_shape"] == [1, 3, 128]
    assert loaded["kernels_imported"] is False
    assert loaded["hub_kernels_available"] is False
    assert loaded["attn_implementation"] in ("sdpa", "eager")
