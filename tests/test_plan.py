"""recipe.plan: ZeRO arithmetic, parameter counts of the real draft, the CLI's errors, fits / longest length, the
fake-process-group traces of tp2 and cp2, and (slow) the traced step against the CPU measurement of the same step."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config

from helpers.training import write_ds_config
from recipe.bench.measure import build_model, run_measurement
from recipe.plan.spec import BenchSpec
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.plan import PlanInputs, longest_fit, plan_length, predict_step, states
from recipe.plan.states import GIB
from recipe.plan import __main__ as cli
from recipe.plan.trace import trace_step
from recipe.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = ROOT / "tests" / "data" / "llama-3.1-8b-instruct"
SMALL = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "draft_vocab": 512,
         "vocab": 640, "target_hidden": 64, "ttt_steps": 2, "loss_chunk_size": 64, "attention_tile": 32}


def test_zero_states_per_stage_exact_bytes():
    p = states.DraftParams(trainable=1000, frozen=600, head_buffer=50)
    bf16 = {s: states.zero_states(p, s, dp_cp=4, bf16=True, reduce_bucket=300) for s in range(4)}
    assert bf16[0] == {"weights": 1600 * 2 + 100, "grads": 2000, "optimizer": 12000, "zero_buffers": 0}
    assert bf16[1] == {"weights": 3300, "grads": 2000, "optimizer": 3000, "zero_buffers": 0}
    assert bf16[2] == {"weights": 3300, "grads": 500, "optimizer": 3000, "zero_buffers": 600}
    # stage 3: weights / 4 (+ the head buffer, never partitioned); the step gathers the other 3/4 back
    assert bf16[3] == {"weights": 800 + 100, "grads": 500, "optimizer": 3000, "zero_buffers": 2400 + 600}
    fp32 = states.zero_states(p, 3, dp_cp=2, bf16=False, reduce_bucket=10 ** 9)
    assert fp32 == {"weights": 3200 + 200, "grads": 2000, "optimizer": 4000, "zero_buffers": 3200 + 4000}
    assert states.zero_states(p, 3, dp_cp=1, bf16=True)["zero_buffers"] == 2000  # nothing to gather, one bucket
    # the shipped bf16 configs: fp32 accumulation (stage 1: BF16_Optimizer keeps fp32 grads beside the bf16 ones,
    # stages 2-3: fp32 partitions) and fp32 reduction (a 4-byte bucket)
    fp32_grads = {s: states.zero_states(p, s, 4, True, 300, fp32_grad_accum=True, fp32_comm=True) for s in range(4)}
    assert fp32_grads[0] == bf16[0] and fp32_grads[1]["grads"] == 6000 and fp32_grads[1]["zero_buffers"] == 0
    assert fp32_grads[2]["grads"] == 1000 and fp32_grads[2]["zero_buffers"] == 1200
    assert fp32_grads[3]["grads"] == 1000 and fp32_grads[3]["zero_buffers"] == 2400 + 1200
    with pytest.raises(ValueError, match="stage must be"):
        states.zero_states(p, 4, 1, True)


def _dims(tp, cp, dp):
    return ParallelDims(world_size=tp * cp * dp, tp=tp, cp=cp, dp=dp)


def test_nccl_communicators_count_the_split_targets_ring_only_where_it_is_a_new_group():
    # (tp, cp, dp, split) -> world, tp, cp, dp, dp·cp groups of > 1 rank, plus cp·tp when the split target adds it
    assert states.communicators(_dims(1, 2, 1), True) == states.communicators(_dims(1, 2, 1)) == 3  # ring = cp group
    assert (states.communicators(_dims(2, 1, 1)), states.communicators(_dims(2, 1, 1), True)) == (2, 3)
    assert (states.communicators(_dims(2, 2, 2)), states.communicators(_dims(2, 2, 2), True)) == (5, 6)
    assert states.communicators(_dims(1, 1, 1), True) == 0


def test_nccl_overheads_count_point_to_point_communicators_at_their_own_size():
    """The cp group (the ring) and a split target's cp·tp ring carry send/receive traffic: 1.5 GiB each; every other
    communicator 0.75 GiB (recipe.plan.states' cited measurements)."""
    gib = states.GIB
    assert (states.NCCL_BYTES_PER_COMMUNICATOR, states.NCCL_P2P_BYTES_PER_COMMUNICATOR) == (0.75 * gib, 1.5 * gib)
    assert states.p2p_communicators(_dims(1, 1, 1)) == 0 and states.p2p_communicators(_dims(1, 2, 1)) == 1
    assert (states.p2p_communicators(_dims(2, 2, 1)), states.p2p_communicators(_dims(2, 2, 1), True)) == (1, 2)
    assert states.overheads(_dims(1, 1, 1), 0)["nccl"] == 0
    assert states.overheads(_dims(1, 1, 4), 0)["nccl"] == 3 * 0.75 * gib  # world, dp, dp·cp (each its own)
    assert states.overheads(_dims(1, 2, 1), 0)["nccl"] == 2 * 0.75 * gib + 1.5 * gib  # world, dp·cp; the cp ring
    assert states.overheads(_dims(2, 2, 2), 0, True)["nccl"] == 4 * 0.75 * gib + 2 * 1.5 * gib
    assert states.overheads(_dims(1, 1, 1), 1000)["allocator_slack"] == 50


def test_draft_parameters_are_the_real_drafts_and_respect_tp_and_frozen_lm_head():
    spec = BenchSpec(seq_len=64, **SMALL)
    model = build_model(spec, torch.device("cpu"))
    config = model.draft.config
    counted = states.count_draft_params(config)
    assert counted.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counted.frozen == 640 * 64 and counted.head_buffer == 512 * 64
    frozen_head = states.count_draft_params(config, freeze_lm_head=True)
    assert frozen_head.trainable == counted.trainable - 512 * 64 and frozen_head.frozen == counted.frozen + 512 * 64
    tp2 = states.count_draft_params(config, tp=2)
    split = sum(p.numel() for n, p in model.draft.named_parameters() if n.startswith(("midlayer.self_attn.",
                                                                                       "midlayer.mlp.", "lm_head.")))
    assert tp2.trainable == counted.trainable - split // 2 and tp2.head_buffer == 256 * 64


def test_gpu_sizes_and_bad_names():
    assert states.gpu_bytes("H200") == 143771 * 2 ** 20 and states.gpu_bytes("80") == 80 * GIB
    for bad in ("h300", "-1", "0"):
        with pytest.raises(ValueError, match="--gpu"):
            states.gpu_bytes(bad)


def _run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip()


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    ds = str(ROOT / "ds_configs" / "zero3_bf16.json")
    cases = [(["--ds_config", str(tmp_path / "nope.json"), "--target", str(LLAMA_8B), "--length", "4k"], "nope.json"),
             (["--ds_config", ds, "--target", str(tmp_path / "none"), "--length", "4k"], "--target"),
             (["--ds_config", ds, "--target", str(LLAMA_8B), "--length", "4k", "--gpu", "h300"], "h300"),
             (["--ds_config", ds, "--target", str(LLAMA_8B), "--length", "101", "--cp", "2"], "--length 101")]
    for argv, named in cases:
        code, err = _run_cli(argv, capsys)
        assert code == 2 and named in err and len(err.splitlines()) == 1, err
    typo = write_ds_config(tmp_path / "typo.json", base="zero3_bf16.json", zero_optimisation={})
    pinned = write_ds_config(tmp_path / "pinned.json", base="zero3_bf16.json", parallelism={"dp_size": 2})
    for argv, named in [(["--ds_config", str(typo), "--length", "4k"], "'zero_optimisation': unknown key"),
                        (["--ds_config", str(pinned), "--length", "4k", "--world-size", "3"], "must equal world_size")]:
        code, err = _run_cli(argv + ["--target", str(LLAMA_8B)], capsys)  # the ConfigError's path, named once
        assert code == 2 and named in err and err.count(argv[1]) == 1 and len(err.splitlines()) == 1, err
    gemma = tmp_path / "gemma2.json"  # an architecture the ring cannot run: online cp > 1 refused
    Gemma2Config().to_json_file(gemma)
    code, err = _run_cli(["--ds_config", ds, "--target", str(gemma), "--length", "4k", "--cp", "2"], capsys)
    assert code == 2 and "online at cp_size=2" in err and "python -m recipe.dump" in err, err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--ds_config", ds, "--target", str(LLAMA_8B), "--length", "4q"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "bad length '4q'" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_cli_plans_offline_what_it_refuses_online(tmp_path, capsys):
    """Gemma 2 (an architecture the ring cannot run, refused online at cp > 1 above) is planned offline at cp = 2
    (a whole trace and fit: tens of seconds)."""
    ds = str(ROOT / "ds_configs" / "zero3_bf16.json")
    gemma = tmp_path / "gemma2.json"
    Gemma2Config().to_json_file(gemma)
    argv = ["--ds_config", ds, "--target", str(gemma), "--length", "4k", "--cp", "2", "--offline"]
    code, err = _run_cli(argv, capsys)
    assert code == 0, err


def _small_inputs(gpu_gib: float, **spec_changes) -> PlanInputs:
    spec = BenchSpec(seq_len=64, layout="chunked+ckpt", dtype="bf16", attention_backend="flex",
                     **{**SMALL, "loss_chunk_size": 128, **spec_changes})
    config = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=640, draft_vocab_size=512, target_hidden_size=64,
                               aux_layer_ids=[1, 2, 3])
    target = states.TargetShape(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=640,
                                params=200_000, layer_params=40_000, embed_params=40_960)
    return PlanInputs(spec=spec, dp=1, zero_stage=3, reduce_bucket=states.DEFAULT_REDUCE_BUCKET,
                      params=states.count_draft_params(config, spec.tp), target=target, offline=False,
                      partitioned_target=False, gpu="test", gpu_bytes=int(gpu_gib * GIB))


def test_plan_length_splits_the_online_target_by_the_runs_rule(monkeypatch):
    """recipe.target.registry.splits_target decides the planned target forward as it decides the run's: at tp = 2 a
    routable target (llama) runs on 1/tp of the positions and adds the cp·tp ring's communicator, a non-routable one
    (gemma2) runs whole; at cp = 2 gemma2 is refused online and planned offline (no target at all)."""
    import recipe.plan as plan

    monkeypatch.setattr(plan, "predict_step", lambda spec, fit=None: {"step_bytes": 0, "method": "stub"})
    tp2 = dataclasses.replace(_small_inputs(1, tp=2), dp=1)
    llama, gemma = (plan_length(dataclasses.replace(tp2, target_arch=a), 1024) for a in ("llama", "gemma2"))
    whole = states.target_bytes(tp2.target, 1024, 2, False, False, argmax_chunk=tp2.argmax_chunk)["target_forward"]
    halved = states.target_bytes(tp2.target, 512, 2, False, False, argmax_chunk=tp2.argmax_chunk)["target_forward"]
    assert (gemma["target_forward"], llama["target_forward"]) == (whole, halved) and halved < whole
    assert llama["nccl"] - gemma["nccl"] == states.NCCL_P2P_BYTES_PER_COMMUNICATOR
    cp2 = dataclasses.replace(_small_inputs(1, cp=2), target_arch="gemma2")
    with pytest.raises(ValueError, match="does not support model_type 'gemma2'"):
        plan_length(cp2, 1024)
    offline = plan_length(dataclasses.replace(cp2, offline=True), 1024)
    assert offline["target_weights"] == offline["target_forward"] == 0


@pytest.mark.slow
def test_fits_and_longest_length(monkeypatch):
    monkeypatch.setattr(states, "CUDA_CONTEXT_BYTES", 0)  # the tiny draft must not drown in the fixed overheads
    inputs = _small_inputs(0.05)
    row = plan_length(inputs, 4096)
    parts = sum(row[k] for k in ("weights", "grads", "optimizer", "zero_buffers", "batch", "target_weights"))
    assert row["total"] == parts + max(row["draft_activations"], row["target_forward"]) + row["allocator_slack"]
    best = longest_fit(inputs)
    assert best is not None and best % 1024 == 0
    assert plan_length(inputs, best)["fits"] is True
    from recipe.plan import layout_fit

    fit = layout_fit(inputs.spec)
    assert plan_length(inputs, best, fit)["fits"] and not plan_length(inputs, best + 1024, fit)["fits"]
    assert longest_fit(dataclasses.replace(inputs, gpu_bytes=1)) is None
    assert not plan_length(dataclasses.replace(inputs, gpu_bytes=1), 1024)["fits"]


@pytest.mark.slow
def test_tp2_and_cp2_traces_hold_less_per_rank_than_one_rank():
    """Flex (the stand-in kernel; per-position memory dominates) and the tiled ring, on the fake process group."""
    base = BenchSpec(seq_len=4096, layout="chunked+ckpt", attention_backend="flex", **{**SMALL, "loss_chunk_size": 512})
    one = trace_step(base)
    tp2 = trace_step(dataclasses.replace(base, tp=2))
    cp2 = trace_step(dataclasses.replace(base, cp=2))
    assert tp2.step_bytes < 0.75 * one.step_bytes and cp2.step_bytes < 0.75 * one.step_bytes, (one, tp2, cp2)
    assert tp2.params["trainable"] < one.params["trainable"] == cp2.params["trainable"]
    tiled = dataclasses.replace(base, seq_len=1024, attention_backend="tiled", attention_tile=256)
    assert trace_step(dataclasses.replace(tiled, cp=2)).step_bytes < trace_step(tiled).step_bytes
    import torch.distributed as dist

    assert not dist.is_initialized()  # the fake process group is gone again


def test_cli_writes_the_json_of_a_small_target(tmp_path, capsys):
    target = tmp_path / "t" / "config.json"
    target.parent.mkdir()
    target.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 640, "max_position_embeddings": 4096}))
    out = tmp_path / "plan.json"
    code = cli.main(["--ds_config", str(ROOT / "ds_configs" / "zero3_bf16.json"), "--target", str(target.parent),
                     "--length", "1k,8k", "--gpu", "1", "--draft-vocab-size", "512", "--ttt-steps", "2",
                     "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    (lay,) = plan["layouts"]
    assert [r["length"] for r in lay["rows"]] == [1024, 8192] and lay["backend"] == "flex"
    assert plan["command"].startswith("python -m recipe.plan --ds_config") and plan["zero_stage"] == 3
    assert all(r["total"] < 1 * GIB for r in lay["rows"]) and lay["longest_fit"] > 8192
    # the whole draft's count (what the docs quote), and each layout's per-rank count beside it (equal at tp = 1)
    assert plan["draft"]["trainable_params"] == lay["trainable_params_per_rank"] > 0


@pytest.mark.slow
def test_traced_step_matches_the_cpu_measurement_within_10_percent():
    """``python -m recipe.bench memory``'s step Δ (VmHWM peak − RSS before the step, fresh processes) against the
    planner's step bytes of the same BenchSpec, fp32, one process: three lengths, chunked+ckpt and full."""
    pairs = []
    for layout in ("chunked+ckpt", "full"):
        for n in (1024, 2048, 3072):
            spec = BenchSpec(seq_len=n, layout=layout, ttt_steps=2, loss_chunk_size=1024, attention_tile=1024)
            measured = run_measurement(spec)
            assert measured["status"] == "ok", measured["detail"]
            pairs.append((layout, n, predict_step(spec)["step_bytes"], measured["ranks"][0]["step_bytes"]))
    for layout, n, predicted, measured in pairs:
        print(f"{layout} {n}: predicted {predicted / 2 ** 20:.1f} MiB, measured {measured / 2 ** 20:.1f} MiB")
        assert abs(predicted / measured - 1) < 0.10, pairs


def test_committed_plan_records_the_whole_drafts_parameters():
    """docs quote ``draft.trainable_params`` of plan_h200.json as the 8B draft's size: the unsplit count (the tp = 1
    layouts' per-rank count), not the last layout's share."""
    plan = json.loads((ROOT / "docs" / "results" / "plan_h200.json").read_text())
    by_tp = {lay["tp"]: lay["trainable_params_per_rank"] for lay in plan["layouts"]}
    assert plan["draft"]["trainable_params"] == by_tp[1] > by_tp[2]
    assert round(plan["draft"]["trainable_params"] / 1e6) == 425  # "425 M" in README.md and docs/recipes.md


def test_fraction_masks_supervise_exactly_the_last_fraction_and_named_masks_stay():
    from recipe.plan.spec import fraction_mask, mask_fraction, supervised_mask

    assert fraction_mask(0.25) == "last0.25" and mask_fraction("last0.25") == 0.25 and mask_fraction("long10") is None
    expected = torch.zeros(2, 100, dtype=torch.bool)
    expected[:, 75:] = True
    assert torch.equal(supervised_mask("last0.25", 2, 100), expected)
    assert supervised_mask("last0.29", 1, 100).sum() == 29  # the decimal, not the float 0.29 (28.999... of 100)
    assert supervised_mask("last1e-05", 1, 64).tolist() == [[False] * 63 + [True]]  # at least one position
    assert torch.equal(supervised_mask("last1.0", 3, 50), supervised_mask("full", 3, 50))
    for n in (7, 100, 4096, 32768):  # long10 is the fraction mask of 0.1
        assert torch.equal(supervised_mask(fraction_mask(0.1), 1, n), supervised_mask("long10", 1, n))
    assert supervised_mask("sharegpt", 1, 195).sum() == 135 and supervised_mask("full", 1, 8).all()
    assert BenchSpec(seq_len=64, mask="last0.3").mask == "last0.3"
    for bad in ("last0", "last1.5", "lastx", "last", "half"):
        with pytest.raises(ValueError, match="mask|fraction"):
            BenchSpec(seq_len=64, mask=bad)
    for bad in (0, -0.1, 1.01, True):
        with pytest.raises(ValueError, match="supervised fraction"):
            fraction_mask(bad)


def _chats(path: Path) -> Path:
    """Three ShareGPT chats and a bad line; under the char-level template of ``chat_target`` a turn is
    len(role) + len(content) + 4 tokens (<|im_start|>, "\\n" after the role, <|im_end|>, "\\n"), and an assistant
    turn's content and its <|im_end|> are supervised: 28 tokens / 6 supervised, 32 / 5, 23 / 2."""
    def chat(user, answer):
        return json.dumps({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]})

    path.write_text("\n".join([chat("hi", "hello"), "{", chat("add two", "four"), chat("x", "y")]) + "\n")
    return path


def test_supervised_fraction_of_the_data_is_supervised_over_all_tokens(chat_target, tmp_path):
    from recipe.plan.supervision import measure_supervision

    data = _chats(tmp_path / "chats.jsonl")
    cache = str(tmp_path / "cache")
    whole = measure_supervision([str(data)], chat_target, 1024, cache_dir=cache)
    assert (whole.supervised, whole.tokens, whole.examples, whole.skipped) == (13, 83, 3, 1)
    assert whole.fraction == 13 / 83
    first = measure_supervision([str(data)], chat_target / "config.json", 1024, limit=3, cache_dir=cache)
    assert (first.supervised, first.tokens, first.examples, first.fraction) == (11, 60, 2, 11 / 60)
    with pytest.raises(ValueError, match="tokenizer"):
        measure_supervision([str(data)], LLAMA_8B, 1024, cache_dir=cache)
    with pytest.raises(ValueError, match="nope.jsonl"):
        measure_supervision([str(tmp_path / "nope.jsonl")], chat_target, 1024, cache_dir=cache)


@pytest.mark.slow
def test_cli_plans_the_supervised_fraction_given_or_measured_from_data(chat_target, tmp_path, capsys):
    data, cache, out = _chats(tmp_path / "chats.jsonl"), str(tmp_path / "cache"), tmp_path / "plan.json"
    base = ["--ds_config", str(ROOT / "ds_configs" / "zero3_bf16.json"), "--target", str(chat_target), "--length",
            "1k", "--gpu", "1", "--ttt-steps", "2"]
    code = cli.main(base + ["--data", str(data), "--limit", "3", "--cache-dir", cache, "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = " ".join(capsys.readouterr().out.split())  # rich may wrap a title
    assert "11 of 60 tokens supervised (18.33%)" in printed and "last 18.33% supervised" in printed
    plan = json.loads(out.read_text())
    assert plan["supervision"]["source"] == "--data" and plan["supervision"]["fraction"] == 11 / 60
    assert plan["supervision"]["data"]["limit"] == 3 and plan["supervision"]["data"]["max_length"] == 1024
    dense, sparse = plan["layouts"]
    assert (dense["sparse_anchors"], dense["mask"]) == (False, "full")
    assert (sparse["sparse_anchors"], sparse["mask"]) == (True, f"last{11 / 60!r}")
    assert sparse["rows"][0]["draft_activations"] < dense["rows"][0]["draft_activations"]
    # the flag wins over the data (still measured and recorded); named masks stay beside it
    args = cli.build_parser().parse_args(base + ["--supervised-fraction", "0.5", "--data", str(data), "--cache-dir",
                                                 cache, "--sparse-anchors", "long10"])
    cli.check_data_arguments(cli.build_parser(), args)
    given = cli.supervision(args)
    assert (given["fraction"], given["source"], given["data"]["fraction"]) == (0.5, "--supervised-fraction", 13 / 83)
    assert cli.supervision(cli.build_parser().parse_args(base)) is None
    capsys.readouterr()
    for flags, named in ((["--supervised-fraction", "0"], "(0, 1]"), (["--supervised-fraction", "2"], "(0, 1]"),
                         (["--data", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
                         (["--data", str(data), "--limit", "0"], "--limit")):
        try:
            code = cli.main(base + flags)
        except SystemExit as exc:  # argparse's one-line error
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and named in err and len(err.splitlines()) == 1, err
