"""Bad inputs and configurations: each gives ``error (rank N): ...`` naming the file, line or field and exit code 2
through ``run.main`` (argparse errors: SystemExit 2 naming the flag; a full disk: ``EXIT_WRITE_FAILED``), or a
counted skip; never a traceback.

All single-process cases share one gloo process (``run_ranks(1, run_jobs, ...)``), the tp/cp cases one 2-rank group.
"""
from __future__ import annotations

import json
import shutil

import pytest
from helpers.faults import Job, run_jobs
from helpers.ranks import run_ranks
from helpers.training import ROOT, train_argv, write_ds_config

from recipe.io_errors import EXIT_WRITE_FAILED
from recipe.export import LATEST
from recipe.train.sampler import StepSampler

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _store_variant(store, folder, edit):
    shutil.copytree(store, folder)
    edit(folder)
    return folder


def _truncate(folder):
    shard = sorted(folder.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])


def _corrupt_header(folder):
    shard = sorted(folder.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:16] = b"\xff" * 16  # same size, garbage header length
    shard.write_bytes(bytes(data))


def _version_1(folder):
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "version": 1}))


def _shard_count(folder):
    index = json.loads((folder / "index.json").read_text())
    index["num_shards"] += 1
    (folder / "index.json").write_text(json.dumps(index))


def _write(path, text: str | bytes):
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _chat(*turns):
    return json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]})


@pytest.fixture(scope="module")
def cases(tiny_target_and_store, other_tiny_target, assets, tmp_path_factory):
    """Run every single-process bad case once; return {name: (Outcome, expected fragments, tmp folder)}."""
    tmp = tmp_path_factory.mktemp("bad")
    target, store = tiny_target_and_store
    online = shutil.copytree(target, tmp / "online_target")
    for name in TOKENIZER_FILES:
        shutil.copy(assets.target / name, online / name)
    no_template = shutil.copytree(target, tmp / "no_template")
    for name in TOKENIZER_FILES[:2]:
        shutil.copy(assets.target / name, no_template / name)
    other_target = other_tiny_target
    cfg = write_ds_config(tmp / "z0.json", train_batch_size=2, train_micro_batch_size_per_gpu=2)
    accum = write_ds_config(tmp / "accum.json", train_batch_size=2, train_micro_batch_size_per_gpu=1)
    bad_json = _write(tmp / "bad.json", '{"train_batch_size": 2,\n  "optimizer": {oops}\n}')
    unknown_key = write_ds_config(tmp / "unknown.json", parallelism={"tp_size": 1, "pp_size": 2})
    zero_batch = write_ds_config(tmp / "zero_batch.json", train_batch_size=0)
    tp2 = write_ds_config(tmp / "tp2.json", parallelism={"tp_size": 2})
    draft_overrides = _write(tmp / "draft.json", '{"num_heads": 4}')
    not_a_dir = _write(tmp / "a_file", "x")
    long_user = " ".join(["word"] * 200)
    data = {
        "malformed": _write(tmp / "malformed.jsonl", '{"conversations": [\n{oops}\n'),
        "empty": _write(tmp / "empty.jsonl", ""),
        "schema": _write(tmp / "schema.jsonl", '{"text": "hello"}\n{"prompt": "a", "answer": "b"}\n'),
        "latin1": _write(tmp / "latin1.jsonl",  # "café" in Latin-1: byte 0xe9 is not UTF-8
                         _chat(("human", "cafe"), ("gpt", "ok")).encode().replace(b"cafe", b"caf\xe9") + b"\n"),
        "no_assistant": _write(tmp / "no_assistant.jsonl", _chat(("human", "hi"), ("human", "again")) + "\n"),
        "too_long": _write(tmp / "too_long.jsonl", _chat(("human", long_user), ("gpt", "ok")) + "\n"),
        "extension": _write(tmp / "data.txt", _chat(("human", "hi"), ("gpt", "ok")) + "\n"),
    }

    def offline(name, *extra, cfg=cfg, target=target, store=store):
        return train_argv(cfg, target, store, tmp / name, "--max-steps", "3", "--no-export", *extra)

    def online_argv(name, file, *extra, target=online):
        return ["--ds_config", str(cfg), "--target", str(target), "--data", str(file), "--output", str(tmp / name),
                "--max-length", "16", "--draft-vocab-size", "64", "--cache-dir", str(tmp / "cache"), *extra]

    nan_step = next(s for s in range(12) if 5 in StepSampler(24, 2, 0).step_indices(s)) + 1
    table = {  # name: (job, expected fragments of the error line)
        "ds_config_missing": (Job(offline("o1", cfg=tmp / "nope.json")), ["nope.json", "cannot read DeepSpeed config"]),
        "ds_config_invalid_json": (Job(offline("o2", cfg=bad_json)), ["bad.json", "invalid JSON at line 2"]),
        "unknown_parallelism_key": (Job(offline("o3", cfg=unknown_key)), ["unknown key(s) ['pp_size']",
                                                                        "'parallelism'"]),
        "unknown_draft_override": (Job(offline("o3b", "--draft-config", str(draft_overrides))),
                                   ["draft.json", "unknown draft config key(s) ['num_heads']"]),
        "zero_batch": (Job(offline("o4", cfg=zero_batch)), ["zero_batch.json", "train_batch_size must be a positive"]),
        "tp_not_dividing_world": (Job(offline("o5", cfg=tp2)), ["world_size=1", "tp=2", "not divisible"]),
        "resume_nothing": (Job(offline("o6", "--resume")), ["no checkpoint to resume from", "o6/checkpoints/latest"]),
        "output_not_writable": (Job(train_argv(cfg, target, store, not_a_dir / "out")),
                                ["--output", "a_file/out", "not a writable folder"]),
        "target_missing_offline": (Job(offline("o7", target=tmp / "no_target")),
                                   ["no_target", "not a target model folder"]),
        "target_missing_online": (Job(online_argv("o8", data["no_assistant"], target=tmp / "no_target")),
                                  ["target folder not found", "no_target"]),
        "store_other_target": (Job(offline("o9", target=other_target)), ["incompatible", "target fingerprint"]),
        "store_other_layers": (Job(offline("o10", "--aux-layer-ids", "1,2,3")),
                               ["incompatible", "aux_layer_ids [1, 3, 4] != requested [1, 2, 3]"]),
        "store_missing_index": (Job(offline("o11", store=tmp / "no_store")), ["no_store/index.json", "no index"]),
        "store_truncated_shard": (Job(offline("o12", store=_store_variant(store, tmp / "s_trunc", _truncate))),
                                  ["shard-r000-00000.safetensors", "truncated"]),
        "store_corrupt_shard": (Job(offline("o13", store=_store_variant(store, tmp / "s_corrupt", _corrupt_header))),
                                ["shard-r000-00000.safetensors", "unreadable safetensors file"]),
        "store_shard_count": (Job(offline("o14", store=_store_variant(store, tmp / "s_count", _shard_count))),
                              ["s_count", "expected num_shards="]),
        "store_version_1": (Job(offline("o15", store=_store_variant(store, tmp / "s_v1", _version_1))),
                            ["s_v1/index.json", "written by an older version of this recipe (store version 1, no "
                             "'target_argmax'", "python -m recipe.dump"]),
        "cuda_out_of_memory": (Job(offline("m1", "--max-steps", "3", "--no-packing"), oom_at_step=2),
                               ["out of memory at step 2 on a micro-batch of 2 sample(s) padded to 20 tokens on rank 0",
                                "cpu: no allocator statistics", '"loss_chunk_size": 4096', "checkpoint_ttt_steps",
                                'a smaller "memory.attention_tile_size" (now 1024)', "a larger cp_size (now 1",
                                "--max-length (now 2048)",
                                "Tried to allocate 20.00 GiB (injected)"]),
        "data_malformed_jsonl": (Job(online_argv("d1", data["malformed"])),
                                 ["malformed.jsonl", "no usable conversation", "invalid_json", "rows 1, 2"]),
        "data_empty": (Job(online_argv("d2", data["empty"])), ["empty.jsonl", "empty"]),
        "data_schema": (Job(online_argv("d3", data["schema"])), ["schema.jsonl", "no conversation column",
                                                              "keys ['answer', 'prompt', 'text']", "--data-column"]),
        "data_non_utf8": (Job(online_argv("d4", data["latin1"])), ["latin1.jsonl", "non_utf8 1 [rows 1]"]),
        "data_no_assistant": (Job(online_argv("d5", data["no_assistant"])), ["no_assistant.jsonl",
                                                                              "no_assistant_turn 1 [rows 1]"]),
        "data_all_too_long": (Job(online_argv("d6", data["too_long"])), ["too_long.jsonl",
                                                                          "no_supervised_tokens 1 [rows 1]"]),
        "data_extension": (Job(online_argv("d7", data["extension"])), ["data.txt", "unknown conversation file"]),
        "target_no_chat_template": (Job(online_argv("d8", data["no_assistant"], target=no_template)),
                                    ["no_template", "has no chat template"]),
        "nonfinite_loss": (Job(offline("n1", "--max-steps", str(nan_step + 1), "--no-packing"), nan_sample=5),
                           [f"non-finite loss at step {nan_step}", "rank(s) [0]", "samples [", "--skip-nonfinite"]),
        "skip_nonfinite_needs_accum_1": (Job(offline("n2", "--skip-nonfinite", cfg=accum)),
                                         ["--skip-nonfinite needs gradient_accumulation_steps = 1", "got 2"]),
        "disk_full_setup": (Job(offline("full", "--max-steps", "2")), []),
        "disk_full": (Job(offline("full", "--max-steps", "4", "--resume", "--extend"), enospc=True),
                      ["saving checkpoint", "step-00000004", "(rank 0: ", "rng-rank00000.safetensors: No space left "
                       "on device", "the previous checkpoint step-00000002 is intact"]),
    }
    skip = Job(offline("n3", "--max-steps", str(nan_step + 1), "--skip-nonfinite", "--no-packing"), nan_sample=5)
    # about 30 runs of run.py in one process: minutes on a loaded 2-core machine (a cold DeepSpeed JIT build of its
    # CPU all-reduce op may fall in here too), so more than run_ranks' default allowance
    outcomes = run_ranks(1, run_jobs, [job for job, _ in table.values()] + [skip], timeout=1800)[0]
    result = {name: (out, table[name][1]) for name, out in zip(table, outcomes)}
    result["skip_nonfinite"] = (outcomes[-1], nan_step)
    result["_tmp"] = tmp
    return result


SINGLE = ["ds_config_missing", "ds_config_invalid_json", "unknown_parallelism_key", "unknown_draft_override",
          "zero_batch", "tp_not_dividing_world", "resume_nothing", "output_not_writable", "target_missing_offline",
          "target_missing_online", "store_other_target", "store_other_layers", "store_missing_index",
          "store_truncated_shard", "store_corrupt_shard", "store_shard_count", "store_version_1", "cuda_out_of_memory",
          "data_malformed_jsonl", "data_empty",
          "data_schema", "data_non_utf8", "data_no_assistant", "data_all_too_long", "data_extension",
          "target_no_chat_template", "nonfinite_loss", "skip_nonfinite_needs_accum_1", "disk_full"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE)
def test_bad_input_gives_a_clear_error(cases, name):
    out, fragments = cases[name]
    expected = EXIT_WRITE_FAILED if name == "disk_full" else 2  # output that cannot be written: the run is not done
    assert out.rc == expected, f"{name}: rc {out.rc}\n{out.stderr}"
    lines = [line for line in out.stderr.splitlines() if line.startswith("error (rank 0): ")]
    assert lines, out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, f"{name}: {fragment!r} not in\n{out.stderr}"
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_disk_full_keeps_the_previous_checkpoint(cases):
    checkpoints = cases["_tmp"] / "full" / "checkpoints"
    assert cases["disk_full_setup"][0].rc == 0
    assert (checkpoints / LATEST).read_text().strip() == "step-00000002"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002"]
    assert not (checkpoints / ".partial" / "step-00000004").exists()
    assert (checkpoints / "step-00000002" / "draft.safetensors").is_file()


@pytest.mark.slow
def test_skip_nonfinite_counts_and_skips_the_step(cases):
    out, nan_step = cases["skip_nonfinite"]
    assert out.rc == 0, out.stderr
    records = {r["step"]: r for r in out.metrics}
    assert sorted(records) == list(range(1, nan_step + 2))
    skipped = records[nan_step]
    assert "loss" not in skipped and f"non-finite loss at step {nan_step}" in skipped["skipped"]
    assert "5" in skipped["skipped"].split("samples")[1]
    # the optimizer and the warmup scheduler did not move: the next step sees the same learning rate
    assert records[nan_step + 1]["lr"] == skipped["lr"]
    assert all(r["loss"] == r["loss"] for s, r in records.items() if s != nan_step)  # finite elsewhere
    assert f"skipped 1 step(s) with a non-finite loss: [{nan_step}]" in out.stderr


@pytest.mark.slow
def test_malformed_lines_among_good_ones_are_counted_skips(assets, tmp_path):
    from recipe.data.examples import build_examples
    from recipe.target.capture import load_tokenizer

    lines = [_chat(("human", "hi"), ("gpt", "hello")), "{oops", _chat(("human", "x")), '{"text": 1}',
             _chat(("human", "what"), ("gpt", "that"))]
    path = _write(tmp_path / "mixed.jsonl", "\n".join(lines) + "\n")
    dataset, data_report = build_examples(path, load_tokenizer(assets.target), 64, cache_dir=str(tmp_path / "c"))
    (report,) = data_report.files
    assert len(dataset) == 2 and list(dataset["row"]) == [1, 5]
    assert report.kept == 2 and report.skipped == {"invalid_json": 1, "no_assistant_turn": 1, "unknown_schema": 1}
    assert report.example_rows == {"invalid_json": [2], "no_assistant_turn": [3], "unknown_schema": [4]}


@pytest.mark.parametrize("flag,value,message", [
    ("--max-length", "0", "argument --max-length: bad length '0': must be a positive whole number of tokens"),
    ("--max-length", "32q", "argument --max-length: bad length '32q': expected an integer or a number followed by k"),
    ("--max-steps", "-1", "argument --max-steps: must be a positive integer, got -1"),
    ("--ttt-steps", "0", "argument --ttt-steps: must be a positive integer, got 0"),
    ("--save-every", "-2", "argument --save-every: must be a non-negative integer, got -2"),
    ("--epochs", "0", "argument --epochs: must be a positive finite number, got 0"),
    ("--keep-checkpoints", "0", "argument --keep-checkpoints: must be a positive integer, got 0"),
    ("--aux-layer-ids", "1,x", "argument --aux-layer-ids: expected comma-separated integers"),
])
def test_bad_flag_values_name_the_flag(flag, value, message, capsys, tmp_path):
    import sys

    sys.path.insert(0, str(ROOT))
    from run import main

    with pytest.raises(SystemExit) as exc:
        main(["--ds_config", "x.json", "--target", "t", "--hidden-states", "s", "--output", str(tmp_path), flag, value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_data_and_hidden_states_are_exclusive(capsys, tmp_path):
    from run import main

    with pytest.raises(SystemExit) as exc:
        main(["--ds_config", "x.json", "--target", "t", "--output", str(tmp_path)])
    assert exc.value.code == 2 and "give exactly one of --data" in capsys.readouterr().err


@pytest.mark.slow
def test_parallel_layout_errors_on_two_ranks(tiny_target_and_store, tmp_path):
    target, store = tiny_target_and_store
    tp2 = write_ds_config(tmp_path / "tp2.json", base="zero3_tp2.json", train_batch_size=2)
    cp2 = write_ds_config(tmp_path / "cp2.json", base="zero3_cp2.json", train_batch_size=2)
    tp2cp2 = write_ds_config(tmp_path / "tp2cp2.json", base="zero3_tp2_cp2.json", train_batch_size=2)
    heads = _write(tmp_path / "heads.json", '{"num_attention_heads": 3, "num_key_value_heads": 1}')
    jobs = [Job(train_argv(tp2, target, store, tmp_path / "a", "--draft-config", str(heads))),
            Job(train_argv(cp2, target, store, tmp_path / "b", "--max-length", "3")),
            Job(train_argv(tp2cp2, target, store, tmp_path / "c"))]
    heads_out, short_out, grid_out = run_ranks(2, run_jobs, jobs)[0]
    for out in (heads_out, short_out, grid_out):
        assert out.rc == 2 and "error (rank 0): " in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "tp=2 must divide" in heads_out.stderr and "num_attention_heads=3" in heads_out.stderr
    assert "--max-length = 3 is shorter than 2·cp·tp = 4 (cp=2, tp=1)" in short_out.stderr
    assert "world_size=2" in grid_out.stderr and "cp=2, tp=2" in grid_out.stderr
