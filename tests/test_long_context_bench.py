"""``python -m recipe.experiments long-context``: the arms' training flags (stages stubbed, nothing trained), the evaluation
commands (every arm's draft in one ``recipe.eval`` run, windows as ``DIR@W``), and the report built from a
``recipe.eval --context-lengths`` JSON."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe.experiments import long_context as lc
from recipe.experiments.long_context_report import (arm_summary, length_rows, paired_rows, paired_table, plot_report,
                                              report, report_table)
from recipe.eval.report import paired_tau_difference


class _Assets:
    def __init__(self, root: Path):
        self.target, self.conversations, self.prompts = root / "target", root / "data.jsonl", root / "mt.jsonl"


def _stub_stages(monkeypatch, calls):
    def dump(args, assets, data, store, console):
        calls.append(("dump", args.output.name, store.name))
        return True

    def train(args, assets, store, console, data_args=None, extra=()):
        calls.append(("train", args.output.name, args.max_length, args.batch_size, args.ranks, args.epochs,
                      args.lr, store.name if store else None, tuple(data_args or ()), tuple(extra)))
        (args.output / "export").mkdir(parents=True, exist_ok=True)
        (args.output / "export" / "config.json").write_text("{}")
        return False
    monkeypatch.setattr(lc.demo, "stage_dump", dump)
    monkeypatch.setattr(lc.demo, "stage_train", train)
    monkeypatch.setattr(lc, "_target_positions", lambda target: 8192)


def test_arms_are_trained_with_their_flags(tmp_path, monkeypatch):
    calls = []
    _stub_stages(monkeypatch, calls)
    args = lc.build_parser().parse_args(["--output", str(tmp_path / "out"), "--long-length", "4k",
                                         "--long-conversations", "180", "--warm-fraction", "0.25"])
    runs = lc.train_arms(args, ["--lr", "1e-3"], _Assets(tmp_path), console=None)
    assert list(runs) == ["short", "long", "warm", "posrobust"]
    chained = ("--data", str(tmp_path / "data.jsonl"), "--limit", "180", "--chain-conversations", "4096")
    store = "store-sharegpt-n540-len256"
    assert calls == [
        ("dump", "short", store),
        ("train", "short", 256, 4, 2, 4.0, 1e-3, store, (), ()),
        ("train", "long", 4096, 1, 2, 1.0, 1e-3, None, chained, ("--cp-size", "2")),
        ("train", "warm", 4096, 1, 2, 0.25, 5e-4, None, chained,
         ("--cp-size", "2", "--init-draft", str(runs["short"] / "export"))),
        ("dump", "posrobust", store),
        ("train", "posrobust", 256, 4, 2, 4.0, 1e-3, store, (), ("--position-offset-max", str(8192 - 256))),
    ]


def test_a_given_short_run_is_not_retrained_and_a_missing_export_is_an_error(tmp_path, monkeypatch):
    calls = []
    _stub_stages(monkeypatch, calls)
    short = tmp_path / "demo"
    (short / "export").mkdir(parents=True)
    (short / "export" / "config.json").write_text("{}")
    args = lc.build_parser().parse_args(["--output", str(tmp_path / "out"), "--short-run", str(short),
                                         "--arms", "short,posrobust", "--position-offset-max", "1000"])
    runs = lc.train_arms(args, [], _Assets(tmp_path), console=None)
    assert runs == {"short": short.resolve(), "posrobust": tmp_path / "out" / "posrobust"}
    assert [c[:2] for c in calls] == [("dump", "posrobust"), ("train", "posrobust")]
    assert calls[-1][-1] == ("--position-offset-max", "1000")
    monkeypatch.setattr(lc.demo, "stage_train", lambda *a, **k: False)  # "trained" without an export
    args = lc.build_parser().parse_args(["--output", str(tmp_path / "out2"), "--arms", "short,long"])
    with pytest.raises(RuntimeError, match="arm short: .*export was not written"):
        lc.train_arms(args, [], _Assets(tmp_path), console=None)


def test_unknown_arm_is_refused(capsys):
    assert lc.main(["--arms", "short,huge"]) == 2
    assert lc.main(["--arms", "long"]) == 2  # the short arm is what the others are compared with


def _entry(length, drafts):
    runs, trees = [], []
    for i, d in enumerate(drafts):
        runs.append({"draft": d, "num_draft_tokens": 3, "tau": 1.3 + 0.1 * i, "tau_se": 0.02,
                     "accepted_per_position": [10, 3, 1]})
        runs.append({"draft": d, "num_draft_tokens": 5, "tau": 9.0, "tau_se": 0.0, "accepted_per_position": []})
        trees.append({"draft": d, "num_draft_tokens": 5, "tau": 1.5 + 0.1 * i, "tau_se": float("nan")})
    return {"context_length": length, "num_prompts": 4, "mean_context_tokens": length * 0.98, "runs": runs,
            "tree_runs": trees}


def test_report_rows_table_and_plot(tmp_path):
    about = {"context_lengths": [256, 4096], "lengths": [_entry(256, ["short", "short@256"]),
                                                           _entry(4096, ["short", "short@256"])]}
    contrast = {"context_lengths": [0], "lengths": [_entry(0, ["short"])]}
    rows = length_rows(about)
    assert [(r["draft"], r["context_length"]) for r in rows] == [("short", 256), ("short@256", 256),
                                                                   ("short", 4096), ("short@256", 4096)]
    assert rows[1]["k"] == 3 and rows[1]["tau"] == pytest.approx(1.4) and rows[1]["tau_tree"] == pytest.approx(1.6)
    assert math.isnan(rows[0]["tau_tree_se"])
    args = lc.build_parser().parse_args(["--output", str(tmp_path)])
    result = report(args, {"short": {"run": "x"}}, about, contrast)
    assert result["unrelated"]["rows"][0]["context_length"] == 0
    assert json.loads(json.dumps(result, default=str))["settings"]["output"] == str(tmp_path)
    table = report_table(result)
    assert [c.header for c in table.columns] == ["requests", "arm", "0", "256", "4096"]
    assert table.row_count == 3
    cells = list(table.columns[3].cells)
    assert cells[0] == "1.300 ± 0.020\n1.500" and cells[2] == ""
    pytest.importorskip("matplotlib")
    out = plot_report(result, tmp_path / "p.png")
    assert out is not None and out.stat().st_size > 0


def test_arm_summary_from_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 1.0, "tokens": 100, "samples": 2, "time_s": 0.5, "acc_all_supervised": [s / 10, 0]})
        + "\n" for s in range(1, 13)))
    (tmp_path / "run_config.json").write_text(json.dumps(
        {"args": {"max_length": 4096, "chain_conversations": 4096, "position_offset_max": 0, "cp_size": None},
         "parallelism": {"tp": 1, "cp": 2, "dp": 1},  # cp from the DeepSpeed JSON, not the flag
         "deepspeed": {"optimizer": {"params": {"lr": 0.002}}}}))
    s = arm_summary(tmp_path)
    assert (s["steps"], s["samples"], s["supervised_tokens"], s["train_s"]) == (12, 24, 1200, 6.0)
    assert s["acc0_last10"] == pytest.approx(sum(range(3, 13)) / 100)
    assert s["max_length"] == 4096 and s["lr"] == 0.002
    assert s["layout"] == {"tp": 1, "cp": 2, "dp": 1} and s["cp_size"] is None
    assert arm_summary(tmp_path / "none") == {"run": str(tmp_path / "none"),
                                              "export": str(tmp_path / "none" / "export")}


def test_one_eval_run_for_every_arm_and_its_skip_stamp(tmp_path, monkeypatch):
    seen = []

    def fake_call(cmd, env, cwd, **kwargs):
        seen.append((cmd, cwd))
        Path(cmd[cmd.index("--output") + 1]).write_text(json.dumps({"context_lengths": [256], "lengths": []}))
        return 0
    monkeypatch.setattr(lc.subprocess, "call", fake_call)
    args = lc.build_parser().parse_args(["--prompts", "8", "--context-lengths", "256,4k"])
    out = tmp_path / "about"
    drafts = ["short", "long", "short@256"]
    merged = lc._eval(_Assets(tmp_path), args, tmp_path, drafts, args.context_lengths, "about-context", out,
                      console=lc.Console(quiet=True))
    assert merged == {"context_lengths": [256, 4096], "lengths": []}
    # longest first (the long pole starts first when --eval-jobs runs lengths side by side), merged in given order
    assert [Path(c[c.index("--output") + 1]).name for c, _ in seen] == ["about-L4096.json", "about-L256.json"]
    cmd, cwd = seen[0]
    assert cwd == tmp_path and cmd[1:3] == ["-m", "recipe.eval"]
    assert cmd[cmd.index("--context-lengths") + 1] == "4096" and cmd[cmd.index("--limit") + 1] == "8"
    assert cmd[cmd.index("--context-request") + 1] == "about-context"
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "--draft"] == drafts
    lc._eval(_Assets(tmp_path), args, tmp_path, drafts, args.context_lengths, "about-context", out,
             console=lc.Console(quiet=True))
    assert len(seen) == 2  # the same commands again: skipped
    lc._eval(_Assets(tmp_path), args, tmp_path, drafts[:2], [4096], "about-context", out,
             console=lc.Console(quiet=True))
    assert len(seen) == 3
    monkeypatch.setattr(lc.subprocess, "call", lambda *a, **k: 1)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        lc._eval(_Assets(tmp_path), args, tmp_path, ["x"], [0], "unrelated", tmp_path / "u",
                 console=lc.Console(quiet=True))


def test_fewer_prompts_at_the_longest_length_and_threads_shared_by_jobs(tmp_path, monkeypatch):
    seen = {}

    def fake_call(cmd, env, cwd, **kwargs):
        seen[cmd[cmd.index("--context-lengths") + 1]] = (cmd[cmd.index("--limit") + 1], env["OMP_NUM_THREADS"])
        Path(cmd[cmd.index("--output") + 1]).write_text(json.dumps({"context_lengths": [0], "lengths": []}))
        return 0
    monkeypatch.setattr(lc.subprocess, "call", fake_call)
    monkeypatch.setattr(lc.os, "cpu_count", lambda: 4)
    args = lc.build_parser().parse_args(["--prompts", "32", "--prompts-longest", "16", "--eval-jobs", "2",
                                         "--context-lengths", "256,7k,2k"])
    lc._eval(_Assets(tmp_path), args, tmp_path, ["short"], args.context_lengths, "about-context", tmp_path / "a",
             console=lc.Console(quiet=True))
    assert seen == {"7168": ("16", "2"), "2048": ("32", "2"), "256": ("32", "2")}
    seen.clear()  # the unrelated contrast: --prompts at every length, or --contrast-prompts
    lc._eval(_Assets(tmp_path), args, tmp_path, ["short"], [0, 4096], "unrelated", tmp_path / "u",
             console=lc.Console(quiet=True))
    assert seen == {"0": ("32", "2"), "4096": ("32", "2")}
    seen.clear()
    args.contrast_prompts = 16
    lc._eval(_Assets(tmp_path), args, tmp_path, ["short"], [0, 4096], "unrelated", tmp_path / "u2",
             console=lc.Console(quiet=True))
    assert seen == {"0": ("16", "2"), "4096": ("16", "2")}


def _per_prompt(emitted, steps):
    return {"per_prompt": {"emitted": list(emitted), "verify_steps": list(steps)}}


def _delta_method(emitted, steps_a, steps_b):
    """τ_a − τ_b = ē (1/s̄_a − 1/s̄_b) and its standard error by the multivariate delta method: gᵀ Σ g / n with g
    the gradient in (ē, s̄_a, s̄_b) and Σ the sample covariance (n − 1) of the per-prompt (e, s_a, s_b): an
    independent route to what paired_tau_difference computes prompt by prompt."""
    n = len(emitted)
    cols = [emitted, steps_a, steps_b]
    means = [sum(c) / n for c in cols]
    e, sa, sb = means
    g = [1 / sa - 1 / sb, -e / sa ** 2, e / sb ** 2]
    cov = [[sum((x - mx) * (y - my) for x, y in zip(cx, cy)) / (n - 1) for cy, my in zip(cols, means)]
           for cx, mx in zip(cols, means)]
    var = sum(g[i] * cov[i][j] * g[j] for i in range(3) for j in range(3)) / n
    return e / sa - e / sb, math.sqrt(var)


def test_paired_difference_is_the_delta_method_on_the_same_prompts():
    """Lossless runs of one prompt emit the same tokens whatever the draft; the drafts differ in verification
    steps. The paired difference and its standard error equal the multivariate delta method's."""
    emitted, sa, sb = [31, 20, 31, 31, 15, 28], [22, 16, 25, 20, 12, 24], [24, 15, 27, 25, 13, 24]
    delta, se = paired_tau_difference(_per_prompt(emitted, sa), _per_prompt(emitted, sb))
    want_delta, want_se = _delta_method(emitted, sa, sb)
    assert delta == pytest.approx(want_delta, rel=1e-12) and delta > 0
    assert se == pytest.approx(want_se, rel=1e-9) and se > 0


def test_paired_difference_removes_shared_prompt_difficulty():
    """A draft that needs one verification step fewer on every prompt, on prompts of very different difficulty:
    the unpaired standard error of each τ is wide, the paired one of their difference far narrower; identical
    runs give 0 ± 0; runs of other prompts are refused."""
    from recipe.eval.length_report import tau_standard_error
    from recipe.eval.speculative import Generation

    emitted, sa = [31, 31, 31, 31, 31, 31], [12, 30, 16, 28, 20, 24]
    sb = [s + 1 for s in sa]
    delta, se = paired_tau_difference(_per_prompt(emitted, sa), _per_prompt(emitted, sb))
    unpaired = tau_standard_error([Generation([], 0.0, accepted=[e - s] + [0] * (s - 1), k=3)
                                   for e, s in zip(emitted, sa)])
    assert delta == pytest.approx(186 / 130 - 186 / 136) and se < unpaired / 10
    assert paired_tau_difference(_per_prompt([7, 3], [4, 2]), _per_prompt([7, 3], [4, 2])) == (0.0, 0.0)
    assert paired_tau_difference({"tau": 1.0}, _per_prompt([7, 3], [4, 2])) is None
    assert paired_tau_difference(_per_prompt([7, 3, 1], [4, 2, 1]), _per_prompt([7, 3], [4, 2])) is None
    with pytest.raises(ValueError, match="did not decode the same prompts"):
        paired_tau_difference(_per_prompt([7, 3], [4, 2]), _per_prompt([3, 7], [2, 4]))


def test_paired_rows_and_table_against_the_short_arm(tmp_path):
    entry = _entry(4096, ["short", "warm"])
    emitted, short_steps, warm_steps = [8, 5, 12, 6], [4, 4, 4, 4], [3, 4, 3, 4]
    for r in entry["runs"] + entry["tree_runs"]:
        r.update(_per_prompt(emitted, warm_steps if r["draft"] == "warm" else short_steps))
    old = _entry(256, ["short", "warm"])  # a JSON written before per-prompt counts existed
    about = {"context_lengths": [256, 4096], "lengths": [old, entry]}
    rows = paired_rows(about)
    assert [(r["draft"], r["context_length"]) for r in rows] == [("warm", 256), ("warm", 4096)]
    assert rows[0]["delta_tau"] is None and rows[0]["delta_tau_tree"] is None
    want_delta, want_se = _delta_method(emitted, warm_steps, short_steps)
    assert rows[1]["delta_tau"] == pytest.approx(31 / 14 - 31 / 16) == pytest.approx(want_delta)
    assert rows[1]["delta_tau_se"] == pytest.approx(want_se, rel=1e-9)
    assert rows[1]["delta_tau_tree"] == rows[1]["delta_tau"]
    args = lc.build_parser().parse_args(["--output", str(tmp_path)])
    result = report(args, {"short": {"run": "x"}}, about, None)
    assert result["about_context"]["paired"] == rows
    table = paired_table(result)
    assert [c.header for c in table.columns] == ["arm", "4096"] and table.row_count == 1
    assert list(table.columns[1].cells)[0].startswith(f"+{31 / 14 - 31 / 16:.3f} ± ")
    assert paired_table(report(args, {}, {"context_lengths": [256], "lengths": [old]}, None)) is None
