"""Micro-batch building: offline under CP a rank reads only its rows of the store, and its TTT batch equals the
zigzag shard of the single-rank batch exactly."""
from __future__ import annotations


import pytest
import torch

from recipe.data.store import FIELDS, HiddenStateStore
from recipe.data.vocab import VocabMap
from recipe.parallel.cp_shard import shard_ttt_batch
from recipe.parallel.dims import ParallelDims
from recipe.train.batches import BatchBuilder


class CountingStore(HiddenStateStore):
    """Records the rows read per field."""

    def __init__(self, path):
        super().__init__(path)
        self.reads: list[tuple[str, int]] = []

    def get(self, i, rows=None, fields=FIELDS):
        out = super().get(i, rows=rows, fields=fields)
        self.reads += [(f, out[f].shape[0]) for f in fields]
        return out


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_rank_reads_only_its_rows_and_equals_the_shard(tiny_target_and_store, cp):
    _, store_dir = tiny_target_and_store
    vocab = VocabMap.from_draft_ids(torch.arange(0, 96, 2), 96)
    K, divisor = 3, 2 * cp

    def builder(store, cp_size, cp_rank):
        return BatchBuilder(store=store, t2d=vocab.t2d, ttt_steps=K, seq_divisor=divisor,
                            dims=ParallelDims(cp_size, cp=cp_size), cp_rank=cp_rank)

    full = builder(HiddenStateStore(store_dir), 1, 0).build([0, 3, 5]).ttt
    seq = full.input_ids_KBS.shape[-1]
    rows_read = 0
    for rank in range(cp):
        store = CountingStore(store_dir)
        local = builder(store, cp, rank).build([0, 3, 5]).ttt
        expected = shard_ttt_batch(full, cp, rank)
        assert local.call_extent is None and expected.call_extent is None
        for name in local.tensor_fields():
            assert torch.equal(getattr(local, name), getattr(expected, name)), (rank, name)
        aux_rows = sum(n for f, n in store.reads if f == "aux_hidden")
        assert aux_rows <= 3 * seq // cp  # its zigzag positions only
        rows_read += aux_rows
    lengths = HiddenStateStore(store_dir).lengths
    assert rows_read == sum(lengths[i] for i in (0, 3, 5))  # every real aux row read exactly once over the cp ranks


def test_a_seq_divisor_that_the_zigzag_chunks_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"seq_divisor=6 is not a multiple of 2·cp = 4"):
        BatchBuilder(store=object(), t2d=torch.ones(4, dtype=torch.bool), ttt_steps=1, seq_divisor=6,
                     dims=ParallelDims(2, cp=2))
    with pytest.raises(ValueError, match=r"seq_divisor=3 is not a multiple of 2·cp = 2"):
        BatchBuilder(store=object(), t2d=torch.ones(4, dtype=torch.bool), ttt_steps=1, seq_divisor=3)
