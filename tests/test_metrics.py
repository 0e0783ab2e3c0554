"""Progress output of the training loop: ``--log-every`` sets how often the statistics refresh, and in a log file
(console not a terminal) each refresh is one printed line."""
import io

import pytest
from rich.console import Console

from recipe.train.metrics import TrainProgress


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "acc": [0.5, 0.25], "tokens": 100, "lr": 1e-3}


def _timed(step: int, seconds: float, mfu: float | None) -> dict:
    """A record with the speed fields the loop adds (``StepSpeed.rates``): 400 positions, 100 supervised tokens."""
    return {**_record(step), "time_s": seconds, "positions": 400, "model_tflops_per_gpu": 2.0 / seconds,
            "mfu": None if mfu is None else mfu / seconds}


def test_log_every_prints_a_line_every_n_steps_and_at_the_end_when_not_a_terminal():
    out = io.StringIO()
    progress = TrainProgress(5, 0, True, Console(file=out, force_terminal=False, width=200), log_every=2)
    for step in range(1, 6):
        progress.update(_record(step))
    progress.close()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert "loss 0.5000  acc0 0.500" in lines[0] and "lr 1.00e-03" in lines[0]
    assert progress.epoch_acc == [[0.5, 0.25]] * 5  # every step counts towards the epoch table


def test_no_lines_on_other_ranks_and_bad_cadence_refused():
    out = io.StringIO()
    progress = TrainProgress(3, 0, False, Console(file=out, force_terminal=False), log_every=1)
    for step in range(1, 4):
        progress.update(_record(step))
    progress.close()
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="log_every must be a positive integer, got 0"):
        TrainProgress(3, 0, False, log_every=0)


def test_the_jsonl_reader_names_file_and_line_or_skips_cut_lines(tmp_path):
    from recipe.jsonl import read_jsonl

    f = tmp_path / "x.jsonl"
    f.write_text('{"a": 1}\n\n[2]\n{"cut')
    assert list(read_jsonl(f, skip_bad=True)) == [(1, {"a": 1}), (3, [2])]
    assert list(read_jsonl(f, skip_bad=True, raw=True))[1] == (3, [2], "[2]")
    with pytest.raises(KeyError, match=rf"{f}: line 4: not valid JSON"):
        list(read_jsonl(f, error=KeyError))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'none.jsonl'}: cannot read"):
        list(read_jsonl(tmp_path / "none.jsonl"))


def test_the_step_line_names_what_it_counts_over_the_steps_since_the_last_line():
    """pos/s and supervised tokens/s, model TFLOP/s a GPU and MFU, averaged over the steps since the last line by
    their own time_s: steps of 1 s and 3 s give 800 / 4 = 200 pos/s, (2 + 2) / 4 = 1.0 TFLOP/s."""
    out = io.StringIO()
    progress = TrainProgress(4, 0, True, Console(file=out, force_terminal=False, width=300), log_every=2)
    for step, seconds in ((1, 1.0), (2, 3.0)):
        progress.update(_timed(step, seconds, 0.01))
    for step, seconds in ((3, 2.0), (4, 2.0)):
        progress.update(_timed(step, seconds, None))  # no peak known: TFLOP/s only
    progress.close()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert "200 pos/s (50 supervised)  1.0 TFLOP/s/GPU 0.5% MFU  lr 1.00e-03" in lines[0], lines
    assert "200 pos/s (50 supervised)  1.0 TFLOP/s/GPU  lr" in lines[1] and "MFU" not in lines[1], lines


def test_step_speed_counts_positions_and_model_flops_of_a_step():
    """``StepSpeed``: the positions and model FLOPs of a step's samples from their lengths, and the rates of a
    record (per GPU over the world size, MFU against the peak)."""
    from recipe.model.flops import DraftShape, step_flops
    from recipe.train.metrics import StepSpeed

    shape = DraftShape(hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, draft_vocab=8, target_hidden=24,
                       ttt_steps=3)
    lengths = {0: 10, 1: 7, 2: 12}
    speed = StepSpeed(shape, None, world_size=2, peak_tflops=100.0, sample_lengths=lambda ix: [lengths[i] for i in ix])
    counts = speed.step_counts([2, 0], supervised_tokens=9)
    assert counts == {"positions": 22, "model_flops": step_flops(shape, [12, 10]).model_total}
    rates = speed.rates({**counts, "tokens": 9, "time_s": 0.5})
    assert rates["positions_per_s"] == 44.0 and rates["supervised_tokens_per_s"] == 18.0
    assert rates["model_tflops_per_gpu"] == counts["model_flops"] / 0.5 / 2 / 1e12
    assert rates["mfu"] == rates["model_tflops_per_gpu"] / 100.0
    assert "MFU against 100 TFLOP/s" in speed.describe()
