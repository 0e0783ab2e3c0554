"""The GPU-sized demo (``python -m recipe.experiments demo-gpu``, ``make demo`` on a GPU) on the CPU: its plan fits one
device call and is what ``--dry-run`` prints, ``DEMO_SCALE`` picks the scale, chunks of one context length merge into
the entry of one run, the page quotes its JSON, the device call's carried parts join back byte for byte, and (slow)
every stage at the tiny scale through run.py and recipe.eval, then the results page made from that run's JSON."""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.training import ROOT
from recipe import demo
from recipe.eval.context import ContextPrompt
from recipe.eval.length_report import length_entry, merge_entries
from recipe.eval.speculative import Generation
from recipe.experiments import demo_gpu
from recipe.experiments.demo_gpu_page import page_markdown
from recipe.experiments.demo_gpu_plan import ESTIMATES_S, GPU, TINY, eval_jobs, plan, step_seconds
from recipe.experiments.demo_gpu_report import mtbench_section, section

sys.path.insert(0, str(ROOT / "tests"))
import test_docs  # noqa: E402  (the docs check's table reader)


def _script():
    spec = importlib.util.spec_from_file_location("gpu_demo", ROOT / "scripts" / "gpu_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_plan_fits_one_device_call_in_order(capsys):
    p = plan(GPU)
    assert list(p["stages"]) == ["assets", "short", "warm", "eval", "report"]
    ends = [s["deadline"] for s in p["stages"].values()]
    assert ends == sorted(ends) and ends[-1] <= 540 and p["fits"]
    assert p["steps"]["short"] >= 100 and p["steps"]["warm"] >= 20  # training fills what the other stages leave
    assert p["step_seconds"]["warm"] > p["step_seconds"]["short"]  # 4 chained 7k samples against 16 of 1.5k
    jobs = eval_jobs(GPU)
    about = {n: sum(j.count for j in jobs if j.request == "about-context" and j.length == n) for n in (256, 2048,
                                                                                                       4096, 7168)}
    assert about == {256: 64, 2048: 64, 4096: 64, 7168: 64}  # at least 64 prompts per length
    mtbench = [j for j in jobs if j.request == "unrelated" and j.length == 0]
    assert sum(j.count for j in mtbench) == 80 and all(j.ks == (5, 3) and j.tree for j in mtbench)
    assert [j.seed for j in mtbench] == [0, 1]  # chunks draw their own contexts
    assert any(j.request == "unrelated" and j.length == 7168 for j in jobs)
    # a larger budget trains longer; one with no room left is flagged and keeps the minimum steps
    assert plan(GPU, 800)["steps"]["short"] > p["steps"]["short"]
    tight = plan(GPU, 200)
    assert not tight["fits"] and tight["steps"] == {"short": 5, "warm": 5}
    assert demo_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "deadline" in out and "about-L7168-c0" in out and "steps of 16 samples ≤ 2048 tokens" in out
    assert demo_gpu.main(["--dry-run", "--budget", "200"]) == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_the_gpu_scale_refuses_a_machine_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "_cuda_count", lambda: 0)
    assert demo_gpu.main(["--output", str(tmp_path / "run")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_device_call_schedule_ends_within_its_budget(capsys):
    _script().dry_run()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["imports", "unpack", "convert", "demo"]
    total = float(lines[-1].split("deadline")[1].split()[0])
    assert total <= 540 < 575 and "budget 540" in lines[-1]


def test_only_the_demos_own_import_failures_stop_the_call():
    script = _script()
    failed = ["specforge-0.2.0-py3-none-any.whl:specforge", "gguf-0.19.0-py3-none-any.whl:gguf", "recipe.bench.x",
              "cuda: no CUDA device"]
    assert script.demo_failures(failed) == failed[1:]
    assert script.demo_failures(["specforge-0.2.0-py3-none-any.whl:specforge"]) == []


def test_tiny_steps_are_fixed_and_estimates_scale_with_the_target():
    assert plan(TINY)["steps"] == {"short": 3, "warm": 2}
    big = json.loads((ROOT / "recipe" / "target" / "configs" / "Llama-3.1-8B-Instruct.json").read_text())
    assert step_seconds(GPU, "short", ESTIMATES_S) == step_seconds(GPU, "short", ESTIMATES_S, demo_gpu.SMOLLM2)
    assert step_seconds(GPU, "short", ESTIMATES_S) * 10 < step_seconds(GPU, "short", ESTIMATES_S, big)


def test_demo_scale_from_the_environment_or_cuda(monkeypatch):
    monkeypatch.setattr(demo, "_cuda_count", lambda: 0)
    assert demo.demo_scale({}) == "cpu" and demo.demo_scale({"DEMO_SCALE": "GPU"}) == "gpu"
    monkeypatch.setattr(demo, "_cuda_count", lambda: 1)
    assert demo.demo_scale({}) == "gpu" and demo.demo_scale({"DEMO_SCALE": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match="DEMO_SCALE='tpu'"):
        demo.demo_scale({"DEMO_SCALE": "tpu"})
    calls = []
    monkeypatch.setattr(demo.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 0)
    monkeypatch.setattr(demo, "main", lambda argv: calls.append(("cpu", argv)) or 0)
    monkeypatch.setenv("DEMO_SCALE", "gpu")
    assert demo.cli(["--budget", "300"]) == 0
    assert calls[-1][1:] == ["-m", "recipe.experiments", "demo-gpu", "--budget", "300"]
    monkeypatch.setenv("DEMO_SCALE", "cpu")
    assert demo.cli(["--epochs", "1"]) == 0 and calls[-1] == ("cpu", ["--epochs", "1"])
    monkeypatch.setenv("DEMO_SCALE", "tpu")
    assert demo.cli([]) == 2


def _generations(accepted: list[list[int]]) -> list[Generation]:
    return [Generation(tokens=list(range(sum(a) + len(a))), seconds=0.5, accepted=a, k=3) for a in accepted]


def _entry(length: int, chains: dict[str, list[list[int]]], names: list[str]) -> dict:
    cps = [ContextPrompt(name=n, category="c", ids=[1] * (length + 10), context_tokens=length, length=length)
           for n in names]
    greedy = [Generation(tokens=[0] * 8, seconds=1.0) for _ in names]
    return length_entry(length, cps, greedy, {(d, 3): _generations(a) for d, a in chains.items()},
                        {d: _generations(a) for d, a in chains.items()}, SimpleTree())


class SimpleTree:
    depth = 5

    def as_dict(self):
        return {"topk": 4, "depth": 5, "budget": 16}


def test_chunks_of_one_length_merge_into_the_entry_of_one_run():
    short = [[1, 0, 2], [0, 0], [3, 1], [2]]
    warm = [[1, 1, 2], [0, 1], [3, 2], [2]]
    names = ["a", "b", "c", "d"]
    whole = _entry(256, {"short": short, "warm": warm}, names)
    parts = [_entry(256, {"short": short[:2], "warm": warm[:2]}, names[:2]),
             _entry(256, {"short": short[2:], "warm": warm[2:]}, names[2:])]
    merged = merge_entries(parts)
    assert merged["num_prompts"] == 4 and merged["merged_from"] == 2
    for got, want in zip(merged["runs"] + merged["tree_runs"], whole["runs"] + whole["tree_runs"]):
        assert got["per_prompt"] == want["per_prompt"]
        assert got["accepted_per_position"] == want["accepted_per_position"]
        assert got["tau"] == want["tau"]  # the same integer sums divided once
        assert got["tau_se"] == pytest.approx(want["tau_se"], rel=1e-12)  # the same residuals, summed in order
    assert merged["tau"] == whole["tau"] and merged["mean_context_tokens"] == whole["mean_context_tokens"]
    with pytest.raises(ValueError, match="different context lengths"):
        merge_entries([parts[0], _entry(512, {"short": short[:2], "warm": warm[:2]}, names[:2])])


def test_spread_prompts_take_the_categories_in_turn(tmp_path):
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["x"]}) + "\n"
                           for i, c in enumerate("aaabbc")))
    out = demo_gpu.spread_prompts(src, tmp_path / "spread.jsonl")
    assert [json.loads(line)["question_id"] for line in out.read_text().splitlines()] == [0, 3, 5, 1, 4, 2]


def _result(delta_sign: int = -1) -> dict:
    """A result JSON as build_result makes it, from synthetic runs (the warm draft accepts less, or more)."""
    names = [f"p{i}" for i in range(6)]
    short = [[2, 1, 0], [1, 1], [3, 0], [2, 2], [0, 1], [1]]
    warm = [[2, 1, 0], [1, 1], [3, 0], [2, 2], [0, 1], [1]]
    warm[0] = [1, 1, 0, 0] if delta_sign < 0 else [3, 1]  # 6 tokens emitted, as short's: in 4 rounds, or in 2
    about = {"context_lengths": [256, 7168], "lengths": [_entry(n, {"short": short, "warm": warm}, names)
                                                           for n in (256, 7168)]}
    unrelated = {"context_lengths": [0], "lengths": [_entry(0, {"short": short, "warm": warm}, names)]}
    stages = {s: {"seconds": 10.5 + i, "estimate_s": 12.0, "deadline_s": 20.0 * (i + 1)}
              for i, s in enumerate(("assets", "short", "warm", "eval", "report"))}
    arms = {"short": {"steps": 200, "samples": 3200, "supervised_tokens": 3141592, "s_per_step": 0.41,
                      "acc0_last10": 0.61, "lr": 0.001, "stopped_at_deadline": False},
            "warm": {"steps": 50, "samples": 200, "supervised_tokens": 999999, "s_per_step": 0.7,
                     "acc0_last10": 0.52, "lr": 0.00025, "stopped_at_deadline": True}}
    return {"device": "NVIDIA H100 80GB HBM3", "scale_settings": dict(GPU.__dict__), "stages": stages, "arms": arms,
            "mtbench": mtbench_section(unrelated), "about_context": section(about), "unrelated": section(unrelated),
            "mismatches": 0, "elapsed_s": 455.0, "call": {"source": {"commit": "abcdef123", "prepared": "2026-12-07"}}}


@pytest.mark.parametrize("sign", [-1, 1])
def test_the_page_quotes_its_json(tmp_path, monkeypatch, sign):
    result = _result(sign)
    paired = result["about_context"]["paired"][0]
    assert paired["draft"] == "warm" and (paired["delta_tau"] < 0) == (sign < 0)
    assert paired["delta_tau_abs"] == abs(paired["delta_tau"])
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo_gpu.json").write_text(json.dumps(result))
    page = tmp_path / "results" / "demo_gpu.md"
    page.write_text(page_markdown(result))
    monkeypatch.setattr(test_docs, "ROOT", tmp_path)
    assert len(test_docs.cited_tables(page)) == 5  # stages, training, MT-Bench, by length, contrast
    assert test_docs.table_mismatches(page) == []
    text = page.read_text()
    assert f"| warm − short (paired) | {'−' if sign < 0 else '+'}{abs(paired['delta_tau']):.3f} ± " in text
    assert "| draft | chain k = 3 | tree" in text and "| draft | 256 (256 tok) | 7168 (7168 tok) |" in text
    assert all(len(line) <= 120 for line in text.splitlines() if not line.startswith("|"))
    assert "- Outputs that differed from greedy decoding: 0." in text and not math.isnan(paired["delta_tau_se"])


def test_the_carried_parts_join_back_byte_for_byte(tmp_path):
    script = _script()
    data = bytes(range(256)) * 4096 + b"tail"
    src = tmp_path / "target.gguf"
    src.write_bytes(data)
    packed = script.compress(src, tmp_path / "target.gguf.xz", preset=1)
    parts = script.split(packed, packed.stat().st_size // 3, (tmp_path / "stage", tmp_path / "assets"))
    assert [p["name"] for p in parts] == ["target.gguf.xz.part1", "target.gguf.xz.part2"]
    out = script.join(parts, [tmp_path / "assets", tmp_path / "elsewhere", tmp_path / "stage"], tmp_path / "out")
    assert out.read_bytes() == data
    with pytest.raises(FileNotFoundError, match="part1 is in none of .*stage-check"):
        script.join(parts, [tmp_path / "assets"], tmp_path / "out2")
    (tmp_path / "stage" / "target.gguf.xz.part1").write_bytes(b"x")
    with pytest.raises(ValueError, match="sha256 differs"):
        script.join(parts, [tmp_path / "assets", tmp_path / "stage"], tmp_path / "out3")


@pytest.mark.slow  # run.py twice and four recipe.eval processes at the tiny scale (~60-75 s on 2 cores)
def test_tiny_scale_runs_every_stage_and_its_page_quotes_the_json(assets, tmp_path, monkeypatch):
    from recipe.target.random_target import main as random_target

    target = tmp_path / "target"
    assert random_target(["--arch", str(assets.target), "--out", str(target), "--tokenizer", str(assets.target),
                          "--layers", "8", "--set", "hidden_size=64", "intermediate_size=128",
                          "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16", "--dtype", "fp32"]) == 0
    data = tmp_path / "conversations.jsonl"
    with open(assets.conversations) as src:
        data.write_text("".join(line for _, line in zip(range(120), src)))
    out = tmp_path / "run"
    assert demo_gpu.main(["--tiny", "--target", str(target), "--data", str(data), "--prompts", str(assets.prompts),
                          "--output", str(out), "--num-proc", "1"]) == 0
    result = json.loads((out / "demo_gpu.json").read_text())
    assert list(result["stages"]) == ["assets", "short", "warm", "eval", "report"]
    assert all(s["seconds"] <= s["deadline_s"] + 5 for s in result["stages"].values())
    assert result["arms"]["short"]["steps"] == 3 and result["arms"]["warm"]["steps"] == 2
    assert result["arms"]["warm"]["init_draft"] == str(out / "short" / "export")  # the continuation of short
    assert result["arms"]["warm"]["chain_conversations"] == 256 and len(result["arms"]["warm"]["curve"]) == 2
    assert result["mismatches"] == 0 and result["stages"]["eval"]["failed"] == []
    assert [r["context_length"] for r in result["about_context"]["rows"]] == [64, 64, 128, 128]
    assert {p["context_length"] for p in result["unrelated"]["paired"]} == {0, 128}
    assert set(result["mtbench"]["drafts"]["warm"]["chain"]) == {"3", "2"} and result["mtbench"]["paired"]
    assert (out / "demo_gpu.png").is_file() and (out / "demo_gpu_curves.png").is_file()
    # a run stopped at its deadline is exported from its checkpoint: the same tensors as the run's own export
    copy = tmp_path / "copy"
    shutil.copytree(out / "short" / "checkpoints", copy / "checkpoints")
    assert demo_gpu.export_checkpoint(copy) and not demo_gpu.export_checkpoint(tmp_path / "none")
    made = load_file(copy / "export" / "model.safetensors")
    own = load_file(out / "short" / "export" / "model.safetensors")
    assert made.keys() == own.keys() and all(torch.equal(made[k], own[k]) for k in own)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo_gpu.json").write_text((out / "demo_gpu.json").read_text())
    page = tmp_path / "results" / "demo_gpu.md"
    page.write_text(page_markdown(result))
    monkeypatch.setattr(test_docs, "ROOT", tmp_path)
    assert len(test_docs.cited_tables(page)) == 5 and test_docs.table_mismatches(page) == []


@pytest.mark.slow  # three stand-in processes
def test_a_run_past_its_deadline_is_stopped_then_killed(tmp_path):
    import time

    def run(body: str, seconds: float) -> tuple[int, bool]:
        cmd = [sys.executable, "-c", "import signal, sys, time\n" + body]
        return demo_gpu.run_until(cmd, demo_gpu.run_env(1, False), time.monotonic() + seconds, 3, tmp_path / "log")

    assert run("sys.exit(0)", 30) == (0, False)
    # run.py's answer to SIGTERM: a checkpoint, then exit 75 (recipe.lifecycle.signals.EXIT_INTERRUPTED)
    assert run("signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\ntime.sleep(60)", 1) == (75, True)
    start = time.monotonic()
    assert run("signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", 1) == (-9, True)  # after grace
    assert time.monotonic() - start < 30
