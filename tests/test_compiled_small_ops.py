"""The draft's compiled small ops (``recipe.model.small_ops``: RMS norm, RoPE, SwiGLU product, TTT merge, soft CE)
against their eager functions on the CPU, through Dynamo's ``aot_eager`` backend: AOTAutograd's joint forward and
backward graphs, as Inductor receives them, run without code generation. float32, every output and every gradient
within 1e-5 relative (the same function, computed by another graph: float summation order), alone and inside a
whole TTT step. And the policy: a failed compile and a recompile past the cap are errors naming the switch, never an
eager fallback; the config switch and where it is applied."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.activations import ACT2FN

from kernels.tracing import tracing
from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.config_keys import ConfigError
from recipe.model.small_ops import (EAGER_SMALL_OPS, SmallOps, SmallOpsCompileError, compile_small_ops,
                                    install_small_ops, process_small_ops)
from recipe.model.ttt import TTTModel
from recipe.parallel.parallelize import parallelize
from helpers.cases import assert_rel_close, assert_same_run, build_case, model_pair, run_model, zero3_two_steps
from helpers.parity import assert_parity, run_layout
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_AFTER_ADAM, FP32_REORDERED

TOL = FP32_REORDERED  # compiled graphs fuse and reorder the same sums


@pytest.fixture
def aot_ops():
    """A fresh compiled set on ``aot_eager``, Dynamo's caches and counters reset around the test."""
    torch._dynamo.reset()
    counters.clear()
    yield compile_small_ops("aot_eager")
    assert not counters["graph_break"], dict(counters["graph_break"])  # fullgraph: a break would have raised
    torch._dynamo.reset()


def _inputs(name: str, s: int, n: int, g: torch.Generator):
    """(positional args, indices of the args that get a gradient) of op ``name`` at sequence length ``s`` (``n``
    diagonal keys for the TTT merge), B = 2, shaped as the draft calls it (4 heads, 2 KV heads, head dim 8)."""
    def r(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    if name == "rms_norm":
        return (r(2, s, 32), r(32), 1e-6), (0, 1)
    if name == "rope":  # q as the projection hands it: a transposed view of [B, S, H, D]
        angle = torch.rand(2, s, 4, generator=g) * 6.0
        cos, sin = (torch.cat([f(angle)] * 2, dim=-1) for f in (torch.cos, torch.sin))
        return (r(2, s, 4, 8).transpose(1, 2), cos, sin), (0,)
    if name == "act_mul":
        return (r(2, s, 48), r(2, s, 48), ACT2FN["silu"]), (0, 1)
    if name == "ttt_merge":  # row 1's last positions: padding, no readable causal key (out 0, lse -inf)
        out, lse = r(2, 4, s, 8, grad=False), r(2, 4, s, grad=False)
        out[1, :, -3:], lse[1, :, -3:] = 0.0, float("-inf")
        return (out.requires_grad_(), lse.requires_grad_(), r(2, 4, s, 8), r(2, 2, s, n, 8),
                r(2, 2, s, n, 8)), (0, 1, 2, 3, 4)
    valid = torch.rand(2, s, generator=g) < 0.7
    return (r(2, s, 8), r(2, s, 8, grad=False) * 3, valid), (0,)


def _run(op, args, grad_of):
    """Outputs and the gradients of ``Σ_i Σ out_i · w_i`` (fixed random weights w_i) w.r.t. ``args[grad_of]``."""
    outs = op(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, [args[i] for i in grad_of])
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("name", ["rms_norm", "rope", "act_mul", "ttt_merge", "soft_ce"])
def test_each_op_compiled_equals_eager_at_every_length(aot_ops, name):
    """Forward and every input gradient, compiled vs eager, at two lengths (13, 29) and two diagonal depths (2, 3):
    one graph serves both (the row dims and N are symbolic, the widths static)."""
    for s, n in ((13, 2), (29, 3)):
        args, grad_of = _inputs(name, s, n, torch.Generator().manual_seed(s))
        got = _run(getattr(aot_ops, name), args, grad_of)
        ref = _run(getattr(EAGER_SMALL_OPS, name), args, grad_of)
        for i, (o, r) in enumerate(zip(got[0], ref[0])):
            if o.is_floating_point():
                assert torch.equal(torch.isinf(o), torch.isinf(r))
                finite = torch.isfinite(r)
                assert_rel_close(o[finite], r[finite], TOL, f"{name} output {i}")
            else:
                assert torch.equal(o, r) and r.sum() > 0  # soft CE's argmax-match count
        for i, g, r in zip(grad_of, got[1], ref[1]):
            assert_rel_close(g, r, TOL, f"{name} d/darg{i}")
    assert aot_ops.stats()[name]["compiles"] == 1 and aot_ops.stats()[name]["calls"] == 2


@pytest.mark.parametrize("switches", [{}, {"loss_chunk_size": 5, "checkpoint_steps": True}])
def test_ttt_step_with_compiled_small_ops_equals_eager(aot_ops, switches):
    """Loss sums, counts and all 13 parameter gradients (and the aux-state gradient) of a K = 3 TTT step on the tiny
    case, every small op compiled vs the eager model; plain, and with the chunked loss and step checkpointing (ops
    recomputed in backward, loss chunks of one batch row). Every op was called compiled, and compiled a few graphs
    only (the norm at most 4: a frozen input (the embedding) and a trainable one, a loss chunk of one batch row and
    the last chunk of one position, both specialised by Dynamo)."""
    draft, ref_draft, head_VH, batch = model_pair(seed=5, K=3)
    model = install_small_ops(TTTModel(draft, head_VH, **switches, sparse_anchors=False), aot_ops)
    ref = TTTModel(ref_draft, head_VH, **switches, sparse_anchors=False)
    assert_same_run(run_model(model, batch), run_model(ref, batch), tol=TOL)
    stats = aot_ops.stats()
    assert set(stats) == {"rms_norm", "rope", "act_mul", "ttt_merge", "soft_ce"}
    assert all(st["calls"] > 0 and 1 <= st["compiles"] <= 4 for st in stats.values()), stats


def test_a_failed_compile_is_an_error_naming_the_switch():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    ops = compile_small_ops(broken_backend)
    x = torch.randn(2, 5, 8)
    with pytest.raises(SmallOpsCompileError, match=r"small op rms_norm could not be compiled.*"
                                                   r'"compile_small_ops": false.*kernels\.compile_small_ops'):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    assert ops.rms_norm.compiles == 1
    torch._dynamo.reset()


def test_recompiles_past_the_cap_are_an_error_not_an_eager_fallback():
    """Widths are static: a third hidden size is a third compile, past a cap of 2 an error (Dynamo alone would run
    the op eagerly from then on); new lengths under a width compile nothing."""
    torch._dynamo.reset()
    ops = compile_small_ops("eager", recompile_limit=2)
    for h, s in ((8, 5), (16, 5), (16, 9)):
        ops.rms_norm(torch.randn(2, s, h), torch.ones(h), 1e-6)
    assert ops.rms_norm.compiles == 2
    with pytest.raises(SmallOpsCompileError, match=r"rms_norm reached its recompile limit \(2 compiles.*"
                                                   r"compile_small_ops\": false"):
        ops.rms_norm(torch.randn(2, 5, 24), torch.ones(24), 1e-6)
    assert ops.rms_norm.compiles == 2
    torch._dynamo.reset()


def test_the_planners_trace_runs_the_eager_ops():
    ops = compile_small_ops("eager")
    x = torch.randn(2, 5, 8)
    with tracing():
        assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-6), EAGER_SMALL_OPS.rms_norm(x, torch.ones(8), 1e-6))
    assert (ops.rms_norm.calls, ops.rms_norm.compiles) == (0, 0)


def test_the_kernels_switch_is_parsed_resolved_and_applied():
    """``kernels.compile_small_ops``: "auto" (default), true or false, anything else refused naming the field;
    "auto" is on for CUDA only; ``parallelize`` installs the process's compiled set (nothing compiles until a call)
    or the eager one on every op-calling module and on the single-device loss."""
    assert KernelOptions.pop_from({}, "x.json").compile_small_ops == "auto"
    assert KernelOptions.pop_from({"kernels": {"compile_small_ops": False}}, "x.json").compile_small_ops is False
    with pytest.raises(ConfigError, match=r"x\.json: 'kernels\.compile_small_ops' must be true, false or \"auto\""):
        KernelOptions.pop_from({"kernels": {"compile_small_ops": "yes"}}, "x.json")
    draft, head_VH, _ = build_case(0, 2)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    for value, device, compiled in (("auto", "cpu", False), (True, "cpu", True), (False, "cpu", False)):
        parallelize(model, None, MemoryOptions(), device, KernelOptions("tiled", compile_small_ops=value))
        want = process_small_ops() if compiled else EAGER_SMALL_OPS
        holders = [m for m in model.draft.modules() if "ops" in type(m).__dict__]
        assert len(holders) == 6 and all(m.ops is want for m in holders)  # 4 norms, attention, MLP
        assert model.loss_fn is want.soft_ce
    assert isinstance(process_small_ops(), SmallOps) and process_small_ops().rms_norm.calls == 0


def _compiled_ranks(rank, world):
    """On 2 gloo ranks, every small op compiled on ``aot_eager`` against the eager ops: tp = 2 with the MLP in tiles
    (the TP tile's SwiGLU product) and the chunked loss (parallelize told to compile and handed that set) against the
    eager single-process reference; and two AdamW steps under ZeRO-3 (weights partitioned, gathered by its module
    hooks before the op reads them), compiled vs eager."""
    import recipe.parallel.parallelize as par

    ops = compile_small_ops("aot_eager")
    par.compile_on = lambda value, device: True
    par.process_small_ops = lambda: ops
    tp2 = run_layout(rank, world, tp=2, cp=1, K=3, seed=2, seq_len=20, dtype=torch.float32,
                     switches={"mlp_tile_size": 8, "loss_chunk_size": 7})
    stats = ops.stats()
    zero3 = {}
    for name, small_ops in (("eager", EAGER_SMALL_OPS), ("compiled", ops)):
        draft, head_VH, batch = build_case(seed=3, K=3)
        model = install_small_ops(TTTModel(draft, head_VH, sparse_anchors=False), small_ops)
        zero3[name] = zero3_two_steps(model, batch, 3, world)
    return {"tp2": tp2, "tp2_stats": stats, "zero3": zero3, "zero3_stats": ops.stats()}


@pytest.mark.slow  # two gloo ranks, each compiling its graphs
def test_tp2_and_zero3_with_compiled_small_ops_match_eager():
    """tp = 2: loss sums, counts and every gradient in float32 within 1e-5 of the single-process run; the
    vocab-parallel loss (it all-reduces) stays eager, every other op ran compiled on the local heads and MLP shard.
    ZeRO-3: both steps' losses within 1e-5, every updated parameter within ``FP32_AFTER_ADAM``."""
    for rank, result in enumerate(run_ranks(2, _compiled_ranks)):
        assert assert_parity(result["tp2"], FP32_REORDERED, f"tp=2 compiled small ops, rank {rank}") == 13
        stats = result["tp2_stats"]
        assert all(stats[name]["calls"] > 0 for name in ("rms_norm", "rope", "act_mul", "ttt_merge"))
        assert stats["soft_ce"]["calls"] == 0
        (eager_loss, eager_params), (loss, params) = result["zero3"]["eager"], result["zero3"]["compiled"]
        assert not torch.equal(eager_loss[0], eager_loss[1])  # the first step changed the weights
        assert_rel_close(loss, eager_loss, FP32_REORDERED, "ZeRO-3 losses")
        for name, value in eager_params.items():
            assert_rel_close(params[name], value, FP32_AFTER_ADAM, name)
        assert result["zero3_stats"]["soft_ce"]["calls"] > 0
