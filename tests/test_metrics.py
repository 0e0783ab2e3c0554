"""Progress output of the training loop: ``--log-every`` sets how often the statistics refresh, and in a log file
(console not a terminal) each refresh is one printed line."""
import io

import pytest
from rich.console import Console

from recipe.train.metrics import TrainProgress


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "acc": [0.5, 0.25], "tokens": 100, "lr": 1e-3}


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
