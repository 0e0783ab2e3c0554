"""The layout-free training state survives every DeepSpeed optimizer wrapper exactly, in bf16 (tiny target, 2 gloo
ranks): a checkpoint written by one wrapper, resumed on another layout (``recipe.lifecycle.reshard.restore``) and
gathered again (``recipe.lifecycle.reshard.gather``) gives back the saved fp32 masters and both Adam moments bit for bit,
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
    from recipe.lifecycle import reshard
    from recipe.train.flags import parse_args
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


def test_a_run_without_adam_saves_no_layout_free_state_and_says_so(tiny_target_and_store, tmp_path):
    """torch's SGD (DeepSpeed builds any ``torch.optim`` class named in the JSON): every checkpoint is complete for
    its own layout, has no train_state.safetensors, the run says once why, and a resume on another layout is refused
    naming the checkpoint's layout."""
    from helpers.faults import Job, run_jobs
    from recipe.lifecycle.reshard import TRAIN_STATE_FILE

    target, store = tiny_target_and_store
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    cfg = write_ds_config(tmp_path / "sgd.json", base="zero1.json", train_batch_size=4, optimizer=sgd,
                          zero_allow_untested_optimizer=True, parallelism=None)
    argv = train_argv(cfg, target, store, tmp_path / "run", "--epochs", "2", "--no-export", "--max-steps", "2",
                      "--save-every", "1")
    other = train_argv(cfg, target, store, tmp_path / "run", "--epochs", "2", "--no-export", "--max-steps", "2",
                       "--resume", "--cp-size", "2")
    trained, refused = run_ranks(2, run_jobs, [Job(argv), Job(other)])[0]
    assert trained.rc == 0, trained.stderr[-3000:]
    text = " ".join(trained.stderr.split())
    assert text.count("note: checkpoints resume on this layout only: the optimizer is SGD") == 1
    for step in (1, 2):
        folder = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
        assert (folder / "manifest.json").is_file() and not (folder / TRAIN_STATE_FILE).exists()
    assert refused.rc == 2
    text = " ".join(refused.stderr.split())
    assert "cannot resume from" in text and "on another layout: it has no train_state.safetensors" in text
    assert "resume it on its own layout, tp1 cp1 dp2 ZeRO-1 float32 (2 ranks)" in text


def test_zero3_partitions_that_do_not_divide_a_parameter_are_restored_exactly(tiny_target_and_store, tmp_path):
    """A ZeRO-1 dp2 bf16 checkpoint resumed at ZeRO-3 on 3 ranks: the tiny draft's 32-wide norms and most of its
    matrices do not split in 3, so ZeRO-3 pads their partitions (DeepSpeed's ``safe_set_full_*`` would read past the
    end on the last rank); the state gathered again equals the saved one bit for bit."""
    target, store = tiny_target_and_store

    def argv(name, base, *extra):
        cfg = write_ds_config(tmp_path / f"{name}.json", base=base, train_batch_size=6, parallelism=None)
        return train_argv(cfg, target, store, tmp_path / "run", "--epochs", "2", "--no-export", "--max-steps",
                          str(STEPS), *extra)

    run_ranks(2, _roundtrips, {"z1dp2": argv("z1dp2", "zero1_bf16.json")}, [])
    (line, differ, meta_differ, count), = run_ranks(3, _roundtrips, {}, [
        ("z1dp2", argv("z3dp3", "zero3_bf16.json", "--resume"))])[0]
    assert line is not None and "checkpoint on tp1 cp1 dp3 ZeRO-3" in line
    assert (differ, meta_differ, count) == ([], [], 3 * 13)
