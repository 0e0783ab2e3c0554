"""recipe.data.store / store_writer / recipe.dump: round trip, row slicing, resume, 2-rank dump, validation."""
import json
import os

import pytest
import torch
from datasets import Dataset
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_REORDERED, assert_close_rel
from safetensors.torch import load_file, save_file

from recipe.data.store import HiddenStateStore, StoreError, StoreMeta, write_json_atomic
from recipe.data.store_writer import ShardPlan, StoreWriter, shard_plan
from recipe.dump import dump_hidden_states
from recipe.parallel.collectives import Collectives
from recipe.target.capture import TargetModel
from recipe.target.head import validity_rows

H = 32
LENGTHS = [5, 12, 3, 9, 9, 7, 11, 4, 6, 10]


def make_dataset(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "row": list(range(len(lengths)))})


@pytest.fixture(scope="module")
def target(tiny_target):
    return TargetModel(tiny_target, device="cpu")


@pytest.fixture(scope="module")
def dataset():
    return make_dataset()


class CountingTarget:
    """Delegates to a TargetModel, counting capture calls; raises after ``fail_after`` calls when set."""

    def __init__(self, target, fail_after=None):
        self.target, self.calls, self.fail_after = target, 0, fail_after

    def capture(self, *args, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("simulated crash")
        self.calls += 1
        return self.target.capture(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


def dump(target, dataset, out, **kw):
    kw = {"max_length": 16, "batch_size": 2, "shard_size": 3, **kw}
    return dump_hidden_states(target, dataset, out, **kw)


def test_shard_plan_covers_rank_samples_longest_first():
    plans = shard_plan(LENGTHS, rank=1, world_size=2, shard_size_samples=2)
    assert plans == [ShardPlan(0, (1, 9)), ShardPlan(1, (3, 5)), ShardPlan(2, (7,))]  # lengths 12, 10, 9, 7, 4
    with pytest.raises(ValueError, match="shard_size_samples"):
        shard_plan(LENGTHS, 0, 1, 0)


def test_writer_round_trip_exact(tmp_path):
    meta = StoreMeta("t", "f" * 16, H, [1, 3, 4], "bf16", 16, "d" * 16, 2)
    torch.manual_seed(0)
    samples = {i: {"input_ids": torch.randint(0, 96, (n,)), "loss_mask": torch.randint(0, 2, (n,)),
                   "target_argmax": torch.randint(0, 96, (n,)), "aux_hidden": torch.randn(n, 3 * H),
                   "last_hidden": torch.randn(n, H)} for i, n in [(0, 4), (1, 6)]}
    writer = StoreWriter(tmp_path, meta)
    writer.write_shard(ShardPlan(0, (1, 0)), samples)
    writer.finalize()
    store = HiddenStateStore(tmp_path)
    assert len(store) == 2 and store.lengths == [4, 6] and store.aux_layer_ids == [1, 3, 4]
    for i in (0, 1):
        got = store.get(i)
        assert torch.equal(got["input_ids"], samples[i]["input_ids"]) and got["input_ids"].dtype == torch.int64
        assert torch.equal(got["loss_mask"], samples[i]["loss_mask"])
        assert torch.equal(got["target_argmax"], samples[i]["target_argmax"])
        assert got["target_argmax"].dtype == torch.int64
        assert got["aux_hidden"].dtype == torch.bfloat16
        assert torch.equal(got["aux_hidden"], samples[i]["aux_hidden"].to(torch.bfloat16))
        assert torch.equal(got["last_hidden"], samples[i]["last_hidden"].to(torch.bfloat16))
    files = list(tmp_path.glob("shard-*.safetensors"))
    assert [f.name for f in files] == ["shard-r000-00000.safetensors"]
    assert store.total_bytes == files[0].stat().st_size
    assert store.bytes_per_token == pytest.approx(store.total_bytes / 10)
    assert store.bytes_per_token > 4 + 1 + 4 + 4 * H * 2  # int32 id + uint8 mask + int32 argmax + 4·H bf16, header
    with pytest.raises(StoreError, match=r"aux_hidden has shape \(4, 96\), expected \(4, 64\)"):
        StoreWriter(tmp_path / "other", StoreMeta("t", "f", H, [1, 3], "bf16", 16, "d", 1)).write_shard(
            ShardPlan(0, (0,)), samples)


def test_dump_matches_target_and_bf16_is_cast_of_fp32(target, dataset, tmp_path):
    dump(target, dataset, tmp_path / "fp32", dtype="fp32")
    dump(target, dataset, tmp_path / "bf16", dtype="bf16")
    fp32, bf16 = HiddenStateStore(tmp_path / "fp32"), HiddenStateStore(tmp_path / "bf16")
    bf16.validate(deep=True)
    assert fp32.lengths == LENGTHS and len(fp32.shards) == 4
    for i in range(len(dataset)):
        ref = target.capture(torch.tensor([dataset[i]["input_ids"]]))
        got = fp32.get(i)
        assert got["input_ids"].tolist() == dataset[i]["input_ids"]
        assert got["loss_mask"].tolist() == dataset[i]["loss_mask"]
        assert_close_rel(got["aux_hidden"], ref.aux_hidden_BSA[0], FP32_REORDERED, f"sample {i} aux")
        assert_close_rel(got["last_hidden"], ref.last_hidden_BSH[0], FP32_REORDERED, f"sample {i} last")
        # the target's own greedy token (full CausalLM forward), computed at dump time at the rows the TTT validity
        # reads (the next token supervised), 0 elsewhere
        logits = target.model(torch.tensor([dataset[i]["input_ids"]])).logits[0]
        rows = validity_rows(torch.tensor([dataset[i]["loss_mask"]]))[0]
        assert rows.any() and not rows.all()
        assert torch.equal(got["target_argmax"][rows], logits.argmax(-1)[rows]) and not got["target_argmax"][~rows].any()
        assert torch.equal(bf16.get(i)["target_argmax"], got["target_argmax"])
        low = bf16.get(i)  # same batches in both dumps, so bf16 is exactly the cast of fp32
        assert torch.equal(low["aux_hidden"], got["aux_hidden"].to(torch.bfloat16))
        assert torch.equal(low["last_hidden"], got["last_hidden"].to(torch.bfloat16))
    assert fp32.bytes_per_token - bf16.bytes_per_token == pytest.approx(4 * H * 2, abs=2)  # 4·H values, 2 B more


def test_rows_slicing_equals_full_read(target, dataset, tmp_path):
    dump(target, dataset, tmp_path)
    store = HiddenStateStore(tmp_path)
    full = store.get(1)  # 12 tokens
    zigzag = torch.tensor([0, 1, 2, 9, 10, 11])  # cp=2 chunks 0 and 3 of 4
    for rows, expect in [(slice(3, 7), slice(3, 7)), (zigzag, zigzag), ([5], [5]), (torch.tensor([8, 2]), [8, 2])]:
        part = store.get(1, rows=rows)
        for field in full:
            assert torch.equal(part[field], full[field][expect]), (rows, field)
    assert set(store.get(1, fields=("input_ids",))) == {"input_ids"}
    with pytest.raises(ValueError, match="unknown store fields"):
        store.get(1, fields=("logits",))
    with pytest.raises(IndexError, match="sample 10 not in store"):
        store.get(10)
    view = store.subset([7, 1])
    assert len(view) == 2 and view.lengths == [4, 12]
    assert torch.equal(view.get(1)["aux_hidden"], full["aux_hidden"])


def test_resume_skips_finished_shards(target, dataset, tmp_path):
    # shards (longest first, 3 samples) hold 3, 3, 3, 1 samples = 2, 2, 2, 1 batches of 2; crash in shard 1
    crashing = CountingTarget(target, fail_after=3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dump(crashing, dataset, tmp_path)
    assert not (tmp_path / "index.json").exists()
    with pytest.raises(StoreError, match="has not finished"):
        HiddenStateStore(tmp_path)
    first = tmp_path / "shard-r000-00000.safetensors"
    mtime = first.stat().st_mtime_ns
    resumed = CountingTarget(target)
    stats = dump(resumed, dataset, tmp_path)
    assert (stats.shards_skipped, stats.shards_written) == (1, 3)
    assert resumed.calls == 5  # shards 1, 2, 3 only
    assert first.stat().st_mtime_ns == mtime
    again = CountingTarget(target)
    assert dump(again, dataset, tmp_path).shards_skipped == 4 and again.calls == 0
    dump(target, dataset, tmp_path / "fresh")
    store, fresh = HiddenStateStore(tmp_path), HiddenStateStore(tmp_path / "fresh")
    store.validate()
    for i in range(len(dataset)):
        assert all(torch.equal(store.get(i)[k], fresh.get(i)[k]) for k in fresh.get(i))


def test_resume_with_other_settings_refused(target, dataset, tmp_path):
    dump(target, dataset, tmp_path)
    with pytest.raises(StoreError, match=r"different settings \(shard_size_samples, meta.dtype\)"):
        dump(target, dataset, tmp_path, shard_size=4, dtype="fp32")
    with pytest.raises(StoreError, match="meta.data_hash"):
        dump(target, make_dataset(seed=1), tmp_path)


def _dump_rank(rank, world_size, tiny_target, lengths, out):
    target = TargetModel(tiny_target, device="cpu")
    stats = dump(target, make_dataset(lengths), out, rank=rank, world_size=world_size, dtype="fp32",
                 comm=Collectives("cpu"))
    return stats.samples_written, None if stats.index_path is None else str(stats.index_path)


@pytest.mark.slow
def test_two_rank_dump_merges_one_index(tiny_target, target, dataset, tmp_path):
    results = run_ranks(2, _dump_rank, tiny_target, LENGTHS, tmp_path / "two")
    assert [r[0] for r in results] == [5, 5] and results[1][1] is None
    assert results[0][1] == str(tmp_path / "two" / "index.json")
    store = HiddenStateStore(tmp_path / "two")
    store.validate()
    ids = [int(i) for s in store.shards for i in s["sample_ids"]]
    assert sorted(ids) == list(range(10))
    for shard in store.shards:
        assert all(shard["file"].startswith(f"shard-r{i % 2:03d}-") for i in shard["sample_ids"])
    dump(target, dataset, tmp_path / "one", dtype="fp32")
    one = HiddenStateStore(tmp_path / "one")
    for i in range(10):
        a, b = store.get(i), one.get(i)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["target_argmax"], b["target_argmax"])
        assert_close_rel(a["aux_hidden"], b["aux_hidden"], FP32_REORDERED, f"sample {i} aux")
        assert_close_rel(a["last_hidden"], b["last_hidden"], FP32_REORDERED, f"sample {i} last")


@pytest.fixture
def store_dir(target, dataset, tmp_path):
    dump(target, dataset, tmp_path)
    return tmp_path


def _rewrite_shard(store_dir, name, edit):
    """Apply ``edit`` to a shard's tensors, save it, and update the index's byte size so only ``edit`` is wrong."""
    path = store_dir / name
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    index = json.loads((store_dir / "index.json").read_text())
    next(s for s in index["shards"] if s["file"] == name)["bytes"] = path.stat().st_size
    write_json_atomic(store_dir / "index.json", index)


def test_validate_names_truncated_shard(store_dir):
    name = "shard-r000-00001.safetensors"
    data = (store_dir / name).read_bytes()
    (store_dir / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match=rf"{name}: size {len(data) // 2} bytes != indexed {len(data)}"):
        HiddenStateStore(store_dir).validate()


def test_validate_names_missing_key_and_wrong_shape(store_dir):
    store = HiddenStateStore(store_dir)
    shard = store.shards[2]
    a, b = shard["sample_ids"][:2]
    _rewrite_shard(store_dir, shard["file"], lambda t: t.pop(f"{a}.aux_hidden"))
    _rewrite_shard(store_dir, shard["file"], lambda t: t.update({f"{b}.last_hidden": t[f"{b}.last_hidden"][:-1]}))
    with pytest.raises(StoreError) as err:
        HiddenStateStore(store_dir).validate()
    assert f"{shard['file']}: missing key {a}.aux_hidden" in str(err.value)
    n = LENGTHS[b]
    assert f"{shard['file']}: key {b}.last_hidden has shape [{n - 1}, {H}] BF16, expected [{n}, {H}] BF16" in str(err.value)


def test_validate_deep_finds_non_finite(store_dir):
    shard = HiddenStateStore(store_dir).shards[0]
    i = shard["sample_ids"][0]
    _rewrite_shard(store_dir, shard["file"], lambda t: t[f"{i}.aux_hidden"].__setitem__((0, 0), float("nan")))
    HiddenStateStore(store_dir).validate()  # shallow: header is fine
    with pytest.raises(StoreError, match=rf"{shard['file']}: key {i}.aux_hidden has non-finite values"):
        HiddenStateStore(store_dir).validate(deep=True)


def test_validate_shard_count_and_coverage(store_dir):
    index = json.loads((store_dir / "index.json").read_text())
    dropped = index["shards"].pop(1)
    write_json_atomic(store_dir / "index.json", index)
    with pytest.raises(StoreError) as err:
        HiddenStateStore(store_dir).validate()
    assert "index lists 3 shards, expected num_shards=4" in str(err.value)
    assert f"shards hold {10 - len(dropped['sample_ids'])} sample ids" in str(err.value)


def test_check_compatible(store_dir, target, tiny_target, other_tiny_target):
    store = HiddenStateStore(store_dir)
    store.check_compatible(target, [1, 3, 4])
    store.check_compatible(target.fingerprint, None)
    store.check_compatible(tiny_target, [1, 3, 4])  # a path is fingerprinted from config + weights
    with pytest.raises(StoreError, match=r"aux_layer_ids \[1, 3, 4\] != requested \[1, 2, 4\]"):
        store.check_compatible(target, [1, 2, 4])
    other = TargetModel(other_tiny_target, device="cpu")
    with pytest.raises(StoreError, match="target fingerprint .* != the current target's"):
        store.check_compatible(other, [1, 3, 4])


def test_index_written_atomically(store_dir, monkeypatch):
    before = (store_dir / "index.json").read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_json_atomic(store_dir / "index.json", {"format": "half-written"})
    assert (store_dir / "index.json").read_text() == before
    assert sorted(p.name for p in store_dir.glob(".*")) == []  # the temp file is cleaned up
    assert HiddenStateStore(store_dir).fingerprint() == HiddenStateStore(store_dir).fingerprint()


def test_store_refuses_other_format(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(StoreError, match="format 'other' version 1, expected 'eagle3-hidden-store'"):
        HiddenStateStore(tmp_path)


def test_version_1_store_is_refused_naming_it_and_the_redump(store_dir):
    index = json.loads((store_dir / "index.json").read_text())
    write_json_atomic(store_dir / "index.json", {**index, "version": 1})
    with pytest.raises(StoreError) as err:
        HiddenStateStore(store_dir)
    message = str(err.value)
    assert message.startswith(f"{store_dir / 'index.json'}: written by an older version of this recipe (store "
                              "version 1, no 'target_argmax' field;")
    assert "re-create it into a new folder" in message
    assert f"python -m recipe.dump --target {index['meta']['target_path']}" in message


def test_multi_rank_finalize_needs_comm(tmp_path):
    writer = StoreWriter(tmp_path, StoreMeta("t", "f" * 16, H, [1, 3, 4], "bf16", 16, "d" * 16, 2), world_size=2)
    with pytest.raises(ValueError, match="world_size=2 needs comm"):
        writer.finalize()
