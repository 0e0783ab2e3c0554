"""Existing EAGLE-3 drafts for the ``--init-draft`` tests: this project's export of a random draft of a tiny target,
and the same weights in the EAGLE repository's and the ``layers.0.`` key layouts."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from recipe.export import WEIGHTS_FILE, export_tensors, load_export, write_export
from recipe.model.draft import Eagle3Draft
from recipe.target.registry import draft_config_for


def make_export(target: Path, out: Path, draft_vocab: int = 64, seed: int = 3, **overrides) -> Path:
    """An export folder (``recipe.export.write_export``) of a draft of ``target`` with the target's geometry
    (``overrides`` applied): weight matrices ~ N(0, 0.2) and norms in [0.5, 1.5] drawn from ``seed`` (far from the
    near-uniform predictions of a fresh draft, and every tensor distinct, so a load that skips one shows), a random
    sorted vocabulary map of ``draft_vocab`` ids."""
    config = draft_config_for(AutoConfig.from_pretrained(target), draft_vocab, overrides)
    draft = Eagle3Draft(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in draft.parameters():
            p.uniform_(0.5, 1.5, generator=g) if p.dim() == 1 else p.normal_(0.0, 0.2, generator=g)
    ids = torch.sort(torch.randperm(config.vocab_size, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(draft_vocab), t2d)
    return write_export(export_tensors(draft.state_dict()), config.to_hf_dict(), out)


def eagle_repo_layout(export: Path, out: Path) -> Path:
    """The export's weights as the EAGLE repository releases a draft: ``pytorch_model.bin`` (a pickled state dict)
    with the ``midlayer.*`` keys and the target embedding ``embed_tokens.weight``, and a config.json without
    ``eagle_config`` (the aux layers are then the target's defaults) or ``torch_dtype``."""
    tensors, config = load_export(export)
    out.mkdir(parents=True)
    state = {**tensors, "embed_tokens.weight": torch.zeros(config["vocab_size"], config["hidden_size"])}
    torch.save(state, out / "pytorch_model.bin")
    eagle = {k: v for k, v in config.items() if k not in ("eagle_config", "torch_dtype")}
    (out / "config.json").write_text(json.dumps(eagle))
    return out


def layers0_file(export: Path, out: Path, drop: tuple[str, ...] = ("t2d",)) -> Path:
    """The export's weights in one ``.safetensors`` file, keys ``model.layers.0.*`` / ``model.fc.weight`` ..., the
    keys in ``drop`` left out, no config.json."""
    tensors, _ = load_export(export)
    renamed = {"model." + k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k not in drop}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(renamed, str(out))
    return out


def export_weights(export: Path) -> dict[str, torch.Tensor]:
    """The export's tensors (``model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(str(Path(export) / WEIGHTS_FILE))
