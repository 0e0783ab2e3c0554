"""Dump the target's hidden states for a conversation file into an offline store (``recipe.data.store``).

    python -m recipe.dump --target DIR --data SOURCE [SOURCE ...] --output STORE [--data-column FIELD=COLUMN]
        [--data-weights W1,W2] [--chain-conversations TOKENS] [--seed S] [--max-length N] [--limit N]
        [--batch-size N] [--shard-size N] [--dtype bf16|fp32] [--aux-layer-ids 1,14,26] [--num-proc N] [--cache-dir DIR]
        [--partition-target] [--ds_config JSON]

``--data`` and its companions read conversations exactly as ``run.py --data`` does (``recipe.data.sources``).

Also runs under ``torchrun --nproc_per_node N -m recipe.dump ...`` or the deepspeed launcher: RANK / WORLD_SIZE /
LOCAL_RANK come from the environment and a process group (nccl on GPU, else gloo) is made only when WORLD_SIZE > 1.
Sample i is dumped by rank i % WORLD_SIZE. Re-running the same command resumes: finished shards are skipped.

A target too big for one device is ZeRO-3 partitioned over the ranks (``--partition-target``, or the ``target``
section of the training run's JSON given with ``--ds_config``, ``recipe.target.options``): every rank still
dumps its own samples, and the ranks with fewer batches left run one-token forwards until all have made as many
forwards as the busiest (each layer's weights are all-gathered over every rank).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from recipe.arg_types import int_list
from recipe.config import load_sections
from recipe.config_keys import ConfigError
from recipe.data.flags import add_data_arguments, check_data_arguments
from recipe.data.store import DTYPES, HiddenStateStore, StoreMeta, examples_hash
from recipe.data.store_writer import StoreWriter, shard_plan
from recipe.lifecycle.distributed import cuda_device_index, launcher_environment
from recipe.parallel.collectives import Collectives
from recipe.target.head import validity_rows
from recipe.target.options import TargetOptions
from recipe.target.partition import build_target


@dataclass
class DumpStats:
    """What one rank did: shards/samples/tokens written now, shards skipped as already finished, forward passes."""

    shards_written: int = 0
    shards_skipped: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    forward_calls: int = 0
    seconds: float = 0.0
    index_path: Path | None = None


def _pad_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to [B, S_max] int64 ids (pad id 0, masked) and the [B, S_max] attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, :len(row)] = 1
    return ids, mask


def dump_hidden_states(target, dataset, out_dir: str | Path, *, max_length: int, dtype: str = "bf16",
                       batch_size: int = 8, shard_size: int = 64, rank: int = 0, world_size: int = 1,
                       comm=None, group=None, data_hash: str | None = None) -> DumpStats:
    """Run ``target`` (a ``TargetModel``) over ``dataset`` (columns ``input_ids``, ``loss_mask``) and write this
    rank's shards of the store at ``out_dir``, then (rank 0, after a barrier over ``group`` through ``comm``, a
    ``recipe.parallel.collectives.Collectives``; needed when world_size > 1) the merged index.

    Samples of a shard are sorted by length and batched ``batch_size`` at a time, right-padded; padding rows are
    stripped before storing. A shard is held in CPU memory until written: about
    ``shard_size · max_length · 4·H_t · 2`` bytes in bf16 (SmolLM2, 2048 tokens, 64 samples: 0.6 GB). Shards
    already finished by an earlier run with the same settings are skipped. With a partitioned target
    (``target.partitioned``, whose capture is a collective over the world) every rank makes as many forwards as the
    busiest one (agreed through ``comm`` over the world; the others are ``target.idle_capture()``).
    Raises StoreError when ``out_dir`` holds a store started with other settings; ValueError for a partitioned
    target with world_size > 1 and no ``comm``.
    """
    start = time.perf_counter()
    lengths = [len(ids) for batch in dataset.iter(batch_size=1024) for ids in batch["input_ids"]]
    store_dtype = DTYPES[dtype]
    meta = StoreMeta(target_path=str(target.path), target_fingerprint=target.fingerprint,
                     hidden_size=target.hidden_size, aux_layer_ids=target.aux_layer_ids, dtype=dtype,
                     max_length=max_length, data_hash=data_hash or examples_hash(dataset), num_samples=len(dataset))
    writer = StoreWriter(out_dir, meta, rank=rank, world_size=world_size, shard_size_samples=shard_size)
    stats = DumpStats()
    plans = shard_plan(lengths, rank, world_size, shard_size)
    pending = [plan for plan in plans if not writer.is_finished(plan.n)]
    stats.shards_skipped = len(plans) - len(pending)
    forwards = sum(math.ceil(len(plan.sample_ids) / batch_size) for plan in pending)
    if target.partitioned and world_size > 1:
        if comm is None:
            raise ValueError(f"dump_hidden_states: a partitioned target on world_size={world_size} needs comm")
        forwards = max(comm.all_gather_object(forwards))  # the target's collectives span the world
    for plan in pending:
        samples = {}
        for k in range(0, len(plan.sample_ids), batch_size):
            batch_ids = list(plan.sample_ids[k:k + batch_size])
            rows = dataset[batch_ids]
            input_ids, attention = _pad_batch(rows["input_ids"])
            loss_mask = torch.zeros_like(input_ids)
            for b, mask in enumerate(rows["loss_mask"]):
                loss_mask[b, :len(mask)] = torch.tensor(mask, dtype=torch.long)
            # the argmax only at the rows the TTT validity reads (0 elsewhere): docs/data.md
            capture = target.capture(input_ids, attention, argmax_rows_BS=validity_rows(loss_mask))
            stats.forward_calls += 1
            for b, (i, ids, mask) in enumerate(zip(batch_ids, rows["input_ids"], rows["loss_mask"])):
                n = len(ids)
                samples[i] = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask),  # padding stripped
                              "target_argmax": capture.argmax_BS[b, :n],
                              "aux_hidden": capture.aux_hidden_BSA[b, :n].to("cpu", store_dtype),
                              "last_hidden": capture.last_hidden_BSH[b, :n].to("cpu", store_dtype)}
        writer.write_shard(plan, samples)
        stats.shards_written += 1
        stats.samples_written += len(samples)
        stats.tokens_written += sum(lengths[i] for i in plan.sample_ids)
    if target.partitioned:
        for _ in range(forwards - stats.forward_calls):
            target.idle_capture()
    stats.index_path = writer.finalize(comm, group)
    stats.seconds = time.perf_counter() - start
    return stats


def summary_table(store: HiddenStateStore, dataset, stats: DumpStats) -> Table:
    """A rich table of the finished store: samples, tokens, supervised tokens, size, bytes per token, this run."""
    tokens = sum(store.lengths)
    supervised = sum(sum(m) for batch in dataset.iter(batch_size=1024) for m in batch["loss_mask"])
    table = Table(title=f"Hidden-state store: {store.path}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [("samples", f"{len(store)}"), ("shards", f"{len(store.shards)}"), ("tokens", f"{tokens:,}"),
            ("supervised tokens", f"{supervised:,} ({supervised / max(tokens, 1):.1%})"),
            ("dtype / aux layers", f"{store.meta.dtype} / {list(store.meta.aux_layer_ids)}"),
            ("store size", f"{store.total_bytes / 2**20:,.1f} MiB"),
            ("bytes per token", f"{store.bytes_per_token:,.0f}"),
            ("this run (rank 0)", f"{stats.shards_written} shards written, {stats.shards_skipped} skipped, "
                                  f"{stats.tokens_written / max(stats.seconds, 1e-9):,.0f} tokens/s")]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipe.dump", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target HF folder or .gguf file")
    add_data_arguments(p, required=True)
    p.add_argument("--seed", type=int, default=0,
                   help="interleaving seed with --data-weights, chaining order with --chain-conversations")
    p.add_argument("--output", required=True, type=Path, help="store folder (created; re-running resumes)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int, help="read only the first N conversations of each data file")
    p.add_argument("--batch-size", type=int, default=8, help="samples per target forward pass")
    p.add_argument("--shard-size", type=int, default=64, help="samples per shard file (held in memory)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="stored hidden-state dtype")
    p.add_argument("--aux-layer-ids", type=int_list,
                   help="comma-separated decoder layer ids (default [1, L//2-1, L-4])")
    p.add_argument("--num-proc", type=int, default=1, help="tokenisation worker processes")
    p.add_argument("--cache-dir", help="datasets cache folder for the tokenised examples")
    p.add_argument("--partition-target", action="store_true",
                   help="ZeRO-3 partition the target over the ranks (for a target too big for one device; needs "
                   "WORLD_SIZE > 1); same as target.partition = \"zero3\" in the JSON")
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", type=Path,
                   help="the training run's DeepSpeed JSON: its 'target' section (partition, zero_optimization) "
                   "says how the target is held (the whole file is checked as run.py checks it)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # appended by deepspeed
    args = p.parse_args(argv)
    check_data_arguments(p, args)
    return args


def target_options(args: argparse.Namespace) -> TargetOptions:
    """The ``target`` section of ``--ds_config`` as the run parses it (``recipe.config.load_sections``; the defaults
    without the flag), with ``partition = "zero3"`` under ``--partition-target``. Raises ConfigError naming the file
    and field for a bad JSON or section."""
    options = TargetOptions() if args.ds_config is None else load_sections(args.ds_config).target
    if args.partition_target:
        options = TargetOptions(partition="zero3", zero_optimization=options.zero_optimization)
    return options


def main(argv=None) -> None:
    args = _parse(argv)

    try:
        options = target_options(args)
    except ConfigError as exc:
        raise SystemExit(f"python -m recipe.dump: {exc}") from None

    try:  # rank and world from whichever launcher started this process (torchrun, deepspeed, MPI, Slurm)
        _, found = launcher_environment(os.environ)
    except ValueError as exc:
        raise SystemExit(f"python -m recipe.dump: {exc}") from None
    rank, world = int(found["RANK"]), int(found["WORLD_SIZE"])
    if options.partitioned and world == 1:
        raise SystemExit("python -m recipe.dump: a partitioned target needs several ranks: launch with "
                         "`torchrun --nproc_per_node N -m recipe.dump ...` (or the deepspeed launcher)")
    local_rank = int(found["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    comm = None
    own_group = world > 1 and not dist.is_initialized()  # a caller (a test's ranks) may have made the group
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if own_group:
            os.environ.update(found)  # torch's env:// rendezvous
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        comm = Collectives(device)
    console = Console()
    try:
        from recipe.data.examples import build_examples  # import cost: pulls in datasets

        target = build_target(args.target, options, aux_layer_ids=args.aux_layer_ids, device=device)

        def build():
            return build_examples(args.data, target.load_tokenizer(), args.max_length, num_proc=args.num_proc,
                                  cache_dir=args.cache_dir, limit=args.limit, columns=args.data_column,
                                  weights=args.data_weights, seed=args.seed, chain=args.chain_conversations)

        if world > 1 and rank != 0:
            comm.barrier()  # rank 0 builds (and caches) the examples first
        dataset, report = build()
        if world > 1 and rank == 0:
            comm.barrier()
        if rank == 0:
            console.print(report.table())
        stats = dump_hidden_states(target, dataset, args.output, max_length=args.max_length, dtype=args.dtype,
                                   batch_size=args.batch_size, shard_size=args.shard_size, rank=rank,
                                   world_size=world, comm=comm)
        if rank == 0:
            console.print(summary_table(HiddenStateStore(args.output), dataset, stats))
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
