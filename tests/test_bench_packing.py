"""``python -m recipe.bench step --packing`` (``recipe.bench.packing``) without timing anything: the padded and the
packed batch of one mix hold the same samples (tokens, supervision, hidden states at each sample's positions), the
summary's ratios, and the step benchmark's flags."""
from __future__ import annotations

import pytest
import torch

from recipe.bench.packing import draw_mixes, layout_batch, packing_table, summarise
from recipe.bench.step import build_parser
from recipe.data.packing import packed_layout, padded_layout

SPEC = {"vocab": 50, "target_hidden": 4, "ttt_steps": 2, "dtype": "fp32"}


def test_padded_and_packed_batches_hold_the_same_samples():
    lengths = [7, 3, 5]
    padded, packed = padded_layout(lengths, 2), packed_layout(lengths, sum(lengths), 2)
    a, b = layout_batch(padded, lengths, SPEC, "cpu"), layout_batch(packed, lengths, SPEC, "cpu")
    assert packed.rows == 1 and packed.seq == 16 and padded.rows == 3 and padded.seq == 8
    for p, q in zip(sorted(padded.placements, key=lambda x: x.slot), sorted(packed.placements, key=lambda x: x.slot)):
        rows_a, rows_b = slice(p.offset, p.offset + p.length), slice(q.offset, q.offset + q.length)
        assert torch.equal(a.aux_hidden_BSA[p.row, rows_a], b.aux_hidden_BSA[q.row, rows_b])
        assert torch.equal(a.key_valid_BS[p.row, rows_a], b.key_valid_BS[q.row, rows_b])
        # step 0 reads the next token inside the sample; past its end the input is 0 in both layouts
        assert torch.equal(a.input_ids_KBS[0, p.row, rows_a], b.input_ids_KBS[0, q.row, rows_b])
    assert a.valid_KBS.sum() == b.valid_KBS.sum() and int(b.key_valid_BS.sum()) == sum(lengths)


def test_summary_ratios_and_table():
    rows = [{"mix": 0, "packed": packed, "sparse": False, "status": "ok", "seconds": s, "shape": shape,
             "padding_share": share, "peak_bytes": 1 << 30}
            for packed, s, shape, share in ((False, 10.0, [2, 8], 0.25), (True, 6.0, [1, 12], 0.0),
                                            (False, 12.0, [2, 8], 0.25), (True, 7.0, [1, 12], 0.0))]
    summary = summarise(rows, [[8, 4]])
    assert summary[0]["padded"]["seconds"] == 11.0 and summary[0]["packed"]["seconds"] == 6.5
    assert summary[0]["packed_vs_padded"] == pytest.approx(6.5 / 11.0)
    assert summary[0]["positions_packed_vs_padded"] == 12 / 16
    assert summary[1] == {"mix": "all", "sparse": False, "padded_seconds": 11.0, "packed_seconds": 6.5,
                          "packed_vs_padded": pytest.approx(6.5 / 11.0), "positions_packed_vs_padded": 12 / 16,
                          "padding_share": 0.25}
    config = {"micro_batch": 2, "max_length": 8, "hidden": 4, "draft_vocab": 8, "ttt_steps": 2, "dtype": "fp32",
              "backend": "sdpa", "device": "cpu"}
    assert packing_table({"config": config, "summary": summary}).row_count == 2
    assert draw_mixes([1, 2, 3, 4, 5], 2, 3, seed=0) == draw_mixes([1, 2, 3, 4, 5], 2, 3, seed=0)
    assert [len(m) for m in draw_mixes([1, 2, 3, 4, 5], 2, 3, seed=0)] == [2, 2, 2]


def test_step_packing_flags():
    args = build_parser().parse_args(["--packing", "--micro-batch", "8", "--max-length", "2k", "--mixes", "2"])
    assert (args.packing, args.micro_batch, args.max_length, args.mixes, args.packing_tokens) == (True, 8, 2048, 2,
                                                                                                   None)
