"""``--position-offset-max N`` (anchor-offset positions): the draft's position ids keep the first 4 (sinks) and shift
the rest by one offset in [0, N] per sample, drawn from the seed and the sample's index; the batch builder puts them
(and their host copies, every cp rank's) in the TTT batch and changes nothing else; N = 0 is bitwise today's batch;
training with it on gives the single-process curve under tp = 2 (ZeRO-3) and cp = 2 (ZeRO-1)."""
from __future__ import annotations

import pytest
import torch
from helpers.drafts import make_export
from helpers.ranks import run_ranks
from helpers.training import assert_curves_close, run_training, train_argv, write_ds_config
from helpers.tolerance import FP32_CURVE

from kernels.host_positions import host_copies
from recipe.data.store import HiddenStateStore
from recipe.parallel.cp_shard import zigzag_split
from recipe.parallel.dims import ParallelDims
from recipe.train.batches import BatchBuilder
from recipe.train.positions import SINK_POSITIONS, anchor_offset_positions


def test_positions_as_specified():
    pos = anchor_offset_positions([5, 7, 5, 9], 12, 100, seed=3)
    assert pos.dtype == torch.int64 and pos.shape == (4, 12)
    for row in pos:
        assert torch.equal(row[:SINK_POSITIONS], torch.arange(SINK_POSITIONS))  # sinks kept
        offset = int(row[SINK_POSITIONS] - SINK_POSITIONS)
        assert 0 <= offset <= 100
        assert torch.equal(row[SINK_POSITIONS:], torch.arange(SINK_POSITIONS, 12) + offset)  # one shift per sample
    assert torch.equal(pos[0], pos[2])  # the same sample, the same offset
    assert torch.equal(pos, anchor_offset_positions([5, 7, 5, 9], 12, 100, seed=3))  # deterministic
    many = anchor_offset_positions(list(range(400)), 6, 100, seed=0)[:, -1] - 5
    assert many.min() == 0 and many.max() == 100 and len(set(many.tolist())) > 90  # uniform over [0, 100]
    other_seed = anchor_offset_positions(list(range(400)), 6, 100, seed=1)[:, -1] - 5
    assert not torch.equal(many, other_seed)
    assert torch.equal(anchor_offset_positions([1, 2], 7, 0, seed=3), torch.arange(7).repeat(2, 1))
    with pytest.raises(ValueError, match="must be >= 0"):
        anchor_offset_positions([1], 4, -1, seed=0)


def _builder(store, t2d, cp=1, rank=0, offset_max=None):
    kw = {} if offset_max is None else {"position_offset_max": offset_max, "seed": 0}
    return BatchBuilder(store=HiddenStateStore(store), t2d=t2d, ttt_steps=3, seq_divisor=2 * cp,
                        dims=ParallelDims(cp, cp=cp), cp_rank=rank, **kw)


@pytest.mark.parametrize("cp", [1, 2])
def test_builder_puts_the_offsets_in_and_changes_nothing_else(tiny_target_and_store, cp):
    _, store = tiny_target_and_store
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[:64] = True
    indices = [3, 11, 17, 0]
    for rank in range(cp):
        plain = _builder(store, t2d, cp, rank).build(indices).ttt
        zero = _builder(store, t2d, cp, rank, offset_max=0).build(indices).ttt
        shifted = _builder(store, t2d, cp, rank, offset_max=500).build(indices).ttt
        full = anchor_offset_positions(indices, plain.position_ids_BS.shape[1] * cp, 500, seed=0)
        parts = [zigzag_split(full, cp, r, 1) for r in range(cp)] if cp > 1 else [full]
        assert torch.equal(shifted.position_ids_BS, parts[rank])
        assert not torch.equal(shifted.position_ids_BS, plain.position_ids_BS)
        copies = host_copies(shifted.position_ids_BS)  # what the attention decides its tile pairs from
        assert copies is not None and all(torch.equal(a, b) for a, b in zip(copies.per_rank, parts))
        assert zero.call_extent == plain.call_extent == shifted.call_extent
        for name in plain.tensor_fields():
            assert torch.equal(getattr(zero, name), getattr(plain, name)), name  # N = 0: bitwise today's batch
            if name != "position_ids_BS":
                assert torch.equal(getattr(shifted, name), getattr(plain, name)), name


STEPS, OFFSET = 3, 1000


@pytest.fixture(scope="module")
def curves(tiny_target_and_store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("position_offsets")
    target, store = tiny_target_and_store
    export = make_export(target, tmp / "export")  # a draft whose attention is far from uniform: the offsets show

    def argv(name, base, offset, *extra):
        cfg = write_ds_config(tmp / f"{name}.json", base=base, train_batch_size=4, train_micro_batch_size_per_gpu=4)
        return train_argv(cfg, target, store, tmp / name, "--max-steps", str(STEPS), "--no-export", "--init-draft",
                          str(export), "--position-offset-max", str(offset), *extra)

    single = [argv("tp1", "zero0.json", OFFSET), argv("tp1-0", "zero0.json", 0),
              argv("tp1-none", "zero0.json", 0)[:-2]]
    pair = [argv("tp2", "zero3_tp2.json", OFFSET), argv("cp2", "zero1.json", OFFSET, "--cp-size", "2")]
    out = dict(zip(("tp1", "tp1-0", "tp1-none"), run_ranks(1, run_training, single)[0]))
    out.update(zip(("tp2", "cp2"), run_ranks(2, run_training, pair)[0]))
    return out


@pytest.mark.slow
def test_offsets_train_the_same_curve_under_tp2_and_cp2(curves):
    assert_curves_close(curves["tp1"], curves["tp2"], FP32_CURVE, "tp2-zero3 offsets")
    assert_curves_close(curves["tp1"], curves["cp2"], FP32_CURVE, "cp2-zero1 offsets")
    # the option changes training (the sinks' distances grow) and 0 is exactly the run without the flag
    assert abs(curves["tp1"][0]["loss"] - curves["tp1-0"][0]["loss"]) > 1e-6 * curves["tp1-0"][0]["loss"]
    keys = ("loss", "loss_k", "acc", "grad_norm", "valid")
    assert [{k: r[k] for k in keys} for r in curves["tp1-0"]] == [{k: r[k] for k in keys} for r in curves["tp1-none"]]


def test_resume_with_another_offset_is_refused(tmp_path):
    from recipe.lifecycle.resume_checks import check_compatible

    check_compatible({}, {"position_offset_max": 0}, tmp_path, keys=("position_offset_max",))  # older checkpoint
    with pytest.raises(ValueError, match="position_offset_max: checkpoint 0, now 1000"):
        check_compatible({}, {"position_offset_max": 1000}, tmp_path, keys=("position_offset_max",))
