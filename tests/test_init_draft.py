"""``run.py --init-draft``: an existing EAGLE-3 draft (this project's export, the EAGLE repository's ``midlayer.*``
pickle, a ``model.layers.0.*`` safetensors file) loads into the single-device model weight for weight with its
vocabulary map; a wrong geometry, missing or extra keys, a disagreeing ``--draft-vocab-size`` or aux layers, and a
pickle that needs more than ``weights_only`` are refused naming what is wrong; ``--resume`` accepts only the draft
the run started from. The end-to-end first-step loss (tp1, tp2, cp2) is ``tests/test_init_draft_training.py``."""
from __future__ import annotations

import pickle

import pytest
import torch
from helpers.drafts import eagle_repo_layout, export_weights, layers0_file, make_export
from transformers import AutoConfig

from recipe.model.draft import Eagle3Draft
from recipe.model.ttt import TTTModel
from recipe.target.registry import draft_config_for
from recipe.train import init_draft


def _load(target, path, requested_vocab=None, overrides=None):
    """What ``build_run`` does with ``--init-draft path``: (model with the draft loaded, InitDraft, notes)."""
    hf = AutoConfig.from_pretrained(target)
    init = init_draft.prepare(path, requested_vocab, hf.vocab_size, dict(overrides or {}))
    config = draft_config_for(hf, init.draft_vocab_size, init.overrides)
    init_draft.check_geometry(init, config, hf.num_hidden_layers)
    draft = Eagle3Draft(config, seed=0)
    model = TTTModel(draft, torch.zeros(config.vocab_size, config.target_hidden_size)[:config.draft_vocab_size],
                     sparse_anchors=False)
    init_draft.load_into(model, init)
    return model, init, init.notes + init_draft.setting_notes(init, config)


def _assert_loaded(model, export):
    state = model.draft.state_dict()
    for name, value in export_weights(export).items():
        assert torch.equal(state[name], value), name  # every tensor, bit for bit (fp32 export into fp32 model)
    assert not torch.equal(state["embed_tokens.weight"], torch.zeros_like(state["embed_tokens.weight"]))


@pytest.fixture(scope="module")
def export(tiny_target, tmp_path_factory):
    return make_export(tiny_target, tmp_path_factory.mktemp("init") / "export")


def test_this_projects_export_loads_weight_for_weight(tiny_target, export):
    model, init, notes = _load(tiny_target, export)
    _assert_loaded(model, export)
    fresh = Eagle3Draft(model.draft.config, seed=0).state_dict()
    assert not torch.equal(fresh["fc.weight"], model.draft.fc.weight)  # the comparison above is not vacuous
    record = init.record()
    assert record["layout"] == "midlayer" and record["format"] == "safetensors" and len(record["sha256"]) == 64
    assert record["draft_vocab_size"] == 64
    assert len(notes) == 1 and notes[0].startswith(f"starting from the draft {export} (midlayer layout, safetensors")


def test_eagle_repository_layout_loads(tiny_target, export, tmp_path):
    folder = eagle_repo_layout(export, tmp_path / "eagle")
    model, init, notes = _load(tiny_target, folder)
    _assert_loaded(model, export)
    assert init.imported.file_format == "pytorch (weights_only)" and init.imported.layout == "midlayer"
    assert init.imported.dropped == ["embed_tokens.weight"]
    assert any("does not state its aux layers" in n for n in notes)
    assert any("embed_tokens.weight is not used" in n for n in notes)


def test_layers0_safetensors_file_without_t2d_loads(tiny_target, export, tmp_path):
    file = layers0_file(export, tmp_path / "draft.safetensors")
    model, init, _ = _load(tiny_target, file)
    _assert_loaded(model, export)  # t2d rebuilt from d2t and the target's vocabulary size
    assert init.imported.layout == "layers.0 +model. prefix"


def test_wrong_geometry_is_refused_naming_the_field(tiny_target, tmp_path):
    narrow = make_export(tiny_target, tmp_path / "narrow", intermediate_size=48)
    with pytest.raises(ValueError, match=r"intermediate_size: draft 48 \(midlayer.mlp.gate_proj.weight\), run 64"):
        _load(tiny_target, narrow)
    # same q/k/v shapes (2 heads of 16 = 4 heads of 8 = 32 rows), other heads: named from the draft's config.json
    heads = make_export(tiny_target, tmp_path / "heads", num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError) as err:
        _load(tiny_target, heads)
    assert "num_attention_heads: draft 2 (config.json), run 4" in str(err.value)
    assert "head_dim: draft 16 (config.json), run 8" in str(err.value)
    with pytest.raises(ValueError, match=r"aux_layer_ids: draft \[1, 3, 9\], but the target has 8 decoder layers"):
        _load(tiny_target, make_export(tiny_target, tmp_path / "deep", aux_layer_ids=[1, 3, 9]))


def test_missing_and_extra_keys_are_named(tiny_target, export, tmp_path):
    file = layers0_file(export, tmp_path / "no_norm.safetensors", drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(ValueError, match="missing key 'midlayer.hidden_norm.weight'"):
        _load(tiny_target, file)
    from safetensors.torch import save_file

    extra = {**export_weights(export), "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected key 'midlayer.self_attn.rotary_emb.inv_freq'"):
        _load(tiny_target, tmp_path / "extra.safetensors")


def test_disagreeing_vocab_size_or_aux_layers_are_refused(tiny_target, export):
    _load(tiny_target, export, requested_vocab=64)  # the same size: fine
    with pytest.raises(ValueError, match="--draft-vocab-size 10000 disagrees"):  # capped at the target's 96 != 64
        _load(tiny_target, export, requested_vocab=10_000)
    with pytest.raises(ValueError, match="--draft-vocab-size 32 disagrees with the draft .*: its vocabulary map has "
                                         "64 tokens"):
        _load(tiny_target, export, requested_vocab=32)
    with pytest.raises(ValueError, match=r"aux_layer_ids: the draft .* reads target layers \[1, 3, 4\].* asks for "
                                         r"\[1, 2, 3\]"):
        _load(tiny_target, export, overrides={"aux_layer_ids": [1, 2, 3]})


class _Marker:
    """Unpickling this would create the file ``path`` (what a malicious pickle could do instead)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_is_read_only_with_weights_only(tiny_target, export, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    folder = tmp_path / "evil"
    folder.mkdir()
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": torch.zeros(2), "payload": _Marker(marker)}, f)
    with pytest.raises(ValueError, match=r"refused: .*torch.load\(weights_only=True\) so that no code in it runs"):
        _load(tiny_target, folder)
    assert not marker.exists()  # nothing of the pickle ran
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    _load(tiny_target, eagle_repo_layout(export, tmp_path / "eagle"))
    assert calls and all(kw.get("weights_only") is True for kw in calls)


def test_resume_takes_only_the_draft_the_run_started_from(tiny_target, export, tmp_path):
    init = init_draft.prepare(export, None, 96, {})
    note = init_draft.check_resume({"init_draft": init.record()}, init, tmp_path)
    assert "the draft file is only compared" in note
    with pytest.raises(ValueError, match="started from another draft"):
        init_draft.check_resume({"init_draft": {**init.record(), "sha256": "0" * 64}}, init, tmp_path)
    with pytest.raises(ValueError, match="did not start from a draft; drop --init-draft"):
        init_draft.check_resume({}, init, tmp_path)


def test_cli_draft_vocab_default_is_the_drafts_with_init_draft():
    from recipe.train.flags import DEFAULT_DRAFT_VOCAB, parse_args

    base = ["--ds_config", "c.json", "--target", "t", "--hidden-states", "s", "--output", "o"]
    assert parse_args(base).draft_vocab_size == DEFAULT_DRAFT_VOCAB
    args = parse_args(base + ["--init-draft", "d"])
    assert args.draft_vocab_size is None and str(args.init_draft) == "d"
    assert parse_args(base + ["--init-draft", "d", "--draft-vocab-size", "8"]).draft_vocab_size == 8


def test_other_rope_in_the_drafts_config_is_named_and_the_targets_used(tiny_target, export, tmp_path):
    import json

    folder = eagle_repo_layout(export, tmp_path / "eagle")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 500.0, "max_position_embeddings": 64}))
    model, _, notes = _load(tiny_target, folder)
    note = next(n for n in notes if "was configured with" in n)
    assert "rope_theta 500.0, max_position_embeddings 64" in note
    assert "trains and exports it with rope_theta 10000.0, max_position_embeddings 256" in note
    assert model.draft.config.rope_theta == 10000.0 and model.draft.config.max_position_embeddings == 256
