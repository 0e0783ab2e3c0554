"""Training curves (``python -m recipe.plot RUN_DIR``): the figure holds metrics.jsonl's loss, acc_k and lr over the
steps (a skipped step left out), the PNG is written, and without matplotlib a one-line note replaces it."""
from __future__ import annotations

import json
import sys

import pytest

from recipe import plot


def _run_dir(tmp_path):
    records = [{"step": s, "loss": 3.0 / s, "acc": [0.1 * s, 0.05 * s], "lr": 1e-3 * s} for s in (1, 2, 4)]
    skipped = {"step": 3, "skipped": "non-finite loss at step 3", "samples": 4, "lr": 2e-3}
    lines = [json.dumps(r) for r in records[:2]] + [json.dumps(skipped), "", json.dumps(records[2])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path, records


def test_figure_holds_the_metrics_and_the_png_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install -e '.[plot]')")
    run, records = _run_dir(tmp_path)
    loss_ax, acc_ax, lr_ax = plot.curves_figure(plot.read_metrics(run / "metrics.jsonl")).axes
    assert loss_ax.lines[0].get_xydata().tolist() == [[1, 3.0], [2, 1.5], [4, 0.75]]
    assert [line.get_label() for line in acc_ax.lines] == ["acc_0", "acc_1"]
    assert acc_ax.lines[1].get_xydata().tolist() == [[r["step"], r["acc"][1]] for r in records]
    assert lr_ax.lines[0].get_xydata().tolist() == [[1, 1e-3], [2, 2e-3], [4, 4e-3]]
    assert plot.main([str(run)]) == 0
    png = run / plot.CURVES_FILE
    assert capsys.readouterr().out.strip() == f"training curves written to {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (880, 770)  # 7 x 8 inches at 110 dpi


def test_without_matplotlib_a_note_and_no_file(tmp_path, capsys, monkeypatch):
    run, _ = _run_dir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert plot.main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == plot.NO_MATPLOTLIB
    assert plot.plot_note(run) == plot.NO_MATPLOTLIB and not (run / plot.CURVES_FILE).exists()


def test_bad_metrics_name_the_file(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert f"error: {tmp_path / 'metrics.jsonl'}: cannot read" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0, "acc": [0], "lr": 1}\n{oops\n')
    assert plot.main([str(tmp_path)]) == 2
    assert "metrics.jsonl: line 2: not valid JSON" in capsys.readouterr().err
    assert plot.plot_note(tmp_path).startswith("no training curve drawn: ")
