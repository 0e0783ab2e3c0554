"""Train an EAGLE-3 draft with DeepSpeed: parse, build, train, export; the process group is closed either way.

    deepspeed --num_gpus N run.py --ds_config ds_configs/zero3.json --target DIR --data FILE --output DIR ...
    torchrun --nproc_per_node N run.py ...      python run.py ...   (one process)

`python run.py --help` lists every flag; README.md and docs/cluster.md have the launcher recipes (CPU, several
machines).

Exit codes: 0 finished; 2 bad input or configuration (``error (rank N): ...`` names the file, line or field, no
traceback; argparse errors also exit 2), or a step out of accelerator memory (the message names the step, the
length, the rank's memory and the switches to try, ``recipe.lifecycle.oom``), or flex attention that would run uncompiled
on CUDA (``kernels.flex_attention.FlexCompileError``); 75
(``recipe.lifecycle.signals.EXIT_INTERRUPTED``) interrupted by SIGTERM/SIGINT (or the launcher's death) after a checkpoint
of the last completed step was saved, rank 0 wrote ``OUTPUT/INTERRUPTED`` (continue with ``--resume``; the
``deepspeed`` launcher passes 75 on only when the ranks were signalled, docs/training.md "Interruption, resume and exit
codes"); 74 (``recipe.io_errors.EXIT_WRITE_FAILED``, sysexits EX_IOERR) the run
is not complete because its output could not be written (a checkpoint, ``metrics.jsonl``, monitor files or the
export: disk full, I/O error, permission; ``error (rank N): ...`` names the path and the cause; the final save and
the export were each retried once); ``checkpoints/latest`` still names the last complete checkpoint, continue with
``--resume`` once there is room; 76 (``recipe.lifecycle.watch.EXIT_HUNG``) no step, checkpoint or validation finished
within ``--hang-timeout-minutes``: every rank wrote its Python stacks to ``OUTPUT/hang-rank-R.txt``, nothing was
saved, ``checkpoints/latest`` is the resume point; 128+signum when a second signal, 2 s or more after the first,
forced an immediate exit. ``RECIPE_DEBUG=1`` re-raises errors with their traceback.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from recipe.config import load_sections
from recipe.config_keys import ConfigError
from recipe.io_errors import EXIT_WRITE_FAILED, WriteError
from recipe.lifecycle.signals import EXIT_INTERRUPTED, StopRequest, clear_interrupted, write_interrupted
from recipe.lifecycle.watch import group_timeout
from recipe.train.flags import parse_args


def mark_interrupted(output: Path, stop, console) -> None:
    """Write ``OUTPUT/INTERRUPTED`` naming the checkpoint ``checkpoints/latest`` points at (rank 0, after an
    interrupted run saved it; ``recipe.lifecycle.signals.write_interrupted``). A failed write only warns: the checkpoint
    is saved and the exit code still says so."""
    from recipe.lifecycle.checkpoint import RUN_STATE, latest_tag  # import cost: torch, DeepSpeed (see main)

    try:
        tag = latest_tag(output / "checkpoints")
        try:
            step = json.loads((output / "checkpoints" / tag / RUN_STATE).read_text())["step"] if tag else None
        except (OSError, ValueError, KeyError):
            step = None
        write_interrupted(output, tag, step, stop.reason)
    except OSError as exc:
        console.print(f"[yellow]warning[/yellow]: could not write {output / 'INTERRUPTED'} ({exc})")


def launch_rank() -> int:
    """This process's global rank before ``init_distributed``: the group's when one is up, else the launcher's
    variables' (``recipe.lifecycle.distributed.launcher_ranks``), 0 when they do not describe a world."""
    # import cost: torch (see main)
    import torch.distributed as dist

    from recipe.lifecycle.distributed import launcher_ranks  # import cost: pulls in torch

    if dist.is_initialized():
        return dist.get_rank()
    try:
        return launcher_ranks(os.environ)[1]
    except ValueError:
        return 0


def _train(args, sections, device, console, stop) -> int:
    """Build the run from the JSON's parsed ``sections`` (``recipe.config.RunSections``), train it and say what was
    compiled; the exit code (0, or ``EXIT_INTERRUPTED`` after a saved stop). Raises what ``main`` reports (bad input,
    checkpoint, out-of-memory and compile errors)."""
    import torch.distributed as dist  # import cost: torch, once the process group is up

    # import cost: DeepSpeed and transformers, once the process group is up
    from recipe.train.loop import Trainer, TrainSettings
    from recipe.train.metrics import plan_summary  # import cost: pulls in torch
    from recipe.train.positions import position_lines, run_positions  # import cost: pulls in torch

    # import cost: pulls in deepspeed, transformers, torch
    from recipe.train.setup import build_run, write_resolved_config

    # checks --output (a previous run, writable) before writing to it
    parts = build_run(args, device, console, sections)
    trainer = Trainer(TrainSettings.from_args(args), parts, console)  # refuses an incompatible --resume
    # every check has passed: only now is anything of the previous run replaced
    if dist.get_rank() == 0:
        clear_interrupted(args.output)
    write_resolved_config(args, parts, console)
    if dist.get_rank() == 0:
        console.print(plan_summary(parts))
        console.print(trainer.speed.describe())
        for line in position_lines(run_positions(parts)):  # longest sample vs the target's serving context
            console.print(line)
    code = trainer.train()
    if code == EXIT_INTERRUPTED and dist.get_rank() == 0:
        mark_interrupted(args.output, stop, console)
    if dist.get_rank() == 0:
        _compile_lines(console)
    return code


def _compile_lines(console) -> None:
    """The compile counts of flex attention and the compiled small ops, where they ran (rank 0)."""
    from kernels.flex_attention import flex_compile_stats  # import cost: pulls in torch
    from recipe.model.small_ops import small_ops_stats  # import cost: pulls in torch, transformers

    flex = flex_compile_stats()
    if flex["calls"]:
        console.print(f"flex attention: {flex['compiles']} compile(s) for {flex['calls']} calls "
                      f"(dynamic={flex['dynamic']}, limit {flex['recompile_limit']})")
    small = small_ops_stats()
    if any(op["calls"] for op in small.values()):
        console.print("compiled small ops: " + ", ".join(f"{name} {op['compiles']}" for name, op in small.items())
                      + f" compile(s) (limit {next(iter(small.values()))['recompile_limit']} each)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # import cost: torch, DeepSpeed and transformers load only from here, so --help and flag errors answer without them
    from recipe.lifecycle.distributed import default_cuda_alloc_conf

    default_cuda_alloc_conf()  # expandable segments on CUDA unless the user set the allocator (before any allocation)

    # import cost: torch and the training modules (see above)
    import torch.distributed as dist
    from rich.console import Console  # import cost: rich
    from rich.markup import escape  # import cost: rich

    from kernels.compile_policy import CompileError  # import cost: pulls in torch
    from recipe.lifecycle.checkpoint import CheckpointError  # import cost: pulls in torch
    from recipe.lifecycle.distributed import close_process_group, init_distributed, release_shm_buffer  # import cost: torch
    from recipe.lifecycle.oom import StepOutOfMemory  # import cost: pulls in torch

    console = Console(stderr=True)
    try:  # the JSON parsed once, before the process group is up: every rank names a bad file, key or section
        sections = load_sections(args.ds_config)
    except ConfigError as exc:
        if os.environ.get("RECIPE_DEBUG"):
            raise
        console.print(f"[bold red]error[/bold red] (rank {launch_rank()}): {escape(str(exc))}")
        return 2
    try:
        device, owns_group = init_distributed(group_timeout(args.hang_timeout_minutes))
    except ValueError as exc:  # the launcher's variables do not describe a world (recipe.lifecycle.distributed)
        if os.environ.get("RECIPE_DEBUG"):
            raise
        console.print(f"[bold red]error[/bold red]: {escape(str(exc))}")
        return 2
    # one stop request for the whole run (the loop's shares it): signals during set-up count, the launcher's death
    # counts (watch_launcher), a forced exit still unlinks the /dev/shm buffer, and signals while closing are ignored
    stop = StopRequest(watch_launcher=True, on_abort=release_shm_buffer).__enter__()
    finished = False  # every rank returned from training (then they all reach the barrier before the teardown)
    try:
        code = _train(args, sections, device, console, stop)
        finished = True
        return code
    except (ValueError, KeyError, OSError, CheckpointError, StepOutOfMemory, CompileError) as exc:
        if os.environ.get("RECIPE_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        console.print(f"[bold red]error[/bold red] (rank {dist.get_rank()}): {escape(str(message))}")
        return EXIT_WRITE_FAILED if isinstance(exc, WriteError) else 2
    finally:
        stop.closing()
        if owns_group and dist.is_initialized():
            close_process_group(device, barrier=finished)
        release_shm_buffer()
        stop.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
