"""Whole-draft tensor parallelism: tp=2 vs the single-process draft, forward (per-step loss sums, correct counts) and
EVERY parameter gradient (TP shards gathered), for K = 1, 3, 7 TTT steps; and the export of a tp=2 model equals the
tp=1 export tensor for tensor. gloo, 2 ranks, one process launch for every case."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.cases import PARITY, build_case
from helpers.parity import assert_parity, run_layout
from helpers.tolerance import FP32_REORDERED

pytestmark = pytest.mark.slow  # every test reads the 2-rank launch

SEQ = 20  # rows of 19 and 14 tokens, padded to a multiple of 2·tp = 4
SEED = 2  # a case where the draft already matches a few target argmaxes, so the correct counts are not all 0
CASES = [(1, torch.float64), (7, torch.float64), (3, torch.float32)]


def _export(rank, world):
    """Export tensors of the same full weights at tp=1 and at tp=2 (via the training loop's gather)."""
    from recipe.export import check_tensors, export_tensors
    from recipe.model.ttt import TTTModel
    from recipe.parallel.apply_tp import apply_tensor_parallel
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.parallelize import gather_full_state, gather_full_tensors
    from recipe.parallel.topology import ParallelState

    draft, head_VH, _ = build_case(seed=5, K=1, seq_len=SEQ, geometry=PARITY, dtype=torch.float32)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    single = ParallelState(ParallelDims(world_size=world, tp=1))  # dp=2: a tp group of size 1
    tp_state = ParallelState(ParallelDims(world_size=world, tp=2))
    ref = export_tensors(gather_full_state(SimpleNamespace(module=model), single))
    apply_tensor_parallel(model, tp_state.tp_group)
    sharded_q = tuple(model.draft.midlayer.self_attn.q_proj.weight.shape)
    exported = export_tensors(gather_full_state(SimpleNamespace(module=model), tp_state))
    consolidated = gather_full_tensors(model, tp_state.tp_group)
    problems = check_tensors(exported, PARITY.draft_config().to_hf_dict())
    return {"ref": ref, "tp": exported, "consolidated": consolidated, "full": full, "problems": problems,
            "sharded_q": sharded_q}


def _all(rank, world):
    out = {f"K{K}-{dtype}": run_layout(rank, world, tp=2, cp=1, K=K, seed=SEED, seq_len=SEQ, dtype=dtype)
           for K, dtype in CASES}
    out["export"] = _export(rank, world)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, _all)


@pytest.mark.parametrize("K,dtype", CASES, ids=[f"K{K}-{str(d).removeprefix('torch.')}" for K, d in CASES])
def test_tp2_loss_and_every_gradient_match_single_process(ranks, K, dtype):
    for rank, result in enumerate(ranks):
        r = result[f"K{K}-{dtype}"]
        assert r["tp_rank"] == rank and r["lm_head_shape"] == (32, 32)  # this rank's half of the draft vocab
        n = assert_parity(r, FP32_REORDERED, f"tp=2 K={K} {dtype} rank {rank}")
        assert n == 13  # fc, 3 layer norms, q/k/v/o, gate/up/down, final norm, lm_head (embeddings frozen)
        assert r["ref"][1].shape == (K,)


def test_tp2_export_equals_tp1_export(ranks):
    for rank, result in enumerate(ranks):
        e = result["export"]
        assert e["sharded_q"] == (16, 64)  # really sharded: 2 of 4 heads × head_dim 8, input 2H
        assert e["problems"] == []
        assert e["tp"].keys() == e["ref"].keys()
        assert "embed_tokens.weight" not in e["tp"] and e["tp"]["d2t"].dtype == torch.int64
        for name, tensor in e["ref"].items():
            assert e["tp"][name].dtype == tensor.dtype and torch.equal(e["tp"][name], tensor), name
        assert e["consolidated"].keys() == e["full"].keys()
        for name, tensor in e["full"].items():
            assert torch.equal(e["consolidated"][name], tensor), name
