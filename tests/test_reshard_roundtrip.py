"""The layout-free training state survives every DeepSpeed optimizer wrapper exactly, in bf16 (tiny target, 2 gloo
ranks): a checkpoint written by one wrapper, resumed on another layout (``recipe.train.reshard.restore``) and
gathered again (``recipe.train.reshard.gather``) gives back the saved fp32 masters and both Adam moments bit for bit,
and the same Adam step, learning rates, scheduler state and step counters.

The wrappers, each a source and a destination once: bf16 ZeRO-0 dp2 (DeepSpeed's unfused bf16 optimizer: fp32 copies
in ``fp32_groups``), bf16 ZeRO-1 dp2 (``BF16_Optimizer``, fp32 gradient accumulation), bf16 ZeRO-2 cp2 (ZeRO's
fragments), bf16 ZeRO-3 tp2 (fp32 partitions over the flat groups, tp shards), and fp32 ZeRO-3 tp2: the same layout
in another dtype is resharded too (bf16 ZeRO-3 tp2 -> fp32 ZeRO-3 tp2 -> bf16 ZeRO-0). The fp32 curves across world
sizes are tests/test_reshard.py.
"""
from __future__ import annotations

import pytest

from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config

pytestmark = pytest.mark.slow  # DeepSpeed training on 2 ranks

STEPS = 2
# name -> (shipped bf16 config, tp, cp); each is resumed on the next one (cyclically)
LAYOUTS = {"z0dp2": ("zero0_bf16.json", 1, 1), "z1dp2": ("zero1_bf16.json", 1, 1),
           "z2cp2": ("zero2_bf16.json", 1, 2), "z3tp2": ("zero3_bf16.json", 2, 1),
           "z3tp2-fp32": ("zero3.json", 2, 1)}


def _roundtrips(rank: int, world: int, sources: dict[str, list[str]], resumes: list[tuple[str, list[str]]]) -> list:
    """``run_ranks`` worker: train every source (``run.main``), then for each (source, argv) resume the source's
    checkpoint with ``argv`` (the engine built and loaded as ``run.py`` does), gather the training state again and
    compare it on rank 0 with the checkpoint's file. Returns, per resume: (the run-plan's resharding line,
    differing tensor names, differing metadata keys, number of tensors compared)."""
    import sys

    import torch
    from rich.console import Console

    sys.path.insert(0, str(ROOT))
    from recipe.cli import parse_args
    from recipe.train import reshard
    from recipe.train.loop import Trainer, TrainSettings
    from recipe.train.setup import build_run
    from run import main

    for argv in sources.values():
        assert main(argv) == 0, argv
    out = []
    console = Console(stderr=True)
    for source, argv in resumes:
        args = parse_args(argv)
        parts = build_run(args, torch.device("cpu"), console)
        trainer = Trainer(TrainSettings.from_args(args), parts, console)
        tensors, meta = reshard.gather(trainer.engine, trainer.pstate.tp_group)
        if rank != 0:
            continue
        saved, saved_meta = reshard.read(parts.resume_from)
        differ = sorted(k for k in saved.keys() | tensors.keys()
                        if k not in tensors or k not in saved or not torch.equal(saved[k], tensors[k]))
        meta_differ = sorted(k for k in saved_meta if saved_meta[k] != meta.get(k))
        out.append((parts.resharding, differ, meta_differ, len(saved)))
    return out


def test_every_wrapper_restores_and_gathers_the_saved_state_exactly(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store

    def argv(name, layout, output, *extra):
        base, tp, cp = LAYOUTS[layout]
        cfg = write_ds_config(tmp_path / f"{name}.json", base=base, train_batch_size=4, parallelism=None)
        return train_argv(cfg, target, store, output, "--tp-size", str(tp), "--cp-size", str(cp), "--epochs", "2",
                          "--no-export", *extra)

    names = list(LAYOUTS)
    sources = {name: argv(name, name, tmp_path / name, "--max-steps", str(STEPS)) for name in names}
    # each destination resumes the source's folder (the engine is only built and loaded, no step is taken)
    resumes = [(name, argv(f"{name}-on-{dest}", dest, tmp_path / name, "--max-steps", str(STEPS), "--resume"))
               for name, dest in zip(names, names[1:] + names[:1])]
    results = run_ranks(2, _roundtrips, sources, resumes)[0]
    assert len(results) == len(names)
    for (name, _), dest, (line, differ, meta_differ, count) in zip(resumes, names[1:] + names[:1], results):
        assert line is not None and "resharding" in line, (name, dest, line)
        # the draft's 13 trainable tensors (fc, 3 norms of the midlayer, q/k/v/o, gate/up/down, norm, lm_head) x 3
        assert count == 3 * 13, (name, count)
        assert differ == [], f"{name} -> {dest}: {differ}"
        assert meta_differ == [], f"{name} -> {dest}: {meta_differ}"
