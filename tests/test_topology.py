"""ParallelState groups on real gloo ranks, and DeepSpeed with FlatMPU + TP layers vs a single-process reference."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.ranks import run_ranks
from helpers.tp_reference import group_rank_lists
from helpers.tolerance import FP32_AFTER_ADAM, FP32_REORDERED, within
from recipe.parallel.parallelize import gather_full_tensors
from recipe.parallel.dims import ParallelDims
from recipe.parallel.topology import ParallelState
from recipe.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1), (1, 1, 4)]  # (dp, cp, tp) for world 4


def _groups(rank, world):
    out = []
    for dp, cp, tp in LAYOUTS:
        dims = ParallelDims(world_size=world, tp=tp, cp=cp, dp=dp)
        state = ParallelState(dims)
        seen = {}
        for axis in ("tp", "cp", "dp", "dp_cp"):
            group = getattr(state, f"{axis}_group")
            members = [None] * dist.get_world_size(group)
            dist.all_gather_object(members, rank, group=group)  # who really answers in this group
            seen[axis] = (members, getattr(state, f"{axis}_ranks"), getattr(state, f"{axis}_rank"),
                          getattr(state, f"{axis}_size"))
        mpu = state.mpu()
        facts = (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), mpu.get_data_parallel_group_ranks(),
                 mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank(),
                 mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(),
                 mpu.get_tensor_model_parallel_src_rank(),
                 mpu.get_data_parallel_group() is state.dp_cp_group, mpu.get_model_parallel_group() is state.tp_group,
                 any(hasattr(mpu, m) for m in ("get_sequence_parallel_world_size", "get_sequence_data_parallel_group",
                                                "initialize_sequence_parallel")))
        out.append((tuple(state.coord), seen, facts))
    return out


@pytest.mark.slow
def test_parallel_state_groups_match_rank_grid():
    results = run_ranks(4, _groups)
    for i, (dp, cp, tp) in enumerate(LAYOUTS):
        dims = ParallelDims(world_size=4, tp=tp, cp=cp, dp=dp)
        for rank, per_layout in enumerate(results):
            coord, seen, facts = per_layout[i]
            assert coord == tuple(dims.coords(rank))
            for axis, (members, ranks, idx, size) in seen.items():
                expected = next(g for g in group_rank_lists(axis, dims.dp, dims.cp, dims.tp) if rank in g)
                assert members == ranks == expected, (axis, dims, rank)
                assert (idx, size) == (expected.index(rank), len(expected))
            tp_ranks = seen["tp"][1]
            dpcp_ranks = seen["dp_cp"][1]
            assert facts == (dp * cp, dpcp_ranks.index(rank), dpcp_ranks, tp, tp_ranks.index(rank), tp,
                             tp_ranks.index(rank), tp_ranks[0], True, True, False)


def _parallel_state_wrong_world(rank, world):
    with pytest.raises(ValueError, match="world_size=4 but torch.distributed has 2 processes") as err:
        ParallelState(ParallelDims(world_size=4, tp=2))
    return str(err.value)


@pytest.mark.slow
def test_parallel_state_rejects_wrong_world_size():
    assert all("world_size=4" in m for m in run_ranks(2, _parallel_state_wrong_world))


# ---------------------------------------------------------------------------------------------------------------------
class _Net(nn.Module):
    """column → gelu → row → ·scale (replicated parameter) ; single-device or TP."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8, bias=False)
        self.down = nn.Linear(8, 4, bias=True)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x):
        return (self.down(F.gelu(self.up(x))) * self.scale).pow(2).sum()


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 6, generator=g)


def _reference(clip):
    """Single process: loss = mean over the 8 samples; returns (grad norm, params after one clipped AdamW step)."""
    torch.manual_seed(0)
    net = _Net()
    x = _data()
    (net(x) / x.shape[0]).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in net.parameters())).item()
    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.0).step()
    return norm, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _ds_step(rank, world, tp, cp, stage, clip, with_control):
    out = [_ds_engine_step(world, tp, cp, stage, clip, mark=True)]
    if with_control:
        out.append(_ds_engine_step(world, tp, cp, stage, clip, mark=False))
    return out


def _ds_engine_step(world, tp, cp, stage, clip, mark):
    import deepspeed

    dims = ParallelDims(world_size=world, tp=tp, cp=cp)
    state = ParallelState(dims)
    torch.manual_seed(0)
    net = _Net()
    net.up = ColumnParallelLinear.from_linear(net.up, state.tp_group)
    net.down = RowParallelLinear.from_linear(net.down, state.tp_group)
    if not mark:  # control: what happens without the attribute DeepSpeed's grad norm reads
        for p in (net.up.weight, net.down.weight):
            p.tensor_model_parallel = False
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "train_batch_size": dims.dp_cp, "gradient_clipping": clip, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg, mpu=state.mpu())
    x = _data()
    local = x[state.dp_cp_rank::dims.dp_cp]  # this dp×cp rank's share (CP splits positions; same algebra)
    # DeepSpeed averages gradients over dp·cp, so scale the local sum by dp·cp / N_global.
    loss = engine(local) * dims.dp_cp / x.shape[0]
    engine.backward(loss)
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = float(norm.item() if torch.is_tensor(norm) else norm)
    full = gather_full_tensors(engine.module, state.tp_group)
    engine.destroy()
    return norm, full


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,cp,stage", [(2, 2, 1, 1), (2, 2, 1, 3), (4, 2, 2, 3)])
def test_deepspeed_flat_mpu_grad_norm_and_step_match_single_process(world, tp, cp, stage):
    """engine.get_global_grad_norm() and the clipped AdamW step equal the single-process ones; at tp=2 ZeRO-1 a
    control run without ``tensor_model_parallel`` marks shows the norm going wrong (a trap listed in
    docs/algorithm.md, "The flat mpu")."""
    clip = 0.05
    ref_norm, ref_params = _reference(clip)
    assert ref_norm > 10 * clip  # clipping is active
    with_control = stage == 1
    for runs in run_ranks(world, _ds_step, tp, cp, stage, clip, with_control):
        norm, params = runs[0]
        within(abs(norm - ref_norm) / ref_norm, FP32_REORDERED, "grad norm")
        for key, value in ref_params.items():
            rel = ((params[key] - value).abs().max() / value.abs().max()).item()
            within(rel, FP32_AFTER_ADAM, f"{key} after the clipped AdamW step")
        if with_control:
            unmarked_norm = runs[1][0]
            assert abs(unmarked_norm - ref_norm) > 1e-3 * ref_norm, (unmarked_norm, ref_norm)
