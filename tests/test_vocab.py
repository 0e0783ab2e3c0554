import pytest
import torch
from datasets import Dataset
from safetensors.torch import save_file

from recipe.data.vocab import VocabMap, build_vocab_map, select_draft_ids, supervised_token_counts, vocab_stats

V = 12


def _dataset(rows):
    return Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]})


# Supervised counts: id 7 ×3, id 2 ×2, id 9 ×2, id 5 ×1, id 1 ×1. Id 11 appears 4 times but never supervised.
ROWS = [
    ([11, 11, 7, 7, 2, 9], [0, 0, 1, 1, 1, 1]),
    ([11, 7, 2, 9, 5, 1, 11], [0, 1, 1, 1, 1, 1, 0]),
]


def test_most_frequent_ids_ties_by_smaller_id_sorted_by_id():
    vocab = build_vocab_map(_dataset(ROWS), V, 4)
    # Top 4 by count: 7 (3), 2 (2), 9 (2), then 1 and 5 tie at 1 -> 1 wins; sorted by id.
    assert vocab.draft_ids.tolist() == [1, 2, 7, 9]
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [1, 1, 5, 6]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.nonzero().flatten().tolist() == [1, 2, 7, 9]
    counts, _ = supervised_token_counts(_dataset(ROWS), V)
    assert counts.tolist() == [0, 1, 2, 0, 0, 1, 0, 3, 0, 2, 0, 0]
    assert vocab_stats(vocab, counts) == {"draft_vocab_size": 4, "distinct_supervised_ids": 5,
                                          "filled_unseen_ids": 0, "supervised_tokens": 9, "coverage": 8 / 9}


def test_fewer_distinct_tokens_than_vd_fill_with_smallest_unused_ids():
    vocab = build_vocab_map(_dataset(ROWS), V, 8)
    # The 5 seen ids {1, 2, 5, 7, 9} plus the smallest unused ids 0, 3, 4.
    assert vocab.draft_ids.tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert build_vocab_map(_dataset(ROWS), V, V).draft_ids.tolist() == list(range(V))
    assert select_draft_ids(torch.zeros(5, dtype=torch.int64).numpy(), 2).tolist() == [0, 1]


def test_save_load_roundtrip(tmp_path):
    vocab = build_vocab_map(_dataset(ROWS), V, 4)
    vocab.save(tmp_path / "vocab.safetensors")
    loaded = VocabMap.load(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert (loaded.draft_vocab_size, loaded.target_vocab_size) == (4, V)


@pytest.mark.parametrize("tensors, message", [
    ({"d2t": torch.tensor([1, 1, 5, 6]), "t2d": torch.zeros(V, dtype=torch.bool)}, "t2d marks 0 ids"),
    ({"d2t": torch.tensor([1, 1], dtype=torch.int32), "t2d": torch.ones(V, dtype=torch.bool)}, "1-D int64"),
    ({"d2t": torch.tensor([1, 1]), "t2d": torch.ones(V, dtype=torch.uint8)}, "1-D bool"),
    ({"d2t": torch.tensor([3, 1]), "t2d": torch.ones(V, dtype=torch.bool)}, "strictly increasing"),
    ({"d2t": torch.tensor([11, 11]), "t2d": torch.ones(V, dtype=torch.bool)}, "strictly increasing"),
    ({"d2t": torch.tensor([1])}, "lacks"),
])
def test_load_rejects_inconsistent_maps_naming_the_file(tmp_path, tensors, message):
    path = tmp_path / "bad_vocab.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=message) as err:
        VocabMap.load(path)
    assert str(path) in str(err.value)


def test_load_unreadable_file_names_it(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read vocabulary map") as err:
        VocabMap.load(path)
    assert str(path) in str(err.value)


def test_cache_is_keyed_by_token_data_and_vd(tmp_path):
    cache = tmp_path / "cache"
    first = build_vocab_map(_dataset(ROWS), V, 4, cache_dir=cache)
    cached = sorted(cache.iterdir())
    assert len(cached) == 1
    # A different Dataset object with the same content reuses the file; prove it by planting a different map there.
    VocabMap.from_draft_ids([0, 3, 4, 6], V).save(cached[0])
    assert build_vocab_map(_dataset(ROWS), V, 4, cache_dir=cache).draft_ids.tolist() == [0, 3, 4, 6]
    assert first.draft_ids.tolist() == [1, 2, 7, 9]
    # Other Vd, or the same ids with another loss mask: new entries.
    build_vocab_map(_dataset(ROWS), V, 5, cache_dir=cache)
    remasked = [(ids, [1] * len(ids)) for ids, _ in ROWS]
    assert 11 in build_vocab_map(_dataset(remasked), V, 4, cache_dir=cache).draft_ids.tolist()
    assert len(list(cache.iterdir())) == 3


@pytest.mark.parametrize("draft_vocab_size", [0, -1, V + 1])
def test_bad_draft_vocab_size(draft_vocab_size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(_dataset(ROWS), V, draft_vocab_size)


def test_token_outside_target_vocab():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab_map(_dataset([([1, V], [1, 1])]), V, 2)


def test_target_argmax_coverage_and_report():
    from recipe.data.vocab import target_argmax_coverage, vocab_coverage_report

    vocab = build_vocab_map(_dataset(ROWS), V, 4)  # draft ids 1, 2, 7, 9
    # argmax at q predicts token q+1: counted where loss_mask[q+1] == 1 -> q = 1, 2, 3 (argmax 7, 11, 2)
    samples = [(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([5, 7, 11, 2, 9]))]
    cov = target_argmax_coverage(samples, vocab.t2d)
    assert cov == {"predictions": 3, "in_draft_vocab": 2, "argmax_coverage": 2 / 3}
    assert target_argmax_coverage([], vocab.t2d)["argmax_coverage"] == 0.0

    class Store:  # the two fields of a HiddenStateStore the report reads
        def __len__(self):
            return 2

        def get(self, i, fields):
            assert fields == ("loss_mask", "target_argmax")
            return {"loss_mask": samples[0][0], "target_argmax": samples[0][1] if i == 0 else torch.full((5,), 9)}

    line = vocab_coverage_report(_dataset(ROWS), vocab, Store())
    # supervised tokens: 7 x3, 2 x2, 9 x2, 5, 1 -> the map covers 8 of 9; argmax: 2 of 3, then 3 of 3 -> 5 of 6
    assert "4 ids cover 88.9% of the 9 supervised tokens (5 distinct ids, 0 filled unseen)" in line
    assert "83.3% of the target's 6 argmax tokens" in line
    assert "argmax" not in vocab_coverage_report(_dataset(ROWS), vocab)
