"""Packing (``data.packing``; docs/algorithm.md, "Packing"), one process: where the samples go
(``recipe.data.packing``), and a packed micro-batch against the same samples padded, in float32: loss sums and every
gradient (the aux states' too, mapped back to their samples) within ``FP32_REORDERED``, per-step correct and valid
counts exactly, with every CPU kernel (the dense block, the tiled reference, the fused CPU kernel, flex compiled
through ``aot_eager``), the sparse anchors on and off, and the memory switches that cut the work into pieces;
documents shorter than K; a micro-batch of one sample unchanged bit for bit; the batch builder offline (the tiny
store) and online (the tiny target, whose forward isolates the documents for every supported architecture: aux and
last hidden states equal the padded forward's)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from kernels.attention_backends import make_causal_attention
from kernels.documents import token_positions
from kernels.flex_attention import CompiledFlex, FlexCausalAttention
from recipe.data.packing import micro_batch_layout, packed_layout, padded_layout
from recipe.data.store import HiddenStateStore
from recipe.data.vocab import VocabMap
from recipe.model.draft import Eagle3Draft
from recipe.model.ttt import TTTModel
from recipe.target.capture import TargetModel
from recipe.target.registry import draft_config_for
from recipe.train.batches import BatchBuilder
from helpers.cases import PARITY, build_case, run_model
from helpers.tiny_target import ARCHITECTURES, save_tiny_target
from helpers.tolerance import FP32_REORDERED, assert_close_rel

LENGTHS = (19, 3, 14, 1, 9)  # two documents shorter than K
K = 7
BUDGET = 24  # rows [19, 3, 1] and [14, 9]


def test_layouts():
    packed = packed_layout(list(LENGTHS), BUDGET, divisor=4)
    assert [(p.slot, p.row, p.offset) for p in packed.placements] == [(0, 0, 0), (1, 0, 19), (3, 0, 22),
                                                                      (2, 1, 0), (4, 1, 14)]
    assert (packed.rows, packed.seq, packed.tokens) == (2, 24, 46)
    padded = padded_layout(list(LENGTHS), 4)
    assert (padded.rows, padded.seq, padded.positions) == (5, 20, 100) and not padded.packed
    assert micro_batch_layout(list(LENGTHS), "auto", BUDGET, 4) == packed  # 48 positions < 100
    assert micro_batch_layout([10, 10], "auto", 10, 4) == padded_layout([10, 10], 4)  # 24 positions either way
    assert micro_batch_layout([10, 10], True, 10, 4) == padded_layout([10, 10], 4)  # each alone: the padded batch
    assert micro_batch_layout([7], True, 20, 4) == padded_layout([7], 4)  # one sample: the same batch
    assert not micro_batch_layout(list(LENGTHS), False, BUDGET).packed
    assert packed_layout([30, 5], 8).rows == 2  # a sample over the budget gets its own row
    docs, pos = packed.documents()
    assert docs[0].tolist() == [0] * 19 + [1] * 3 + [2] + [3]
    assert pos[1].tolist() == list(range(14)) + list(range(9)) + [0]
    with pytest.raises(ValueError, match="packing"):
        micro_batch_layout([3], "yes", 8)


def _aux_rows(aux_grad, layout):
    """[samples, longest, A]: each sample's aux gradient rows, from a batch of ``layout``."""
    out = torch.zeros(len(layout.placements), max(LENGTHS), aux_grad.shape[-1], dtype=aux_grad.dtype)
    for p in layout.placements:
        out[p.slot, :p.length] = aux_grad[p.row, p.offset:p.offset + p.length]
    return out


def assert_packed_run(got, ref, layout, label: str) -> None:
    """A packed ``run_model`` result against the padded one (module docstring)."""
    (out, grads, aux), (ref_out, ref_grads, ref_aux) = got, ref
    assert ref_out.valid_K.min() > 0 and ref_out.correct_K.sum() > 0, f"{label}: vacuous"
    assert torch.equal(out.valid_K, ref_out.valid_K) and torch.equal(out.correct_K, ref_out.correct_K), label
    assert_close_rel(out.loss_sum_K, ref_out.loss_sum_K, FP32_REORDERED, f"{label}: loss sums")
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name, grad in ref_grads.items():
        assert grad.abs().max() > 0, name
        assert_close_rel(grads[name], grad, FP32_REORDERED, f"{label}: {name}")
    assert_close_rel(_aux_rows(aux, layout), _aux_rows(ref_aux, padded_layout(list(LENGTHS))), FP32_REORDERED,
                     f"{label}: aux gradient")


@pytest.fixture
def aot_flex(monkeypatch):
    """flex compiled on ``aot_eager``, torch's CPU-backward refusal lifted (``tests/test_flex_compiled.py``)."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    torch._dynamo.reset()
    yield CompiledFlex(backend="aot_eager")
    torch._dynamo.reset()


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kernel", ["dense", "tiled", "sdpa", "flex", "switches"])
def test_packed_micro_batch_equals_padded(kernel, sparse, request):
    draft, head_VH, padded = build_case(3, K, lengths=LENGTHS, geometry=PARITY)
    packed = build_case(3, K, lengths=LENGTHS, geometry=PARITY, packing_tokens=BUDGET)[2]
    assert packed.input_ids_KBS.shape[1:] == (2, 23)

    def model():
        d = copy.deepcopy(draft)
        if kernel == "flex":
            d.midlayer.self_attn.causal_attention = FlexCausalAttention(compiled=request.getfixturevalue("aot_flex"))
        else:
            tile = {"dense": None, "tiled": 4, "sdpa": 4, "switches": 5}[kernel]
            d.midlayer.self_attn.causal_attention = make_causal_attention(
                "sdpa" if kernel == "sdpa" else "tiled", tile, "cpu")
        m = TTTModel(d, head_VH, sparse_anchors=sparse)
        if kernel == "switches":  # the loss in chunks and each step recomputed in backward
            m.loss_chunk_size, m.checkpoint_steps = 7, True
        return m
    ref = run_model(model(), padded)
    assert_packed_run(run_model(model(), packed), ref, packed_layout(list(LENGTHS), BUDGET), f"{kernel}")


def _draft_for(target_dir):
    config = TargetModel(target_dir, dtype=torch.float32, device="cpu").config
    draft = Eagle3Draft(draft_config_for(config, 48), seed=1)
    vocab = VocabMap.from_draft_ids(torch.arange(0, 96, 2), 96)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    head = torch.randn(96, config.hidden_size, generator=torch.Generator().manual_seed(2))
    return draft, head, vocab


def _run(builder, draft, head, indices):
    batch = builder.build(indices)
    out, grads, _ = run_model(TTTModel(copy.deepcopy(draft), head, sparse_anchors=False), batch.ttt)
    return batch, out, grads


def _assert_same(got, ref, label):
    (batch, out, grads), (ref_batch, ref_out, ref_grads) = got, ref
    assert torch.equal(out.valid_K, ref_out.valid_K) and torch.equal(out.correct_K, ref_out.correct_K), label
    assert ref_out.valid_K.min() > 0
    assert torch.equal(batch.supervised_K, ref_batch.supervised_K), label
    assert batch.supervised_tokens == ref_batch.supervised_tokens
    assert_close_rel(out.loss_sum_K, ref_out.loss_sum_K, FP32_REORDERED, f"{label}: loss sums")
    for name, grad in ref_grads.items():
        assert_close_rel(grads[name], grad, FP32_REORDERED, f"{label}: {name}")


def test_offline_builder_packs_and_equals_padded(tiny_target_and_store):
    target_dir, store_dir = tiny_target_and_store
    draft, head, vocab = _draft_for(target_dir)
    indices = [0, 3, 5, 8, 11, 13]

    def builder(packing, offset_max=0):
        return BatchBuilder(store=HiddenStateStore(store_dir), t2d=vocab.t2d, ttt_steps=3, seq_divisor=4,
                            packing=packing, packing_tokens=64, position_offset_max=offset_max, seed=5)
    padded, packed = builder(False), builder("auto")
    host = packed.tokens(indices)
    assert host.layout.packed and host.layout.positions < padded.tokens(indices).layout.positions
    assert torch.equal(packed.local_valid(host), padded.local_valid(padded.tokens(indices)))
    extent = packed.call_extent([indices, indices[:1]])
    assert extent == (host.seq, host.layout.positions)  # from the packed shapes, without reading a sample
    got = _run(packed, draft, head, indices)
    _assert_same(got, _run(padded, draft, head, indices), "offline")
    # positions restart per document; --position-offset-max draws per sample as unpacked
    offsets = builder("auto", 40).build(indices).ttt.position_ids_BS
    plain = builder(False, 40).build(indices).ttt.position_ids_BS
    for p in host.layout.placements:
        assert torch.equal(token_positions(offsets[p.row, p.offset:p.offset + p.length]), plain[p.slot, :p.length])
    one = packed.build(indices[:1]).ttt  # a micro-batch of one sample: the padded batch, bit for bit
    ref_one = padded.build(indices[:1]).ttt
    assert all(torch.equal(getattr(one, n), getattr(ref_one, n)) for n in one.tensor_fields())


def _chats():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(4)
    rows = {"input_ids": [], "loss_mask": [], "row": []}
    for i, n in enumerate((17, 3, 12, 22, 9, 2)):  # two samples shorter than K
        rows["input_ids"].append(torch.randint(1, 96, (n,), generator=gen).tolist())
        rows["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
        rows["row"].append(i)
    return Dataset.from_dict(rows)


def test_online_builder_packs_and_equals_padded(tiny_target):
    """Online, packed against padded: through the whole target (transformers' block-diagonal mask) and through the
    one-rank ``SplitTarget`` a run at one rank gives the builder for its packed micro-batches (``packed_target``:
    the project's tiled block, cut at the documents), which runs once per packed micro-batch."""
    from recipe.parallel.collectives import Collectives
    from recipe.target.split import SplitTarget

    target = TargetModel(tiny_target, dtype=torch.float32, device="cpu")
    draft, head, vocab = _draft_for(tiny_target)
    one_rank = SplitTarget(target, Collectives("cpu"), None, 1, 0, "tiled", 8)

    def builder(packing, packed_target=None):
        return BatchBuilder(examples=_chats(), target=target, t2d=vocab.t2d, ttt_steps=4, seq_divisor=2,
                            packing=packing, packing_tokens=32, packed_target=packed_target)
    indices = list(range(6))
    padded, packed = builder(False), builder(True)
    host = packed.tokens(indices)
    assert host.layout.rows == 3
    ref = _run(padded, draft, head, indices)
    for how, b in (("whole target", packed), ("one-rank split target", builder(True, one_rank))):
        got = _run(b, draft, head, indices)
        _assert_same(got, ref, f"online, {how}")
        for p in host.layout.placements:  # the target's aux states: each document's equal its padded row's
            assert_close_rel(got[0].ttt.aux_hidden_BSA[p.row, p.offset:p.offset + p.length],
                             ref[0].ttt.aux_hidden_BSA[p.slot, :p.length], FP32_REORDERED,
                             f"{how}: aux of sample {p.slot}")
    assert one_rank.counts.captures == 1  # the packed micro-batch went through it
    builder(True, one_rank).build(indices[:1])  # one sample: never packed, the whole target's forward
    assert one_rank.counts.captures == 1


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_target_forward_isolates_documents(tmp_path, arch):
    """``TargetModel.capture`` with packed positions: aux and last hidden states of every document equal the
    padded forward's, for every supported architecture (RoPE restarts, attention masked across documents)."""
    target = TargetModel(save_tiny_target(tmp_path / arch, arch), dtype=torch.float32, device="cpu")
    lengths = [13, 5, 9]
    layout = packed_layout(lengths, 30, 2)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 96, (n,), generator=gen) for n in lengths]
    padded = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for j, t in enumerate(ids):
        padded[j, :len(t)], mask[j, :len(t)] = t, 1
    packed = torch.zeros(1, layout.seq, dtype=torch.long)
    packed_mask = torch.zeros_like(packed)
    for p in layout.placements:
        packed[0, p.offset:p.offset + p.length], packed_mask[0, p.offset:p.offset + p.length] = ids[p.slot], 1
    ref = target.capture(padded, mask)
    got = target.capture(packed, packed_mask, position_ids_BS=layout.documents()[1])
    for p in layout.placements:
        for name in ("aux_hidden_BSA", "last_hidden_BSH"):
            assert_close_rel(getattr(got, name)[0, p.offset:p.offset + p.length],
                             getattr(ref, name)[p.slot, :p.length], FP32_REORDERED, f"{arch} {name} {p.slot}")
    assert not packed_mask.all()
    with pytest.raises(ValueError, match="right-padded"):  # left padding: transformers would not isolate them
        target.capture(packed, packed_mask.flip(1), position_ids_BS=layout.documents()[1])


def test_data_section_and_the_padding_report():
    from recipe.config_data import DataOptions
    from recipe.config_keys import ConfigError
    from recipe.data.lengths import LengthReport

    assert DataOptions.pop_from({}, "run.json") == DataOptions("auto", None)
    cfg = {"data": {"packing": False, "packing_tokens": 4096, "_comment": "kept out"}, "train_batch_size": 1}
    assert DataOptions.pop_from(cfg, "run.json") == DataOptions(False, 4096) and cfg == {"train_batch_size": 1}
    for bad, match in (({"packing": "yes"}, "data.packing' must be"), ({"packing_tokens": 0}, "packing_tokens"),
                       ({"pack": True}, "did you mean 'packing'")):
        with pytest.raises(ConfigError, match=match):
            DataOptions.pop_from({"data": bad}, "run.json")
    assert DataOptions().with_flag(False).packing is False and DataOptions(False).with_flag(None).packing is False
    assert DataOptions("auto", 64).for_target("gemma2", False, "run.json") == DataOptions(False, 64)  # padded
    assert DataOptions().for_target("llama", True, "run.json") == DataOptions()
    assert DataOptions().for_attention(None).packing is False and DataOptions(True).for_attention(None).packing is True
    assert DataOptions().for_attention(1024) == DataOptions()
    from recipe.target.registry import ARCHITECTURES as FACTS  # packing online only where the test above covers it

    assert {name for name, arch in FACTS.items() if arch.packs_documents} == set(ARCHITECTURES)
    with pytest.raises(ConfigError, match=r"run.json: 'data.packing' \(or run.py --packing\) is true, but the online "
                                          r"target's forward \(model_type 'gemma2'\)"):
        DataOptions(True).for_target("gemma2", False, "run.json")
    report = LengthReport(2048, [100, 2000, 3000, 500], micro_batch=4)  # cut: 4648 tokens in 4 x 2048 positions
    assert report.padding_shares() == (pytest.approx(1 - 4648 / 8192), 0.0)  # packed: one row of 4648
    assert report.padding_line() == ("padding: 43.3% of the positions of micro-batches of 4 samples padded, 0.0% "
                                     "packed (one row a micro-batch); this run: data.packing \"auto\"")
    assert report.for_batches(4, False, None).padding_shares() == (pytest.approx(1 - 4648 / 8192), 0.0)
    assert LengthReport(2048, [5, 9]).padding_line() is None  # micro-batches of one sample: no padding
    budget = LengthReport(2048, [100, 2000, 3000, 500], micro_batch=4, packing_tokens=1000)  # 2000, 3000 alone
    assert budget.padding_line().endswith("; 2 of 4 samples are longer than data.packing_tokens 1000 and get a row "
                                          "of their own, packed with nothing")


def test_a_steps_packing_is_counted_and_summed_per_epoch():
    """``packing_counts`` of a step's layouts (every dp rank's micro-batches), and the epoch's line that sums them;
    no line when no micro-batch held two samples. A budget that leaves every sample alone is the padded layout (not
    counted as packed); the padding line names the mode the draft's attention leaves (no tile: padded)."""
    from types import SimpleNamespace

    from recipe.config_data import DataOptions
    from recipe.data.lengths import LengthReport
    from recipe.train.setup import _for_batches

    from recipe.data.packing import micro_batch_layout, packing_counts
    from recipe.train.metrics import TrainProgress

    layouts = [micro_batch_layout([3, 9], "auto", None, 2), micro_batch_layout([8, 8], "auto", None, 2),
               micro_batch_layout([5], True, None, 2)]  # packed (12 < 18), padded (16 = 16), one sample (never)
    assert [x.packed for x in layouts] == [True, False, False]
    counts = packing_counts(layouts)
    assert counts == {"micro_batches": 3, "packed_micro_batches": 1, "padding_share": pytest.approx(1 - 33 / 34)}
    assert packing_counts([]) == {"micro_batches": 0, "packed_micro_batches": 0, "padding_share": 0.0}
    progress = TrainProgress(4, 0, False)
    for step, share in ((1, 0.5), (2, 0.25)):
        progress.update({"step": step, "acc": [0.5], "tokens": 1, "samples": 5, "micro_batches": 3,
                         "packed_micro_batches": step, "padding_share": share})
    assert progress.packing_line() == ("data.packing: 3 of 6 micro-batches packed; padding 37.5% of the "
                                          "positions computed (mean over steps)")
    progress.epoch_packing = [(2, 2, 0, 0.0)]
    assert progress.packing_line() is None  # one sample a micro-batch: nothing to pack
    alone = micro_batch_layout([30, 20, 25], True, 20, 2)  # no two fit in 20 tokens: each alone, = padded
    assert not alone.packed and alone == micro_batch_layout([30, 20, 25], False, None, 2)
    assert micro_batch_layout([30, 20, 25], True, 45, 2).packed  # 25 + 20 share a row
    config = SimpleNamespace(plan=SimpleNamespace(micro_batch=2), data=DataOptions(), dims=SimpleNamespace(
        seq_divisor=2), memory=SimpleNamespace(attention_tile_size=None))
    assert _for_batches(LengthReport(64, [10, 30]), config).padding_line().endswith("data.packing false")
    config.memory.attention_tile_size = "auto"  # resolves to a tile: "auto" stays
    assert _for_batches(LengthReport(64, [10, 30]), config).padding_line().endswith("data.packing \"auto\"")


def test_run_json_and_flags_set_packing(tmp_path):
    import json

    from recipe.config import load_run_config
    from recipe.config_keys import ConfigError
    from recipe.train.flags import parse_args

    path = tmp_path / "run.json"
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}}
    path.write_text(json.dumps(base))
    assert load_run_config(path, 1).record()["data"] == {"packing": "auto", "packing_tokens": None}
    path.write_text(json.dumps({**base, "data": {"packing": True, "packing_tokens": 2048}}))
    config = load_run_config(path, 1)
    assert config.record()["data"] == {"packing": True, "packing_tokens": 2048} and "data" not in config.deepspeed
    path.write_text(json.dumps({**base, "data": {"packing": "on"}}))
    with pytest.raises(ConfigError, match=r"run.json: 'data.packing' must be true, false or \"auto\", got 'on'"):
        load_run_config(path, 1)
    path.write_text(json.dumps({**base, "data": ["packing"]}))
    with pytest.raises(ConfigError, match="run.json: 'data' must be an object"):
        load_run_config(path, 1)
    path.write_text(json.dumps({**base, "dta": {}}))
    with pytest.raises(ConfigError, match="'dta': unknown key; did you mean 'data'"):
        load_run_config(path, 1)
    common = ["--ds_config", str(path), "--target", "t", "--hidden-states", "s", "--output", "o"]
    assert [parse_args(common + flag).packing for flag in ([], ["--packing"], ["--no-packing"])] == [None, True, False]


def test_a_packed_online_run_names_a_missing_target(tmp_path):
    """An online run that packs (``"auto"`` or ``--packing``) reads the target's config first
    (``run_data_options``): a missing target is named as everywhere else, not reported by transformers' hub lookup."""
    from types import SimpleNamespace

    from recipe.config_data import DataOptions
    from recipe.train.setup import run_data_options

    args = SimpleNamespace(packing=None, data=["x.jsonl"], target=tmp_path / "no_target")
    config = SimpleNamespace(data=DataOptions(), path=tmp_path / "run.json")
    with pytest.raises(FileNotFoundError, match="target folder not found: .*no_target"):
        run_data_options(args, config)


def test_an_offline_run_prints_its_padding_line(tiny_target_and_store, tmp_path, monkeypatch):
    """An offline run states the padding share of its micro-batches from the store's sample lengths, as the online
    data report does: the samples in the sampler's seeded order, 4 to a micro-batch, padded to each one's longest."""
    import random
    from types import SimpleNamespace

    from rich.console import Console

    from recipe.config_data import DataOptions
    from recipe.data.store import HiddenStateStore
    from recipe.train import setup

    _, store_dir = tiny_target_and_store
    monkeypatch.setattr(setup.dist, "get_rank", lambda: 0)
    args = SimpleNamespace(cache_dir=None, output=tmp_path, hidden_states=store_dir, limit=None, max_length=64)
    config = SimpleNamespace(plan=SimpleNamespace(micro_batch=4), data=DataOptions(),
                             dims=SimpleNamespace(seq_divisor=1), memory=SimpleNamespace(attention_tile_size=1024))
    console = Console(record=True, width=400)
    _, store, _ = setup._data(args, console, None, config)
    lengths = HiddenStateStore(store_dir).lengths
    random.Random(0).shuffle(lengths)
    padded = sum(4 * max(lengths[i:i + 4]) for i in range(0, len(lengths), 4))
    assert len(store) == 24 and len(set(lengths)) > 1  # samples of several lengths: there is padding to report
    assert console.export_text().strip() == (
        f"padding: {1 - sum(lengths) / padded:.1%} of the positions of micro-batches of 4 samples padded, 0.0% packed "
        '(one row a micro-batch); this run: data.packing "auto"')
