"""The ZeRO-3 partitioned frozen target (``recipe.target.partition``): its ``target`` JSON section, captures
equal to the replicated target's on 2 gloo ranks, the multi-rank dump with it writing the single-rank store, and
online training with it giving the replicated target's curve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.tiny_target import random_chats, save_tiny_llama
from helpers.training import assert_curves_close, run_training, write_ds_config
from helpers.tolerance import FP32_CURVE, FP32_REORDERED, assert_close_rel, within

from recipe.config import load_run_config
from recipe.config_keys import ConfigError
from recipe.target.options import TargetOptions

# partition every parameter (DeepSpeed keeps parameters below 1e5 elements whole by default: all of a tiny model's)
ZERO = {"stage3_param_persistence_threshold": 0}
SECTION = {"partition": "zero3", "zero_optimization": ZERO}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_target_section_parsed_recorded_and_removed(tmp_path):
    cfg = write_ds_config(tmp_path / "z.json", train_batch_size=2, target=SECTION)
    config = load_run_config(cfg, 2)
    assert config.target == TargetOptions("zero3", ZERO) and config.target.partitioned
    assert "target" not in config.deepspeed
    assert config.record()["target"] == SECTION
    assert config.target.zero_config() == {"stage": 3, "memory_efficient_linear": False, **ZERO}
    default = load_run_config(write_ds_config(tmp_path / "d.json", train_batch_size=2), 2)
    assert default.target == TargetOptions() and not default.target.partitioned
    assert default.record()["target"] == {"partition": "none", "zero_optimization": {}}


@pytest.mark.parametrize("section, fragment", [
    ("zero3", "'target' must be an object"),
    ({"partition": "zero2"}, "'target.partition' must be one of ['none', 'zero3'], got 'zero2'"),
    ({"partiton": "zero3"}, "unknown key(s) ['partiton'] in 'target'"),
    ({"partition": "zero3", "zero_optimization": 3}, "'target.zero_optimization' must be an object"),
    ({"partition": "zero3", "zero_optimization": {"stage": 2}}, "'target.zero_optimization.stage' must be 3"),
    ({"partition": "zero3", "zero_optimization": {"bogus": 1}},
     "'target.zero_optimization.bogus': Extra inputs are not permitted"),
    ({"partition": "zero3", "zero_optimization": {"stage3_max_live_parameters": "many"}},
     "'target.zero_optimization.stage3_max_live_parameters'"),
])
def test_bad_target_section_names_file_and_field(tmp_path, section, fragment):
    cfg = write_ds_config(tmp_path / "bad.json", train_batch_size=2, target=section)
    with pytest.raises(ConfigError) as info:
        load_run_config(cfg, 2)
    assert str(cfg) in str(info.value) and fragment in str(info.value)


def test_dump_flags_select_the_partitioned_target(tmp_path):
    from recipe.dump import _parse, target_options

    base = ["--target", "t", "--data", "d.jsonl", "--output", "o"]
    assert target_options(_parse(base)) == TargetOptions()
    assert target_options(_parse(base + ["--partition-target"])) == TargetOptions("zero3")
    cfg = write_ds_config(tmp_path / "z.json", target={"zero_optimization": ZERO})
    assert target_options(_parse(base + ["--ds_config", str(cfg)])) == TargetOptions("none", ZERO)
    assert target_options(_parse(base + ["--ds_config", str(cfg), "--partition-target"])) == TargetOptions(
        "zero3", ZERO)
    bad = write_ds_config(tmp_path / "bad.json", target={"partition": "yes"})
    with pytest.raises(ConfigError, match="bad.json: 'target.partition' must be one of"):
        target_options(_parse(base + ["--ds_config", str(bad)]))


def _capture_rank(rank, world_size, folder):
    from recipe.target.capture import TargetModel
    from recipe.target.partition import PartitionedTargetModel

    target = PartitionedTargetModel(folder, aux_layer_ids=[1, 4, 7], dtype=torch.float32, device="cpu",
                                    options=TargetOptions.from_section(SECTION))
    reference = TargetModel(folder, aux_layer_ids=[1, 4, 7], dtype=torch.float32, device="cpu")
    q = dict(target.model.named_parameters())["model.layers.3.self_attn.q_proj.weight"]
    partition = (q.ds_tensor.numel(), q.ds_numel, tuple(q.data.shape))
    with pytest.raises(RuntimeError, match="full_lm_head"):
        target.lm_head_weight
    gen = torch.Generator().manual_seed(rank)
    out = []
    for length in (5 + 3 * rank, 17 - 4 * rank):  # other shapes on each rank, right padding in the second batch
        ids = torch.randint(1, 96, (2, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, length // 2:] = 0
        got, ref = target.capture(ids, mask), reference.capture(ids, mask)
        out.append({"rel_aux": float((got.aux_hidden_BSA - ref.aux_hidden_BSA).norm() / ref.aux_hidden_BSA.norm()),
                    "rel_last": float((got.last_hidden_BSH - ref.last_hidden_BSH).norm()
                                      / ref.last_hidden_BSH.norm()),
                    "argmax_equal": bool(torch.equal(got.argmax_BS, ref.argmax_BS)),
                    "shapes": (tuple(got.aux_hidden_BSA.shape), tuple(got.last_hidden_BSH.shape))})
    return {"batches": out, "partition": partition, "vocab": (target.vocab_size, reference.vocab_size),
            "fingerprint": (target.fingerprint, reference.fingerprint)}


def _capture_ranks(rank, world_size, folders):
    return [_capture_rank(rank, world_size, folder) for folder in folders]


@pytest.mark.slow
def test_partitioned_capture_equals_replicated(tmp_path):
    folders = [save_tiny_llama(tmp_path / name, tie_word_embeddings=tied)  # SmolLM2-like targets tie the lm_head
               for name, tied in (("untied", False), ("tied", True))]
    for rank, results in enumerate(run_ranks(2, _capture_ranks, folders, timeout=300)):
        for folder, result in zip(folders, results):
            label = f"rank {rank}, {folder.name}"
            held, full, data = result["partition"]
            assert held * 2 == full == 32 * 32 and data == (0,), f"{label}: q_proj is not split over 2 ranks"
            assert result["vocab"] == (96, 96) and result["fingerprint"][0] == result["fingerprint"][1], label
            for batch in result["batches"]:
                within(batch["rel_aux"], FP32_REORDERED, f"{label} aux")
                within(batch["rel_last"], FP32_REORDERED, f"{label} last hidden")
                assert batch["argmax_equal"], (label, batch)
                assert batch["shapes"][0][-1] == 3 * 32, label


def _dump_rank(rank, world_size, folder, out, num_samples):
    from recipe.dump import dump_hidden_states
    from recipe.parallel.collectives import Collectives
    from recipe.target.partition import PartitionedTargetModel

    target = PartitionedTargetModel(folder, dtype=torch.float32, device="cpu",
                                    options=TargetOptions.from_section(SECTION))
    stats = dump_hidden_states(target, random_chats(num_samples), out, max_length=64, dtype="fp32", batch_size=2,
                               shard_size=8, rank=rank, world_size=world_size, comm=Collectives("cpu"))
    return stats.forward_calls


@pytest.mark.slow
def test_two_rank_partitioned_dump_writes_the_single_rank_store(tiny_target, tmp_path):
    from recipe.data.store import HiddenStateStore
    from recipe.dump import dump_hidden_states
    from recipe.target.capture import TargetModel

    n = 21  # rank 0: 11 samples = shards of 8 + 3 = 4 + 2 forwards; rank 1: 10 = 8 + 2 = 4 + 1 forwards
    dump_hidden_states(TargetModel(tiny_target, dtype=torch.float32, device="cpu"), random_chats(n),
                       tmp_path / "one", max_length=64, dtype="fp32", batch_size=2, shard_size=8)
    forwards = run_ranks(2, _dump_rank, tiny_target, tmp_path / "two", n, timeout=300)
    assert forwards == [6, 5]  # rank 1 made one idle forward more, not counted here
    one, two = HiddenStateStore(tmp_path / "one"), HiddenStateStore(tmp_path / "two")
    two.validate()
    assert one.meta == two.meta and len(two.shards) == 4
    for i in range(n):
        a, b = one.get(i), two.get(i)
        for key in ("input_ids", "loss_mask", "target_argmax"):
            assert torch.equal(a[key], b[key]), (i, key)
        for key in ("aux_hidden", "last_hidden"):
            assert_close_rel(b[key], a[key], FP32_REORDERED, f"sample {i} {key}")


@pytest.mark.slow
def test_online_training_with_partitioned_target_gives_the_replicated_curve(assets, tmp_path):
    """Online runs (draft ZeRO-3 too; 4 samples per step): the partitioned target (over every rank) gives the
    replicated target's curve of the same layout, on 2 ranks at dp=2 (2 micro-batches, so 2 captures, per rank), tp=2
    (DeepSpeed's data-parallel group of the draft is one rank) and cp=2, and on 4 ranks at tp2·cp2; under cp or tp the
    target's forward is split over the cp·tp ranks (the ring inside ZeRO-3's layer gathers)."""
    target = _chat_target(tmp_path / "target", assets)  # all its vocabulary in the draft's: a random target's
    # argmax is anywhere in it
    layouts = {"dp2": (2, 1, 1), "tp2": (2, 2, 1), "cp2": (2, 1, 2), "tp2cp2": (4, 2, 2)}
    argvs = {2: [], 4: []}
    for layout, (world, tp, cp) in layouts.items():
        for holding, changes in (("replicated", {}), ("partitioned", {"target": SECTION})):
            name = f"{holding}_{layout}"
            cfg = write_ds_config(tmp_path / f"{name}.json", base="zero3.json", train_batch_size=4,
                                  train_micro_batch_size_per_gpu=1, scheduler=None,
                                  parallelism={"tp_size": tp, "cp_size": cp}, **changes)
            argvs[world].append(["--ds_config", str(cfg), "--target", str(target), "--data",
                                 str(assets.conversations), "--limit", "32", "--max-length", "64", "--output",
                                 str(tmp_path / name), "--max-steps", "3", "--draft-vocab-size", "49152",
                                 "--ttt-steps", "2", "--seed", "0", "--lm-head-init", "random", "--cache-dir",
                                 str(tmp_path / "cache"), "--no-export"])
    curves = run_ranks(2, run_training, argvs[2], timeout=900)[0] + run_ranks(4, run_training, argvs[4],
                                                                              timeout=900)[0]
    for i, layout in enumerate(layouts):
        ref, partitioned = curves[2 * i], curves[2 * i + 1]
        assert len(ref) == 3 and all(r["loss"] > 0 and min(r["valid"]) > 0 for r in ref), layout
        assert_curves_close(ref, partitioned, FP32_CURVE, f"partitioned target, {layout}")
        recorded = json.loads((tmp_path / f"partitioned_{layout}" / "run_config.json").read_text())
        assert recorded["online_target"]["partitioned"], layout
        assert recorded["online_target"]["forward_split"] == layouts[layout][1] * layouts[layout][2], layout
    assert recorded["target"] == SECTION and "target" not in recorded["deepspeed"]


def _chat_target(folder, assets):
    """A tiny random Llama with the SmolLM2 tokenizer (vocabulary 49152) at ``folder``."""
    target = save_tiny_llama(folder, vocab=49152)
    for name in TOKENIZER_FILES:
        shutil.copy(assets.target / name, target / name)
    return target


def _dump_main_rank(rank, world_size, argv):
    from recipe.dump import main

    main(argv)


@pytest.mark.slow
def test_dump_cli_with_partition_target_on_two_ranks_writes_the_single_rank_store(assets, tmp_path):
    from recipe.data.store import HiddenStateStore
    from recipe.dump import main

    target = _chat_target(tmp_path / "target", assets)
    cfg = write_ds_config(tmp_path / "z.json", target={"zero_optimization": ZERO})
    base = ["--target", str(target), "--data", str(assets.conversations), "--limit", "24", "--max-length", "64",
            "--batch-size", "2", "--shard-size", "4", "--dtype", "fp32", "--cache-dir", str(tmp_path / "cache")]
    main(base + ["--output", str(tmp_path / "one")])
    run_ranks(2, _dump_main_rank, base + ["--output", str(tmp_path / "two"), "--ds_config", str(cfg),
                                          "--partition-target"], timeout=300)
    one, two = HiddenStateStore(tmp_path / "one"), HiddenStateStore(tmp_path / "two")
    assert one.meta == two.meta and len(one) == len(two) > 8
    for i in range(len(one)):
        a, b = one.get(i), two.get(i)
        for key in ("input_ids", "loss_mask", "target_argmax"):
            assert torch.equal(a[key], b[key]), (i, key)
        for key in ("aux_hidden", "last_hidden"):
            assert_close_rel(b[key], a[key], FP32_REORDERED, f"sample {i} {key}")
    with pytest.raises(SystemExit, match="needs several ranks"):
        main(base + ["--output", str(tmp_path / "three"), "--partition-target"])
