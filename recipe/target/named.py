"""The public targets whose ``config.json`` ships with the recipe (``recipe/target/configs/``), by their public names.

A shipped config holds a public model's architecture values as its hub repository publishes them (sizes, heads,
vocabulary, ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``), and no weights. Two uses:

- **planning**: ``python -m recipe.plan --target Llama-3.1-8B-Instruct`` reads the shipped config when the name is
  no folder (``recipe.plan``), so a layout is checked before any weight is downloaded;
- **benchmarks and checks without weights**: ``python -m recipe.target.random_target --arch NAME`` writes a target
  folder of that architecture with random weights (``recipe.target.random_target``).

Training and evaluation need the real weights: ``run.py --target`` and ``python -m recipe.eval --target`` take a
folder (or a ``*.gguf`` file); a shipped name there is refused with what to do (:func:`missing_target_message`).

Names are matched without their organisation prefix and case (``meta-llama/Llama-3.1-8B-Instruct``,
``llama-3.1-8b-instruct``).
"""
from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""``recipe/target/configs/NAME.json``: one shipped config per public model (package data)."""

HUB_REPOS = {
    "Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen3-8B": "Qwen/Qwen3-8B",
    "Llama-3.3-70B-Instruct": "meta-llama/Llama-3.3-70B-Instruct",
}
"""Shipped name -> the hub repository its values come from (``config.json`` at the repository's main branch)."""


def shipped_names() -> list[str]:
    """The public names of the shipped configs, sorted."""
    return sorted(HUB_REPOS)


def shipped_name(name: str | Path) -> str | None:
    """The shipped name ``name`` means (organisation prefix and case ignored), or None."""
    bare = str(name).strip().rstrip("/").rsplit("/", 1)[-1].lower()
    return next((n for n in HUB_REPOS if n.lower() == bare), None)


def shipped_config(name: str | Path) -> Path | None:
    """The shipped ``config.json`` file of ``name`` (:func:`shipped_name`), or None when it names none."""
    found = shipped_name(name)
    return CONFIG_DIR / f"{found}.json" if found else None


def resolve_config(target: str | Path) -> Path:
    """The config.json a planner reads for ``target``: ``target/config.json`` of a folder, ``target`` itself for a
    file, else the shipped config of a public name. Raises FileNotFoundError naming the input and the shipped names
    when it is none of these."""
    path = Path(target)
    if path.is_dir():
        return path / "config.json"
    if path.is_file():
        return path
    shipped = shipped_config(target)
    if shipped is None:
        raise FileNotFoundError(f"--target {target}: no such folder with a config.json, nor a config.json file, nor "
                                f"a shipped config (names: {', '.join(shipped_names())})")
    return shipped


def missing_target_message(target: str | Path) -> str:
    """Why a target that is no folder cannot train or be evaluated, and what to do: for a shipped name, where its
    weights come from and the random-weight builder for benchmarks; otherwise that a folder is needed."""
    name = shipped_name(target)
    if name is None:
        return (f"target folder not found: {target} (--target takes a Hugging Face folder with config, weights and "
                f"tokenizer, or a *.gguf file; download a hub model first, e.g. `hf download ORG/NAME --local-dir "
                f"DIR`)")
    return (f"target folder not found: {target}. {name} is a shipped config (recipe/target/configs/{name}.json): the "
            f"planner reads it (python -m recipe.plan --target {name}), but training and evaluation need the weights "
            f"in a folder: `hf download {HUB_REPOS[name]} --local-dir DIR`, then --target DIR. For benchmarks and "
            f"checks without weights: python -m recipe.target.random_target --arch {name} --out DIR --tokenizer TOK")
