"""Build everything a run needs before its first step: layout, data, vocabulary map, draft, DeepSpeed engine.

Order matters for reproducibility: the draft's full weights come from ``--seed`` before any parallel layer shards
them, so every (tp, cp, dp) layout and ZeRO stage starts from the same weights.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from rich.console import Console

from recipe.config import RunConfig, load_run_config
from recipe.cli import TrainArgs
from recipe.data.vocab import VocabMap, build_vocab_map, vocab_coverage_report
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig, load_draft_config_overrides
from recipe.model.target_head import final_logit_softcap, load_embedding_and_head
from recipe.model.ttt import TTTModel
from recipe.parallel.parallelize import parallelize
from recipe.parallel.topology import ParallelState
from recipe.train import checkpoint
from recipe.train.batches import BatchBuilder
from recipe.train.sampler import StepSampler
from recipe.train.validation import Validator, held_out_data


@dataclass
class RunParts:
    """What ``build_run`` made: the resolved config (layout, batch plan, dtype, total steps, DeepSpeed dict), the
    process groups, the draft's config and vocabulary map, the data (builder, sampler, fingerprint), the DeepSpeed
    engine and the checkpoint to resume from (None: a fresh run)."""

    config: RunConfig
    pstate: ParallelState
    draft_config: Eagle3DraftConfig
    vocab: VocabMap
    builder: BatchBuilder
    sampler: StepSampler
    engine: object
    data_fingerprint: str
    resume_from: Path | None
    validator: object | None = None  # recipe.train.validation.Validator of the held-out split (None: no validation)


def rank0_first(fn, comm):
    """Run ``fn`` on global rank 0, then on the others (so caches written by rank 0 are hits elsewhere); the
    barriers go through ``comm`` (the run's ``recipe.parallel.collectives.Collectives``)."""
    if dist.get_rank() == 0:
        out = fn()
        comm.barrier()
        return out
    comm.barrier()
    return fn()


def _data(args: TrainArgs, console: Console, comm):
    """Online: (examples Dataset, None, fingerprint); offline: (None, HiddenStateStore, fingerprint)."""
    cache = args.cache_dir or args.output / "cache"
    if args.hidden_states is not None:
        from recipe.data.store import HiddenStateStore

        store = HiddenStateStore(args.hidden_states)
        store.validate()
        if args.limit:
            store = store.subset(range(min(args.limit, len(store))))
        return None, store, f"store:{store.fingerprint()}:{len(store)}"
    from recipe.data.examples import build_examples
    from recipe.model.target import load_tokenizer

    tokenizer = load_tokenizer(args.target)

    def build():
        return build_examples(args.data, tokenizer, args.max_length, num_proc=args.num_proc, cache_dir=cache,
                              limit=args.limit, columns=args.data_column, weights=args.data_weights, seed=args.seed)

    examples, report = rank0_first(build, comm)
    if dist.get_rank() == 0:
        console.print(report.table())
    return examples, None, f"examples:{examples._fingerprint}:{len(examples)}"


def _token_rows(examples, store):
    """A datasets.Dataset of input_ids/loss_mask for the vocabulary count, from either source."""
    if examples is not None:
        return examples
    from datasets import Dataset

    rows = [store.get(i, fields=("input_ids", "loss_mask")) for i in range(len(store))]
    return Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                              "loss_mask": [r["loss_mask"].tolist() for r in rows]})


def build_run(args: TrainArgs, device: torch.device, console: Console) -> RunParts:
    """Everything a run needs before its first step (module docstring); collective over the world.

    Raises ConfigError/ValueError/KeyError/OSError naming the file or field for bad input (``run.py`` prints them).
    """
    config = load_run_config(args.ds_config, dist.get_world_size(),
                             {"tp_size": args.tp_size, "cp_size": args.cp_size})
    config = config.for_device(device)
    dims, memory = config.dims, config.memory
    pstate = ParallelState(dims, device)

    examples, store, fingerprint = _data(args, console, pstate.comm)
    examples, store, eval_examples, eval_store, eval_tag = held_out_data(args, examples, store, console, pstate.comm)
    fingerprint += f":{eval_tag}:{len(examples) if examples is not None else len(store)}" if eval_tag else ""
    embed_VH, lm_head_VH, hf_config = load_embedding_and_head(args.target)
    if store is not None:
        store.check_compatible(args.target, args.aux_layer_ids)

    resume_from = checkpoint.resolve(args.resume, args.output / "checkpoints") if args.resume else None
    draft_vocab = min(args.draft_vocab_size, hf_config.vocab_size)
    if resume_from is not None:
        vocab = VocabMap.load(resume_from / checkpoint.VOCAB_FILE)
    else:
        cache = args.cache_dir or args.output / "cache"
        rows = _token_rows(examples, store)  # read once: the vocabulary and its coverage report count the same rows
        vocab = rank0_first(lambda: build_vocab_map(rows, hf_config.vocab_size, draft_vocab, cache_dir=cache),
                            pstate.comm)
        if dist.get_rank() == 0:
            console.print(vocab_coverage_report(rows, vocab, store))

    overrides = load_draft_config_overrides(args.draft_config) if args.draft_config else {}
    if args.aux_layer_ids:
        overrides["aux_layer_ids"] = list(args.aux_layer_ids)
    elif store is not None:
        overrides.setdefault("aux_layer_ids", list(store.aux_layer_ids))
    draft_config = Eagle3DraftConfig.from_target_config(hf_config, draft_vocab, overrides)
    draft = Eagle3Draft(draft_config, seed=args.seed)
    draft.load_target_embeddings(embed_VH)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    if args.lm_head_init == "target":
        draft.init_lm_head_from_target(lm_head_VH, vocab.draft_ids)
    model = TTTModel(draft, lm_head_VH[vocab.draft_ids].clone(), loss_chunk_size=memory.loss_chunk_size,
                     checkpoint_steps=memory.checkpoint_ttt_steps, target_softcap=final_logit_softcap(hf_config))
    parallelize(model, pstate, memory, device)
    if args.freeze_lm_head:  # whichever module holds lm_head now (vocab-parallel under tp)
        model.draft.lm_head.weight.requires_grad_(False)

    target = None
    if examples is not None:  # replicated, or ZeRO-3 partitioned over the world (the JSON's "target" section)
        from recipe.model.target_partition import build_target

        target = build_target(args.target, config.target, aux_layer_ids=draft_config.aux_layer_ids,
                              dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
        if dims.cp > 1:
            from recipe.model.target_cp import CPTarget

            target = CPTarget(target, pstate.comm, pstate.cp_group, dims.cp, pstate.cp_rank,
                              memory.attention_backend, memory.attention_tile_size)
    builder = BatchBuilder(examples=examples, store=store, target=target, t2d=vocab.t2d,
                           ttt_steps=args.ttt_steps, seq_divisor=dims.seq_divisor, cp_size=dims.cp,
                           cp_rank=pstate.cp_rank, device=device, dtype=config.dtype)
    sampler = StepSampler(len(builder), config.plan.global_batch, args.seed)
    validator = None
    if eval_examples is not None or eval_store is not None:
        eval_builder = BatchBuilder(examples=eval_examples, store=eval_store, target=target, t2d=vocab.t2d,
                                    ttt_steps=args.ttt_steps, seq_divisor=dims.seq_divisor, cp_size=dims.cp,
                                    cp_rank=pstate.cp_rank, device=device, dtype=config.dtype)
        validator = Validator(eval_builder, args.eval_every, config.plan.micro_batch, pstate,
                              args.ttt_steps)
    config = config.with_total_steps(sampler.total_steps(args.epochs, args.max_steps))

    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config.deepspeed_config(),
                                           mpu=pstate.mpu())
    return RunParts(config=config, pstate=pstate, draft_config=draft_config, vocab=vocab, builder=builder,
                    sampler=sampler, engine=engine, data_fingerprint=fingerprint, resume_from=resume_from,
                    validator=validator)


def write_resolved_config(args: TrainArgs, parts: RunParts) -> None:
    """OUTPUT/run_config.json (rank 0): ``args`` (the flags), the resolved settings (``RunConfig.record``:
    ``deepspeed``, ``parallelism``, ``batch``, ``memory``, ``dtype``, ``total_steps``, ``monitor``, ``target``) and
    ``draft_config``."""
    if dist.get_rank() != 0:
        return
    record = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **parts.config.record(), "draft_config": parts.draft_config.to_hf_dict()}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "run_config.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
