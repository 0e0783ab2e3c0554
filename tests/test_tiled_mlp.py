"""The sequence-tiled draft MLP (``memory.mlp_tile_size``, ``recipe.model.tiled_mlp``): the same loss, every parameter
gradient and the input gradient as untiled (fp32, rel ≤ ``FP32_REORDERED``), for tiles that divide S and ragged ones,
with the per-TTT-step checkpointing on and off; no [·, I] tensor longer than a tile in forward or backward; under
tp = 2 (gloo) against the single-process untiled draft, with the TP all-reduces counted; and under DeepSpeed ZeRO-3
(dp = 2) two optimizer steps as untiled."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.cases import PARITY, assert_same_run, build_case, run_model, zero3_two_steps
from helpers.parity import full_grads
from helpers.tolerance import FP32_AFTER_ADAM, FP32_REORDERED, max_rel, within
from helpers.ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.model.tiled_mlp import MLPTiling, tiled_norm_mlp
from recipe.model.ttt import TTTModel
from recipe.parallel.parallelize import parallelize

K = 3
SEQ = 16  # padded rows of 13 and 9 tokens (MEMORY geometry: hidden 32, MLP width 48)
TILES = [4, 5, 7, 16]  # 4 divides S, 5 and 7 leave a ragged last tile, 16 = S (one tile: the untiled path)


def _tiled(draft, tile):
    head_VH = torch.zeros(draft.config.draft_vocab_size, draft.config.target_hidden_size)
    parallelize(TTTModel(draft, head_VH, sparse_anchors=False), None,
                MemoryOptions(attention_tile_size=None, mlp_tile_size=tile), kernel_options=KernelOptions("tiled"))
    return draft


@pytest.mark.parametrize("checkpoint_steps", [False, True], ids=["plain", "ckpt-steps"])
@pytest.mark.parametrize("tile", TILES)
def test_ttt_step_matches_untiled(tile, checkpoint_steps):
    draft, head_VH, batch = build_case(seed=5, K=K, seq_len=SEQ)
    ref_draft = copy.deepcopy(draft)
    _tiled(draft, tile)
    assert draft.midlayer.mlp_tiling == MLPTiling(tile)
    got = run_model(TTTModel(draft, head_VH, checkpoint_steps=checkpoint_steps, sparse_anchors=False), batch)
    ref = run_model(TTTModel(ref_draft, head_VH, sparse_anchors=False), batch)
    assert_same_run(got, ref)
    within(max_rel(got[0].loss_sum_K, ref[0].loss_sum_K), FP32_REORDERED, "loss_sum_K")
    for name, grad in got[1].items():
        within(max_rel(grad, ref[1][name]), FP32_REORDERED, name)


@pytest.mark.parametrize("tile", [4, 5])
def test_decoder_layer_matches_untiled_with_input_gradient(tile):
    draft, _, _ = build_case(seed=6, K=1, seq_len=SEQ)
    layer = draft.midlayer
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, SEQ, 32, generator=g)
    weight = torch.randn(2, SEQ, 32, generator=g)

    def run(tiling):
        layer.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_(True)
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        out = x + (mlp(norm(x)) if tiling is None else tiled_norm_mlp(norm, mlp, x, tiling))
        (out * weight).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), x.grad, grads

    out, dx, grads = run(MLPTiling(tile))
    ref_out, ref_dx, ref_grads = run(None)
    within(max_rel(out, ref_out), FP32_REORDERED, "out")
    within(max_rel(dx, ref_dx), FP32_REORDERED, "dx")
    assert sorted(grads) == ["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                             "post_attention_layernorm.weight"]
    for name, grad in grads.items():
        assert ref_grads[name].abs().max() > 0, name
        within(max_rel(grad, ref_grads[name]), FP32_REORDERED, name)
    with torch.no_grad():  # evaluation: tiles without checkpoints, same values (a GEMM of fewer rows may round
        # differently: not bitwise)
        within(max_rel(tiled_norm_mlp(layer.post_attention_layernorm, layer.mlp, h, MLPTiling(tile)),
                       layer.mlp(layer.post_attention_layernorm(h))), FP32_REORDERED, "no grad")


class _WidestIntermediate(TorchDispatchMode):
    """The largest sequence extent (dim 1) of any 3-d op output of the MLP's width I, forward and backward."""

    def __init__(self, width):
        super().__init__()
        self.width, self.longest = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.width:
                self.longest = max(self.longest, t.shape[1])
        return out


@pytest.mark.parametrize("checkpoint_steps", [False, True], ids=["plain", "ckpt-steps"])
def test_mlp_intermediates_exist_one_tile_at_a_time(checkpoint_steps):
    draft, head_VH, batch = build_case(seed=5, K=K, seq_len=SEQ)
    width = draft.config.intermediate_size
    for tile, longest in ((None, SEQ), (5, 5), (4, 4)):
        model = TTTModel(copy.deepcopy(draft) if tile is None else _tiled(copy.deepcopy(draft), tile), head_VH,
                         checkpoint_steps=checkpoint_steps, sparse_anchors=False)
        with _WidestIntermediate(width) as mode:
            run_model(model, batch)
        assert mode.longest == longest, (tile, mode.longest)


def test_parallelize_sets_and_clears_the_tiling_and_rejects_bad_sizes():
    draft, head_VH, _ = build_case(seed=4, K=1)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    tiled = KernelOptions("tiled")
    parallelize(model, None, MemoryOptions(mlp_tile_size=8), kernel_options=tiled)
    assert draft.midlayer.mlp_tiling == MLPTiling(8) and draft.midlayer.mlp_tiling.applies_to(9)
    assert not draft.midlayer.mlp_tiling.applies_to(8)
    parallelize(model, None, MemoryOptions(), kernel_options=tiled)
    assert draft.midlayer.mlp_tiling is None
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="mlp tile size"):
            MLPTiling(bad)
    with pytest.raises(ValueError, match=r"\[B, S, H\]"):
        tiled_norm_mlp(draft.midlayer.post_attention_layernorm, draft.midlayer.mlp, torch.zeros(4, 32), MLPTiling(2))


# ---- tp = 2 and ZeRO-3, one 2-rank launch --------------------------------------------------------------------
TP_SEQ = 20  # PARITY rows of 19 and 14 tokens; tiles of 8 (ragged: 8 + 8 + 4) and 5 (divides)
TP_CASES = [(8, False), (8, True), (5, True)]


def _count_all_reduces(fn):
    """Run ``fn()`` counting ``recipe.parallel.mappings._all_reduce`` calls: [(phase, numel)], phase = the label
    set in ``fn`` through the returned setter."""
    from recipe.parallel import mappings

    calls, phase = [], ["forward"]
    original = mappings._all_reduce

    def counting(x, group):
        calls.append((phase[0], x.numel()))
        return original(x, group)

    mappings._all_reduce = counting
    try:
        fn(lambda name: phase.__setitem__(0, name))
    finally:
        mappings._all_reduce = original
    return calls


def _tp_worker(rank, world):
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.topology import ParallelState

    pstate = ParallelState(ParallelDims(world_size=world, tp=2))
    out = {}
    for tile, ckpt in TP_CASES:
        draft, head_VH, batch = build_case(seed=2, K=K, seq_len=TP_SEQ, geometry=PARITY)
        ref = run_model(TTTModel(copy.deepcopy(draft), head_VH, sparse_anchors=False), batch)
        model = parallelize(TTTModel(draft, head_VH, checkpoint_steps=ckpt, sparse_anchors=False), pstate,
                            MemoryOptions(attention_tile_size=None, mlp_tile_size=tile),
                            kernel_options=KernelOptions("tiled"))
        got = run_model(model, batch)
        out[(tile, ckpt)] = {"ref": ref, "loss": got[0], "aux_grad": got[2],
                             "grads": full_grads(model, pstate.cp_group, pstate.tp_group),
                             "down_shape": tuple(draft.midlayer.mlp.down_proj.weight.shape)}

    # all-reduces of the layer's norm + MLP alone, untiled vs tiled (tile 8 on S = 20: three tiles)
    draft, head_VH, _ = build_case(seed=2, K=1, seq_len=TP_SEQ, geometry=PARITY)
    parallelize(TTTModel(draft, head_VH, sparse_anchors=False), pstate, MemoryOptions(attention_tile_size=None),
                kernel_options=KernelOptions("tiled"))
    layer = draft.midlayer
    h = torch.randn(2, TP_SEQ, 32, generator=torch.Generator().manual_seed(1))

    def mlp_step(tiling):
        def run(set_phase):
            x = h.clone().requires_grad_(True)
            norm = layer.post_attention_layernorm
            y = layer.mlp(norm(x)) if tiling is None else tiled_norm_mlp(norm, layer.mlp, x, tiling)
            set_phase("backward")
            (y * h).sum().backward()
        return _count_all_reduces(run)

    from recipe.parallel.apply_tp import mlp_tiling

    out["counts"] = {"untiled": mlp_step(None), "tiled": mlp_step(mlp_tiling(8, pstate.tp_group))}
    out["zero3"] = _zero3_worker(rank, world)
    return out


def _zero3_worker(rank, world):
    """Two AdamW steps under ZeRO-3 over 2 data-parallel ranks, untiled vs tiled (tile 5, ragged on S = 13) with the
    per-step checkpointing; returns the losses and the full parameters after each."""
    results = {}
    for tile in (None, 5):
        draft, head_VH, batch = build_case(seed=3, K=K)
        model = TTTModel(draft, head_VH, checkpoint_steps=tile is not None, sparse_anchors=False)
        parallelize(model, None, MemoryOptions(attention_tile_size=None, mlp_tile_size=tile),
                    kernel_options=KernelOptions("tiled"))
        results[tile] = zero3_two_steps(model, batch, K, world)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _tp_worker)


@pytest.mark.slow
@pytest.mark.parametrize("tile,ckpt", TP_CASES, ids=[f"tile{t}-{'ckpt' if c else 'plain'}" for t, c in TP_CASES])
def test_tp2_tiled_matches_single_process_untiled(two_ranks, tile, ckpt):
    for result in two_ranks:
        r = result[(tile, ckpt)]
        assert r["down_shape"] == (32, 32)  # really row-parallel: half of the MLP width 64
        ref_out, ref_grads, ref_aux = r["ref"]
        assert ref_out.correct_K.sum() > 0
        within(max_rel(r["loss"].loss_sum_K, ref_out.loss_sum_K), FP32_REORDERED, "tp2 loss")
        assert torch.equal(r["loss"].correct_K, ref_out.correct_K)
        assert r["grads"].keys() == ref_grads.keys() and len(ref_grads) == 13
        for name, grad in ref_grads.items():
            assert grad.abs().max() > 0, name
            within(max_rel(r["grads"][name], grad), FP32_REORDERED, f"tp2 {name}")
        within(max_rel(r["aux_grad"], ref_aux), FP32_REORDERED, "tp2 aux")


@pytest.mark.slow
def test_tp2_tiled_mlp_all_reduces_once_in_forward_and_never_in_the_recompute(two_ranks):
    numel = 2 * TP_SEQ * 32  # one [B, S, H]
    for result in two_ranks:
        untiled, tiled = result["counts"]["untiled"], result["counts"]["tiled"]
        # untiled: down's reduce in forward; gate's and up's dx all-reduced in backward
        assert untiled == [("forward", numel), ("backward", numel), ("backward", numel)]
        # tiled: the same single forward all-reduce over the whole sequence, none when backward recomputes the
        # tiles, and one dx all-reduce per tile (shared by gate and up): half the untiled backward traffic
        assert tiled[0] == ("forward", numel) and [c for c in tiled if c[0] == "forward"] == [tiled[0]]
        assert sorted(n for p, n in tiled if p == "backward") == [2 * 4 * 32, 2 * 8 * 32, 2 * 8 * 32]


@pytest.mark.slow
def test_zero3_tiled_training_matches_untiled(two_ranks):
    for result in two_ranks:
        (plain_loss, plain_params), (loss, params) = result["zero3"][None], result["zero3"][5]
        assert not torch.equal(plain_loss[0], plain_loss[1])  # the first step changed the weights
        within(max_rel(loss, plain_loss), FP32_REORDERED, "ZeRO-3 losses")
        assert params.keys() == plain_params.keys()
        for name, value in plain_params.items():
            within(max_rel(params[name], value), FP32_AFTER_ADAM, name)


@pytest.mark.slow
def test_planner_trace_sees_the_tiling():
    """The fake-tensor trace (``recipe.plan``) runs the tiled step: its peak drops by more than four [S, I] fp32
    tensors (the untiled SwiGLU's), and ``--mlp-tile`` parses into one value per table."""
    from recipe.plan.__main__ import build_parser
    from recipe.plan.spec import BenchSpec
    from recipe.plan.trace import trace_lengths, trace_step

    # a wide MLP and a small vocabulary, so the SwiGLU tensors set the peak (traced: 490 MB -> 180 MB)
    spec = BenchSpec(seq_len=4096, layout="chunked+ckpt", ttt_steps=2, draft_vocab=256, vocab=256, intermediate=4096)
    untiled = trace_step(spec).step_bytes
    tiled = trace_step(BenchSpec(**{**spec.__dict__, "mlp_tile": 512})).step_bytes
    assert untiled - tiled > 4 * 4096 * spec.intermediate * 4, (untiled, tiled)  # four [S, I] fp32 tensors
    assert all(n % 6000 == 0 for n in trace_lengths(BenchSpec(seq_len=4096, cp=2, mlp_tile=3000)))  # whole tiles
    with pytest.raises(ValueError, match="mlp tile"):
        BenchSpec(seq_len=4096, mlp_tile=0)
    args = build_parser().parse_args(["--ds_config", "x.json", "--target", "t", "--length", "4k", "--mlp-tile",
                                      "none,0,4096"])
    assert args.mlp_tile == [None, None, 4096]
