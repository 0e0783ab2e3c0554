"""The ZeRO-1/2 bf16 configs (fp32 gradient accumulation: at ZeRO-1 DeepSpeed runs its BF16_Optimizer) train, save
and resume exactly on 2 gloo ranks: 6 steps straight == 3 steps + checkpoint + resume for 3, bit for bit."""
from __future__ import annotations

import json

import pytest

from helpers.faults import Job, run_jobs, same_curve
from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config

STEPS = 6


@pytest.mark.slow
def test_zero1_and_zero2_bf16_train_save_and_resume_exactly(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    jobs, names = [], []
    for base in ("zero1_bf16.json", "zero2_bf16.json"):
        shipped = json.loads((ROOT / "ds_configs" / base).read_text())
        assert shipped["data_types"] == {"grad_accum_dtype": "fp32"} and shipped["communication_data_type"] == "fp32"
        cfg = write_ds_config(tmp_path / base, base=base, train_batch_size=4)

        def argv(name, *extra, cfg=cfg):
            return train_argv(cfg, target, store, tmp_path / name, "--max-steps", str(STEPS), "--epochs", "2",
                              "--no-export", *extra)

        stem = base.removesuffix(".json")
        jobs += [Job(argv(stem)), Job(argv(f"{stem}_cut", "--save-every", "3"), sigterm_after=3),
                 Job(argv(f"{stem}_cut", "--resume"))]
        names.append(stem)
    out = run_ranks(2, run_jobs, jobs)[0]
    for i, name in enumerate(names):
        ref, cut, res = out[3 * i:3 * i + 3]
        assert ref.rc == 0 and res.rc == 0, (name, ref.stderr[-2000:], res.stderr[-2000:])
        assert len(ref.metrics) == STEPS and ref.metrics[-1]["loss"] < ref.metrics[0]["loss"], name
        assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in ref.metrics), name
        assert [r["step"] for r in cut.metrics] == [1, 2, 3], name
        same_curve(ref.metrics, res.metrics)
