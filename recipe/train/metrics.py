"""Per-step metrics: ``OUTPUT/metrics.jsonl`` (global rank 0), the rich progress bar and the per-epoch table.

Every value written is global (summed or averaged over all ranks and micro-batches of the step), so runs with
different parallel layouts compare line by line.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from recipe.io_errors import WriteError, writing
from recipe.model.flops import DraftShape, TargetShape, run_peak_tflops, speed_fields, step_flops


def ttt_metrics(loss_sum_K: torch.Tensor, correct_K: torch.Tensor, valid_K: torch.Tensor,
                supervised_K: torch.Tensor) -> dict:
    """The per-step record fields from GLOBAL sums over the step's (or the held-out split's) positions, each [K]
    float64: ``loss`` = Σ_k STEP_DECAY^k · loss_k, ``loss_k`` and ``acc`` per valid position (target argmax in the
    draft vocabulary), ``acc_all_supervised`` per supervised position (the EAGLE/SpecForge count: out-of-vocabulary
    targets are misses), and the counts ``valid`` / ``supervised``."""
    from recipe.model.ttt import step_weights  # import cost: pulls in transformers

    n, m = valid_K.clamp(min=1), supervised_K.clamp(min=1)
    return {"loss": float((step_weights(len(loss_sum_K), torch.float64) * loss_sum_K / n).sum()),
            "loss_k": (loss_sum_K / n).tolist(), "acc": (correct_K / n).tolist(),
            "acc_all_supervised": (correct_K / m).tolist(), "valid": valid_K.long().tolist(),
            "supervised": supervised_K.long().tolist()}


class MetricsLog:
    """Appends one JSON object per optimizer step to ``path``; with ``enabled=False`` (ranks > 0) does nothing.

    On resume the file is truncated to the steps before the resume point, so it never holds a step twice. A write
    that fails (disk full, I/O error, permission) loses nothing and raises nothing: the file is cut back to its last
    complete line, the records are kept in memory and written before the next one; :meth:`flush` retries and returns
    the failure still unresolved (``"PATH: cause (...)"``, ``recipe.io_errors``), which the loop reports at the next
    checkpoint (collective, so every rank stops together).
    """

    def __init__(self, path: Path, enabled: bool, resume_step: int = 0):
        self.path, self.enabled = Path(path), enabled
        self.error: str | None = None
        self._pending: list[tuple[int, str]] = []  # (step, line) not yet in the file
        self._rewrite: str | None = None  # the truncated file's text, not yet written
        if not enabled:
            return
        kept = []
        if resume_step and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        self._rewrite = "".join(line + "\n" for line in kept)
        self._flush()

    def _flush(self) -> None:
        try:
            with writing(self.path):
                if self._rewrite is not None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self.path.write_text(self._rewrite)
                    self._rewrite = None
                if self._pending:
                    self._append("".join(line for _, line in self._pending).encode())
                    self._pending = []
            self.error = None
        except WriteError as exc:
            first = f" (the records from step {self._pending[0][0]} on are kept in memory)" if self._pending else ""
            self.error = f"{exc}{first}"

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                os.ftruncate(fd, start)  # no half line: the retry appends the whole records again
                raise
        finally:
            os.close(fd)

    def write(self, record: dict) -> None:
        if self.enabled:
            self._pending.append((record.get("step", -1), json.dumps(record) + "\n"))
            self._flush()

    def flush(self) -> str | None:
        """Write what is still in memory; return the failure that remains (None: every record is in the file)."""
        if self.enabled:
            self._flush()
        return self.error


TIMED_FIELDS = ("time_s", "positions_per_s", "supervised_tokens_per_s", "model_tflops_per_gpu", "mfu")
"""The fields of a step's metrics.jsonl record that depend on its wall time (the rest repeat bit for bit in a rerun)."""


@dataclass(frozen=True)
class StepSpeed:
    """A run's speed accounting (docs/training.md, "Speed: tokens, TFLOP/s and MFU"): the model FLOPs of a step's
    samples (``recipe.model.flops.step_flops``: the draft's shape, the online target's or None offline) and a
    finished step's rates. ``world_size``: the GPUs the FLOPs are shared by; ``peak_tflops``: the device's dense
    peak for the run's dtype (None: unknown, TFLOP/s only); ``sample_lengths``: sample indices -> token counts
    (``BatchBuilder.sample_lengths``)."""

    shape: DraftShape
    target: TargetShape | None
    world_size: int
    peak_tflops: float | None
    sample_lengths: Callable[[list[int]], list[int]]

    @classmethod
    def of_run(cls, parts, ttt_steps: int, freeze_lm_head: bool, peak_override: float | None) -> "StepSpeed":
        """From a built run (``recipe.train.setup.RunParts``) and the flags (``--peak-tflops``: ``peak_override``)."""
        target = parts.builder.target
        config = getattr(getattr(target, "target", target), "config", None)  # a SplitTarget wraps its TargetModel
        return cls(DraftShape.of_config(parts.draft_config, ttt_steps, freeze_lm_head),
                   TargetShape.of_config(config) if config is not None else None, dist.get_world_size(),
                   run_peak_tflops(parts.pstate.device, parts.config.dtype, peak_override),
                   parts.builder.sample_lengths)

    def step_counts(self, indices: list[int], supervised_tokens: int) -> dict:
        """``{"positions", "model_flops"}`` of a step's samples ``indices`` (every dp rank's; from the host lengths,
        no collective): the token positions and the model FLOPs of the whole step, all ranks together."""
        flops = step_flops(self.shape, self.sample_lengths(indices), target=self.target, supervised=supervised_tokens)
        return {"positions": flops.positions, "model_flops": flops.model_total}

    def rates(self, record: dict) -> dict:
        """A finished step's rates over its ``time_s``: ``positions_per_s``, ``supervised_tokens_per_s`` (``tokens``,
        the supervised ones), ``model_tflops_per_gpu`` and ``mfu`` (None without a peak)."""
        seconds = max(record["time_s"], 1e-9)
        return {"positions_per_s": record["positions"] / seconds, "supervised_tokens_per_s": record["tokens"] / seconds,
                **speed_fields(record["model_flops"], seconds, self.world_size, self.peak_tflops)}

    def describe(self) -> str:
        """One line for the run plan: what the rates count and what MFU divides by."""
        peak = f"MFU against {self.peak_tflops:g} TFLOP/s a GPU" if self.peak_tflops else \
            "no peak known for this device and dtype: TFLOP/s only (--peak-tflops sets one)"
        return (f"speed: pos/s = token positions, supervised = loss-masked tokens; TFLOP/s = model FLOPs / time / "
                f"{self.world_size} GPU(s) (recipe.model.flops); {peak}")


def speed_text(positions: float, supervised: float, tflops: float | None, mfu: float | None) -> str:
    """The step line's speed part: ``12,345 pos/s (8,765 supervised)  41.2 TFLOP/s/GPU 4.2% MFU``, the parts with
    no value left out (rates per second; ``tflops`` per GPU)."""
    text = f"{positions:,.0f} pos/s ({supervised:,.0f} supervised)" if positions else f"{supervised:,.0f} sup tok/s"
    if tflops is not None:
        value = f"{tflops:.1f}" if tflops >= 0.1 else f"{tflops:.2g}"  # a tiny CPU model: 0.00028
        text += f"  {value} TFLOP/s/GPU" + (f" {mfu:.1%} MFU" if mfu is not None else "")
    return text


class TrainProgress:
    """Rich progress bar (loss, acc_0, speed, lr) and a per-epoch table of acc_0..acc_{K-1}; rank 0 only.

    The bar advances every step; its statistics are refreshed every ``log_every`` steps and at the last step. When
    the console is not a terminal (a log file, where rich draws the bar only once at the end) those refreshes are
    also printed as one line each: ``step 20/100  loss … acc0 … 12,345 pos/s (8,765 supervised)  41.2 TFLOP/s/GPU
    41.7% MFU  lr …``. The speed is over the steps since the last refresh and their own ``time_s`` (validation and
    checkpoints left out; the wall clock for records without it): token positions, supervised tokens, model TFLOP/s
    a GPU and MFU (:func:`speed_text`; the records' ``StepSpeed.rates``). Raises ValueError on ``log_every < 1``.
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None,
                 log_every: int = 1):
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive integer, got {log_every!r}")
        self.enabled, self.total_steps, self.log_every = enabled, total_steps, log_every
        self.console = console or Console(stderr=True)
        self.epoch_acc: list[list[float]] = []
        self.epoch_packing: list[tuple[int, int, int, float]] = []  # samples, micro-batches, packed, padding share
        self._last = time.perf_counter()
        self._window = dict.fromkeys(("time_s", "positions", "tokens", "tflop", "mfu"), 0.0)
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def update(self, record: dict) -> None:
        """Account one finished step's metrics record (``step``, ``loss``, ``acc``, ``tokens``, ``lr``; the speed
        fields ``time_s``, ``positions``, ``model_tflops_per_gpu``, ``mfu`` when present)."""
        w, seconds = self._window, record.get("time_s") or 0.0
        w["time_s"] += seconds
        w["positions"] += record.get("positions", 0)
        w["tokens"] += record["tokens"]
        tflops, mfu = record.get("model_tflops_per_gpu"), record.get("mfu")
        w["tflop"] = None if tflops is None or w["tflop"] is None else w["tflop"] + tflops * seconds
        w["mfu"] = None if mfu is None or w["mfu"] is None else w["mfu"] + mfu * seconds
        self.epoch_acc.append(record["acc"])
        if "micro_batches" in record:
            self.epoch_packing.append((record["samples"], record["micro_batches"], record["packed_micro_batches"],
                                       record["padding_share"]))
        if not self.enabled:
            return
        step = record["step"]
        if step % self.log_every and step != self.total_steps:
            self.progress.update(self.task, completed=step)
            return
        now = time.perf_counter()
        span = w["time_s"] or max(now - self._last, 1e-9)
        speed = speed_text(w["positions"] / span, w["tokens"] / span,
                           w["tflop"] / span if w["tflop"] is not None and w["time_s"] else None,
                           w["mfu"] / span if w["mfu"] is not None and w["time_s"] else None)
        self._last, self._window = now, dict.fromkeys(w, 0.0)
        stats = f"loss {record['loss']:.4f}  acc0 {record['acc'][0]:.3f}  {speed}  lr {record['lr']:.2e}"
        self.progress.update(self.task, completed=step, stats=stats)
        if not self.console.is_terminal:
            self.console.print(f"step {step}/{self.total_steps}  {stats}")

    def end_epoch(self, epoch: int) -> None:
        """The epoch's table: mean accuracy per TTT step, then its packing line (:meth:`packing_line`)."""
        if not self.enabled or not self.epoch_acc:
            self.epoch_acc, self.epoch_packing = [], []
            return
        k = len(self.epoch_acc[0])
        table = Table(title=f"epoch {epoch}: mean accuracy per TTT step over {len(self.epoch_acc)} steps")
        for i in range(k):
            table.add_column(f"acc_{i}", justify="right")
        table.add_row(*[f"{sum(a[i] for a in self.epoch_acc) / len(self.epoch_acc):.3f}" for i in range(k)])
        self.progress.console.print(table)
        if (packing := self.packing_line()) is not None:
            self.progress.console.print(packing)
        self.epoch_acc, self.epoch_packing = [], []

    def packing_line(self) -> str | None:
        """``data.packing: P of M micro-batches packed; padding X% of the positions computed (mean over steps)`` for
        the epoch's steps (records' ``micro_batches``, ``packed_micro_batches``, ``padding_share``: every dp rank's
        micro-batches); None when no micro-batch held more than one sample (nothing to pack)."""
        samples, micro, packed, padding = zip(*self.epoch_packing) if self.epoch_packing else ((), (), (), ())
        if sum(samples) <= sum(micro):
            return None
        return (f"data.packing: {sum(packed)} of {sum(micro)} micro-batches packed; padding "
                f"{sum(padding) / len(padding):.1%} of the positions computed (mean over steps)")

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def zero0_grad_norm(engine, comm, tp_group) -> float:
    """Global L2 norm of the (already data-parallel reduced) gradients, for ZeRO stage 0 in fp32 where DeepSpeed
    clips but does not report the norm. TP-sharded gradients are summed over the tp group (``comm``: the run's
    ``recipe.parallel.collectives.Collectives``); replicated ones count once. Call after the last backward of the
    step and before ``engine.step()``."""
    sharded, replicated = [], []
    for p in engine.module.parameters():
        if p.grad is not None:
            (sharded if getattr(p, "tensor_model_parallel", False) else replicated).append(p.grad.float().pow(2).sum())
    zero = torch.zeros((), device=next(engine.module.parameters()).device)
    sq_sharded = torch.stack(sharded).sum() if sharded else zero.clone()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        sq_sharded = comm.sum(sq_sharded, tp_group)
    sq = sq_sharded + (torch.stack(replicated).sum() if replicated else zero)
    return float(sq.sqrt())


def plan_summary(parts) -> str:
    """The run plan: one line of layout, ZeRO stage, batch plan, steps, samples and dtype of a built run (``parts``:
    ``recipe.train.setup.RunParts``), then the memory switches' line (``recipe.config_memory.MemoryReport.line``:
    what "auto" chose, the predicted peak against the free memory and the alternative it rejected)."""
    config = parts.config
    memory = "" if config.memory_report is None else "\n" + config.memory_report.line()
    d, p = config.dims, config.plan
    return (f"layout dp={d.dp} cp={d.cp} tp={d.tp} (world {d.world_size}); ZeRO stage "
            f"{parts.engine.zero_optimization_stage()}; global batch {p.global_batch} = micro {p.micro_batch} × "
            f"accum {p.grad_accum} × dp {p.dp}; {config.total_steps} steps over {len(parts.builder)} samples; "
            f"dtype {str(config.dtype).removeprefix('torch.')}; attention {config.kernels.attention} "
            f"(tile {config.memory.attention_tile_size}"
            f"{f', {config.kernels.sequence_parallel} over cp' if d.cp_enabled else ''}); "
            f"small ops {'compiled' if config.kernels.compile_small_ops is True else 'eager'}; batch {asdict(p)}; "
            f"collectives {dist.get_backend()} on "
            f"{parts.pstate.device}" + (f"; {parts.resharding}" if parts.resharding else "")
            + (f"; target forward split over {parts.builder.target.split_size} ranks (cp·tp)"
               if parts.builder.split_target else "") + memory)
