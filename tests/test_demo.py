"""recipe.demo pieces that run without training: the untrained (seed-initialised) export and the DeepSpeed JSON."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from rich.console import Console

from recipe import demo
from recipe.export import check_export, export_tensors, load_export, write_export
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.target_head import load_embedding_and_head


def test_untrained_export_is_the_seed_draft_with_the_trained_vocab(tiny_target, tmp_path):
    target = tiny_target
    _, lm_head_VH, hf_config = load_embedding_and_head(target)
    config = Eagle3DraftConfig.from_target_config(hf_config, 16)
    trained = Eagle3Draft(config, seed=9)
    ids = torch.arange(3, 96, 6)[:16]
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    trained.set_vocab_map(ids - torch.arange(16), t2d)
    write_export(export_tensors(trained.state_dict()), config.to_hf_dict(), tmp_path / "run" / "export")

    args = SimpleNamespace(output=tmp_path / "run", seed=4)
    out = demo.stage_untrained_export(args, SimpleNamespace(target=target), Console(quiet=True))
    assert check_export(out) == []
    tensors, cfg = load_export(out)
    assert cfg == config.to_hf_dict(torch_dtype="float32")  # write_export records the tensors' dtype
    assert torch.equal(tensors["d2t"], ids - torch.arange(16)) and torch.equal(tensors["t2d"], t2d)
    assert torch.equal(tensors["lm_head.weight"], lm_head_VH[ids])
    seed_draft = Eagle3Draft(config, seed=4)
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"):
        assert torch.equal(tensors[name], seed_draft.state_dict()[name]), name


def test_ds_config_overrides(tmp_path):
    args = SimpleNamespace(ds_config=demo.REPO / "ds_configs" / "demo_zero3.json", lr=3e-3, batch_size=6,
                           output=tmp_path)
    cfg = json.loads(demo._ds_config(args).read_text())
    assert cfg["optimizer"]["params"]["lr"] == 3e-3 and cfg["train_batch_size"] == 6
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["parallelism"] == {"tp_size": 1, "cp_size": 1}
