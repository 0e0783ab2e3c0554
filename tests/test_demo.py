"""recipe.demo pieces that run without training (the DeepSpeed JSON, the regeneration command, the evaluation stage
on the real target with a random export) and ``python -m recipe.experiments data``'s arm parsing and rows."""
from __future__ import annotations

import json
import os

import pytest
from rich.console import Console
from transformers import AutoConfig

from recipe import demo
from recipe.experiments import data as bench_data
from recipe.export import export_tensors, write_export
from recipe.model.draft import Eagle3Draft
from recipe.target.registry import draft_config_for


def test_ds_config_overrides(tmp_path):
    args = demo.build_parser().parse_args(["--output", str(tmp_path), "--lr", "3e-3", "--batch-size", "6"])
    cfg = json.loads(demo._ds_config(args).read_text())
    assert cfg["optimizer"]["params"]["lr"] == 3e-3 and cfg["train_batch_size"] == 6
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["parallelism"] == {"tp_size": 1, "cp_size": 1}
    assert "gradient_accumulation_steps" not in cfg


@pytest.mark.parametrize("flag,frozen", [([], False),
                                         (["--freeze-lm-head"], True), (["--no-freeze-lm-head"], False)])
def test_train_stage_passes_the_lm_head_setting(tmp_path, monkeypatch, flag, frozen):
    calls = []
    monkeypatch.setattr(demo, "_run", lambda cmd, env, console, what: calls.append(cmd))
    args = demo.build_parser().parse_args(["--output", str(tmp_path), *flag])
    assets = type("A", (), {"target": tmp_path / "t"})
    assert demo.stage_train(args, assets, tmp_path / "store", Console(quiet=True)) is False
    (cmd,) = calls
    assert ("--freeze-lm-head" in cmd) is frozen and "--epochs" in cmd
    assert "freeze_lm_head" in demo.STAGE_INPUTS["train"]


def test_regenerate_stage_runs_the_first_exchange(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "_run", lambda cmd, env, console, what: calls.append((cmd, env)))
    args = demo.build_parser().parse_args(["--output", str(tmp_path), "--answers", "regenerated",
                                           "--conversations", "7", "--regenerate-tokens", "33"])
    assets = type("A", (), {"target": tmp_path / "t", "conversations": tmp_path / "c.jsonl"})
    out = demo.stage_regenerate(args, assets, Console(quiet=True))
    assert out == tmp_path / "regenerated-n7.jsonl"
    (cmd, env), = calls
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[1:3] == ["-m", "recipe.regenerate"]
    assert flags["--limit"] == "7" and flags["--max-turns"] == "1" and flags["--max-new-tokens"] == "33"
    assert flags["--data"] == str(tmp_path / "c.jsonl") and flags["--output"] == str(out)
    assert env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)


def _random_export(assets, folder):
    config = draft_config_for(AutoConfig.from_pretrained(assets.target), 512)
    return write_export(export_tensors(Eagle3Draft(config, seed=0).state_dict()), config.to_hf_dict(), folder)


@pytest.mark.slow
def test_eval_stage_reports_chain_and_tree(assets, tmp_path):
    import torch

    _random_export(assets, tmp_path / "export")
    argv = ["--output", str(tmp_path), "--eval-prompts", "2", "--max-new-tokens", "5", "--num-draft-tokens", "3,2",
            "--tree-topk", "2", "--tree-depth", "3", "--tree-budget", "4"]
    threads = torch.get_num_threads()
    result = demo.stage_eval(demo.build_parser().parse_args(argv), assets, [3, 2], Console(quiet=True))
    assert torch.get_num_threads() == threads  # restored after the one-process stage
    assert result["num_prompts"] == 2 and result["num_draft_tokens"] == 3 and set(result["per_k"]) == {"3", "2"}
    assert result["tau"] == result["per_k"]["3"]["tau"] == result["runs"][0]["tau"]
    assert result["tau_tree"] == result["tree_runs"][0]["tau"] and 1.0 <= result["tau_tree"] <= 4.0
    assert result["tree"] == {"topk": 2, "depth": 3, "budget": 4}
    assert [r["draft"] for r in result["runs"]] == ["trained", "trained"]  # no untrained draft any more
    assert result["reference"] == "batched" and result["greedy_tokens_per_s"] > 0
    table = demo.summary_table(result, {"train": 1.0})
    assert table.row_count == 3 and [c.header for c in table.columns] == ["drafting", "draft tokens / round", "τ"]

    chain_only = demo.stage_eval(demo.build_parser().parse_args(argv + ["--tree-depth", "0"]), assets, [3],
                                 Console(quiet=True))
    assert chain_only["tau_tree"] is None and "tree_runs" not in chain_only
    assert demo.summary_table(chain_only, {}).row_count == 1

    context = demo.stage_context(demo.build_parser().parse_args(argv + ["--context-lengths", "64,128",
                                                                        "--context-prompts", "2",
                                                                        "--context-max-new-tokens", "5"]),
                                 assets, [3, 2], Console(quiet=True))
    assert context["request"] == "about-context" and context["num_draft_tokens"] == 3 and context["num_prompts"] == 2
    assert list(context["tau_by_length"]) == ["64", "128"] and [e["num_prompts"] for e in context["lengths"]] == [2, 2]
    assert all(0 < context["mean_context_tokens"][n] <= int(n) for n in ("64", "128"))
    assert all(r["num_draft_tokens"] == 3 for e in context["lengths"] for r in e["runs"])
    assert all(0 < r["new_tokens"] <= 2 * 5 for e in context["lengths"] for r in e["runs"])
    assert demo.summary_table({**chain_only, "context": context}, {}).row_count == 3
    assert demo.stage_context(demo.build_parser().parse_args(argv + ["--context-prompts", "0"]), assets, [3],
                              Console(quiet=True)) is None


def test_bench_arms_parse():
    assert bench_data.parse_arm("sharegpt:740:1") == ("sharegpt", 740, 1.0)
    assert bench_data.parse_arm("regenerated:185:2.5") == ("regenerated", 185, 2.5)
    assert bench_data.arm_name("regenerated", 185, 2.5) == "regenerated-n185-e2.5"
    for bad in ("sharegpt:740", "web:10:1", "sharegpt:x:1", "sharegpt:0:1", "sharegpt:10:0", "sharegpt:1:1:1"):
        with pytest.raises(ValueError, match="arm"):
            bench_data.parse_arm(bad)
    assert bench_data.main(["--arms", "nope", "--output", "/nonexistent"]) == 2


def test_bench_row_reads_a_finished_arm(tiny_target_and_store, tmp_path):
    _, store = tiny_target_and_store
    run = tmp_path / "sharegpt-n30-e2"
    run.mkdir()
    (run / "store-sharegpt-n30-len64").symlink_to(store)
    eval_json = {"tau": 1.5, "tau_tree": 1.75, "num_draft_tokens": 5, "num_prompts": 16, "per_k": {"5": {"tau": 1.5}},
                 "tree": {"topk": 4, "depth": 5, "budget": 16}, "stage_seconds": {"train": 12.5},
                 "settings": {"max_length": 64}}
    (run / "eval.json").write_text(json.dumps(eval_json))
    lines = [{"step": s, "loss": 3.0 - s / 10, "acc_all_supervised": [0.1 * s, 0.0], "tokens": 100 + s}
             for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    row = bench_data.arm_row(run, "sharegpt", 30, 2.0, batch=4)
    assert row["samples"] == 24 and row["steps"] == 3 and row["sample_passes"] == 12 and row["epochs"] == 0.5
    assert row["tau"] == 1.5 and row["tau_tree"] == 1.75 and row["train_s"] == 12.5
    assert row["supervised_tokens"] == 306
    assert row["acc0_last10"] == pytest.approx(0.2)
    assert bench_data.table([row], "t").row_count == 1


def test_stages_report_a_skip_when_their_output_is_there(tiny_target_and_store, tmp_path):
    _, store = tiny_target_and_store
    args = demo.build_parser().parse_args(["--output", str(tmp_path)])
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    assert demo.stage_train(args, None, store, Console(quiet=True)) is True  # no launcher run: the export is there
    assert demo.stage_dump(args, None, None, store, Console(quiet=True)) is True  # a complete store


def test_rerun_keeps_the_seconds_of_skipped_stages(tmp_path, monkeypatch):
    """A rerun that finds a stage's output records the seconds of the run that did the work (the bench reads them)
    and names the stage in ``stages_skipped``; a stage that ran measures itself; a skipped stage whose earlier run had
    other settings, or no readable eval.json, gets no seconds at all rather than this run's ~0 s."""
    from types import SimpleNamespace

    argv = ["--output", str(tmp_path)]
    settings = demo._settings(demo.build_parser().parse_args(argv)) | {"output": str(tmp_path.resolve())}
    earlier = {"tau": 1.3, "tau_tree": 1.5, "num_draft_tokens": 5, "num_prompts": 16, "per_k": {"5": {"tau": 1.3}},
               "stage_seconds": {"assets": 60.0, "dump": 200.0, "train": 500.0, "eval": 400.0, "total": 1160.0},
               "settings": settings}
    fresh = {k: v for k, v in earlier.items() if k not in ("stage_seconds", "settings")}

    def rerun(eval_json, dump_ran=False, eval_result=None):
        (tmp_path / "eval.json").write_text(json.dumps(eval_json))
        monkeypatch.setattr(demo, "stage_dump", lambda *a: not dump_ran)
        monkeypatch.setattr(demo, "stage_eval", lambda *a: dict(eval_result or {**earlier, demo.SKIPPED: True}))
        assert demo.main(argv) == 0
        return json.loads((tmp_path / "eval.json").read_text())

    monkeypatch.setattr(demo, "prepare_assets", lambda: SimpleNamespace(conversations=tmp_path / "c.jsonl"))
    monkeypatch.setattr(demo, "stage_train", lambda *a: True)
    monkeypatch.setattr(demo, "summary_table", lambda *a: "")
    contexts = []
    monkeypatch.setattr(demo, "stage_context", lambda *a: contexts.append(1) or {"tau_by_length": {"256": 1.3}})
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")

    out = rerun(earlier)  # the earlier eval.json has no long-context rows: they are computed
    assert contexts == [1] and out["context"] == {"tau_by_length": {"256": 1.3}}
    assert out["stages_skipped"] == ["dump", "train", "eval"] and demo.SKIPPED not in out
    again = rerun({**out, "stage_seconds": {**out["stage_seconds"], "context": 30.0}},
                  eval_result={**out, demo.SKIPPED: True})
    assert contexts == [1] and again["stages_skipped"] == ["dump", "train", "eval", "context"]
    assert again["stage_seconds"]["context"] == 30.0 and again["context"] == out["context"]
    assert {k: out["stage_seconds"][k] for k in ("dump", "train", "eval")} == {"dump": 200.0, "train": 500.0,
                                                                              "eval": 400.0}
    assert out["stage_seconds"]["assets"] < 60.0 and out["tau"] == 1.3

    out = rerun(earlier, dump_ran=True, eval_result=fresh)  # the dump and the evaluation ran this time
    assert out["stages_skipped"] == ["train"]
    assert out["stage_seconds"]["dump"] < 200.0 and out["stage_seconds"]["eval"] < 400.0
    assert out["stage_seconds"]["train"] == 500.0

    other = {**earlier, "settings": {**settings, "conversations": 7}}  # the earlier seconds are another store's
    out = rerun(other)
    assert out["stages_skipped"] == ["dump", "train", "eval"]
    assert "dump" not in out["stage_seconds"] and "train" not in out["stage_seconds"]

    out = rerun({"stage_seconds": 5, "settings": settings})  # malformed: no earlier seconds, no crash
    assert "dump" not in out["stage_seconds"] and "train" not in out["stage_seconds"]
