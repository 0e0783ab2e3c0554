"""Train an EAGLE-3 draft with DeepSpeed: parse, build, train, export; the process group is closed either way.

    deepspeed --num_gpus N run.py --ds_config ds_configs/zero3.json --target DIR --data FILE --output DIR ...
    torchrun --nproc_per_node N run.py ...      python run.py ...   (one process)

`python run.py --help` lists every flag; README.md has the launcher recipes (CPU, several machines).
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from recipe.config import parse_args

    args = parse_args(argv)

    import torch.distributed as dist
    from rich.console import Console

    from recipe.train.distributed import init_distributed

    console = Console(stderr=True)
    device, owns_group = init_distributed()
    try:
        from recipe.train.loop import Trainer, plan_summary
        from recipe.train.setup import build_run, write_resolved_config

        parts = build_run(args, device, console)
        write_resolved_config(args, parts)
        if dist.get_rank() == 0:
            console.print(plan_summary(parts))
        Trainer(args, parts, console).train()
        return 0
    except (ValueError, FileNotFoundError, KeyError) as exc:
        if os.environ.get("RECIPE_DEBUG"):
            raise
        console.print(f"[bold red]error[/bold red] (rank {dist.get_rank()}): {exc}")
        return 2
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
