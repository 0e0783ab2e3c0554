"""Zigzag CP sharding: indices, exact split/unsplit, padding, TTT-batch sharding with target-row remapping."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from recipe.model.ttt import TTTBatch
from helpers.tp_reference import pad_to_multiple, zigzag_unsplit
from recipe.parallel.cp_shard import contiguous_indices, shard_ttt_batch, zigzag_indices, zigzag_split


def test_zigzag_indices_cp2_s8():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_zigzag_indices_cover_sequence_once():
    for cp in (1, 2, 3, 4):
        all_idx = torch.cat([zigzag_indices(24, cp, r) for r in range(cp)])
        assert torch.equal(all_idx.sort().values, torch.arange(24))
        assert zigzag_indices(24, cp, 0).dtype == torch.int64


def test_contiguous_indices():
    assert contiguous_indices(8, 2, 1).tolist() == [4, 5, 6, 7]


def test_bad_lengths_and_ranks_raise():
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        zigzag_indices(6, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match="3 shards"):
        zigzag_unsplit([torch.zeros(4)] * 3, 2, 0)


def test_split_unsplit_exact():
    x = torch.randn(3, 16, 5)
    for cp in (1, 2, 4):
        shards = [zigzag_split(x, cp, r, dim=1) for r in range(cp)]
        assert all(s.shape == (3, 16 // cp, 5) for s in shards)
        assert torch.equal(shards[0][:, : 16 // (2 * cp)], x[:, : 16 // (2 * cp)])
        assert torch.equal(zigzag_unsplit(shards, cp, dim=1), x)
    y = torch.arange(8)
    assert torch.equal(zigzag_split(y, 2, 1, dim=-1), torch.tensor([2, 3, 4, 5]))


def test_one_rank_split_is_the_identity_but_the_batch_shard_compacts_target_rows():
    """What lets ``BatchBuilder`` split its [B, S] and [K, B, S] tensors without asking whether cp > 1 (one rank's
    ``zigzag_split`` of an even length returns every value in place), and why it still asks before
    ``shard_ttt_batch`` (which keeps only the label rows of the target's hidden states, even of one rank)."""
    x = torch.randn(3, 16, 5)
    for dim in range(3):
        if x.shape[dim] % 2 == 0:
            assert torch.equal(zigzag_split(x, 1, 0, dim), x)
    valid = torch.rand(3, 2, 16) > 0.5
    assert torch.equal(zigzag_split(valid, 1, 0, 2), valid)
    batch = _batch()
    one = shard_ttt_batch(batch, 1, 0)
    assert torch.equal(one.aux_hidden_BSA, batch.aux_hidden_BSA)
    assert one.target_hidden_BLH.shape[1] == 15 < batch.target_hidden_BLH.shape[1]  # row 0 is no step's label


def test_pad_to_multiple():
    x = torch.arange(6).view(2, 3)
    p = pad_to_multiple(x, 4, dim=1, value=-1)
    assert torch.equal(p, torch.tensor([[0, 1, 2, -1], [3, 4, 5, -1]]))
    assert pad_to_multiple(x, 3, dim=1) is x
    b = pad_to_multiple(torch.ones(2, 3, dtype=torch.bool), 4, dim=-1, value=False)
    assert b.dtype == torch.bool and b.tolist() == [[True, True, True, False]] * 2
    assert pad_to_multiple(torch.zeros(5, 2), 4, dim=0).shape == (8, 2)


def _batch(k=3, b=2, s=16, a=6, h=5):
    p = torch.arange(s)
    return TTTBatch(
        input_ids_KBS=torch.randint(0, 100, (k, b, s)), valid_KBS=torch.rand(k, b, s) > 0.3,
        position_ids_BS=p.expand(b, s).clone(), key_valid_BS=torch.rand(b, s) > 0.2,
        aux_hidden_BSA=torch.randn(b, s, a), target_hidden_BLH=torch.randn(b, s, h),
        target_row_KS=torch.stack([(p + 1 + i).clamp(max=s - 1) for i in range(k)]))


def test_shard_ttt_batch_exact_and_rows_remapped():
    batch, cp = _batch(), 4
    shards = [shard_ttt_batch(batch, cp, r) for r in range(cp)]
    for name, dim in [("input_ids_KBS", 2), ("valid_KBS", 2), ("position_ids_BS", 1), ("key_valid_BS", 1),
                      ("aux_hidden_BSA", 1)]:
        assert torch.equal(zigzag_unsplit([getattr(s, name) for s in shards], cp, dim), getattr(batch, name)), name
    for r, shard in enumerate(shards):
        assert isinstance(shard, TTTBatch) and shard.input_ids_KBS.shape == (3, 2, 4)
        mine = zigzag_indices(16, cp, r)
        want_rows_KS = batch.target_row_KS[:, mine]
        # Every (step, anchor) reads exactly the target row it read on one device.
        got_BKSH = shard.target_hidden_BLH[:, shard.target_row_KS]
        assert torch.equal(got_BKSH, batch.target_hidden_BLH[:, want_rows_KS])
        assert shard.target_hidden_BLH.shape[1] == torch.unique(want_rows_KS).numel() < 16
    # rank 0 holds chunks 0 and 7: anchors 0,1,14,15 need rows {1,2,3,4,15}
    assert shards[0].target_hidden_BLH.shape[1] == 5


def test_shard_ttt_batch_errors():
    batch = _batch()
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=6"):
        shard_ttt_batch(batch, 3, 0)
    batch.target_row_KS = batch.target_row_KS + 5
    with pytest.raises(ValueError, match="outside target_hidden_BLH's 16 rows"):
        shard_ttt_batch(batch, 2, 0)

    @dataclass
    class Extra(TTTBatch):
        mystery_BS: torch.Tensor = None

    extra = Extra(**{**_batch().__dict__, "mystery_BS": torch.zeros(2, 16)})
    with pytest.raises(ValueError, match="Extra.mystery_BS"):
        shard_ttt_batch(extra, 2, 0)

    @dataclass
    class NoRules:
        input_ids_KBS: torch.Tensor

    with pytest.raises(TypeError, match="expects a TTTBatch dataclass, got NoRules"):
        shard_ttt_batch(NoRules(torch.zeros(3, 2, 16)), 2, 0)


