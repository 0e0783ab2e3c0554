"""DeepSpeed's monitors (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` sections of the JSON) fed with the
loop's per-step metrics, next to ``metrics.jsonl``.

The sections are taken out of the config before ``deepspeed.initialize`` (``recipe.config.pop_monitor_sections``) and
handed to DeepSpeed's own ``MonitorMaster`` here, which writes on global rank 0 only. So the engine writes nothing by
itself (it would log the learning rate after each step against DeepSpeed's sample count, cp times the real count
under context parallelism); instead every event carries the optimizer step (1-based, as in ``metrics.jsonl``) as x
value. Events of a step that was not skipped (``--skip-nonfinite``):

    Train/Steps/loss            the global objective Σ_k 0.8^k·L_k/N_k (``loss`` of metrics.jsonl)
    Train/Steps/loss_{k}        the soft cross-entropy of TTT step k (``loss_k[k]``)
    Train/Steps/acc_{k}         the accuracy of TTT step k over valid positions (``acc[k]``)
    Train/Steps/acc_all_supervised_{k}  ... over all supervised positions (``acc_all_supervised[k]``)
    Train/Steps/lr              the learning rate the step ran with (``lr``)
    Train/Steps/grad_norm       the global gradient norm before clipping (``grad_norm``, when DeepSpeed reports one)
    Train/Steps/positions_per_s          token positions trained / the step's wall time (``positions_per_s``)
    Train/Steps/supervised_tokens_per_s  supervised (loss-masked) tokens / the step's wall time (``tokens`` /
                                         ``time_s``)
    Train/Steps/model_tflops_per_gpu     the step's model FLOPs / its time / the world size, in TFLOP/s
                                         (``recipe.model.flops``)
    Train/Steps/mfu                      that / the device's dense peak (when one is known, ``--peak-tflops``)

and of a validation record (``{"step", "eval"}``, ``recipe.train.validation``): ``Train/Steps/eval_loss``,
``eval_loss_{k}``, ``eval_acc_{k}`` and ``eval_acc_all_supervised_{k}``.

TensorBoard files land in ``output_path/job_name`` (one event file per process start), CSV files in
``output_path/job_name/Train_Steps_<name>.csv`` with the header ``step,<name>``. An empty ``output_path`` (DeepSpeed's
default, the working directory) means the run folder ``--output``. On resume the CSV files are cut to the steps up
to the checkpoint (as ``metrics.jsonl``), so no step appears twice, and the new TensorBoard event file starts with
the restart marker ``SummaryWriter(purge_step=...)`` writes (``SessionLog.START`` at the first resumed step), so
TensorBoard's readers drop the older file's events from that step on (steps run after the checkpoint before a crash).

A monitor that cannot write (disk full, permission) raises nothing: the first failure is kept in
``StepMonitor.error`` (the folder and the cause), the monitors write nothing more, and the loop reports it at the
next checkpoint, which is then not written (``recipe.lifecycle.checkpoint.save``'s ``pending_error``).
"""
from __future__ import annotations

import copy
import csv
from pathlib import Path

from recipe.io_errors import WriteError, writing

PREFIX = "Train/Steps/"
PATH_SECTIONS = ("tensorboard", "csv_monitor")  # the sections with an output_path


def step_events(record: dict) -> list[tuple[str, float, int]]:
    """``(tag, value, step)`` events of one metrics.jsonl record (module docstring); [] for a skipped step."""
    step = record["step"]
    if "eval" in record:
        ev = record["eval"]
        values = {"eval_loss": ev["loss"]}
        for key in ("loss_k", "acc", "acc_all_supervised"):
            name = key.removesuffix("_k")
            values.update({f"eval_{name}_{k}": v for k, v in enumerate(ev[key])})
        return [(PREFIX + name, float(value), step) for name, value in values.items()]
    if "loss" not in record:
        return []
    values = {"loss": record["loss"]}
    values.update({f"loss_{k}": v for k, v in enumerate(record.get("loss_k", []))})
    values.update({f"acc_{k}": v for k, v in enumerate(record["acc"])})
    values.update({f"acc_all_supervised_{k}": v for k, v in enumerate(record.get("acc_all_supervised", []))})
    values["lr"] = record["lr"]
    if record.get("grad_norm") is not None:
        values["grad_norm"] = record["grad_norm"]
    if record.get("time_s"):
        values["supervised_tokens_per_s"] = record["tokens"] / record["time_s"]
    for name in ("positions_per_s", "model_tflops_per_gpu", "mfu"):
        if record.get(name) is not None:
            values[name] = record[name]
    return [(PREFIX + name, float(value), step) for name, value in values.items()]


def resolve_paths(sections: dict, output: Path) -> dict:
    """A copy of the monitor sections with an empty or missing ``output_path`` set to ``output``."""
    sections = copy.deepcopy(sections)
    for name in PATH_SECTIONS:
        if name in sections and not sections[name].get("output_path"):
            sections[name]["output_path"] = str(output)
    return sections


def _cut_csv(folder: Path, resume_step: int) -> list[str]:
    """Keep the rows of step <= ``resume_step`` in our CSV files under ``folder``; delete files left without rows.
    Returns the names (without .csv) of the files kept, whose header is already written."""
    kept = []
    for file in sorted(folder.glob(PREFIX.replace("/", "_") + "*.csv")):
        with file.open(newline="") as f:
            rows = list(csv.reader(f))
        body = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= resume_step]
        if not body:
            file.unlink()
            continue
        with file.open("w", newline="") as f:
            csv.writer(f).writerows(rows[:1] + body)
        kept.append(file.stem)
    return kept


class StepMonitor:
    """DeepSpeed's ``MonitorMaster`` built from the run's monitor sections (``RunConfig.monitor``); rank 0 writes.

    Build it after ``deepspeed.initialize`` (DeepSpeed's rank query needs its communication backend) on every rank.
    ``resume_step``: the step the run continues from (0: a fresh run); see the module docstring for the CSV cut.
    """

    def __init__(self, sections: dict, output: Path, rank0: bool, resume_step: int = 0):
        from deepspeed.monitor.config import get_monitor_config  # import cost: deepspeed

        self.config = get_monitor_config(resolve_paths(sections, Path(output)))
        self.master = None
        self.error: str | None = None  # the first write failure ("PATH: cause ..."); later events are not written
        if not (self.config.enabled and rank0):
            return
        folders = [Path(c.output_path) / c.job_name for c in (self.config.tensorboard, self.config.csv_monitor)
                   if c.enabled]
        self.where = ", ".join(str(f) for f in folders) or "DeepSpeed monitor"
        try:
            with writing(self.where):
                self._start(resume_step)
        except WriteError as exc:
            self.master, self.error = None, f"{exc} (monitor files)"

    def _start(self, resume_step: int) -> None:
        kept = []
        if self.config.csv_monitor.enabled:
            c = self.config.csv_monitor
            folder = Path(c.output_path) / c.job_name
            kept = _cut_csv(folder, resume_step) if folder.is_dir() else []
        from deepspeed.monitor.monitor import MonitorMaster  # import cost: deepspeed

        self.master = MonitorMaster(self.config)
        if self.master.csv_monitor is not None:
            self.master.csv_monitor.filenames.extend(kept)  # DeepSpeed writes the header of files not listed here
        if resume_step and self.master.tb_monitor is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # optional dependency (tensorboard)

            # what torch's SummaryWriter(purge_step=resume_step + 1) writes first
            self.master.tb_monitor.summary_writer._get_file_writer().add_event(
                Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)))

    @property
    def enabled(self) -> bool:
        return self.master is not None

    def write(self, record: dict) -> None:
        """Write one metrics.jsonl record's events (:func:`step_events`). A failure is kept in :attr:`error` (the
        loop reports it at the next checkpoint) and the monitors write nothing more."""
        if self.master is not None and self.error is None:
            events = step_events(record)
            if events:
                try:
                    with writing(self.where):
                        self.master.write_events(events)
                except WriteError as exc:
                    self.error = f"{exc} (monitor events from step {record['step']} on are not written)"

    def close(self) -> None:
        """Flush and close the TensorBoard event file (the CSV monitor writes through on every event)."""
        tb = self.master.tb_monitor if self.master is not None else None
        if tb is not None and tb.summary_writer is not None:
            try:
                with writing(self.where):
                    tb.summary_writer.close()
            except WriteError as exc:
                self.error = self.error or f"{exc} (closing the TensorBoard event file)"
