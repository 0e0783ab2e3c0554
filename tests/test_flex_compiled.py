"""The compiled flex path on the CPU: flex attention through ``torch.compile`` on Dynamo's ``aot_eager`` backend, so
through AOTAutograd's joint graph (the gradient through the returned LSE, the tensors the block mask's function
captures, grouped-query heads), with gradients: directly, in the ring's per-pair recompute and inside ``TTTModel``
with per-step checkpointing, against the tiled reference in float32 (≤ 1e-5); the online (training micro-batches of
varying length) and eval (KV-cache prefill and chain steps) shape sequences replayed with their compiles counted.

torch's ``flex_attention`` refuses a CPU input that requires grad, a Python check made because Inductor's CPU flex
kernel is inference-only and returns no LSE (the last test pins that); under ``aot_eager`` the same higher-order op
runs its reference implementation forward and backward, so the ``aot_flex`` fixture lifts the check for the test.
What stays for a GPU: Inductor's Triton kernels themselves (``tests/test_attention_backends.py``'s CUDA cases)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.utils import counters

from kernels.attention_backends import make_causal_attention
from kernels.flex_attention import CompiledFlex, FlexCausalAttention, FlexCompileError, make_flex_kernel
from kernels.tiled_attention import TiledCausalAttention
from recipe.model.ttt import TTTModel
from helpers.attention import attention_case, run_attention
from helpers.cases import assert_same_run, build_case, model_pair, run_model
from helpers.tolerance import FP32_REORDERED, assert_close_rel

TOL = FP32_REORDERED  # flex (compiled through aot_eager or eager) against the tiled kernel: another summation order
KINDS = ["square", "subset", "later", "mixed"]


@pytest.fixture
def aot_flex(monkeypatch):
    """A fresh :class:`CompiledFlex` on ``aot_eager``, with Dynamo's caches and counters reset around the test and
    torch's CPU-backward refusal lifted (module docstring)."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    torch._dynamo.reset()
    counters.clear()
    yield CompiledFlex(backend="aot_eager")
    assert not counters["graph_break"], dict(counters["graph_break"])  # fullgraph: a break would have raised
    torch._dynamo.reset()


def _flex(how: str, compiled: CompiledFlex, tile: int = 5):
    """The flex causal block as the draft calls it on one device ("direct") or through the ring's tile loop with
    the per-pair recompute backward ("ring-pair")."""
    if how == "direct":
        return FlexCausalAttention(compiled=compiled)
    return TiledCausalAttention(tile, make_flex_kernel(compiled=compiled))


def _assert_same_attention(got, ref):
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, ref
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # rows with no readable key: -inf
    finite = torch.isfinite(ref_lse)
    assert_close_rel(out, ref_out, TOL, "out")
    assert_close_rel(lse[finite], ref_lse[finite], TOL, "lse")
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert r.abs().sum() > 0, name
        assert_close_rel(g, r, TOL, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how, compiles", [("direct", 1), ("ring-pair", 2)])
def test_compiled_flex_with_gradients_matches_the_tiled_reference(aot_flex, how, compiles, kind):
    """out, lse, dq, dk, dv of ``Σ out·w + Σ lse·u`` (padding, GQA 4/2, rows with no readable key, Sq != Sk), head
    dim 16, float32, vs the tiled reference. Compiles: one graph directly; in the ring (tiles of 5 over 16 keys:
    pairs of 5 and 1 positions) the detached pair forward (an inference graph) and the recompute under autograd (a
    training graph), whatever the pair sizes."""
    case = attention_case(kind, dtype=torch.float32, d=16)
    got = run_attention(_flex(how, aot_flex), *case)
    ref = run_attention(make_causal_attention("tiled", None, "cpu"), *case)
    _assert_same_attention(got, ref)
    assert aot_flex.compiles == compiles and aot_flex.calls >= (1 if how == "direct" else 8)


@pytest.mark.parametrize("how", ["direct", "ring-pair"])
def test_ttt_model_with_step_checkpointing_through_compiled_flex(aot_flex, how):
    """Loss and all 13 parameter gradients (and the aux-state gradient) of a K = 3 TTT unroll with the chunked loss
    and per-step checkpointing (the backward recomputes each step's attention), compiled flex vs the tiled block:
    one block mask per micro-batch, and one compile per graph the path needs."""
    K = 3
    draft, ref_draft, head_VH, batch = model_pair(seed=5, K=K)
    attention = _flex(how, aot_flex, tile=4)
    draft.midlayer.self_attn.causal_attention = attention
    got = run_model(TTTModel(draft, head_VH, loss_chunk_size=5, checkpoint_steps=True, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref, tol=TOL)
    if how == "direct":
        assert (attention.masks.misses, aot_flex.compiles) == (1, 1)
        assert aot_flex.calls == 2 * K  # K steps forward, K recomputed in backward
    else:
        assert aot_flex.compiles == 2  # the pair forward and its recompute


def test_online_shape_sequence_compiles_at_most_twice(aot_flex, caplog):
    """Training micro-batches padded to their longest row (13 .. 300 tokens, 1 to 3 flex blocks) through the
    checkpointed TTT unroll: the first compile (one block: Dynamo specialises the count 1), one more at the first
    multi-block micro-batch, none after; every micro-batch's loss and gradients match the tiled reference; each
    compile is logged."""
    with caplog.at_level(logging.INFO, logger="kernels.flex_attention"):
        for seed, lengths in enumerate([(13, 9), (40, 31), (140, 100), (70, 70), (300, 12), (129, 128)]):
            draft, head_VH, batch = build_case(seed, 2, lengths=lengths)
            ref_draft = type(draft)(draft.config)
            ref_draft.load_state_dict(draft.state_dict())
            draft.midlayer.self_attn.causal_attention = FlexCausalAttention(compiled=aot_flex)
            got = run_model(TTTModel(draft, head_VH, checkpoint_steps=True, sparse_anchors=False), batch)
            assert_same_run(got, run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch), tol=TOL)
    logged = [r for r in caplog.records if "flex attention compile" in r.getMessage()]
    assert aot_flex.compiles == 2 and len(logged) == 2 and aot_flex.calls == 6 * 2 * 2


def test_eval_shape_sequence_prefill_and_chain_steps(aot_flex):
    """The eval's inference KV cache (no autograd): a 150-token prefill, an extend of 40, then 12 one-token chain
    steps (keys growing past a block boundary) through compiled flex vs the tiled block. Three compiles, one per
    layout (Dynamo guards on strides): the prefill's keys are the projection's strided view, later ones the
    concatenated cache; one-token queries are contiguous. None for the growing cache after that."""
    from recipe.eval.draft_runtime import DraftKVCache

    draft, ref_draft, _, _ = model_pair(seed=3, K=1)
    draft.midlayer.self_attn.causal_attention = FlexCausalAttention(compiled=aot_flex)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 190, draft.config.hidden_size, generator=g)
    ids = torch.randint(0, draft.config.vocab_size, (1, 190), generator=g)
    outs = {}
    with torch.no_grad():
        for name, model in (("flex", draft), ("tiled", ref_draft)):
            cache, got = model_cache = DraftKVCache(), []
            for lo, hi in ((0, 150), (150, 190)):
                got.append(model.step(hidden[:, lo:hi], ids[:, lo:hi], torch.arange(lo, hi)[None], kv_cache=cache)[0])
            for p in range(190, 202):
                got.append(model.step(got[-1][:, -1:], ids[:, :1], torch.tensor([[p]]), kv_cache=cache)[0])
            outs[name] = torch.cat(got, dim=1)
            del model_cache
    torch.testing.assert_close(outs["flex"], outs["tiled"], rtol=TOL, atol=TOL)
    assert aot_flex.compiles == 3 and aot_flex.calls == 14


def test_inductor_cpu_flex_cannot_train_or_return_the_lse(monkeypatch):
    """Why the CPU tests use ``aot_eager``: Inductor's CPU flex kernel is inference-only without an LSE output, so
    compiling the draft's call (which needs both) fails loudly, never silently eager."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    torch._dynamo.reset()
    q, k, v, q_pos, k_pos, valid, _, _ = attention_case("square", dtype=torch.float32, d=16)
    attention = FlexCausalAttention(compiled=CompiledFlex(backend="inductor"))
    with pytest.raises(FlexCompileError, match="could not be compiled"):
        attention(q.requires_grad_(), k, v, q_pos, k_pos, valid)
    torch._dynamo.reset()
