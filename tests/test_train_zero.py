"""End-to-end DeepSpeed training parity on CPU/gloo, fp32: ZeRO stages 0-3 on 2 data-parallel ranks and 1 rank × 2
micro-batches give the same loss and grad-norm curves (rel ``helpers.tolerance.FP32_CURVE``) as the single-process
reference; the export round-trips, equals DeepSpeed's own consolidation of its ZeRO-3 checkpoint, and the checker
rejects a broken export."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.training import assert_curves_close, run_training, train_argv, write_ds_config
from helpers.tolerance import FP32_CURVE, FP32_REORDERED, assert_close_rel
from recipe.export import LATEST

pytestmark = pytest.mark.slow  # DeepSpeed training runs

STEPS = 5


def test_zero_stages_and_accumulation_match_single_process(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    # global batch 4 with constant LR (no scheduler): every step moves the weights, so curves diverge on any bug
    ref_cfg = write_ds_config(tmp_path / "ref.json", train_batch_size=4, train_micro_batch_size_per_gpu=2,
                              scheduler=None)
    accum_cfg = write_ds_config(tmp_path / "accum.json", train_batch_size=4, train_micro_batch_size_per_gpu=1,
                                scheduler=None)
    (ref,) = run_ranks(1, run_training, [train_argv(ref_cfg, target, store, tmp_path / "ref", "--max-steps",
                                                    str(STEPS))])[0]
    (accum,) = run_ranks(1, run_training, [train_argv(accum_cfg, target, store, tmp_path / "accum", "--max-steps",
                                                      str(STEPS))])[0]
    argvs = []
    for stage in range(4):
        cfg = write_ds_config(tmp_path / f"z{stage}.json", base=f"zero{stage}.json", train_batch_size=4,
                              train_micro_batch_size_per_gpu=1, scheduler=None)
        argvs.append(train_argv(cfg, target, store, tmp_path / f"z{stage}", "--max-steps", str(STEPS)))
    curves = run_ranks(2, run_training, argvs)[0]

    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"]
    assert_curves_close(ref, accum, FP32_CURVE, "1 rank x 2 micro-batches")
    for stage, curve in enumerate(curves):
        assert_curves_close(ref, curve, FP32_CURVE, f"ZeRO-{stage} dp=2")


def test_export_round_trip_and_check(tiny_target_and_store, tmp_path):
    from recipe.export import check_export, load_export
    from recipe.export.__main__ import export_checkpoint
    from recipe.model.draft import Eagle3Draft
    from recipe.model.draft_config import Eagle3DraftConfig

    target, store = tiny_target_and_store
    cfg = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4,
                          train_micro_batch_size_per_gpu=2)
    ((first, second),) = run_ranks(1, run_training, [train_argv(cfg, target, store, tmp_path / "run", "--max-steps",
                                                                  "2")])[0]
    # the scheduler starts at iteration 0: step 1 trains at warmup_min_ratio·lr, not at DeepSpeed's initial lr 0
    assert 0 < first["lr"] < second["lr"]
    export = tmp_path / "run" / "export"
    assert check_export(export) == []
    tensors, config = load_export(export)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["torch_dtype"] == "float32" and tensors["fc.weight"].dtype == torch.float32
    # ZeRO-3 saves copy DeepSpeed's recovery scripts into the save folder: none is left behind
    run = tmp_path / "run"
    assert not list(run.rglob("zero_to_*.py")) and not (run / "checkpoints" / ".partial").exists()
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in tensors

    # export -> load into a fresh draft; the consolidated checkpoint copy exports the same tensors
    draft = Eagle3Draft(Eagle3DraftConfig.from_hf_dict(config), seed=123)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    assert unexpected == [] and missing == ["embed_tokens.weight"]
    checkpoints = tmp_path / "run" / "checkpoints"
    from_ckpt = export_checkpoint(checkpoints, tmp_path / "again")
    again, _ = load_export(from_ckpt)
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)

    # the trained engine's weights, independently of our gather: DeepSpeed's own fp32 consolidation of the ZeRO-3
    # shards it saved. The export equals them tensor for tensor, and the reloaded draft's logits are
    # lm_head(RMSNorm(h)) computed from them
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=(checkpoints / LATEST).read_text().strip())
    assert set(engine) == {f"draft.{k}" for k in tensors} | {"draft.embed_tokens.weight"}
    for name, value in tensors.items():
        assert torch.equal(value, engine[f"draft.{name}"]), name
    h = torch.randn(1, 5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * engine["draft.norm.weight"]
    assert_close_rel(draft.logits(h), normed @ engine["draft.lm_head.weight"].T, FP32_REORDERED, "export logits")

    # the checker names each problem of a broken export
    from safetensors.torch import save_file

    broken = dict(tensors)
    del broken["norm.weight"]
    broken["fc.weight"] = broken["fc.weight"][:, :-1].contiguous()
    broken["d2t"] = broken["d2t"].to(torch.int32)
    save_file(broken, str(export / "model.safetensors"))
    problems = check_export(export)
    assert any("missing tensor 'norm.weight'" in p for p in problems)
    assert any("'fc.weight' has shape" in p for p in problems)
    assert any("'d2t' has dtype" in p for p in problems)
    save_file(tensors, str(export / "model.safetensors"))
    (export / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert "model.safetensors: 'fc.weight' has dtype torch.float32, config.json says torch_dtype 'bfloat16'" \
        in check_export(export)
    config.pop("eagle_config")
    (export / "config.json").write_text(json.dumps(config))
    assert any("missing field 'eagle_config'" in p for p in check_export(export))
