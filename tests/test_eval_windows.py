"""The draft's sliding window (``--draft-window-size``, ``--draft DIR@N``): drafting with a window against an
explicitly masked reference, the mask itself, the ``DIR@N`` syntax, and per-draft windows in one run."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
from helpers.tiny_draft import target_and_draft
from helpers.trees import assert_children_are_topk
from helpers.tolerance import FP64_REORDERED, assert_close_rel

from recipe.eval.by_length import evaluate_by_length
from recipe.eval.context import ContextPrompt
from recipe.eval.draft_runtime import EagleDrafter, window_mask
from recipe.eval.tree import TreeSpec
from recipe.eval.tree_draft import EagleTreeDrafter
from recipe.export import export_tensors, write_export
from recipe.model.draft import Eagle3Draft

VOCAB = 96  # the tiny test target's vocabulary, as in test_eval_context.py


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return target_and_draft(tiny_target)


def _explicit_attention(window):
    """A causal-block stand-in that masks explicitly: softmax over keys with ``q - window < k <= q`` (positions)."""
    def attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, _valid):
        rep = q_BHSD.shape[1] // k_BHkvSD.shape[1]
        k, v = k_BHkvSD.repeat_interleave(rep, 1), v_BHkvSD.repeat_interleave(rep, 1)
        scores = q_BHSD @ k.transpose(-1, -2) / math.sqrt(q_BHSD.shape[-1])
        allowed = torch.zeros(q_pos_BS.shape[1], k_pos_BS.shape[1], dtype=torch.bool)
        for i, qp in enumerate(q_pos_BS[0].tolist()):
            for j, kp in enumerate(k_pos_BS[0].tolist()):
                allowed[i, j] = kp <= qp and (window is None or kp > qp - window)
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v, None
    return attention


@pytest.mark.parametrize("window", [1, 3, 6, 100])
def test_draft_window_matches_an_explicitly_masked_reference(tiny, window, monkeypatch):
    """Chain drafting with ``window`` equals a full-cache drafter whose attention masks ``q - window < k <= q``
    explicitly (float64), also after a dropped chain and a second extend (queries in chunks of 3); tree drafting's
    children at every expanded node are the reference's top-k after that path."""
    monkeypatch.setattr("recipe.eval.draft_runtime.WINDOW_QUERY_CHUNK", 3)
    _, base = tiny
    draft = Eagle3Draft(base.config, seed=3).double().eval()
    ref_draft = Eagle3Draft(base.config, seed=3).double().eval()
    ref_draft.midlayer.self_attn.causal_attention = _explicit_attention(window)
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(14, 3 * base.config.target_hidden_size, generator=gen, dtype=torch.float64)
    nxt = torch.randint(0, VOCAB, (14,), generator=gen)
    got, ref = EagleDrafter(draft, window=window), EagleDrafter(ref_draft)
    for d in (got, ref):
        d.extend(aux[:8], nxt[:8])
        d.chain_step(torch.ones(base.config.hidden_size, dtype=torch.float64), 5, 1)
    h_got, h_ref = got.extend(aux[8:], nxt[8:]), ref.extend(aux[8:], nxt[8:])
    assert_close_rel(h_got, h_ref, FP64_REORDERED, "prefill")
    h_got, h_ref = h_got[-1], h_ref[-1]
    for step in range(1, 5):
        h_got, h_ref = got.chain_step(h_got, 7 + step, step), ref.chain_step(h_ref, 7 + step, step)
        assert_close_rel(h_got, h_ref, FP64_REORDERED, f"step {step}")
    if window == 100:  # a window longer than the sequence: exactly full attention's proposals
        full = EagleDrafter(Eagle3Draft(base.config, seed=3).double().eval())
        got.begin()
        assert got.propose(aux, nxt, 4) == full.propose(aux, nxt, 4)
    tree = EagleTreeDrafter(draft, window=window)
    tree.begin()
    spec = TreeSpec(topk=2, depth=3, budget=100)
    out = tree.propose_tree(aux, nxt, spec)
    assert_children_are_topk(out, ref, ref_draft, aux, nxt, 2)


def test_window_mask(tiny):
    allowed = window_mask(torch.tensor([4, 6]), torch.arange(8), 3)
    assert allowed.tolist() == [[j in (2, 3, 4) for j in range(8)], [j in (4, 5, 6) for j in range(8)]]
    assert window_mask(torch.tensor([2]), torch.arange(4), None).tolist() == [[True, True, True, False]]
    with pytest.raises(ValueError, match="window"):
        EagleDrafter(tiny[1], window=0)


def test_draft_spec_window_suffix(tmp_path):
    from recipe.eval.__main__ import draft_spec

    assert draft_spec("runs/x/export") == ("runs/x/export", Path("runs/x/export"), None)
    assert draft_spec("runs/x/export@256") == ("runs/x/export@256", Path("runs/x/export"), 256)
    for bad in ("export@0", "export@", "export@1k"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            draft_spec(bad)


def test_per_draft_windows_in_one_run_equal_separate_runs(tiny, tiny_target, tmp_path, monkeypatch):
    """``{label: window}``: one run with a draft served at full attention and with a window of 4 gives each the
    τ and tokens of a run with that window alone (the shared prefill changes nothing)."""
    target, draft = tiny
    folder = write_export(export_tensors(draft.state_dict()), draft.config.to_hf_dict(), tmp_path / "a")
    gen = torch.Generator().manual_seed(3)
    buckets = {30: [ContextPrompt(f"p{i}", "all", torch.randint(3, VOCAB, (35,), generator=gen).tolist(), 30, 30)
                    for i in range(2)]}
    import recipe.eval.by_length as by_length

    built = []
    real = by_length.EagleTreeDrafter
    monkeypatch.setattr(by_length, "EagleTreeDrafter",
                        lambda d, window, columns: built.append(window) or real(d, window=window, columns=columns))
    both = evaluate_by_length(tiny_target, {"full": folder, "w4": folder}, buckets, [3], 12, device="cpu",
                              window={"full": None, "w4": 4})
    assert built == [None, 4]
    alone = {w: evaluate_by_length(tiny_target, {"x": folder}, buckets, [3], 12, device="cpu", window=w)
             for w in (None, 4)}
    assert both["draft_window_sizes"] == {"full": None, "w4": 4}
    runs = {r["draft"]: r for r in both["lengths"][0]["runs"]}
    for label, w in (("full", None), ("w4", 4)):
        ref = alone[w]["lengths"][0]["runs"][0]
        assert runs[label]["tau"] == ref["tau"] and runs[label]["accepted_per_position"] == ref["accepted_per_position"]
