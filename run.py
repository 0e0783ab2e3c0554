"""Train an EAGLE-3 draft with DeepSpeed: parse, build, train, export; the process group is closed either way.

    deepspeed --num_gpus N run.py --ds_config ds_configs/zero3.json --target DIR --data FILE --output DIR ...
    torchrun --nproc_per_node N run.py ...      python run.py ...   (one process)

`python run.py --help` lists every flag; README.md has the launcher recipes (CPU, several machines).

Exit codes: 0 finished; 2 bad input or configuration (``error (rank N): ...`` names the file, line or field, no
traceback; argparse errors also exit 2), or a step out of accelerator memory (the message names the step, the
length, the rank's memory and the switches to try, ``recipe.train.oom``); 75
(``recipe.train.signals.EXIT_INTERRUPTED``) interrupted by SIGTERM/SIGINT after a checkpoint of the last completed
step was saved (continue with ``--resume``); 128+signum when a second signal forced an immediate exit.
``RECIPE_DEBUG=1`` re-raises errors with their traceback.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def check_output_writable(output: Path) -> None:
    """Create ``output`` and probe it with a temporary file; ValueError naming the folder when that fails."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"--output {output}: not a writable folder ({exc.strerror or exc})") from None


def main(argv: list[str] | None = None) -> int:
    from recipe.cli import parse_args

    args = parse_args(argv)

    import torch.distributed as dist
    from rich.console import Console
    from rich.markup import escape

    from recipe.train.checkpoint import CheckpointError
    from recipe.train.distributed import init_distributed, release_shm_buffer
    from recipe.train.oom import StepOutOfMemory

    console = Console(stderr=True)
    device, owns_group = init_distributed()
    try:
        from recipe.train.loop import Trainer, TrainSettings, plan_summary
        from recipe.train.setup import build_run, write_resolved_config

        check_output_writable(args.output)
        parts = build_run(args, device, console)
        write_resolved_config(args, parts)
        if dist.get_rank() == 0:
            console.print(plan_summary(parts))
        return Trainer(TrainSettings.from_args(args), parts, console).train()
    except (ValueError, KeyError, OSError, CheckpointError, StepOutOfMemory) as exc:
        if os.environ.get("RECIPE_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        console.print(f"[bold red]error[/bold red] (rank {dist.get_rank()}): {escape(str(message))}")
        return 2
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
        release_shm_buffer()


if __name__ == "__main__":
    sys.exit(main())
