"""TP mappings, layers, vocab-parallel soft CE and apply_tensor_parallel vs single-device references (gloo, CPU).

Every rank builds the full single-device module from the same seed, runs it as the reference, then the sharded
version, and asserts forward values and every gradient. Each rank function returns a short summary that the parent
also checks, so a rank that skipped its checks fails the test.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.ranks import run_ranks
from recipe.parallel.apply_tp import apply_tensor_parallel
from recipe.parallel.parallelize import gather_full_tensors
from helpers.tp_reference import gather_from_tp_region, scatter_to_tp_region
from helpers.tp_stand_in import TTTStandIn, soft_ce
from helpers.tolerance import FP32_REORDERED, FP64_REORDERED
from recipe.parallel.mappings import copy_to_tp_region, reduce_from_tp_region
from recipe.parallel.tp_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead, gather_tensor,
                                       vocab_parallel_soft_ce)

TOL = {torch.float64: FP64_REORDERED, torch.float32: FP32_REORDERED}


def assert_close(actual, expected, dtype, what):
    rel = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    assert rel <= TOL[dtype], f"{what}: rel err {rel:.3e} > {TOL[dtype]:.0e}"
    return rel


def assert_equal(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}: max abs diff {(actual - expected).abs().max().item():.3e}"


def assert_match(actual, expected, dtype, what, exact):
    """torch.equal expected where no floating-point reduction differs; otherwise rel <= TOL. Records exactness in
    ``exact[what]`` so the parent can report which products came out bit-identical."""
    exact[what] = torch.equal(actual, expected)
    if not exact[what]:
        assert_close(actual, expected, dtype, what)


def shard(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank]


# ---------------------------------------------------------------------------------------------------------------------
def _mappings(rank, world, dtype=None):
    group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, same order
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank  # rank-dependent upstream gradient
        g_sum = sum(torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r for r in range(world))
        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        y = copy_to_tp_region(x, group)
        assert_equal(y, x, "copy fwd")
        y.backward(g)
        assert_equal(x.grad, g_sum, "copy bwd = all-reduce")

        x = (torch.ones(2, 3, dtype=torch.float64) * (rank + 1)).requires_grad_()
        y = reduce_from_tp_region(x, group)
        assert_equal(y, torch.ones(2, 3, dtype=torch.float64) * sum(range(1, world + 1)), "reduce fwd")
        y.backward(g)
        assert_equal(x.grad, g, "reduce bwd = identity")

        x = torch.full((2, 3), float(rank), dtype=torch.float64, requires_grad=True)
        y = gather_from_tp_region(x, group)
        assert_equal(y, torch.cat([torch.full((2, 3), float(r), dtype=torch.float64) for r in range(world)], -1),
                     "gather fwd")
        g_full = torch.arange(2 * 3 * world, dtype=torch.float64).reshape(2, 3 * world)
        y.backward(g_full)
        assert_equal(x.grad, shard(g_full, -1, rank, world), "gather bwd = split")

        x = torch.arange(2 * 2 * world, dtype=torch.float64).reshape(2, 2 * world).requires_grad_()
        y = scatter_to_tp_region(x, group)
        assert_equal(y, shard(x.detach(), -1, rank, world), "scatter fwd")
        y.backward(torch.full((2, 2), float(rank), dtype=torch.float64))
        assert_equal(x.grad, torch.cat([torch.full((2, 2), float(r), dtype=torch.float64) for r in range(world)],
                                       -1), "scatter bwd = gather")

        x = torch.randn(2, 4, requires_grad=True)
        for fn in (copy_to_tp_region, reduce_from_tp_region, gather_from_tp_region, scatter_to_tp_region):
            assert fn(x, singles[rank]) is x, f"{fn.__name__}: size-1 group must return the input"
    ours = [str(w.message) for w in caught]

    # Control: the recorder does catch the warning an in-place all-reduce on a grad-requiring tensor gives.
    with warnings.catch_warnings(record=True) as control:
        warnings.simplefilter("always")
        bad = torch.ones(3, requires_grad=True) * 1.0
        dist.all_reduce(bad, group=group)
        bad.sum().backward()  # torch warns here
    return ours, any("autograd kernel was not registered" in str(w.message) for w in control)


@pytest.mark.slow
def test_mappings_directions_and_no_autograd_warning(ranks):
    for result in ranks:
        ours, control_warned = result["mappings"]
        assert ours == [], f"mappings emitted warnings: {ours}"
        assert control_warned, "control: in-place dist.all_reduce on a grad tensor should warn"


# ---------------------------------------------------------------------------------------------------------------------
def _linear_layers(rank, world, dtype):
    group = dist.group.WORLD
    torch.manual_seed(0)
    full_col = nn.Linear(8, 4 * world, bias=True).to(dtype)
    full_row = nn.Linear(4 * world, 6, bias=True).to(dtype)
    x = torch.randn(2, 3, 8, dtype=dtype)
    w_out = torch.randn(2, 3, 6, dtype=dtype)
    rels, exact = {}, {}

    # reference: x → column → gelu → row, loss = Σ y·w_out
    x_ref = x.clone().requires_grad_()
    h_ref = full_col(x_ref)
    h_ref.retain_grad()
    y_ref = full_row(F.gelu(h_ref))
    (y_ref * w_out).sum().backward()

    col = ColumnParallelLinear.from_linear(full_col, group)
    row = RowParallelLinear.from_linear(full_row, group)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert col.bias.tensor_model_parallel and col.bias.partition_dim == 0
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert not getattr(row.bias, "tensor_model_parallel", False)
    x_tp = x.clone().requires_grad_()
    h = col(x_tp)
    h.retain_grad()
    y = row(F.gelu(h))
    (y * w_out).sum().backward()

    # Column outputs are row-subsets of the same matmul, but BLAS may block N=out/tp and N=out differently, so
    # bit-equality is recorded, not required (fp32, tp=4 differed by 9e-8 abs on this machine).
    assert_match(h, shard(h_ref.detach(), -1, rank, world), dtype, "column output shard", exact)
    rels["row output"] = assert_close(y, y_ref, dtype, "row output")
    assert_match(h.grad, shard(h_ref.grad, -1, rank, world), dtype, "column output grad shard", exact)
    assert_match(row.weight.grad, shard(full_row.weight.grad, 1, rank, world), dtype, "row weight grad shard", exact)
    assert_equal(row.bias.grad, full_row.bias.grad, "row bias grad")
    assert_match(col.weight.grad, shard(full_col.weight.grad, 0, rank, world), dtype, "column weight grad shard",
                 exact)
    assert_match(col.bias.grad, shard(full_col.bias.grad, 0, rank, world), dtype, "column bias grad shard", exact)
    rels["input grad"] = assert_close(x_tp.grad, x_ref.grad, dtype, "input grad (all-reduced)")
    assert_equal(gather_tensor(col.weight, 0, group), full_col.weight.detach(), "column weight gathered")
    assert_equal(gather_tensor(row.weight, 1, group), full_row.weight.detach(), "row weight gathered")

    # Row-parallel alone on a sharded input: input-gradient shard needs no reduction.
    xin = torch.randn(2, 3, 4 * world, dtype=dtype)
    xin_ref = xin.clone().requires_grad_()
    (full_row(xin_ref) * w_out).sum().backward()
    xin_tp = shard(xin, -1, rank, world).clone().requires_grad_()
    (row(xin_tp) * w_out).sum().backward()
    assert_match(xin_tp.grad, shard(xin_ref.grad, -1, rank, world), dtype, "row input grad shard", exact)
    return rels, exact


@pytest.mark.slow
def test_column_row_linear_match_unsharded(ranks):
    for result in ranks:
        rels, exact = result["linear"]
        assert set(rels) == {"row output", "input grad"} and len(exact) == 6
    print("bit-exact:", {k: all(r["linear"][1][k] for r in ranks) for k in ranks[0]["linear"][1]})


# ---------------------------------------------------------------------------------------------------------------------
def _soft_ce_case(world, dtype):
    torch.manual_seed(1)
    vd = 4 * world
    logits = torch.randn(2, 5, vd, dtype=dtype) * 3
    target = torch.randn(2, 5, vd, dtype=dtype) * 3
    valid = torch.rand(2, 5) > 0.3
    valid[0, :3] = True
    # Ties across shards: logits' max at ids 1 and vd-3 (different shards). Target argmax at 1 → counts as correct
    # only with smallest-index tie-breaking; at vd-3 → must count as wrong.
    logits[0, 0] = -5.0
    logits[0, 0, 1] = logits[0, 0, vd - 3] = 7.0
    logits[0, 1] = logits[0, 0]
    target[0, 0, 1] = target[0, 1, vd - 3] = 20.0
    logits[0, 2] = target[0, 2]  # plain match
    return logits, target, valid


def _soft_ce(rank, world, dtype):
    logits, target, valid = _soft_ce_case(world, dtype)
    # Reference in fp64 from the same values: the fp32 reference itself is ~3e-7 off in the target gradient.
    lg_ref, tg_ref = logits.double().clone().requires_grad_(), target.double().clone().requires_grad_()
    loss_ref, correct_ref = soft_ce(lg_ref, tg_ref, valid)
    (loss_ref * 1.7).backward()

    lg = shard(logits, -1, rank, world).clone().requires_grad_()
    tg = shard(target, -1, rank, world).clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, correct = vocab_parallel_soft_ce(lg, tg, valid, dist.group.WORLD)
        (loss * 1.7).backward()
    assert [str(w.message) for w in caught] == []
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rel = assert_close(loss, loss_ref, dtype, "loss_sum")
    assert correct.item() == correct_ref.item(), (correct.item(), correct_ref.item())
    # Gradients compared as whole tensors (gathered shards): fp32 exp(y - max) carries |y - max|·eps relative error,
    # which is large relative to a shard whose probabilities are all tiny, but not relative to the full gradient.
    group = dist.group.WORLD
    assert_close(gather_tensor(lg.grad, -1, group), lg_ref.grad, dtype, "logits grad")
    assert_close(gather_tensor(tg.grad, -1, group), tg_ref.grad, dtype, "target logits grad")
    assert (lg.grad[~valid] == 0).all() and (tg.grad[~valid] == 0).all()
    return loss.item(), correct.item(), rel


@pytest.mark.slow
def test_vocab_parallel_soft_ce_matches_single_device(ranks, world_dtype):
    world, dtype = world_dtype
    logits, target, valid = _soft_ce_case(world, dtype)
    loss_ref, correct_ref = soft_ce(logits, target, valid)
    # The crafted ties: position (0,0) correct only under smallest-index tie-breaking, (0,1) wrong, (0,2) right.
    assert logits[0, 0].argmax().item() == 1 and target[0, 0].argmax().item() == 1
    assert target[0, 1].argmax().item() == 4 * world - 3
    for result in ranks:
        loss, correct, _ = result["soft_ce"]
        assert correct == correct_ref.item()
        assert abs(loss - loss_ref.item()) <= TOL[dtype] * abs(loss_ref.item())


def test_vocab_parallel_soft_ce_single_process_group_of_one():
    logits, target, valid = _soft_ce_case(1, torch.float64)
    lg, tg = logits.clone().requires_grad_(), target.clone().requires_grad_()
    loss, correct = vocab_parallel_soft_ce(lg, tg, valid, group=None)  # dist not initialised: size 1
    loss.backward()
    lg_ref, tg_ref = logits.clone().requires_grad_(), target.clone().requires_grad_()
    loss_ref, correct_ref = soft_ce(lg_ref, tg_ref, valid)
    loss_ref.backward()
    assert_close(loss, loss_ref, torch.float64, "loss")
    assert correct.item() == correct_ref.item()
    assert_close(lg.grad, lg_ref.grad, torch.float64, "logits grad")
    assert_close(tg.grad, tg_ref.grad, torch.float64, "target grad")
    with pytest.raises(ValueError, match="must have the same shape"):
        vocab_parallel_soft_ce(lg, tg[..., :-1], valid, group=None)
    with pytest.raises(ValueError, match="valid mask"):
        vocab_parallel_soft_ce(lg, tg, valid[:, :-1], group=None)


# ---------------------------------------------------------------------------------------------------------------------
def _apply_tp(rank, world, dtype):
    group = dist.group.WORLD
    kw = dict(hidden=8, heads=2 * world, kv_heads=world, head_dim=4, inter=4 * world, vd=4 * world)
    torch.manual_seed(0)
    ref = TTTStandIn(dtype, **kw)
    torch.manual_seed(0)
    model = TTTStandIn(dtype, **kw)
    full_state = {k: v.clone() for k, v in model.state_dict().items()}
    emb, h = torch.randn(2, 6, 8, dtype=dtype), torch.randn(2, 6, 8, dtype=dtype)
    target_hidden = torch.randn(2, 6, 6, dtype=dtype)
    valid = torch.rand(2, 6) > 0.2

    loss_ref, correct_ref = ref(emb, h, target_hidden, valid)
    loss_ref.backward()

    apply_tensor_parallel(model, group)
    assert isinstance(model.draft.midlayer.self_attn.k_proj, ColumnParallelLinear)
    assert isinstance(model.draft.midlayer.mlp.down_proj, RowParallelLinear)
    assert isinstance(model.draft.lm_head, VocabParallelLMHead)
    assert model.draft.lm_head.vocab_start == rank * 4 and model.draft.lm_head.vocab_end == rank * 4 + 4
    assert "target_head_d" in dict(model.named_buffers())
    assert model.target_head_d.shape == (4, 6) and model.target_head_d.tensor_model_parallel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, correct = model(emb, h, target_hidden, valid)
        loss.backward()
    assert [str(w.message) for w in caught] == []
    rel = assert_close(loss, loss_ref, dtype, "TTT stand-in loss")
    assert correct.item() == correct_ref.item()
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        grad = gather_tensor(p.grad, p.partition_dim, group) if getattr(p, "tensor_model_parallel", False) \
            else p.grad
        assert_close(grad, ref_params[name].grad, dtype, f"grad {name}")
        checked += 1
    assert checked == len(ref_params)
    consolidated = gather_full_tensors(model, group)
    assert consolidated.keys() == full_state.keys()
    for key, value in full_state.items():
        assert_equal(consolidated[key], value, f"consolidated {key}")
    return rel, checked


@pytest.mark.slow
def test_apply_tensor_parallel_stand_in_matches_single_device(ranks):
    assert all(result["apply_tp"][1] == 10 for result in ranks)  # 8 linears + LayerNorm weight, bias


def _apply_tp_bad_heads(rank, world, dtype):
    model = TTTStandIn(torch.float32, hidden=8, heads=4 * world, kv_heads=3, head_dim=4, inter=4 * world, vd=4 * world)
    with pytest.raises(ValueError, match=rf"tensor-parallel size tp={world} must divide.*num_key_value_heads=3") as err:
        apply_tensor_parallel(model, dist.group.WORLD)
    assert "num_attention_heads" not in str(err.value) and "intermediate_size" not in str(err.value)
    assert isinstance(model.draft.midlayer.self_attn.q_proj, nn.Linear)  # untouched on error
    return str(err.value)


@pytest.mark.slow
def test_apply_tensor_parallel_rejects_indivisible_kv_heads(ranks):
    assert all("num_key_value_heads=3" in result["bad_heads"] for result in ranks)


# ---------------------------------------------------------------------------------------------------------------------
CHECKS = {"mappings": _mappings, "linear": _linear_layers, "soft_ce": _soft_ce,
          "apply_tp": _apply_tp, "bad_heads": _apply_tp_bad_heads}


def _run_all(rank, world, dtype):
    """Every multi-rank check in one process launch (spawning gloo ranks dominates the run time)."""
    return {name: CHECKS[name](rank, world, dtype) for name in CHECKS}


@pytest.fixture(scope="module", params=[(2, torch.float64), (4, torch.float32)], ids=["tp2-fp64", "tp4-fp32"])
def world_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def ranks(world_dtype):
    """Per-rank result dicts of :func:`_run_all`; a failing check on any rank fails every test of that layout."""
    world, dtype = world_dtype
    results = run_ranks(world, _run_all, dtype)
    assert all(set(r) == set(CHECKS) for r in results)
    return results


def test_tp_plan_names_every_module_the_model_lacks():
    from recipe.parallel.apply_tp import _check_plan

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.draft = nn.Module()
            self.draft.lm_head = nn.Linear(4, 8, bias=False)

    with pytest.raises(ValueError) as err:
        _check_plan(Bare())
    message = str(err.value)
    assert "midlayer.self_attn.q_proj" in message and "midlayer.mlp.down_proj" in message
    assert "draft.config.num_attention_heads" in message and "target_head_d" in message and "loss_fn" in message
    assert "lm_head," not in message  # present, so not named
