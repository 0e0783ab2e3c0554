"""DeepSpeed's tensorboard / csv_monitor sections on a 2-rank gloo run: event files and CSVs hold every step's
metrics with the step as x value, equal to metrics.jsonl, and a resume from an earlier checkpoint leaves each step
once; the sections' validation and a missing writer package give a clear ConfigError."""
from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from helpers.ranks import run_ranks
from recipe.config import load_run_config, pop_monitor_sections
from recipe.config_keys import ConfigError
from recipe.train.metrics import TIMED_FIELDS
from recipe.train.monitor import step_events
from helpers.training import run_training, train_argv, write_ds_config

STEPS = 6


def _tags(k: int) -> set[str]:
    names = ["loss", "lr", "grad_norm", "supervised_tokens_per_s", "positions_per_s", "model_tflops_per_gpu"] + [
        f"{m}_{i}" for m in ("loss", "acc", "acc_all_supervised") for i in range(k)]  # no mfu: no peak on the CPU
    return {f"Train/Steps/{n}" for n in names}


def _expected(record: dict) -> dict[str, float]:
    values = {"loss": record["loss"], "lr": record["lr"], "grad_norm": record["grad_norm"],
              "supervised_tokens_per_s": record["tokens"] / record["time_s"],
              "positions_per_s": record["positions_per_s"], "model_tflops_per_gpu": record["model_tflops_per_gpu"]}
    values.update({f"loss_{i}": v for i, v in enumerate(record["loss_k"])})
    values.update({f"acc_{i}": v for i, v in enumerate(record["acc"])})
    values.update({f"acc_all_supervised_{i}": v for i, v in enumerate(record["acc_all_supervised"])})
    return values


def test_step_events_of_a_record_and_of_a_skipped_step():
    record = {"step": 7, "loss": 2.5, "loss_k": [2.0, 1.0], "acc": [0.5, 0.25], "lr": 1e-3, "grad_norm": None,
              "tokens": 300, "time_s": 1.5, "positions_per_s": 400.0, "model_tflops_per_gpu": 2.5, "mfu": None}
    events = step_events(record)
    assert events == [("Train/Steps/loss", 2.5, 7), ("Train/Steps/loss_0", 2.0, 7), ("Train/Steps/loss_1", 1.0, 7),
                      ("Train/Steps/acc_0", 0.5, 7), ("Train/Steps/acc_1", 0.25, 7), ("Train/Steps/lr", 1e-3, 7),
                      ("Train/Steps/supervised_tokens_per_s", 200.0, 7), ("Train/Steps/positions_per_s", 400.0, 7),
                      ("Train/Steps/model_tflops_per_gpu", 2.5, 7)]
    assert ("Train/Steps/mfu", 0.25, 7) in step_events({**record, "mfu": 0.25})  # with a known peak
    assert step_events({"step": 3, "skipped": "non-finite loss", "samples": 4, "lr": 1e-3}) == []


def test_monitor_sections_are_ours_validated_and_need_their_package(tmp_path, monkeypatch):
    cfg = write_ds_config(tmp_path / "m.json", csv_monitor={"enabled": True, "job_name": "csv"},
                          tensorboard={"enabled": False})
    config = load_run_config(cfg, world_size=1)
    assert "csv_monitor" not in config.deepspeed and "tensorboard" not in config.deepspeed  # the engine logs nothing
    assert config.monitor == {"csv_monitor": {"enabled": True, "job_name": "csv"}, "tensorboard": {"enabled": False}}
    assert config.record()["monitor"] == config.monitor
    with pytest.raises(ConfigError, match="m.json: bad monitor section \\(csv_monitor.job: Extra inputs"):
        pop_monitor_sections({"csv_monitor": {"job": "x"}}, "m.json")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    pop_monitor_sections({"wandb": {"enabled": False}}, "m.json")  # disabled: no package needed
    with pytest.raises(ConfigError) as err:
        pop_monitor_sections({"wandb": {"enabled": True, "project": "p"}}, "m.json")
    assert str(err.value) == ("m.json: 'wandb.enabled' is true but the 'wandb' package is not installed: "
                              "pip install wandb, or set it to false")


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv(folder):
    out = {}
    for file in sorted(folder.glob("*.csv")):
        with file.open(newline="") as f:
            header, *rows = list(csv.reader(f))
        out[file.name] = (header, [(int(s), float(v)) for s, v in rows])
    return out


@pytest.mark.slow
def test_tensorboard_and_csv_hold_every_step_on_two_ranks(tmp_path, tiny_target_and_store):
    pytest.importorskip("tensorboard", reason="the tensorboard writer package (pip install -e '.[monitor]')")
    target, store = tiny_target_and_store
    cfg = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4,
                          tensorboard={"enabled": True, "job_name": "tb"},
                          csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv_out"), "job_name": "csv"})
    run = tmp_path / "run"
    argv = train_argv(cfg, target, store, run, "--max-steps", str(STEPS), "--save-every", "3", "--no-export")
    resume = [*argv, "--resume", str(run / "checkpoints" / "step-00000003")]  # steps 4..6 again
    first, resumed = run_ranks(2, run_training, [argv, resume])[0]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(first, resumed):
        assert {k: v for k, v in a.items() if k not in TIMED_FIELDS} == {
            k: v for k, v in b.items() if k not in TIMED_FIELDS}
    assert not (tmp_path / "DeepSpeedJobName").exists() and not (run / "csv").exists()
    # ZeRO-3 saves leave no DeepSpeed recovery script (zero_to_fp32.py) and no .partial folder behind
    assert not list(run.rglob("zero_to_*.py")) and not (run / "checkpoints" / ".partial").exists()

    # TensorBoard: an empty output_path means the run folder; only our tags, x = step, each step once
    scalars = _scalars(run / "tb")
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2  # one file per process start
    assert set(scalars) == _tags(3)
    for name, values in ((n, [_expected(r)[n] for r in resumed]) for n in _expected(resumed[0])):
        series = scalars[f"Train/Steps/{name}"]
        assert [s for s, _ in series] == list(range(1, STEPS + 1)), name
        for (step, got), want in zip(series, values):  # float32 in the event file
            assert got == pytest.approx(want, rel=1e-6), (name, step)  # one float32 rounding: ≤ 2⁻²⁴ ≈ 6e-8
    assert scalars["Train/Steps/loss"][-1][1] < scalars["Train/Steps/loss"][0][1]

    # CSV: one file per tag, header 'step,<name>', the exact floats of metrics.jsonl, cut to step 3 on resume
    tables = _csv(tmp_path / "csv_out" / "csv")
    assert set(tables) == {t.replace("/", "_") + ".csv" for t in _tags(3)}
    for name in _expected(resumed[0]):
        header, rows = tables[f"Train_Steps_{name}.csv"]
        assert header == ["step", name] and [s for s, _ in rows] == list(range(1, STEPS + 1)), name
        assert [v for _, v in rows] == [_expected(r)[name] for r in resumed], name
    assert json.loads((run / "run_config.json").read_text())["monitor"]["csv_monitor"]["job_name"] == "csv"
