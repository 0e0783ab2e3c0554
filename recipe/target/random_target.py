"""A target folder of a public architecture with **random weights**, for benchmarks and checks only.

    python -m recipe.target.random_target --arch Llama-3.1-8B-Instruct --out DIR --tokenizer TOK
        [--layers N] [--set KEY=VALUE ...] [--dtype bf16|fp32] [--device cpu|cuda] [--seed S] [--max-shard-size 4GB]

What it is for: the memory, speed and code paths of a real target's shape (``run.py --target DIR``, ``recipe.eval``,
the GPU checks) where the weights cannot be downloaded. What it is not: a model. Its losses, accuracies and τ mean
nothing, and the folder says so (``RANDOM_TARGET.json``).

- ``--arch``: the public name of a shipped config (``recipe.target.named``: Llama-3.1-8B-Instruct, Qwen3-8B,
  Llama-3.3-70B-Instruct; an ``org/`` prefix is fine) or a config.json / folder. Every value of that config is kept
  (sizes, heads, vocabulary, ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``), but ``--layers`` (fewer
  decoder layers) and ``--set`` (any field, the value read as JSON: ``--set hidden_size=64 rope_scaling=null``) for
  a scaled-down target on the CPU.
- ``--tokenizer``: a folder whose tokenizer and chat template are copied in (the shipped SmolLM2 one:
  ``.cache/recipe/smollm2-135m-instruct`` after ``python -m recipe.assets``, or ``.gpu_assets/target_source``). Its
  ids must stay below the config's ``vocab_size`` (ValueError otherwise); the config's bos/eos/pad ids are set to
  the tokenizer's (the public ids index another vocabulary), the replaced values recorded in ``RANDOM_TARGET.json``.
- Weights: drawn by the architecture's own initialisation (transformers' ``_init_weights``, normal with the config's
  ``initializer_range``) from ``torch.manual_seed(seed)`` directly on ``--device`` in ``--dtype``, then written as
  sharded safetensors (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, shards of at most
  ``--max-shard-size``), the layout of a hub download. An 8B target in bf16 is about 15 GiB of files: on a GPU the
  draw takes seconds and the write is bound by the disk; the tool prints both times.

The folder then loads like any target: ``run.py --target DIR`` (online or ``recipe.dump``), ``python -m recipe.eval
--target DIR``, ``python -m recipe.plan --target DIR``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from recipe.target.named import HUB_REPOS, resolve_config, shipped_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")
"""The tokenizer files copied from ``--tokenizer`` when present."""
MARKER = "RANDOM_TARGET.json"
"""The file that marks a folder as a random-weight target (what it was built from, and that its weights are random)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def parse_override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value read as JSON, else the text itself). Raises ValueError without ``=``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. hidden_size=64")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def target_config(arch: str | Path, layers: int | None = None, overrides: dict | None = None):
    """The transformers config of ``arch`` (a shipped name, a config.json or a folder holding one) with ``layers``
    decoder layers (default: the config's) and ``overrides`` applied. Raises FileNotFoundError for an unknown
    ``arch``, ValueError for ``layers`` < 1 or an unknown field in ``overrides``."""
    from transformers import AutoConfig  # import cost: transformers

    data = json.loads(resolve_config(arch).read_text())
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}: must be >= 1")
        data["num_hidden_layers"] = int(layers)
    for key, value in (overrides or {}).items():
        if key not in data:
            raise ValueError(f"--set {key}: not a field of the {arch} config (fields: {', '.join(sorted(data))})")
        data[key] = value
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _tokenizer_ids(config, tokenizer_dir: Path) -> dict:
    """Check the tokenizer's ids fit the config's vocabulary; set the config's token ids to the tokenizer's.
    Returns the replaced public values. Raises ValueError naming both sizes."""
    from recipe.target.capture import load_tokenizer  # import cost: transformers' tokenizers

    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > int(config.vocab_size):
        raise ValueError(f"--tokenizer {tokenizer_dir}: {len(tokenizer)} token ids, more than the config's vocab_size "
                         f"{config.vocab_size} (ids must stay below it)")
    replaced = {}
    for field in TOKEN_ID_FIELDS:
        new = getattr(tokenizer, field, None)
        replaced[field] = getattr(config, field, None)
        setattr(config, field, new)
    return replaced


def build_random_target(arch: str | Path, out: Path, tokenizer: Path | None, layers: int | None = None,
                        overrides: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu", seed: int = 0, max_shard_size: str | int = "4GB") -> dict:
    """Write a random-weight target of ``arch`` (:func:`target_config` with ``layers`` / ``overrides``) to ``out``:
    config, sharded safetensors in ``dtype`` drawn on ``device`` from ``seed``, ``tokenizer``'s files (None: no
    tokenizer, for offline uses) and ``RANDOM_TARGET.json``. Returns that record (``arch``, ``hub_repo``, ``seed``,
    ``layers``, ``overrides``, ``dtype``, ``device``, ``parameters``, ``bytes`` of the weight files, ``init_s`` and
    ``save_s`` in seconds, ``replaced_token_ids``). Raises FileNotFoundError / ValueError naming a bad input,
    FileExistsError when ``out`` already holds a config.json."""
    from transformers import AutoModelForCausalLM  # import cost: transformers

    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"--out {out}: already holds a config.json; choose a new folder")
    config = target_config(arch, layers, overrides)
    replaced = _tokenizer_ids(config, Path(tokenizer)) if tokenizer is not None else {}
    device = torch.device(device)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(out, max_shard_size=max_shard_size)
    save_s = time.perf_counter() - t0
    for name in TOKENIZER_FILES if tokenizer is not None else ():
        if (Path(tokenizer) / name).is_file():
            shutil.copyfile(Path(tokenizer) / name, out / name)
    name = shipped_name(arch)
    record = {"arch": name or str(arch), "hub_repo": HUB_REPOS.get(name), "seed": seed,
              "layers": int(config.num_hidden_layers), "overrides": overrides or {},
              "dtype": str(dtype).removeprefix("torch."), "device": str(device),
              "parameters": sum(p.numel() for p in model.parameters()),
              "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
              "init_s": round(init_s, 2), "save_s": round(save_s, 2),
              "tokenizer": str(tokenizer) if tokenizer is not None else None, "replaced_token_ids": replaced,
              "note": "random weights, for benchmarks and checks only: losses, accuracies and tau mean nothing"}
    (out / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.target.random_target", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True,
                   help="a shipped config's public name (Llama-3.1-8B-Instruct, Qwen3-8B, Llama-3.3-70B-Instruct; "
                        "org/ prefix fine) or a config.json / folder holding one")
    p.add_argument("--out", type=Path, required=True, help="the new target folder")
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="folder whose tokenizer and chat template are copied in (its ids must be < vocab_size), e.g. "
                        ".cache/recipe/smollm2-135m-instruct")
    p.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="config fields to change, values as JSON (a scaled-down target: --set hidden_size=64 "
                        "intermediate_size=128 num_attention_heads=4 num_key_value_heads=2 head_dim=16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are drawn (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights")
    p.add_argument("--max-shard-size", default="4GB", help="largest safetensors shard, e.g. 4GB or 500MB")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0, or 2 with one line naming the bad input."""
    args = build_parser().parse_args(argv)
    try:
        overrides = dict(parse_override(t) for t in args.overrides)
        record = build_random_target(args.arch, args.out, args.tokenizer, args.layers, overrides,
                                     DTYPES[args.dtype], args.device, args.seed, args.max_shard_size)
    except (OSError, ValueError) as exc:
        print(f"python -m recipe.target.random_target: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {record['arch']} with random weights, {record['layers']} layers, "
          f"{record['parameters'] / 1e9:.2f} B parameters, {record['bytes'] / 2 ** 30:.2f} GiB of {record['dtype']} "
          f"safetensors (drawn on {record['device']} in {record['init_s']:.1f} s, written in "
          f"{record['save_s']:.1f} s); for benchmarks and checks only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
