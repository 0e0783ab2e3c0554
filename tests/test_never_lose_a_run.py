"""Never lose a run: an --output that holds a run is not overwritten without --resume or --overwrite, a resume with
another target's weights or another draft geometry is refused before DeepSpeed loads anything, a typo in the DeepSpeed
JSON is refused on every rank (the nearest-valid-name unit cases: tests/test_config.py), and missing data columns or
tokenizer files are named.

The end-to-end cases run in ONE 2-rank gloo group (``run_ranks(2, run_jobs, ...)``, the jobs one after the other,
as in tests/test_bad_inputs.py): online training on two tiny targets of the same config with other weights (seed 0 and
seed 1), their vocabulary the size of the SmolLM2 tokenizer the assets provide.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
from helpers.faults import Job, run_jobs
from helpers.ranks import run_ranks
from helpers.training import write_ds_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# --- end to end on 2 ranks -----------------------------------------------------------------------------------------

def _online_target(folder: Path, seed: int, assets) -> Path:
    """A tiny Llama (hidden 32, 8 layers) with the SmolLM2 vocabulary size and tokenizer, weights of ``seed``."""
    from helpers.tiny_target import save_tiny_llama

    vocab = json.loads((Path(assets.target) / "config.json").read_text())["vocab_size"]
    save_tiny_llama(folder, vocab=vocab, seed=seed)
    for name in TOKENIZER_FILES:
        shutil.copy(assets.target / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("never_lose")
    target = _online_target(tmp / "target", 0, assets)
    other = _online_target(tmp / "other_target", 1, assets)
    cfg = write_ds_config(tmp / "ds.json", train_batch_size=2, train_micro_batch_size_per_gpu=1, scheduler=None)
    typo = write_ds_config(tmp / "typo.json", train_batch_size=2, zero_optimisation={"stage": 2})
    wider = tmp / "wider.json"
    wider.write_text('{"intermediate_size": 128}')
    import pandas as pd

    table = tmp / "dialogs.parquet"
    pd.DataFrame({"id": [1, 2], "dialog": ['[{"role": "user", "content": "hi"}]'] * 2}).to_parquet(table)
    no_tokenizer = shutil.copytree(target, tmp / "no_tokenizer")
    for name in TOKENIZER_FILES:
        (no_tokenizer / name).unlink()

    def argv(output, *extra, target=target, config=cfg, data=assets.conversations):
        return ["--ds_config", str(config), "--target", str(target), "--data", str(data), "--output", str(tmp / output),
                "--max-length", "96", "--limit", "8", "--draft-vocab-size", "64", "--ttt-steps", "2", "--seed", "0",
                "--lm-head-init", "random", "--cache-dir", str(tmp / "cache"), "--no-export", *extra]

    jobs = {  # run in this order in one 2-rank group
        "first": Job(argv("a", "--max-steps", "2", "--save-every", "1")),
        "again": Job(argv("a", "--max-steps", "2")),
        "other_target": Job(argv("a", "--max-steps", "2", "--resume", target=other)),
        "other_draft": Job(argv("a", "--max-steps", "2", "--resume", "--draft-config", str(wider))),
        "b_first": Job(argv("b", "--max-steps", "2")),
        "b_overwrite": Job(argv("b", "--max-steps", "1", "--overwrite")),
        "config_typo": Job(argv("c", config=typo)),
        "parquet_column": Job(argv("d", data=table)),
        "no_tokenizer": Job(argv("e", target=no_tokenizer)),
    }
    per_rank = run_ranks(2, run_jobs, list(jobs.values()))
    return {"tmp": tmp, **{name: [outcomes[i] for outcomes in per_rank] for i, name in enumerate(jobs)}}


def _refused(outcomes, *fragments):
    for rank, out in enumerate(outcomes):
        assert out.rc == 2, f"rank {rank}: rc {out.rc}\n{out.stderr}"
        assert f"error (rank {rank}): " in out.stderr and "Traceback" not in out.stderr, out.stderr
        for fragment in fragments:
            assert fragment in out.stderr, f"rank {rank}: {fragment!r} not in\n{out.stderr}"


@pytest.mark.slow
def test_a_run_without_resume_into_a_used_output_is_refused_on_every_rank(runs):
    first, again = runs["first"], runs["again"]
    assert first[0].rc == 0 and len(first[0].metrics) == 2, first[0].stderr
    out = runs["tmp"] / "a"
    _refused(again, f"--output {out} already holds a run (metrics.jsonl, checkpoints/step-00000001 .. step-00000002",
             "checkpoints/latest -> step-00000002", "continue it with --resume (from step-00000002)",
             "write to a new --output folder", "pass --overwrite to delete")
    assert again[0].metrics == first[0].metrics  # metrics.jsonl untouched
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000001", "step-00000002"]


@pytest.mark.slow
def test_resume_with_another_target_is_refused_naming_both_fingerprints(runs):
    from recipe.target.capture import target_fingerprint

    tmp = runs["tmp"]
    mine, other = target_fingerprint(tmp / "target"), target_fingerprint(tmp / "other_target")
    assert mine != other
    _refused(runs["other_target"], f"target_fingerprint: checkpoint {mine!r}, now {other!r}")


@pytest.mark.slow
def test_resume_with_another_draft_geometry_is_refused_before_deepspeed(runs):
    _refused(runs["other_draft"], "draft_config: checkpoint {'intermediate_size': 64}, now {'intermediate_size': 128}")
    assert "size of tensor" not in runs["other_draft"][0].stderr


@pytest.mark.slow
def test_refused_runs_leave_run_config_and_metrics_as_they_were(runs):
    out = runs["tmp"] / "a"
    saved = out / "checkpoints" / "step-00000002" / "run_config.json"  # the copy the last save took
    assert (out / "run_config.json").read_text() == saved.read_text()
    assert [r["step"] for r in runs["other_draft"][0].metrics] == [1, 2]


@pytest.mark.slow
def test_overwrite_deletes_the_old_run_first(runs):
    assert runs["b_first"][0].rc == 0, runs["b_first"][0].stderr
    out, overwrite = runs["tmp"] / "b", runs["b_overwrite"]
    for rank in (0, 1):
        assert overwrite[rank].rc == 0, overwrite[rank].stderr
    assert "--overwrite: deleted the previous run's checkpoints, metrics.jsonl, run_config.json" in overwrite[0].stderr
    assert [r["step"] for r in overwrite[0].metrics] == [1]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000001"]
    assert json.loads((out / "run_config.json").read_text())["args"]["overwrite"] is True


@pytest.mark.slow
def test_config_typo_parquet_column_and_tokenizer_messages(runs):
    tmp = runs["tmp"]
    _refused(runs["config_typo"], "typo.json: 'zero_optimisation': unknown key; did you mean 'zero_optimization'?")
    _refused(runs["parquet_column"], f"{tmp / 'dialogs.parquet'}: no conversation column",
             "columns ['id', 'dialog']", "--data-column messages=dialog")
    _refused(runs["no_tokenizer"], f"target folder {tmp / 'no_tokenizer'} has no tokenizer",
             "missing tokenizer.json", "tokenizer_config.json")
    for folder in ("c", "d", "e"):  # refused before anything was written into --output
        assert not (tmp / folder).exists() or not any((tmp / folder).iterdir()), folder


# --- fingerprints ----------------------------------------------------------------------------------------------------

def test_weight_fingerprint_distinguishes_weights_not_dtype_or_sharding(tiny_target, other_tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    from recipe.target.capture import target_fingerprint

    mine = target_fingerprint(tiny_target)
    assert mine.startswith("w1:") and mine != target_fingerprint(other_tiny_target)  # same config, other weights
    tensors = load_file(str(tiny_target / "model.safetensors"))
    resharded = shutil.copytree(tiny_target, tmp_path / "resharded")
    (resharded / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, str(resharded / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(resharded / "model-00002-of-00002.safetensors"))
    assert target_fingerprint(resharded) == mine
    tuned = shutil.copytree(tiny_target, tmp_path / "tuned")  # one layer fine-tuned: every element moves a little
    key = next(k for k in names if "layers.3.mlp.down_proj" in k)
    save_file({**tensors, key: tensors[key] * (1 + 1e-3)}, str(tuned / "model.safetensors"))
    assert target_fingerprint(tuned) != mine
    config = json.loads((tiny_target / "config.json").read_text())
    rope = shutil.copytree(tiny_target, tmp_path / "eps")
    (rope / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert target_fingerprint(rope) != mine


@pytest.mark.slow
def test_weight_fingerprint_of_smollm2_is_cheap(assets):
    from recipe.target.capture import _cached_fingerprint, target_fingerprint

    _cached_fingerprint.cache_clear()
    start = time.perf_counter()
    target_fingerprint(assets.target)
    assert time.perf_counter() - start < 1.0


def test_store_of_an_older_version_is_refused_naming_its_index(tiny_target_and_store, tmp_path):
    from recipe.data.store import HiddenStateStore, StoreError

    target, store = tiny_target_and_store
    assert HiddenStateStore(store).check_compatible(target, None) is None  # a store of this version passes
    old = shutil.copytree(store, tmp_path / "old_store")
    index = json.loads((old / "index.json").read_text())
    index["meta"]["target_fingerprint"] = "0123456789abcdef"  # an older version's 16-hex fingerprint, no "w1:"
    (old / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=r"old_store/index.json: written by an older version of this recipe .*"
                                         r"re-create it"):
        HiddenStateStore(old).check_compatible(target, None)


def _draft_config(**changes):
    from recipe.model.draft_config import Eagle3DraftConfig

    fields = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=96, draft_vocab_size=64, target_hidden_size=32, aux_layer_ids=[1, 3, 4])
    return Eagle3DraftConfig(**{**fields, **changes})


def test_resume_check_of_older_checkpoints(tmp_path):
    from recipe.export import DRAFT_CONFIG_FILE
    from recipe.lifecycle.resume_checks import check_compatible

    geometry = dataclasses.asdict(_draft_config())
    current = {"seed": 0, "target_fingerprint": "w1:abc", "draft_config": geometry}
    assert check_compatible(dict(current), current, tmp_path) is None
    note = check_compatible({"seed": 0}, current, tmp_path)  # older: nothing recorded, no draft_config.json
    assert note.startswith(f"note: {tmp_path} predates the target_fingerprint and draft_config check(s)")
    (tmp_path / DRAFT_CONFIG_FILE).write_text(json.dumps(_draft_config(intermediate_size=128).to_hf_dict()))
    with pytest.raises(ValueError, match=r"draft_config: checkpoint \{'intermediate_size': 128\}, now "
                                         r"\{'intermediate_size': 64\}"):
        check_compatible({"seed": 0}, current, tmp_path)  # the geometry read from the older draft_config.json
    with pytest.raises(ValueError, match="target_fingerprint: checkpoint 'w1:old', now 'w1:abc'"):
        check_compatible({**current, "target_fingerprint": "w1:old"}, current, tmp_path)


# --- flags and messages ----------------------------------------------------------------------------------------------

def test_overwrite_and_resume_are_exclusive(capsys):
    from recipe.train.flags import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--ds_config", "x.json", "--target", "t", "--hidden-states", "s", "--output", "o", "--resume",
                    "--overwrite"])
    assert exc.value.code == 2 and "--overwrite starts the run afresh" in capsys.readouterr().err


def test_csv_without_the_conversation_column_names_file_columns_and_flag(tmp_path):
    from recipe.data.sources import DataFile, load_rows

    path = tmp_path / "chats.csv"
    path.write_text('prompt,reply\n"hi","ho"\n')
    with pytest.raises(ValueError) as err:
        load_rows(DataFile(str(path), "csv"), cache_dir=str(tmp_path / "c"))
    text = str(err.value)
    assert f"{path}: no conversation column" in text and "columns ['prompt', 'reply']" in text
    assert "--data-column" in text
    mapped = tmp_path / "mapped.csv"
    mapped.write_text('dialog\n"[{""role"": ""user"", ""content"": ""hi""}, {""role"": ""assistant"", '
                      '""content"": ""ho""}]"\n')
    rows = load_rows(DataFile(str(mapped), "csv"), columns={"messages": "dialog"}, cache_dir=str(tmp_path / "c"))
    assert rows[0]["reason"] == "" or rows[0]["reason"] is None, rows[0]


def test_target_without_tokenizer_names_folder_and_files(tiny_target, tmp_path):
    from recipe.target.capture import load_tokenizer

    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(tiny_target)
    assert f"target folder {tiny_target} has no tokenizer: missing tokenizer.json" in str(err.value)
    assert "tokenizer_config.json" in str(err.value)
