"""A write failure of the run's output becomes one message naming the path and the cause, without losing what was
being written: the write-error wrapper (``recipe.io_errors.writing``), ``MetricsLog`` keeping records through a
failed write, a monitor's write failure kept, the export's write failure leaving the previous export. The same
failures inside a 2-rank run (exit 74, nothing lost): ``tests/test_checkpoint_integrity.py``.
"""
from __future__ import annotations

import errno
import json
import os

import pytest

from helpers.faults import TORCH_FULL_DISK
from recipe.io_errors import WriteError, writing
from recipe.train.metrics import MetricsLog


def test_writing_names_the_path_and_the_cause():
    with pytest.raises(WriteError, match=r"^/out/x\.pt: the file could not be written completely: disk full or "
                                         r"I/O error \(\[enforce fail at inline_container\.cc"):
        with writing("/out/x.pt"):
            raise RuntimeError(TORCH_FULL_DISK)
    with pytest.raises(WriteError, match=r"^/out/metrics\.jsonl: No space left on device$"):
        with writing("/out/metrics.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name
    with pytest.raises(WriteError, match=r"^/b: Permission denied$"):
        with writing("/a"), writing("/b"):  # the innermost path wins, once
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def test_metrics_log_keeps_records_through_a_failed_write(tmp_path, monkeypatch):
    import recipe.train.metrics as metrics

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, True)
    log.write({"step": 1, "loss": 1.0})
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data[:5]))  # half a line reaches the file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(metrics.os, "write", full_disk)
    log.write({"step": 2, "loss": 0.5})  # no exception
    assert log.flush() == f"{path}: No space left on device (the records from step 2 on are kept in memory)"
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'  # cut back to the last complete line
    monkeypatch.setattr(metrics.os, "write", real_write)
    log.write({"step": 3, "loss": 0.25})
    assert log.flush() is None
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_monitor_write_failure_is_kept_not_raised():
    from recipe.train.monitor import StepMonitor

    class FullDisk:  # DeepSpeed's MonitorMaster on a full disk
        tb_monitor, calls = None, 0

        def write_events(self, events):
            self.calls += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monitor = StepMonitor.__new__(StepMonitor)  # without DeepSpeed's communication backend
    monitor.master, monitor.where, monitor.error = FullDisk(), "/out/csv_monitor", None
    record = {"step": 5, "loss": 1.0, "acc": [0.5], "lr": 1e-3, "tokens": 10, "time_s": 1.0}
    monitor.write(record)
    monitor.write({**record, "step": 6})
    assert monitor.error == ("/out/csv_monitor: No space left on device (monitor events from step 5 on are not "
                             "written)")
    assert monitor.master.calls == 1  # nothing more is written after a failure
    monitor.close()


def test_export_write_failure_names_the_file_and_keeps_the_old_export(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import recipe.export as export
    from recipe.model.draft import Eagle3Draft
    from recipe.model.draft_config import Eagle3DraftConfig

    cfg = Eagle3DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, vocab_size=96, draft_vocab_size=64, target_hidden_size=32,
                            aux_layer_ids=[1, 3, 5])
    tensors = export.export_tensors(Eagle3Draft(cfg, seed=0).state_dict())
    out = export.write_export(tensors, cfg.to_hf_dict(), tmp_path / "export")
    before = (out / export.WEIGHTS_FILE).read_bytes()

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(export, "save_file", full_disk)
    with pytest.raises(WriteError, match=r"export\.tmp/model\.safetensors: Error while serializing: I/O error: No "
                                         r"space left on device"):
        export.write_export(tensors, cfg.to_hf_dict(), tmp_path / "export")
    assert (out / export.WEIGHTS_FILE).read_bytes() == before and not (tmp_path / "export.tmp").exists()


