"""The training loop: global loss normalisation, DeepSpeed steps, metrics, checkpoints and the final export.

Loss normalisation. The objective of one optimizer step is ``Σ_k 0.8^k · L_k / N_k`` where ``L_k`` sums the soft
cross-entropy over every valid position of the step (all ranks, all micro-batches) and ``N_k`` counts them. DeepSpeed
averages gradients over its data-parallel group (dp×cp ranks, see ``recipe.parallel.topology``) and divides each
micro-batch's loss by the accumulation steps, so each rank back-propagates its local sums scaled by
``dp·cp·grad_accum / N_k``; the result is the global objective's gradient whatever the layout.

Reliability. Resume continues exactly: the step counter is the data position (``recipe.train.sampler``), and the
checkpoint holds the engine state, every rank's RNG, the vocabulary map and the layout-free training state; a
checkpoint of another layout (world size, dp, tp, cp, ZeRO stage, dtype) is resharded (``recipe.lifecycle.reshard``), one
of other data or global batch is refused before DeepSpeed touches it (``recipe.lifecycle.resume_checks``), and so is a
resume for another run length (with an LR scheduler) unless ``--extend`` re-plans the schedule
(:meth:`Trainer._replan_schedule`). SIGTERM/SIGINT stop all ranks after the same step, save and return
``EXIT_INTERRUPTED`` (``recipe.lifecycle.signals``); checkpoints by wall time (agreed in the same all-reduce) and the hang
watchdog (stacks to ``OUTPUT/hang-rank-R.txt``, ``EXIT_HUNG``) are ``recipe.lifecycle.watch``. A NaN/inf loss on any rank
stops with the step and sample indices, or with ``--skip-nonfinite`` skips the step (engine untouched) and is counted
in metrics.jsonl (``"skipped"``) and at the end. The finite flags of the micro-batches stay on the device and are
agreed over the world ONCE per optimizer step, after the forward of the last micro-batch and before its backward (so
before the optimizer step; with ``--skip-nonfinite``, which needs one micro-batch per step, before any backward).

Host syncs. Per optimizer step the loop reads the device once for that agreement and once at the end for the
metrics (plus the grad norm); the loss sums, correct counts and the global valid counts stay on the device in between.
Offline, the step's valid counts come from the host tokens before any batch is on the device, and the micro-batches
are built one at a time, the next one's store reads in a background thread (``recipe.train.step_batches.StepBatches``).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape

from recipe.data.packing import packing_counts
from recipe.export import export_tensors, write_export
from recipe.io_errors import WriteError
from recipe.lifecycle import checkpoint, reshard, resume_checks
from recipe.lifecycle.distributed import release_shm_buffer
from recipe.lifecycle.oom import StepOutOfMemory, out_of_memory_message
from recipe.lifecycle.signals import EXIT_INTERRUPTED, StopRequest
from recipe.lifecycle.watch import HangWatchdog, SaveClock
from recipe.model.ttt import ttt_objective
from recipe.parallel.parallelize import gather_full_state
from recipe.plot import plot_note
from recipe.train.flags import TrainArgs
from recipe.train.metrics import MetricsLog, StepSpeed, TrainProgress, ttt_metrics, zero0_grad_norm
from recipe.train.monitor import StepMonitor
from recipe.train.sampler import rank_micro_batches
from recipe.train.settings import TrainSettings
from recipe.train.setup import RunParts, layout_state
from recipe.train.step_batches import StepBatches


class NonFiniteLossError(ValueError):
    """A step's loss was NaN/inf on some rank; the message names the step, the ranks and the sample indices."""


class Trainer:
    """Runs the optimizer steps of a built run (``recipe.train.setup.build_run``) with ``settings``; see
    :meth:`train`. Resumes from ``parts.resume_from`` (resharding one of another layout, refusing one of other data
    or global batch)."""

    def __init__(self, settings: TrainSettings, parts: RunParts, console: Console):
        self.settings, self.parts, self.console = settings, parts, console
        self.config = parts.config
        self.engine, self.pstate = parts.engine, parts.pstate
        self.validator = parts.validator
        self.rank0 = dist.get_rank() == 0
        self.step = 0
        self.skipped_steps: list[int] = []
        self._noted_no_train_state = False  # said once that checkpoints hold no layout-free state
        self.batch_shape: tuple[int, int, int] | None = None
        self._check_settings()
        if parts.resume_from is not None:
            # compare first: nothing of the checkpoint is loaded into a run that differs in data or settings
            saved = checkpoint.read_run_state(parts.resume_from)
            resume_checks.check_compatible(saved, self.run_state(0), parts.resume_from)
            if parts.resharding is None:  # DeepSpeed's own files hold the state of the optimizer that wrote them
                resume_checks.check_optimizer(saved, self.run_state(0), parts.resume_from)
            # without an LR scheduler (constant lr) the run length may change freely: no schedule to mix
            replan = self.engine.lr_scheduler is not None and resume_checks.check_length(
                saved, self.config.total_steps, settings.extend, parts.resume_from)
            saved = checkpoint.load(self.engine, parts.resume_from, self.pstate.tp_group,
                                    resharding=parts.resharding is not None)
            self.step = saved["step"]
            if self.rank0:
                console.print(f"resumed from {parts.resume_from} at step {self.step}")
            if replan:
                self._replan_schedule(saved.get("total_steps"))
        else:
            self._start_scheduler()
        self.metrics = MetricsLog(settings.output / "metrics.jsonl", self.rank0, resume_step=self.step)
        self.monitor = StepMonitor(self.config.monitor, settings.output, self.rank0, resume_step=self.step)
        self.speed = StepSpeed.of_run(parts, settings.ttt_steps, settings.freeze_lm_head, settings.peak_tflops)

    def _start_scheduler(self) -> None:
        """Advance a fresh DeepSpeed LR scheduler from iteration -1 to 0 before the first step.

        DeepSpeed's warmup schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) set lr = 0 at iteration -1 and step
        after each optimizer step, so the first optimizer step would always run at lr 0 (and, with
        ``warmup_min_ratio`` 0, the second too). Starting at iteration 0 makes step 1 use ``warmup_min_ratio · lr``.
        The scheduler state is checkpointed, so a resumed run continues from where it was.
        """
        scheduler = self.engine.lr_scheduler
        if scheduler is not None and getattr(scheduler, "last_batch_iteration", None) == -1:
            scheduler.step()

    def _replan_schedule(self, planned: int | None) -> None:
        """``--extend``: continue on the schedule of the new run length from the saved position.

        ``deepspeed.initialize`` built the LR scheduler from this run's JSON, its ``"auto"`` values filled for the
        new total (``RunConfig.with_total_steps``); the checkpoint restored its iteration i (the optimizer steps
        taken so far) and the optimizer's lr, which is the old schedule's value for step i+1. Re-evaluating the
        scheduler at i writes the new schedule's value instead, so every remaining step s runs at the lr that a
        fresh run planned for the new total uses at step s (minus steps skipped as non-finite, which do not advance
        the scheduler); the lr may jump at step i+1, e.g. from the old schedule's floor back onto the new curve.
        """
        scheduler = self.engine.lr_scheduler
        before = self.lr()
        if scheduler is not None and getattr(scheduler, "last_batch_iteration", -1) >= 0:
            scheduler.step(scheduler.last_batch_iteration)
        if self.rank0:
            self.console.print(f"--extend: run re-planned from {planned} to {self.config.total_steps} steps at step "
                               f"{self.step}; lr of the next step {before:.3e} -> {self.lr():.3e}")

    def _check_settings(self) -> None:
        """ValueError for settings that only make sense together with the layout and the data."""
        settings, d, grad_accum = self.settings, self.config.dims, self.config.plan.grad_accum
        store = self.parts.builder.store
        length = min(settings.max_length, store.meta.max_length) if store is not None else settings.max_length
        if length < d.seq_divisor:
            source = f"the store's max_length ({store.path})" if store is not None and length < settings.max_length \
                else "--max-length"
            raise ValueError(f"{source} = {length} is shorter than 2·cp·tp = {d.seq_divisor} (cp={d.cp}, tp={d.tp}): "
                             "every context-parallel chunk needs at least one token per tp rank; lower cp/tp or use "
                             "longer sequences")
        if settings.skip_nonfinite and grad_accum != 1:
            raise ValueError(f"--skip-nonfinite needs gradient_accumulation_steps = 1 (got {grad_accum} in "
                             f"{self.config.path}): a step cannot be dropped once some of its micro-batches have "
                             "back-propagated")

    def run_state(self, step: int) -> dict:
        p, total = self.config.plan, self.config.total_steps
        return {"step": step, "epoch": self.parts.sampler.epoch_of(step) if step < total else None,
                **layout_state(self.config), "global_batch": p.global_batch,
                "data_fingerprint": self.parts.data_fingerprint, "ttt_steps": self.settings.ttt_steps,
                "draft_vocab_size": self.parts.draft_config.draft_vocab_size, "max_length": self.settings.max_length,
                "seed": self.settings.seed, "total_steps": total,
                "aux_layer_ids": list(self.parts.draft_config.aux_layer_ids),
                "optimizer": type(reshard.base_optimizer(self.engine)).__name__,
                "freeze_lm_head": self.settings.freeze_lm_head, **self.parts.run_identity}

    def _nonfinite(self, bad_M: torch.Tensor, indices: list[int]) -> str | None:
        """Collective over the world, once per step: None if every rank's loss was finite in every micro-batch, else
        a description naming the step, the first micro-batch with a non-finite loss, its ranks and their samples
        (dataset indices; source rows in online mode). ``bad_M``: [M] bool, this rank's non-finite flag per
        micro-batch, on the device; the agreed [world, M] table is read back to the host once."""
        device = self.pstate.device
        table = torch.zeros(dist.get_world_size(), bad_M.shape[0], dtype=torch.int32, device=device)
        table[dist.get_rank()] = bad_M.to(device=device, dtype=torch.int32)
        table = self.pstate.comm.sum(table).cpu()  # the step's one device->host read for the check
        if not table.any():
            return None
        micro = int(table.any(dim=0).nonzero()[0])
        bad_ranks = table[:, micro].nonzero().flatten().tolist()
        parts, d, p = self.parts, self.config.dims, self.config.plan
        samples = set()
        for r in bad_ranks:
            samples.update(rank_micro_batches(indices, p.micro_batch, p.grad_accum, d.dp, d.coords(r).dp)[micro])
        samples = sorted(samples)
        rows = ""
        if parts.builder.examples is not None:
            rows = f" (source rows {[parts.builder.examples[i]['row'] for i in samples]})"
        return (f"non-finite loss at step {self.step + 1} (micro-batch {micro}) on rank(s) {bad_ranks}; "
                f"samples {samples}{rows}")

    def train_step(self) -> dict:
        parts, K, d, p = self.parts, self.settings.ttt_steps, self.config.dims, self.config.plan
        indices = parts.sampler.step_indices(self.step)
        shares = [rank_micro_batches(indices, p.micro_batch, p.grad_accum, d.dp, r) for r in range(d.dp)]
        micro = shares[self.pstate.dp_rank]
        self.batch_shape = None  # (samples, rows, tokens a row) of this rank's micro-batch, for an out-of-memory report
        layouts = [parts.builder.layouts([sh[m] for sh in shares]) for m in range(p.grad_accum)]  # every dp rank's
        extents = [parts.builder.extent_of(ls) for ls in layouts]  # ZeRO-3's calls
        batches = StepBatches(parts.builder, micro, extents)  # the counts now; the device batches one at a time below
        self.batch_shape = batches.shape  # each cp rank holds 1/cp of the padded sequence
        comm, device = self.pstate.comm, self.pstate.device
        # the global valid counts stay on the device: every micro-batch's objective divides by them
        n_valid = comm.sum(batches.local_valid_K.to(device, non_blocking=True).double(), self.pstate.dp_cp_group)
        scale = d.dp_cp * p.grad_accum
        loss_sum = torch.zeros(K, dtype=torch.float64, device=device)
        correct = torch.zeros(K, dtype=torch.float64, device=device)
        bad = []  # per micro-batch: 0-d bool on the device, this rank's loss was non-finite
        own_norm = self.engine.zero_optimization_stage() == 0 and not self.engine.bfloat16_enabled()
        grad_norm = None
        for m, b in enumerate(batches):
            out = self.engine(b.ttt)
            bad.append(~torch.isfinite(out.loss_sum_K.detach()).all())
            if m == len(micro) - 1:  # after the last forward, before its backward and the optimizer step
                problem = self._nonfinite(torch.stack(bad), indices)
                if problem is not None:
                    if not self.settings.skip_nonfinite:
                        raise NonFiniteLossError(f"{problem}; stopped before the optimizer step (pass "
                                                 "--skip-nonfinite to skip such steps)")
                    # grad_accum == 1 (checked at start): nothing was back-propagated, the engine is untouched
                    return {"skipped": problem, "samples": len(indices)}
            loss = ttt_objective(out, n_valid.to(out.loss_sum_K.device)) * scale
            self.engine.backward(loss)
            if own_norm and self.engine.is_gradient_accumulation_boundary():
                grad_norm = zero0_grad_norm(self.engine, comm, self.pstate.tp_group)
            self.engine.step()
            loss_sum += out.loss_sum_K.detach().double().to(device)
            correct += out.correct_K.detach().double().to(device)
        # one sum per group: loss and correct over dp×cp (cp ranks hold parts of a sample), token counts over dp
        loss_sum, correct, n_valid = torch.cat([comm.sum(torch.stack([loss_sum, correct]), self.pstate.dp_cp_group),
                                                n_valid[None]]).cpu()  # the metrics' one device->host read
        local_counts = torch.cat([batches.supervised_K.double(),
                                  torch.tensor([batches.supervised_tokens], dtype=torch.float64)])
        counts = comm.sum(local_counts, self.pstate.dp_group)
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        return {**ttt_metrics(loss_sum, correct, n_valid, counts[:K]),
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": int(counts[K].item()), "samples": len(indices),
                **packing_counts([layout for ls in layouts for layout in ls]),
                **self.speed.step_counts(indices, int(counts[K].item()))}

    def validate(self) -> dict:
        """Evaluate the held-out split (collective, ``recipe.train.validation``); write ``{"step", "eval"}`` to
        metrics.jsonl and the monitors and print it (rank 0). Returns the record."""
        record = {"step": self.step, "eval": self.validator.evaluate(self.engine)}
        self.metrics.write(record)
        self.monitor.write(record)
        if self.rank0:
            ev = record["eval"]
            self.console.print(f"eval at step {self.step}: loss {ev['loss']:.4f}  acc0 {ev['acc'][0]:.3f}  "
                               f"acc_all_supervised0 {ev['acc_all_supervised'][0]:.3f} ({ev['samples']} samples)")
        return record

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, attempts: int = 1) -> dict[str, torch.Tensor]:
        """Checkpoint the current step (collective); return the full draft state it gathered. A log write that
        failed since the last checkpoint (``metrics.jsonl``, monitor files) is retried first and, still failing,
        fails the save (the checkpoint would follow a gap in the logs). ``attempts`` > 1 (the end of the run):
        a failed save is tried again, with a line saying so. Raises CheckpointError after the last attempt."""
        state = gather_full_state(self.engine, self.pstate)
        train_state = reshard.gather(self.engine, self.pstate.tp_group)
        if train_state is None and self.rank0 and not self._noted_no_train_state:
            self._noted_no_train_state = True
            self.console.print(f"note: checkpoints resume on this layout only: {reshard.unsupported(self.engine)}")
        vocab = {"d2t": self.parts.vocab.d2t, "t2d": self.parts.vocab.t2d}
        for attempt in range(1, attempts + 1):
            logs = "; ".join(e for e in (self.metrics.flush(), self.monitor.error) if e) if self.rank0 else ""
            try:
                checkpoint.save(self.engine, self.pstate.comm, self.settings.output / "checkpoints", self.step,
                                self.run_state(self.step), state if self.rank0 else None,
                                self.parts.draft_config.to_hf_dict(), vocab, keep=self.settings.keep_checkpoints,
                                extra_files={"run_config.json": self.settings.output / "run_config.json"},
                                pending_error=logs or None, train_state=train_state if self.rank0 else None)
                return state
            except checkpoint.CheckpointError as exc:
                if attempt == attempts:
                    raise
                if self.rank0:
                    self.console.print(f"[yellow]warning[/yellow]: {escape(str(exc))}; trying once more")
        return state

    def _timed_step(self, epoch: int, watchdog: HangWatchdog) -> dict:
        """One optimizer step, timed: its record (step, epoch, metrics, lr, ``time_s`` and the rates) written to
        metrics.jsonl and the monitors. Raises StepOutOfMemory with the run's memory advice on a CUDA OOM."""
        lr = self.lr()
        t0 = time.perf_counter()
        try:
            record = self.train_step()
        except torch.OutOfMemoryError as exc:
            raise StepOutOfMemory(out_of_memory_message(
                exc, step=self.step + 1, rank=dist.get_rank(), device=self.pstate.device, shape=self.batch_shape,
                memory=self.config.memory, dims=self.config.dims,
                max_length=self.settings.max_length)) from None
        self.step += 1
        watchdog.beat(f"what follows step {self.step} (log, validation, agreement, checkpoint)")
        record = {"step": self.step, "epoch": epoch, **record, "lr": lr, "time_s": round(time.perf_counter() - t0, 4)}
        record.update(self.speed.rates(record) if "positions" in record else {})
        self.metrics.write(record)
        self.monitor.write(record)
        return record

    def _report(self, record: dict, progress: TrainProgress) -> None:
        """A skipped step (non-finite loss, ``--skip-nonfinite``) is counted and said; any other goes to the step
        line."""
        if "skipped" in record:
            self.skipped_steps.append(self.step)
            if self.rank0:
                self.console.print(f"[yellow]skipped step[/yellow] {escape(record['skipped'])}")
        else:
            progress.update(record)

    def train(self) -> int:
        """Train to the last step, save and export; return 0. On SIGTERM/SIGINT (any rank) every rank stops after
        the same step and saves a checkpoint; return :data:`recipe.lifecycle.signals.EXIT_INTERRUPTED`. The final save
        and the export are each retried once; failing again they raise ``recipe.io_errors.WriteError``
        (``run.py``: ``EXIT_WRITE_FAILED``), ``latest`` naming the last complete checkpoint."""
        parts, settings, total = self.parts, self.settings, self.config.total_steps
        progress = TrainProgress(total, self.step, self.rank0, self.console, log_every=settings.log_every)
        epoch = parts.sampler.epoch_of(self.step)
        interrupted = False
        clock = SaveClock(settings.save_every_minutes)
        watchdog = HangWatchdog(settings.output, dist.get_rank(), settings.hang_timeout_minutes,
                                on_exit=release_shm_buffer)
        with StopRequest() as stop, watchdog:
            try:
                while self.step < total:
                    self._report(self._timed_step(epoch, watchdog), progress)
                    if self.validator is not None and self.validator.due(self.step, total):
                        self.validate()
                        watchdog.beat(f"what follows the validation at step {self.step}")
                    # one all-reduce: a stop request (any rank) and a checkpoint by wall time (any rank's clock)
                    stopping, time_due = self.pstate.comm.any_each([stop.requested, clock.due()])
                    if stopping and self.step < total:
                        interrupted = True
                        break
                    by_steps = settings.save_every and self.step % settings.save_every == 0
                    if (by_steps or time_due) and self.step < total:
                        self.save()
                        clock.reset()
                    new_epoch = parts.sampler.epoch_of(self.step)
                    if new_epoch != epoch or self.step == total:
                        progress.end_epoch(epoch)
                        epoch = new_epoch
                    watchdog.beat(f"step {self.step + 1}")
            finally:
                progress.close()
                self.monitor.close()
            watchdog.beat(f"the checkpoint of step {self.step}")
            final_state = self.save(attempts=2)  # the end of the run: a failed save is retried once
        if self.rank0 and self.skipped_steps:
            self.console.print(f"skipped {len(self.skipped_steps)} step(s) with a non-finite loss: "
                               f"{self.skipped_steps}")
        if interrupted:
            if self.rank0:
                self.console.print(f"interrupted: checkpoint of step {self.step} saved in "
                                   f"{settings.output / 'checkpoints'}; continue with --resume")
            return EXIT_INTERRUPTED
        if not settings.no_export:
            self.export(final_state)
        if self.rank0:
            self.console.print(plot_note(settings.output))
        return 0

    def export(self, state: dict[str, torch.Tensor]) -> None:
        """Write OUTPUT/export from the full draft state (rank 0; a write failure is retried once), then agree
        (collective): every rank raises ``recipe.io_errors.WriteError`` when the export could not be written (the
        final checkpoint is saved: ``python -m recipe.export`` makes the export from it), ValueError when the
        tensors make a broken export."""
        failure = None
        if self.rank0:
            for attempt in (1, 2):
                try:
                    out = write_export(export_tensors(state), self.parts.draft_config.to_hf_dict(),
                                       self.settings.output / "export")
                    self.console.print(f"export written to {out}")
                    failure = None
                    break
                except WriteError as exc:
                    failure = ("write", str(exc))
                    if attempt == 1:
                        self.console.print(f"[yellow]warning[/yellow]: writing the export failed ({escape(str(exc))})"
                                           "; trying once more")
                except ValueError as exc:
                    failure = ("value", str(exc))
                    break
        failure = self.pstate.comm.all_gather_object(failure)[0]
        if failure is not None:
            kind, message = failure
            if kind == "value":
                raise ValueError(message)
            ckpt = self.settings.output / "checkpoints" / checkpoint.tag_for(self.step)
            raise WriteError(f"writing the export failed twice ({message}); the run is not complete, but its final "
                             f"checkpoint {ckpt} is saved: `python -m recipe.export {ckpt} "
                             f"{self.settings.output / 'export'}` writes the export once there is room")
