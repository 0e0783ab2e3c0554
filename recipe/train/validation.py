"""Validation during training: a held-out split, evaluated every ``--eval-every`` steps and after the last step.

The held-out samples come from ``--eval-data`` (online: conversation sources tokenised like ``--data``; offline: a
second store of the same target) or from ``--eval-fraction F`` of the training data (online examples or the store's
samples): ``held_out_split`` draws them with the run's seed, and they are removed from the training set (so also
from the draft-vocabulary count).

Each evaluation is a collective over the world: the held-out samples are read in chunks of ``dp · micro_batch``;
dp rank ``d`` takes the chunk's samples ``[d·micro, (d+1)·micro)`` (every tp/cp rank of it the same ones) and runs the
engine's forward without gradients. A rank whose share of the last chunk is empty runs the chunk's first sample
with weight 0, so every rank runs the same forwards (ZeRO-3 gathers parameters in each), and every batch carries the
chunk's largest extent over the dp ranks (``TTTBatch.call_extent``), so they cut them into equally many module calls.
The sums are reduced like a training step's (``recipe.train.loop.Trainer.train_step``). One ``metrics.jsonl`` record
per evaluation:

    {"step": s, "eval": {"loss", "loss_k", "acc", "acc_all_supervised", "valid", "supervised", "samples"}}

Two accuracies per TTT step k, named apart on purpose:

- ``acc[k]``: correct / valid positions, the positions whose target argmax is in the draft vocabulary (the
  training loss's positions, as in the training records' ``acc``);
- ``acc_all_supervised[k]``: correct / all supervised positions (loss-mask ones at step k's label), an
  out-of-vocabulary target token counting as a miss: the accuracy EAGLE and SpecForge report.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.data.store import HiddenStateStore
from recipe.lifecycle.distributed import rank0_first
from recipe.train.metrics import ttt_metrics


def held_out_split(num_samples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held_out)`` sample indices, each sorted: ``round(fraction · num_samples)`` (at least 1) samples of
    ``randperm(num_samples, seed)`` held out. Raises ValueError for a fraction outside (0, 1) or a split that leaves
    no training sample."""
    if not 0 < fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {fraction}")
    n_eval = max(1, round(fraction * num_samples))
    if n_eval >= num_samples:
        raise ValueError(f"--eval-fraction {fraction} of {num_samples} samples leaves none to train on")
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def held_out_data(args, examples, store, console, comm):
    """Split off or load the held-out samples. Returns ``(examples, store, eval_examples, eval_store, tag)``: the
    training data (without the held-out samples for ``--eval-fraction``), the held-out data (None, None without
    validation) and a tag for the data fingerprint. Raises ValueError for a bad fraction, ``--eval-data`` with
    ``--eval-fraction``, or an offline ``--eval-data`` that is not a store of the same target and aux layers."""
    fraction, eval_data = args.eval_fraction, args.eval_data
    if fraction is not None and eval_data is not None:
        raise ValueError("give --eval-data or --eval-fraction, not both")
    if fraction is not None:
        n = len(examples) if examples is not None else len(store)
        train, held = held_out_split(n, fraction, args.seed)
        if examples is not None:
            return examples.select(train), None, examples.select(held), None, f"eval-fraction:{fraction}"
        return None, store.subset(train), None, store.subset(held), f"eval-fraction:{fraction}"
    if eval_data is None:
        return examples, store, None, None, ""
    if store is not None:
        if len(eval_data) != 1:
            raise ValueError(f"offline --eval-data takes one store folder, got {len(eval_data)}: {eval_data}")
        held = HiddenStateStore(eval_data[0])
        held.validate()
        held.check_compatible(args.target, args.aux_layer_ids or list(store.aux_layer_ids))
        return None, store, None, held, f"eval-store:{held.fingerprint()}"
    from recipe.data.examples import build_examples, examples_fingerprint  # import cost: pulls in datasets
    from recipe.target.capture import load_tokenizer  # import cost: pulls in transformers

    tokenizer = load_tokenizer(args.target)
    held, _ = rank0_first(lambda: build_examples(eval_data, tokenizer, args.max_length, num_proc=args.num_proc,
                                                 cache_dir=args.cache_dir or args.output / "cache",
                                                 columns=args.data_column, seed=args.seed,
                                                 chain=args.chain_conversations), comm)
    return examples, None, held, None, f"eval-examples:{examples_fingerprint(held)}"


@dataclass
class Validator:
    """Evaluates the held-out ``builder`` (a ``recipe.train.batches.BatchBuilder``) with the run's engine.

    ``every``: evaluate after every ``every``-th step (0: only after the last); ``micro_batch``: the run's
    micro-batch; ``pstate``: the run's ``ParallelState`` (its dp size and rank choose each rank's samples; collectives
    through ``pstate.comm``); ``ttt_steps``: K.
    """

    builder: object
    every: int
    micro_batch: int
    pstate: object
    ttt_steps: int

    def due(self, step: int, total_steps: int) -> bool:
        return step == total_steps or bool(self.every and step % self.every == 0)

    @torch.no_grad()
    def evaluate(self, engine) -> dict:
        """The ``"eval"`` dict of the module docstring (collective over the world): global sums over every
        held-out sample, ``loss`` = Σ_k 0.8^k · loss_k."""
        ps, comm, K = self.pstate, self.pstate.comm, self.ttt_steps
        dp, rank = ps.dims.dp, ps.dp_rank
        chunk = dp * self.micro_batch
        loss_sum, correct, valid, supervised = (torch.zeros(K, dtype=torch.float64) for _ in range(4))
        total = len(self.builder)
        for start in range(0, total, chunk):
            ix = list(range(start, min(start + chunk, total)))
            mine = ix[rank * self.micro_batch:(rank + 1) * self.micro_batch]
            weight = 1.0 if mine else 0.0
            # every dp rank's batch of this chunk: equal module-call counts under ZeRO-3 (recipe.model.call_extent)
            extent = self.builder.call_extent([ix[r * self.micro_batch:(r + 1) * self.micro_batch] or ix[:1]
                                               for r in range(dp)])
            batch = self.builder.build(mine or ix[:1], extent=extent)
            out = engine(batch.ttt)
            loss_sum += weight * out.loss_sum_K.detach().double().cpu()
            correct += weight * out.correct_K.detach().double().cpu()
            valid += weight * out.valid_K.detach().double().cpu()
            supervised += weight * batch.supervised_K.double()
        loss_sum, correct, valid = comm.sum(torch.stack([loss_sum, correct, valid]), ps.dp_cp_group)
        supervised = comm.sum(supervised, ps.dp_group)
        return {**ttt_metrics(loss_sum, correct, valid, supervised), "samples": total}
