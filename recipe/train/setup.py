"""Build everything a run needs before its first step: layout, data, vocabulary map, draft, DeepSpeed engine.

Order matters for reproducibility: the draft's full weights come from ``--seed`` before any parallel layer shards
them, so every (tp, cp, dp) layout and ZeRO stage starts from the same weights.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from rich.console import Console
from transformers import AutoConfig

from recipe.config import RunConfig, RunSections, load_sections
from recipe.data.lengths import LengthReport
from recipe.data.vocab import VocabMap, build_vocab_map, vocab_coverage_report
from recipe.lifecycle import checkpoint, reshard, resume_checks
from recipe.lifecycle.distributed import rank0_first
from recipe.lifecycle.output_dir import check_output, clear_previous_run
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig, load_draft_config_overrides
from recipe.model.ttt import TTTModel
from recipe.parallel.parallelize import build_training_model
from recipe.parallel.topology import ParallelState
from recipe.target.capture import target_fingerprint
from recipe.target.files import split_gguf
from recipe.target.head import load_embedding_and_head
from recipe.target.registry import arch_facts, draft_config_for, final_logit_softcap
from recipe.train import init_draft, positions
from recipe.train.batches import BatchBuilder
from recipe.train.flags import TrainArgs
from recipe.train.memory_plan import resolve_run_memory, run_plan_inputs
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
    # what the run is made of beyond its flags, recorded in every checkpoint's run state and compared on resume
    # (resume_checks.COMPAT_KEYS): target fingerprint, draft geometry, --position-offset-max; init_draft: recorded
    run_identity: dict = field(default_factory=dict)
    # the run-plan line when the checkpoint resumed from is of another layout (recipe.lifecycle.reshard), else None
    resharding: str | None = None


def _data(args: TrainArgs, console: Console, comm, config: RunConfig):
    """Online: (examples Dataset, None, fingerprint); offline: (None, HiddenStateStore, fingerprint). Either way rank 0
    prints the padding share of ``config``'s micro-batches, padded and packed (``recipe.data.lengths``): online in
    the data report, offline as one line from the store's sample lengths."""
    cache = args.cache_dir or args.output / "cache"
    if args.hidden_states is not None:
        from recipe.data.store import HiddenStateStore

        store = HiddenStateStore(args.hidden_states)
        store.validate()
        if args.limit:
            store = store.subset(range(min(args.limit, len(store))))
        if dist.get_rank() == 0 and (line := _for_batches(LengthReport(args.max_length, store.lengths),
                                                          config).padding_line()) is not None:
            console.print(line)
        return None, store, f"store:{store.fingerprint()}:{len(store)}"
    from recipe.data.examples import build_examples, examples_fingerprint
    from recipe.target.capture import load_tokenizer

    tokenizer = load_tokenizer(args.target)

    def build():
        return build_examples(args.data, tokenizer, args.max_length, num_proc=args.num_proc, cache_dir=cache,
                              limit=args.limit, columns=args.data_column, weights=args.data_weights, seed=args.seed,
                              chain=args.chain_conversations)

    examples, report = rank0_first(build, comm)
    if dist.get_rank() == 0:
        if report.lengths is not None:  # the padding share with and without packing
            _for_batches(report.lengths, config)
        console.print(report.table())
    return examples, None, f"examples:{examples_fingerprint(examples)}:{len(examples)}"


def _for_batches(lengths: LengthReport, config: RunConfig) -> LengthReport:
    """``lengths`` set to ``config``'s micro-batch size and ``data`` section, for its padding line: ``"auto"`` as the
    draft's attention tile will leave it (``DataOptions.for_attention``: padded with no tile; a tile still
    ``"auto"`` resolves to one)."""
    data = config.data.for_attention(config.memory.attention_tile_size)
    return lengths.for_batches(config.plan.micro_batch, data.packing, data.packing_tokens, config.dims.seq_divisor)


def _token_rows(examples, store):
    """A datasets.Dataset of input_ids/loss_mask for the vocabulary count, from either source."""
    if examples is not None:
        return examples
    from datasets import Dataset

    rows = [store.get(i, fields=("input_ids", "loss_mask")) for i in range(len(store))]
    return Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                              "loss_mask": [r["loss_mask"].tolist() for r in rows]})


def build_run(args: TrainArgs, device: torch.device, console: Console,
              sections: RunSections | None = None) -> RunParts:
    """Everything a run needs before its first step (module docstring); collective over the world. ``sections``:
    ``--ds_config`` as ``run.py`` parsed it (None: read here), resolved by :func:`run_config`.

    Raises ConfigError/ValueError/KeyError/OSError naming the file or field for bad input (``run.py`` prints them).
    """
    config = run_config(args, sections, dist.get_world_size(), device)
    pstate = ParallelState(config.dims, device)
    resume = check_output(args, pstate.comm)  # before anything is written into --output or data is read
    if args.resume == "auto" and dist.get_rank() == 0:
        console.print("--resume auto: " + ("resuming the run in " if resume else "no run in ")
                      + f"{args.output}" + ("" if resume else "; starting afresh"))
    # verified before the data is read: a damaged or missing checkpoint costs no tokenisation
    resume_from = checkpoint.resolve(resume, args.output / "checkpoints") if resume else None

    examples, store, fingerprint = _data(args, console, pstate.comm, config)
    examples, store, eval_examples, eval_store, eval_tag = held_out_data(args, examples, store, console, pstate.comm)
    fingerprint += f":{eval_tag}:{len(examples) if examples is not None else len(store)}" if eval_tag else ""
    embed_VH, lm_head_VH, hf_config = load_embedding_and_head(args.target)
    draft_config, init, notes = _draft_config(args, hf_config, store)
    identity, resharding, resume_notes = _identity(args, config, draft_config, init, resume_from)
    if dist.get_rank() == 0:
        for note in filter(None, notes + resume_notes):
            console.print(note)
    vocab = _vocab_map(args, resume_from, init, examples, store, hf_config.vocab_size, pstate, console)

    # the memory section's "auto" resolved for the longest sample and this device (recipe.train.memory_plan)
    config = resolve_run_memory(config, pstate, device, args.memory_budget,
                                run_plan_inputs(config, args, hf_config, draft_config, examples, store))
    config = dataclasses.replace(config, data=config.data.for_attention(config.memory.attention_tile_size))
    model = _training_model(args, config, draft_config, hf_config, embed_VH, lm_head_VH, vocab, pstate, device,
                            init=init if resume_from is None else None,
                            masters_from=resume_from if resharding is not None else None)

    target, argmax_chunk, packed_target = (online_target(args, config, pstate, draft_config, hf_config, device)
                                           if examples is not None else (None, None, None))

    def batch_builder(rows, hidden_states, offset_max=0) -> BatchBuilder:  # training and held-out samples alike
        return BatchBuilder(examples=rows, store=hidden_states, target=target, t2d=vocab.t2d,
                            ttt_steps=args.ttt_steps, seq_divisor=config.dims.seq_divisor, dims=config.dims,
                            cp_rank=pstate.cp_rank, device=device, dtype=config.dtype,
                            argmax_chunk_size=argmax_chunk or 1024, position_offset_max=offset_max, seed=args.seed,
                            packing=config.data.packing, packing_tokens=config.data.packing_tokens,
                            packed_target=packed_target)

    builder = batch_builder(examples, store, args.position_offset_max)  # held-out samples: plain positions
    sampler = StepSampler(len(builder), config.plan.global_batch, args.seed)
    validator = None
    if eval_examples is not None or eval_store is not None:
        validator = Validator(batch_builder(eval_examples, eval_store), args.eval_every, config.plan.micro_batch,
                              pstate, args.ttt_steps)
    config = config.with_total_steps(sampler.total_steps(args.epochs, args.max_steps))

    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config.deepspeed_config(),
                                           mpu=pstate.mpu())
    return RunParts(config=config, pstate=pstate, draft_config=draft_config, vocab=vocab, builder=builder,
                    sampler=sampler, engine=engine, data_fingerprint=fingerprint, resume_from=resume_from,
                    validator=validator, run_identity=identity, resharding=resharding)


def _draft_config(args: TrainArgs, hf_config, store) -> tuple[Eagle3DraftConfig, object | None, list]:
    """(draft config, the ``--init-draft`` draft prepared or None, notes to print): the target's shape with
    ``--draft-config`` and ``--aux-layer-ids`` (else the store's aux layers), or the existing draft's geometry
    checked against it (``recipe.train.init_draft``). Raises ValueError naming the flag or file."""
    notes = [store.check_compatible(args.target, args.aux_layer_ids)] if store is not None else []
    overrides = load_draft_config_overrides(args.draft_config) if args.draft_config else {}
    if args.aux_layer_ids:
        overrides["aux_layer_ids"] = list(args.aux_layer_ids)
    elif store is not None:
        overrides.setdefault("aux_layer_ids", list(store.aux_layer_ids))
    init = None  # --init-draft: the existing draft the run starts from (recipe.train.init_draft)
    if args.init_draft is not None:
        init = init_draft.prepare(args.init_draft, args.draft_vocab_size, hf_config.vocab_size, overrides)
        overrides = init.overrides
    draft_vocab = init.draft_vocab_size if init else min(args.draft_vocab_size, hf_config.vocab_size)
    draft_config = draft_config_for(hf_config, draft_vocab, overrides)
    if init is not None:
        init_draft.check_geometry(init, draft_config, int(hf_config.get_text_config().num_hidden_layers))
        notes += init.notes + init_draft.setting_notes(init, draft_config)
    return draft_config, init, notes


def _identity(args: TrainArgs, config: RunConfig, draft_config, init, resume_from: Path | None):
    """(run identity, resharding line or None, notes): what the run is made of (``RunParts.run_identity``), checked
    against the checkpoint resumed from before its vocabulary map, the draft or DeepSpeed touch anything. Raises
    ValueError for an incompatible checkpoint or one of another layout without its layout-free state."""
    identity = {"target_fingerprint": target_fingerprint(args.target), "position_offset_max": args.position_offset_max,
                "draft_config": json.loads(json.dumps(dataclasses.asdict(draft_config)))}  # as run_state.json holds it
    if resume_from is None:
        if init is not None:
            identity["init_draft"] = init.record()
        return identity, None, []
    saved = checkpoint.read_run_state(resume_from)
    notes = [resume_checks.check_compatible(saved, identity, resume_from, keys=tuple(identity))]
    if init is not None:
        notes.append(init_draft.check_resume(saved, init, resume_from))
    resharding = resume_checks.describe_change(saved, layout_state(config))
    if resharding is not None and not (resume_from / reshard.TRAIN_STATE_FILE).is_file():
        raise ValueError(f"cannot resume from {resume_from} on another layout: it has no "
                         f"{reshard.TRAIN_STATE_FILE} (written by an earlier version, or by a run whose optimizer "
                         f"is not Adam); resume it on its own layout, {resume_checks.layout_name(saved)}, or "
                         "start a new run")
    if saved.get("init_draft") is not None:  # where the run's draft came from stays recorded
        identity["init_draft"] = saved["init_draft"]
    return identity, resharding, notes


def _vocab_map(args: TrainArgs, resume_from: Path | None, init, examples, store, vocab_size: int,
               pstate: ParallelState, console: Console) -> VocabMap:
    """The d2t/t2d map: the checkpoint's on resume, the existing draft's with ``--init-draft`` (never recomputed
    from the data), else the ``--draft-vocab-size`` most frequent target ids (at most ``vocab_size``) counted from
    the training rows on rank 0 (its coverage report printed)."""
    if resume_from is not None:
        return VocabMap.load(resume_from / checkpoint.VOCAB_FILE)
    if init is not None:
        return init.vocab
    cache = args.cache_dir or args.output / "cache"
    rows = _token_rows(examples, store)  # read once: the vocabulary and its coverage report count the same rows
    draft_vocab = min(args.draft_vocab_size, vocab_size)
    vocab = rank0_first(lambda: build_vocab_map(rows, vocab_size, draft_vocab, cache_dir=cache), pstate.comm)
    if dist.get_rank() == 0:
        console.print(vocab_coverage_report(rows, vocab, store))
    return vocab


def _training_model(args: TrainArgs, config: RunConfig, draft_config, hf_config, embed_VH, lm_head_VH,
                    vocab: VocabMap, pstate: ParallelState, device: torch.device, init=None,
                    masters_from: Path | None = None) -> TTTModel:
    """The draft built full from ``--seed`` (target embeddings, vocabulary map, lm_head from the target's rows),
    ``init``'s weights loaded or the saved fp32 masters of ``masters_from`` (a resume on another layout), then
    parallelised (``recipe.parallel.parallelize.build_training_model``); lm_head frozen with ``--freeze-lm-head``."""
    draft = Eagle3Draft(draft_config, seed=args.seed)
    draft.load_target_embeddings(embed_VH)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    if args.lm_head_init == "target" and args.init_draft is None:
        draft.init_lm_head_from_target(lm_head_VH, vocab.draft_ids)

    def before_split(model: TTTModel) -> None:
        if init is not None:  # into the single-device model: every layout is cut from it
            init_draft.load_into(model, init)
        if masters_from is not None:  # the layout is cut from the saved masters, as a fresh run's initial weights
            reshard.load_master_weights(model, masters_from)

    model = build_training_model(draft, lm_head_VH[vocab.draft_ids].clone(), config.memory, config.kernels, pstate,
                                 device, target_softcap=final_logit_softcap(hf_config), before_split=before_split)
    if args.freeze_lm_head:  # whichever module holds lm_head now (vocab-parallel under tp)
        model.draft.lm_head.weight.requires_grad_(False)
    return model


def run_config(args: TrainArgs, sections: RunSections | None, world_size: int, device: torch.device) -> RunConfig:
    """The run's ``RunConfig`` before its data is read: ``sections`` (``--ds_config`` parsed once,
    ``recipe.config.load_sections``; None: read here) resolved for ``world_size`` processes with
    ``--tp-size``/``--cp-size`` (``RunSections.resolve``), its kernels for ``device`` (``RunConfig.for_device``) and
    ``--packing`` applied (:func:`run_data_options`). Raises ConfigError naming the file and field."""
    sections = load_sections(args.ds_config) if sections is None else sections
    config = sections.resolve(world_size, {"tp_size": args.tp_size, "cp_size": args.cp_size}).for_device(device)
    return dataclasses.replace(config, data=run_data_options(args, config))


def run_data_options(args: TrainArgs, config: RunConfig):
    """The run's ``data`` section (``recipe.config_data.DataOptions``) with ``--packing``/``--no-packing`` applied;
    online, ``"auto"`` packs only where the target's forward isolates packed documents
    (``recipe.target.registry.TargetArch.packs_documents``; ``DataOptions.for_target``). Raises ConfigError for
    packing true on another target, FileNotFoundError naming a missing target."""
    data = config.data.with_flag(args.packing)
    if args.data is None or data.packing is False:  # offline: no target forward; the store's states are per sample
        return data
    folder, gguf = split_gguf(args.target)  # a missing target named clearly, a *.gguf file read as one
    hf_config = AutoConfig.from_pretrained(folder, **gguf)
    return data.for_target(getattr(hf_config, "model_type", None), arch_facts(hf_config).packs_documents, config.path)


def online_target(args: TrainArgs, config: RunConfig, pstate: ParallelState, draft_config, hf_config,
                  device: torch.device):
    """``(target, argmax_chunk_size, packed_target)`` of an online run: the target replicated, or ZeRO-3 partitioned
    over the world (the JSON's ``target`` section), in bfloat16 on CUDA and float32 on the CPU; split over the cp·tp
    ranks of each dp replica (``recipe.target.split.SplitTarget``) by ``recipe.target.registry.splits_target``'s rule
    (cp > 1, or tp > 1 with an attention the ring runs; otherwise every tp rank runs it whole). ``packed_target``:
    unsplit at one cp·tp rank with ``data.packing`` on, a one-rank ``SplitTarget`` around the same target for the
    packed micro-batches (``BatchBuilder``'s ``packed_target``; transformers would score the whole packed row under
    a dense mask); None otherwise. Raises ValueError at cp > 1 for a target the ring cannot run."""
    from recipe.target.partition import build_target
    from recipe.target.registry import splits_target
    from recipe.target.split import SplitTarget

    dims = config.dims
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    argmax_chunk = config.memory.argmax_positions(hf_config.vocab_size, dtype)
    target = build_target(args.target, config.target, aux_layer_ids=draft_config.aux_layer_ids, dtype=dtype,
                          device=device)
    split = (config.kernels.attention, config.memory.attention_tile_size, argmax_chunk,
             config.kernels.sequence_parallel)
    if splits_target(hf_config, dims):
        return SplitTarget.from_state(target, pstate, *split), argmax_chunk, None
    one_rank = dims.cp * dims.tp == 1 and config.data.packing is not False
    return target, argmax_chunk, SplitTarget.from_state(target, pstate, *split) if one_rank else None


def online_target_record(builder: BatchBuilder) -> dict:
    """How an online run's target runs: ``forward_split`` (ranks sharing each forward: cp·tp when split, else 1),
    ``partitioned`` (ZeRO-3 over the world) and ``argmax_chunk_size`` (positions per argmax matmul)."""
    target = builder.target
    split = getattr(target, "split_size", 1)
    whole = getattr(target, "target", target)
    return {"forward_split": split, "partitioned": bool(getattr(whole, "partitioned", False)),
            "argmax_chunk_size": target.argmax_chunk_size if builder.split_target else builder.argmax_chunk_size}


def layout_state(config: RunConfig) -> dict:
    """The run-state keys of ``recipe.lifecycle.resume_checks.LAYOUT_KEYS`` for ``config`` (before the engine exists)."""
    d, ds = config.dims, config.deepspeed
    return {"world_size": d.world_size, "tp": d.tp, "cp": d.cp, "dp": d.dp,
            "zero_stage": int((ds.get("zero_optimization") or {}).get("stage", 0)),
            "dtype": str(config.dtype).removeprefix("torch."),
            "grad_accum_dtype": (ds.get("data_types") or {}).get("grad_accum_dtype")}


def write_resolved_config(args: TrainArgs, parts: RunParts, console: Console | None = None) -> None:
    """OUTPUT/run_config.json (rank 0): ``args`` (the flags), the resolved settings (``RunConfig.record``:
    ``deepspeed``, ``parallelism``, ``batch``, ``memory`` (every "auto" resolved), ``memory_auto`` (how:
    ``recipe.config_memory.MemoryReport.record``), ``kernels``, ``dtype``, ``total_steps``, ``monitor``, ``target``,
    ``data`` (packing as the run applies it)), ``draft_config``, ``positions`` (``recipe.train.positions``),
    ``init_draft`` (where an ``--init-draft`` run's draft came from) and, online, ``online_target``
    (:func:`online_target_record`). Call it once every check has passed (after the ``Trainer`` is built: a refused
    resume leaves the folder as it was). With ``--overwrite`` it first deletes the previous run's
    :data:`RUN_ARTEFACTS`."""
    if dist.get_rank() != 0:
        return
    if getattr(args, "overwrite", False):
        removed = clear_previous_run(args.output)
        if removed and console is not None:
            console.print(f"--overwrite: deleted the previous run's {', '.join(removed)} in {args.output}")
    record = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **parts.config.record(), "draft_config": parts.draft_config.to_hf_dict()}
    if parts.builder.target is not None:
        record["online_target"] = online_target_record(parts.builder)
    record.update({k: parts.run_identity[k] for k in ("init_draft",) if k in parts.run_identity})  # --init-draft
    record["positions"] = positions.run_positions(parts)  # longest sample against the target's serving context
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "run_config.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
