"""The training loop: global loss normalisation, DeepSpeed steps, metrics, checkpoints and the final export.

Loss normalisation. The objective of one optimizer step is ``Σ_k 0.8^k · L_k / N_k`` where ``L_k`` sums the soft
cross-entropy over every valid position of the step (all ranks, all micro-batches) and ``N_k`` counts them. DeepSpeed
averages gradients over its data-parallel group (dp×cp ranks, see ``recipe.parallel.topology``) and divides each
micro-batch's loss by the accumulation steps, so each rank back-propagates its local sums scaled by
``dp·cp·grad_accum / N_k``; the result is the global objective's gradient whatever the layout.

Reliability. Resume continues exactly: the step counter is the data position (``recipe.train.sampler``), and the
checkpoint holds the engine state, every rank's RNG and the vocabulary map; a checkpoint of another layout or data is
refused before DeepSpeed touches it. SIGTERM/SIGINT stop all ranks after the same step, save and return
``EXIT_INTERRUPTED`` (``recipe.train.signals``). A NaN/inf loss on any rank (checked before backward, agreed over the
world) stops with the step and sample indices, or with ``--skip-nonfinite`` skips the step (engine untouched) and is
counted in metrics.jsonl (``"skipped"``) and at the end.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape

from recipe.export import export_tensors, write_export
from recipe.model.ttt import step_weights, ttt_objective
from recipe.parallel.parallelize import gather_full_state
from recipe.train import checkpoint
from recipe.train.metrics import MetricsLog, TrainProgress
from recipe.train.oom import StepOutOfMemory, out_of_memory_message
from recipe.train.sampler import rank_micro_batches
from recipe.train.setup import RunParts
from recipe.train.signals import EXIT_INTERRUPTED, StopRequest


class NonFiniteLossError(ValueError):
    """A step's loss was NaN/inf on some rank; the message names the step, the ranks and the sample indices."""


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


class Trainer:
    def __init__(self, args, parts: RunParts, console: Console):
        self.args, self.parts, self.console = args, parts, console
        self.engine, self.pstate = parts.engine, parts.pstate
        self.rank0 = dist.get_rank() == 0
        self.step = 0
        self.skipped_steps: list[int] = []
        self.batch_shape: tuple[int, int] | None = None
        self._check_settings()
        if parts.resume_from is not None:
            # compare first: DeepSpeed fails deep inside on a checkpoint of another layout
            checkpoint.check_compatible(checkpoint.read_run_state(parts.resume_from), self.run_state(0),
                                        parts.resume_from)
            saved = checkpoint.load(self.engine, parts.resume_from)
            self.step = saved["step"]
            if self.rank0:
                console.print(f"resumed from {parts.resume_from} at step {self.step}")
        else:
            self._start_scheduler()
        self.metrics = MetricsLog(args.output / "metrics.jsonl", self.rank0, resume_step=self.step)

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

    def _check_settings(self) -> None:
        """ValueError for settings that only make sense together with the layout and the data."""
        parts, args = self.parts, self.args
        store = parts.builder.store
        length = min(args.max_length, store.meta.max_length) if store is not None else args.max_length
        if length < parts.dims.seq_divisor:
            source = f"the store's max_length ({store.path})" if store is not None and length < args.max_length \
                else "--max-length"
            d = parts.dims
            raise ValueError(f"{source} = {length} is shorter than 2·cp·tp = {d.seq_divisor} (cp={d.cp}, tp={d.tp}): "
                             "every context-parallel chunk needs at least one token per tp rank; lower cp/tp or use "
                             "longer sequences")
        if args.skip_nonfinite and parts.plan.grad_accum != 1:
            raise ValueError(f"--skip-nonfinite needs gradient_accumulation_steps = 1 (got {parts.plan.grad_accum} in "
                             f"{args.ds_config}): a step cannot be dropped once some of its micro-batches have "
                             "back-propagated")

    def run_state(self, step: int) -> dict:
        d, p = self.parts.dims, self.parts.plan
        return {"step": step, "epoch": self.parts.sampler.epoch_of(step) if step < self.parts.total_steps else None,
                "world_size": d.world_size, "tp": d.tp, "cp": d.cp, "dp": d.dp, "global_batch": p.global_batch,
                "data_fingerprint": self.parts.data_fingerprint, "ttt_steps": self.args.ttt_steps,
                "draft_vocab_size": self.parts.draft_config.draft_vocab_size, "max_length": self.args.max_length,
                "seed": self.args.seed, "total_steps": self.parts.total_steps,
                "zero_stage": self.engine.zero_optimization_stage(),
                "aux_layer_ids": list(self.parts.draft_config.aux_layer_ids)}

    def _nonfinite(self, loss_sum_K: torch.Tensor, micro: int, indices: list[int]) -> str | None:
        """Collective over the world: None if every rank's loss is finite, else a description naming the step,
        the ranks and their samples (dataset indices; source rows in online mode)."""
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        flags[dist.get_rank()] = int(not torch.isfinite(loss_sum_K.detach()).all())
        flags = self.pstate.comm.sum(flags)
        bad_ranks = flags.nonzero().flatten().tolist()
        if not bad_ranks:
            return None
        parts = self.parts
        samples = set()
        for r in bad_ranks:
            dp_rank = parts.dims.coords(r).dp
            samples.update(rank_micro_batches(indices, parts.plan.micro_batch, parts.plan.grad_accum, parts.dims.dp,
                                              dp_rank)[micro])
        samples = sorted(samples)
        rows = ""
        if parts.builder.examples is not None:
            rows = f" (source rows {[parts.builder.examples[i]['row'] for i in samples]})"
        return (f"non-finite loss at step {self.step + 1} (micro-batch {micro}) on rank(s) {bad_ranks}; "
                f"samples {samples}{rows}")

    def train_step(self) -> dict:
        parts, K = self.parts, self.args.ttt_steps
        indices = parts.sampler.step_indices(self.step)
        micro = rank_micro_batches(indices, parts.plan.micro_batch, parts.plan.grad_accum, parts.dims.dp,
                                   self.pstate.dp_rank)
        self.batch_shape = None  # (samples, padded tokens) of this rank's micro-batch, for an out-of-memory report
        batches = [parts.builder.build(ix) for ix in micro]
        self.batch_shape = (max(b.samples for b in batches),  # each cp rank holds 1/cp of the padded sequence
                            max(b.ttt.input_ids_KBS.shape[-1] for b in batches) * parts.dims.cp)
        local_valid = torch.stack([b.ttt.valid_KBS.sum(dim=(1, 2)) for b in batches]).sum(0).double()
        comm = self.pstate.comm
        n_valid = comm.sum(local_valid, self.pstate.dp_cp_group)
        scale = parts.dims.dp_cp * parts.plan.grad_accum
        loss_sum = torch.zeros(K, dtype=torch.float64)
        correct = torch.zeros(K, dtype=torch.float64)
        own_norm = self.engine.zero_optimization_stage() == 0 and not self.engine.bfloat16_enabled()
        grad_norm = None
        for m, b in enumerate(batches):
            out = self.engine(b.ttt)
            problem = self._nonfinite(out.loss_sum_K, m, indices)
            if problem is not None:
                if not self.args.skip_nonfinite:
                    raise NonFiniteLossError(f"{problem}; stopped before the optimizer step (pass --skip-nonfinite "
                                             "to skip such steps)")
                # grad_accum == 1 (checked at start): nothing was back-propagated, the engine is untouched
                return {"skipped": problem, "samples": len(indices)}
            loss = ttt_objective(out, n_valid.to(out.loss_sum_K.device)) * scale
            self.engine.backward(loss)
            if own_norm and self.engine.is_gradient_accumulation_boundary():
                grad_norm = zero0_grad_norm(self.engine, comm, self.pstate.tp_group)
            self.engine.step()
            loss_sum += out.loss_sum_K.detach().double().cpu()
            correct += out.correct_K.detach().double().cpu()
        loss_sum = comm.sum(loss_sum, self.pstate.dp_cp_group)
        correct = comm.sum(correct, self.pstate.dp_cp_group)
        tokens = comm.sum(torch.tensor([sum(b.supervised_tokens for b in batches)], dtype=torch.float64),
                          self.pstate.dp_group)
        n = n_valid.clamp(min=1)
        weights = step_weights(K, torch.float64)
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float((weights * loss_sum / n).sum()), "loss_k": (loss_sum / n).tolist(),
                "acc": (correct / n).tolist(), "valid": n_valid.long().tolist(),
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": int(tokens.item()), "samples": len(indices)}

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self) -> dict[str, torch.Tensor]:
        """Checkpoint the current step (collective); return the full draft state it gathered."""
        state = gather_full_state(self.engine, self.pstate)
        vocab = {"d2t": self.parts.vocab.d2t, "t2d": self.parts.vocab.t2d}
        checkpoint.save(self.engine, self.pstate.comm, self.args.output / "checkpoints", self.step,
                        self.run_state(self.step), state if self.rank0 else None,
                        self.parts.draft_config.to_hf_dict(), vocab, keep=self.args.keep_checkpoints,
                        extra_files={"run_config.json": self.args.output / "run_config.json"})
        return state

    def train(self) -> int:
        """Train to the last step, save and export; return 0. On SIGTERM/SIGINT (any rank) every rank stops after
        the same step and saves a checkpoint; return :data:`recipe.train.signals.EXIT_INTERRUPTED`."""
        parts, args = self.parts, self.args
        progress = TrainProgress(parts.total_steps, self.step, self.rank0, self.console)
        epoch = parts.sampler.epoch_of(self.step)
        interrupted = False
        with StopRequest() as stop:
            try:
                while self.step < parts.total_steps:
                    lr = self.lr()
                    t0 = time.perf_counter()
                    try:
                        record = self.train_step()
                    except torch.OutOfMemoryError as exc:
                        raise StepOutOfMemory(out_of_memory_message(
                            exc, step=self.step + 1, rank=dist.get_rank(), device=self.pstate.device,
                            shape=self.batch_shape, memory=parts.memory, cp_size=parts.dims.cp,
                            max_length=args.max_length)) from None
                    self.step += 1
                    record = {"step": self.step, "epoch": epoch, **record, "lr": lr,
                              "time_s": round(time.perf_counter() - t0, 4)}
                    self.metrics.write(record)
                    if "skipped" in record:
                        self.skipped_steps.append(self.step)
                        if self.rank0:
                            self.console.print(f"[yellow]skipped step[/yellow] {escape(record['skipped'])}")
                    else:
                        progress.update(record)
                    if stop.agreed(self.pstate.comm) and self.step < parts.total_steps:
                        interrupted = True
                        break
                    if args.save_every and self.step % args.save_every == 0 and self.step < parts.total_steps:
                        self.save()
                    new_epoch = parts.sampler.epoch_of(self.step)
                    if new_epoch != epoch or self.step == parts.total_steps:
                        progress.end_epoch(epoch)
                        epoch = new_epoch
            finally:
                progress.close()
            final_state = self.save()
        if self.rank0 and self.skipped_steps:
            self.console.print(f"skipped {len(self.skipped_steps)} step(s) with a non-finite loss: "
                               f"{self.skipped_steps}")
        if interrupted:
            if self.rank0:
                self.console.print(f"interrupted: checkpoint of step {self.step} saved in "
                                   f"{args.output / 'checkpoints'}; continue with --resume")
            return EXIT_INTERRUPTED
        if not args.no_export:
            self.export(final_state)
        return 0

    def export(self, state: dict[str, torch.Tensor]) -> None:
        """Write OUTPUT/export from the full draft state (rank 0), then barrier."""
        if self.rank0:
            out = write_export(export_tensors(state), self.parts.draft_config.to_hf_dict(), self.args.output / "export")
            self.console.print(f"export written to {out}")
        self.pstate.comm.barrier()


def plan_summary(parts: RunParts) -> str:
    d, p = parts.dims, parts.plan
    return (f"layout dp={d.dp} cp={d.cp} tp={d.tp} (world {d.world_size}); ZeRO stage "
            f"{parts.engine.zero_optimization_stage()}; global batch {p.global_batch} = micro {p.micro_batch} × "
            f"accum {p.grad_accum} × dp {p.dp}; {parts.total_steps} steps over {len(parts.builder)} samples; "
            f"dtype {str(parts.dtype).removeprefix('torch.')}; batch {asdict(p)}; collectives {dist.get_backend()} on "
            f"{parts.pstate.device}")
