"""``run.py --init-draft EXPORT`` end to end, fp32 on the tiny target's store: the first step's loss, accuracies and
valid counts equal what the exported draft gives on that step's batch, computed in this process with the export's
weights (single-process reference), on one process (ZeRO-0) and on two gloo ranks with tp = 2 (ZeRO-3) and cp = 2
(ZeRO-1); the run starts at step 1 and records where its draft came from; the same command with ``--resume``
continues the run, and ``--resume`` with another draft is refused."""
from __future__ import annotations

import json

import pytest
import torch
from helpers.drafts import make_export
from helpers.ranks import run_ranks
from helpers.training import run_training, train_argv, write_ds_config
from helpers.tolerance import FP32_REORDERED

from recipe.data.store import HiddenStateStore
from recipe.data.vocab import VocabMap
from recipe.export import load_export
from recipe.export.import_draft import file_sha256
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.ttt import TTTModel
from recipe.target.head import load_embedding_and_head
from recipe.train.batches import BatchBuilder
from recipe.train.metrics import ttt_metrics
from recipe.train.sampler import StepSampler

K, BATCH = 3, 4


def _argv(tmp, target, store, export, name, base, *extra):
    cfg = write_ds_config(tmp / f"{name}.json", base=base, train_batch_size=BATCH,
                          train_micro_batch_size_per_gpu=BATCH)  # one micro-batch a step in every layout here
    return train_argv(cfg, target, store, tmp / name, "--max-steps", "2", "--no-export", "--save-every", "1",
                      "--init-draft", str(export), *extra)


def _first_step_reference(target, store, export, load: bool = True) -> dict:
    """The metrics of step 1's batch (sampler step 0, seed 0) under the exported draft (``load``) or a fresh seed-0
    draft of the same geometry and vocabulary map, one process, the dense attention block."""
    tensors, cfg = load_export(export)
    draft = Eagle3Draft(Eagle3DraftConfig.from_hf_dict(cfg), seed=0)
    embed_VH, head_VH, _ = load_embedding_and_head(target)
    vocab = VocabMap(tensors["d2t"], tensors["t2d"])
    if load:
        draft.load_state_dict({**tensors, "embed_tokens.weight": embed_VH})
    else:
        draft.load_target_embeddings(embed_VH)
        draft.set_vocab_map(vocab.d2t, vocab.t2d)
    model = TTTModel(draft, head_VH[vocab.draft_ids].clone(), sparse_anchors=False)
    builder = BatchBuilder(store=HiddenStateStore(store), t2d=vocab.t2d, ttt_steps=K, seq_divisor=2)
    batch = builder.build(StepSampler(len(builder), BATCH, 0).step_indices(0))
    with torch.no_grad():
        out = model(batch.ttt)
    return ttt_metrics(out.loss_sum_K.double(), out.correct_K.double(), out.valid_K.double(), batch.supervised_K)


@pytest.fixture(scope="module")
def runs(tiny_target_and_store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init_draft_training")
    target, store = tiny_target_and_store
    export = make_export(target, tmp / "export")
    other = make_export(target, tmp / "other", seed=4)
    single = [_argv(tmp, target, store, export, "tp1", "zero0.json"),
              _argv(tmp, target, store, export, "tp1", "zero0.json", "--resume", "--max-steps", "3", "--extend")]
    pair = [_argv(tmp, target, store, export, "tp2", "zero3_tp2.json"),
            _argv(tmp, target, store, export, "cp2", "zero1.json", "--cp-size", "2")]
    records = {"tp1": run_ranks(1, run_training, single)[0], "pair": run_ranks(2, run_training, pair)[0]}
    return target, store, export, other, tmp, records


@pytest.mark.slow
def test_first_step_loss_is_the_exported_drafts(runs):
    target, store, export, _, tmp, records = runs
    ref = _first_step_reference(target, store, export)
    fresh = _first_step_reference(target, store, export, load=False)
    assert abs(fresh["loss"] - ref["loss"]) > 1e-2 * ref["loss"]  # the draft's weights decide the first loss
    (tp1, tp1_resumed), (tp2, cp2) = records["tp1"], records["pair"]
    for name, metrics, rtol in (("tp1", tp1, FP32_REORDERED), ("tp2-zero3", tp2, FP32_REORDERED),
                               ("cp2-zero1", cp2, FP32_REORDERED)):
        first = metrics[0]
        assert first["step"] == 1, name  # a new run, not a resume
        assert abs(first["loss"] - ref["loss"]) <= rtol * ref["loss"], (name, first["loss"], ref["loss"])
        for k in range(K):
            assert abs(first["loss_k"][k] - ref["loss_k"][k]) <= rtol * ref["loss_k"][k], (name, k)
        assert first["valid"] == ref["valid"] and first["supervised"] == ref["supervised"], name
        assert first["acc"] == pytest.approx(ref["acc"], abs=1e-12), name
    # the same command + --resume continued the run (steps 1-2 kept, step 3 added), from the checkpoint's weights
    assert [m["step"] for m in tp1_resumed] == [1, 2, 3] and tp1_resumed[:2] == tp1


@pytest.mark.slow
def test_run_records_where_its_draft_came_from(runs):
    _, store, export, _, tmp, _ = runs
    sha = file_sha256(export / "model.safetensors")
    longest = max(HiddenStateStore(store).lengths)
    for name in ("tp1", "tp2", "cp2"):
        record = json.loads((tmp / name / "run_config.json").read_text())
        assert record["init_draft"]["sha256"] == sha and record["init_draft"]["path"] == str(export), name
        assert record["init_draft"]["layout"] == "midlayer" and record["init_draft"]["draft_vocab_size"] == 64
        assert record["positions"]["longest_sample_tokens"] == longest and record["positions"]["far_shorter"] is True
        checkpoints = tmp / name / "checkpoints"  # tp1's latest is the resumed run's: the record carried over
        state = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "run_state.json").read_text())
        assert state["init_draft"]["sha256"] == sha, name


@pytest.mark.slow
def test_resume_with_another_draft_is_refused(runs):
    target, store, _, other, tmp, _ = runs
    argv = _argv(tmp, target, store, other, "tp1", "zero0.json", "--resume", "--max-steps", "3")
    assert run_ranks(1, _main_rc, argv)[0] == 2  # "started from another draft" (tests/test_init_draft.py)
    assert len((tmp / "tp1" / "metrics.jsonl").read_text().splitlines()) == 3  # the run is untouched


def _main_rc(rank, world, argv):
    import sys

    from helpers.training import ROOT

    sys.path.insert(0, str(ROOT))
    from run import main

    return main(argv)
