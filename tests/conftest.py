import functools
import multiprocessing.process
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the helpers package: ``from helpers.ranks import run_ranks``
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    """A build of DeepSpeed's CPU comm op killed in an earlier session (a timeout, Ctrl-C) leaves torch's build lock
    behind, and every test that sets up DeepSpeed would wait on it forever: remove such a stale lock first."""
    from recipe.lifecycle.distributed import clear_stale_build_locks

    clear_stale_build_locks()


# Fixtures that prepare the real SmolLM2 / ShareGPT / MT-Bench assets (minutes on a fresh checkout): a test that uses
# one, directly or through another fixture, belongs to `make test` only and must be marked slow.
REAL_ASSET_FIXTURES = frozenset({"assets", "real_store"})


def pytest_collection_modifyitems(config, items):
    """Keep the quick loop (``pytest -m "not slow"``) free of the real assets: refuse to run a test that reaches
    a fixture of ``REAL_ASSET_FIXTURES`` without ``@pytest.mark.slow`` (raises ``pytest.UsageError`` naming them)."""
    unmarked = [item.nodeid for item in items if item.get_closest_marker("slow") is None
                and REAL_ASSET_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError("these tests use the real assets (fixture " + " or ".join(sorted(REAL_ASSET_FIXTURES))
                                + ") but are not marked @pytest.mark.slow:\n  " + "\n  ".join(unmarked))


# Process starts of the pytest process (a subprocess: run.py, a launcher stand-in, a fresh interpreter, git; a
# multiprocessing child: gloo ranks, datasets workers), counted per test phase. The process still runs; a test without
# the slow mark that started one fails afterwards, asking for the mark.
_PROCESS_STARTS: list[str] = []


def _counted(start, kind: str):
    @functools.wraps(start)
    def counting_start(*args, **kwargs):
        _PROCESS_STARTS.append(kind)
        return start(*args, **kwargs)
    return counting_start


subprocess.Popen.__init__ = _counted(subprocess.Popen.__init__, "a subprocess")
_process = multiprocessing.process.BaseProcess
_process.start = _counted(_process.start, "a multiprocessing child")


def pytest_runtest_logstart(nodeid, location):
    _PROCESS_STARTS.clear()  # what collection or an earlier test's teardown started is not this test's


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail a phase (setup, call, teardown) of a test without ``@pytest.mark.slow`` that started a process."""
    report = (yield).get_result()
    started, _PROCESS_STARTS[:] = sorted(set(_PROCESS_STARTS)), []
    if started and report.passed and item.get_closest_marker("slow") is None:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {' and '.join(started)} during {report.when} but is not marked "
                           "@pytest.mark.slow (the quick loop, pytest -m 'not slow', starts no process)")


@pytest.fixture(scope="session")
def assets():
    """The real embedded assets (SmolLM2 target folder, ShareGPT JSONL, MT-Bench JSONL), prepared once.

    Returns recipe.assets.Assets; the cache lives in ``$RECIPE_CACHE`` or ``<repo>/.cache/recipe``.
    """
    from recipe.assets import prepare_assets

    return prepare_assets()


# The tiny target and its store are shared by every test of the session and must stay as built: a test that edits
# one (adds files, corrupts a shard) works on its own copy (``shutil.copytree``).
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Folder of a tiny random fp32 Llama target (vocab 96, hidden 32, 8 layers, 4 / 2 KV heads, seed 0), saved once
    (``helpers.tiny_target.save_tiny_llama``)."""
    from helpers.tiny_target import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_target") / "target")


@pytest.fixture(scope="session")
def other_tiny_target(tmp_path_factory) -> Path:
    """Folder of a second tiny target, the same architecture as ``tiny_target`` with weights of seed 1."""
    from helpers.tiny_target import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("other_tiny_target") / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_target_and_store(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """(``tiny_target``, folder of its fp32 offline hidden-state store of 24 random chats), dumped once
    (``helpers.tiny_target.dump_random_chats``)."""
    from helpers.tiny_target import dump_random_chats

    return tiny_target, dump_random_chats(tiny_target, tmp_path_factory.mktemp("tiny_store") / "store")


@pytest.fixture(scope="session")
def real_store(assets, tmp_path_factory):
    """(folder, flags) for offline runs on the real SmolLM2 target: an fp32 store of the first 24 ShareGPT
    conversations at max length 128 (``folder/store``, its tokenisation cache ``folder/cache``) and the ``run.py``
    flags every such run shares: the target, the store, a draft of 6 / 2 heads of 96 (SmolLM2's 9 / 3 heads do not
    split over tp = 2), draft vocabulary 2048, 3 TTT steps, seed 0, 2 epochs."""
    import json

    import torch

    from recipe.data.examples import build_examples
    from recipe.dump import dump_hidden_states
    from recipe.target.capture import TargetModel

    tmp = tmp_path_factory.mktemp("real_store")
    target = TargetModel(assets.target, dtype=torch.float32, device="cpu")
    examples, _ = build_examples(assets.conversations, target.load_tokenizer(), 128, limit=24,
                                 cache_dir=str(tmp / "cache"))
    dump_hidden_states(target, examples, tmp / "store", max_length=128, dtype="fp32", batch_size=8)
    del target
    heads = tmp / "heads.json"
    heads.write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 96}))
    flags = ["--target", str(assets.target), "--draft-config", str(heads), "--hidden-states", str(tmp / "store"),
             "--draft-vocab-size", "2048", "--ttt-steps", "3", "--seed", "0", "--epochs", "2",
             "--cache-dir", str(tmp / "cache")]
    return tmp, flags


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\n:;-()"


@pytest.fixture(scope="session")
def chat_target(tiny_target, tmp_path_factory):
    """The tiny target (vocab 96) with a character-level tokenizer: 3 special tokens + CHARS (< 96 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat_target") / "target"
    shutil.copytree(tiny_target, folder)
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS) + ["<unk>"])}
    assert len(vocab) <= 96
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder
