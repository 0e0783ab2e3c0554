"""The one evaluation engine (``recipe.eval.by_length``): a draft in every layout ``run.py --init-draft`` reads (the
EAGLE repository's ``midlayer.*`` pickle whose config states no aux layers, a ``model.layers.0.*`` safetensors file
with no config and no t2d) gives the same τ, per-prompt counts and acceptance per position as the same weights in
this project's export layout; plain evaluation (``evaluate``) is the engine's one-length case, with either greedy
reference."""
from __future__ import annotations

import pytest
import torch
from helpers.drafts import eagle_repo_layout, layers0_file, make_export

import recipe.eval.by_length as by_length
from recipe.eval.context import ContextPrompt
from recipe.eval.draft_runtime import read_draft
from recipe.eval.prompts import Prompt, prompt_ids
from recipe.eval.tree import TreeSpec

VOCAB = 96
COUNTS = ("tau", "verify_steps", "new_tokens", "drafted_per_position", "accepted_per_position", "per_prompt")


def _counts(run: dict) -> dict:
    return {key: run[key] for key in COUNTS}


class Words:
    """A chat template and tokenizer stand-in: one id in [3, VOCAB) per word of the rendered turn."""

    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + sum(map(ord, w)) % (VOCAB - 3) for w in text.split()]}


@pytest.fixture(scope="module")
def layouts(tiny_target, tmp_path_factory):
    """label -> the same draft weights as an export folder, an EAGLE-repository folder and a layers.0 file (seed 7:
    a random draft that a few verification steps accept, so the counts compared below are not all zero)."""
    tmp = tmp_path_factory.mktemp("layouts")
    export = make_export(tiny_target, tmp / "export", seed=7)
    return {"export": export, "eagle": eagle_repo_layout(export, tmp / "eagle"),
            "layers0": layers0_file(export, tmp / "layers0.safetensors")}


PROMPTS = [Prompt(f"p{i}", "all", " ".join(f"w{i}x{j}" for j in range(n))) for i, n in enumerate((9, 23, 14, 31))]


def _bucket(n: int = 6) -> list[ContextPrompt]:
    gen = torch.Generator().manual_seed(7)
    return [ContextPrompt(f"p{i}", "all", torch.randint(3, VOCAB, (length,), generator=gen).tolist(), 0, 0)
            for i, length in enumerate((9, 23, 14, 31, 12, 40)[:n])]


def test_every_init_draft_layout_reads_the_export_s_draft(tiny_target, layouts):
    """``read_draft``: the same tensors and the same config (the EAGLE folder states no aux layers: the target's
    defaults, which the export states; the layers.0 file has no config: all from the target)."""
    config = by_length.target_config(tiny_target)
    tensors, draft_config = read_draft(layouts["export"], config)
    assert draft_config.aux_layer_ids == [1, 3, 4] and draft_config.draft_vocab_size == 64
    for label in ("eagle", "layers0"):
        other, other_config = read_draft(layouts[label], config)
        assert other_config == draft_config and sorted(other) == sorted(tensors)
        assert all(torch.equal(other[name], tensors[name]) for name in tensors), label


def test_every_init_draft_layout_gives_the_export_s_tau(tiny_target, layouts, tmp_path):
    """One run with the three layouts, chain at k 1 and 3 and a tree: equal τ, per-prompt counts and acceptance
    per position, some draft tokens accepted; the same weights reading other aux layers give other counts."""
    other = make_export(tiny_target, tmp_path / "other_aux", seed=7, aux_layer_ids=[0, 2, 6])
    result = by_length.evaluate_by_length(tiny_target, {**layouts, "other": other}, {0: _bucket()}, [1, 3], 32,
                                          device="cpu", tree=TreeSpec(2, 3, 5))
    entry = result["lengths"][0]
    runs = {(r["draft"], r["num_draft_tokens"], "tree" in r): r for r in entry["runs"] + entry["tree_runs"]}
    for k, is_tree in ((1, False), (3, False), (3, True)):
        export = _counts(runs["export", k, is_tree])
        assert sum(export["accepted_per_position"]) > 0 and export["new_tokens"] == 6 * 32
        assert _counts(runs["eagle", k, is_tree]) == export
        assert _counts(runs["layers0", k, is_tree]) == export
        assert _counts(runs["other", k, is_tree]) != export
    assert result["draft_dtypes"] == dict.fromkeys(("export", "eagle", "layers0", "other"), "float32")


def test_plain_evaluation_is_the_one_length_case(tiny_target, layouts, monkeypatch):
    """``evaluate`` on prompts = ``evaluate_by_length`` at length 0 on their rendered ids, count for count, with the
    sequential and the batched greedy reference; the plain keys at the top (``tau``, ``runs``, ``tree_runs``)."""
    monkeypatch.setattr(by_length, "load_tokenizer", lambda _path: Words())
    drafts = {"eagle": layouts["eagle"]}
    tree = TreeSpec(2, 2, 3)
    bucket = [ContextPrompt(p.name, p.category, prompt_ids(Words(), p), 0, 0) for p in PROMPTS]
    entry = by_length.evaluate_by_length(tiny_target, drafts, {0: bucket}, [2], 16, device="cpu",
                                         tree=tree)["lengths"][0]
    for reference in ("sequential", "batched"):
        plain = by_length.evaluate(tiny_target, drafts, PROMPTS, [2], 16, tree=tree, device="cpu",
                                   reference=reference)
        assert [_counts(r) for r in plain["runs"] + plain["tree_runs"]] == \
            [_counts(r) for r in entry["runs"] + entry["tree_runs"]]
        assert plain["tau"] == entry["tau"] and plain["tau_tree"] == entry["tau_tree"]
        assert plain["num_prompts"] == 4 and plain["num_draft_tokens"] == 2 and plain["reference"] == reference
        assert plain["tree"] == {"topk": 2, "depth": 2, "budget": 3} and plain["mismatches"] == []
        assert plain["greedy_tokens_per_s"] > 0


def test_one_position_limit_for_plain_and_by_length(tiny_target, layouts, monkeypatch):
    """The target's 256 positions less 16 new and 3 + 1 drafted leave 236 prompt tokens: both entry points refuse a
    prompt of 237 naming it, and the bucketing limit is the same number."""
    monkeypatch.setattr(by_length, "load_tokenizer", lambda _path: Words())
    config = by_length.target_config(tiny_target)
    assert by_length.prompt_token_limit(config, 16, [3], None) == 256 - 16 - 4
    assert by_length.prompt_token_limit(config, 16, [3], TreeSpec(2, 2, 5)) == 256 - 16 - 6
    long = Prompt("long", "all", " ".join(f"w{j}" for j in range(237 - 2)))  # + "<user>", "<assistant>"
    with pytest.raises(ValueError, match="prompt 'long'.*237 tokens.*max_position_embeddings 256"):
        by_length.evaluate(tiny_target, {"d": layouts["export"]}, [long], [3], 16, device="cpu")
    with pytest.raises(ValueError, match="prompt 'long' at context 0: 237 tokens"):
        by_length.evaluate_by_length(tiny_target, {"d": layouts["export"]},
                                     {0: [ContextPrompt("long", "all", [3] * 237, 0, 0)]}, [3], 16, device="cpu")


def test_a_wrong_shape_is_named_in_the_file_passed(tiny_target, layouts, tmp_path):
    """A draft file of the wrong geometry: the problem names that file, not the export's ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(layouts["layers0"]))
    tensors["model.fc.weight"] = tensors["model.fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "wrongfc.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)--draft .*wrongfc\.safetensors: not a loadable EAGLE-3 draft .*\n  "
                                         r"wrongfc\.safetensors: 'fc\.weight' has shape"):
        read_draft(tmp_path / "wrongfc.safetensors", by_length.target_config(tiny_target))
