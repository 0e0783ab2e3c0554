"""Validation during training: the held-out split, the per-step supervised counts, the eval monitor events, and a
2-rank ZeRO-3 run whose eval records equal an independent single-process computation over the held-out samples."""
from __future__ import annotations

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.training import run_training, train_argv, write_ds_config
from helpers.tolerance import FP32_REORDERED, within

from recipe.train.batches import supervised_per_step
from recipe.train.monitor import step_events
from recipe.train.validation import held_out_split


def test_held_out_split():
    train, held = held_out_split(24, 0.2, seed=0)
    assert len(held) == 5 and len(train) == 19 and sorted(train + held) == list(range(24))
    assert (train, held) == held_out_split(24, 0.2, seed=0)
    assert held != held_out_split(24, 0.2, seed=1)[1]
    assert len(held_out_split(10, 0.01, seed=0)[1]) == 1
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        held_out_split(10, 1.0, seed=0)
    with pytest.raises(ValueError, match="leaves none to train on"):
        held_out_split(2, 0.9, seed=0)


def test_supervised_per_step():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0]])
    # step k counts the labels t[p+2+k]: loss-mask ones at positions >= k + 2
    assert supervised_per_step(mask, 3).tolist() == [3 + 3, 2 + 2, 1 + 1]


def test_eval_record_events():
    record = {"step": 4, "eval": {"loss": 2.0, "loss_k": [1.5, 1.0], "acc": [0.5, 0.25],
                                  "acc_all_supervised": [0.4, 0.2], "valid": [8, 8], "supervised": [10, 10],
                                  "samples": 3}}
    assert step_events(record) == [
        ("Train/Steps/eval_loss", 2.0, 4), ("Train/Steps/eval_loss_0", 1.5, 4), ("Train/Steps/eval_loss_1", 1.0, 4),
        ("Train/Steps/eval_acc_0", 0.5, 4), ("Train/Steps/eval_acc_1", 0.25, 4),
        ("Train/Steps/eval_acc_all_supervised_0", 0.4, 4), ("Train/Steps/eval_acc_all_supervised_1", 0.2, 4)]


def _independent_eval(target, store_dir, export, held: list[int], K: int) -> dict:
    """Sums over the held-out samples, one sample at a time, with the exported draft in fp32 (no padding)."""
    from recipe.data.store import HiddenStateStore
    from recipe.eval.draft_runtime import build_draft, read_draft
    from recipe.model.ttt import TTTModel, make_ttt_batch, step_weights
    from recipe.target.head import load_embedding_and_head
    from recipe.target.registry import final_logit_softcap

    embed, head, hf_config = load_embedding_and_head(target)
    draft = build_draft(*read_draft(export, hf_config), embed, dtype=torch.float32).train()
    model = TTTModel(draft, head, target_softcap=final_logit_softcap(hf_config), sparse_anchors=False)
    store = HiddenStateStore(store_dir)
    loss, correct, valid, supervised = (torch.zeros(K, dtype=torch.float64) for _ in range(4))
    for i in held:
        s = store.get(i)
        ids, mask = s["input_ids"].long()[None], s["loss_mask"].long()[None]
        batch = make_ttt_batch(ids, mask, torch.ones_like(ids), s["aux_hidden"].float()[None],
                               s["last_hidden"].float()[None], draft.t2d[s["target_argmax"].long()][None], K)
        with torch.no_grad():
            out = model(batch)
        loss += out.loss_sum_K.double()
        correct += out.correct_K.double()
        valid += out.valid_K.double()
        supervised += torch.tensor([float(mask[0, k + 2:].sum()) for k in range(K)], dtype=torch.float64)
    return {"loss": float((step_weights(K, torch.float64) * loss / valid).sum()), "acc": (correct / valid).tolist(),
            "acc_all_supervised": (correct / supervised).tolist(), "valid": valid.long().tolist(),
            "supervised": supervised.long().tolist()}


@pytest.mark.slow
def test_validation_records_match_an_independent_computation(tiny_target_and_store, tmp_path):
    """dp=2 under ZeRO-3, 19 training / 5 held-out samples (the last eval chunk gives rank 1 no sample), and tp=2:
    eval records at steps 2 and 4; the one after the last step equals the exported draft's held-out metrics."""
    target, store = tiny_target_and_store
    z3 = write_ds_config(tmp_path / "z3.json", base="zero3.json", train_batch_size=4)
    tp2 = write_ds_config(tmp_path / "tp2.json", base="zero3_tp2.json", train_batch_size=4)
    argvs = [train_argv(cfg, target, store, tmp_path / name, "--max-steps", "4", "--epochs", "2",
                        "--eval-fraction", "0.2", "--eval-every", "2") for cfg, name in ((z3, "z3"), (tp2, "tp2"))]
    runs = run_ranks(2, run_training, argvs)[0]
    for records, name in zip(runs, ("z3", "tp2")):
        _check_run(records, target, store, tmp_path / name / "export")


def _check_run(records, target, store, export):
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert all(0 <= s <= a <= 1 for a, s in zip(r["acc"], r["acc_all_supervised"]))
        assert all(v <= n for v, n in zip(r["valid"], r["supervised"]))
    ev = evals[-1]["eval"]
    assert ev["samples"] == 5
    ref = _independent_eval(target, store, export, held_out_split(24, 0.2, seed=0)[1], K=3)
    assert ev["valid"] == ref["valid"] and ev["supervised"] == ref["supervised"]
    assert any(v < n for v, n in zip(ref["valid"], ref["supervised"]))  # some targets are out of the draft vocab
    within(abs(ev["loss"] - ref["loss"]) / ref["loss"], FP32_REORDERED, "validation loss")
    # accuracies: ratios of equal integer counts (argmax matches), the same float64 division on both sides
    assert ev["acc"] == pytest.approx(ref["acc"], abs=1e-12)
    assert ev["acc_all_supervised"] == pytest.approx(ref["acc_all_supervised"], abs=1e-12)
    assert evals[0]["eval"]["loss"] != ev["loss"]  # evaluated with the weights of step 2, then of step 4


def test_held_out_data_online_fraction_and_conflicting_flags():
    from types import SimpleNamespace

    from datasets import Dataset

    from recipe.train.validation import held_out_data

    examples = Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(10)], "loss_mask": [[0, 1]] * 10})
    args = SimpleNamespace(eval_fraction=0.3, eval_data=None, seed=0)
    train, store, held, held_store, tag = held_out_data(args, examples, None, None, None)
    assert store is None and held_store is None and tag == "eval-fraction:0.3"
    _, want = held_out_split(10, 0.3, seed=0)
    assert [r[0] for r in held["input_ids"]] == want and len(train) == 7
    assert not {r[0] for r in train["input_ids"]} & set(want)
    none = held_out_data(SimpleNamespace(eval_fraction=None, eval_data=None, seed=0), examples, None, None, None)
    assert none[0] is examples and none[2] is None and none[4] == ""
    with pytest.raises(ValueError, match="not both"):
        held_out_data(SimpleNamespace(eval_fraction=0.3, eval_data=["x.jsonl"], seed=0), examples, None, None, None)


def test_eval_flags_parse(capsys):
    from recipe.train.flags import parse_args

    base = ["--ds_config", "c.json", "--target", "t", "--output", "o", "--hidden-states", "s"]
    args = parse_args(base + ["--eval-fraction", "0.1", "--eval-every", "5"])
    assert (args.eval_fraction, args.eval_every, args.eval_data) == (0.1, 5, None)
    with pytest.raises(SystemExit):
        parse_args(base + ["--eval-every", "5"])
    assert "--eval-every needs a held-out split" in capsys.readouterr().err
