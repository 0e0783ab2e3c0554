"""Packing across ranks (docs/algorithm.md, "Packing"): a packed micro-batch under tp 2, cp 2 (dense and sparse
anchors) and tp 2·cp 2 against the padded single-process draft, fp32: loss sums and every gradient within
``FP32_REORDERED``, correct and valid counts exactly (``helpers.parity``). The packed row [19, 14, 3] of 40 positions
puts its second document across both cp ranks' zigzag chunks (positions 19-32: rank 1's [10, 30) and rank 0's
[30, 40)) and the third (3 tokens, shorter than K = 7) in rank 0's last chunk. Online at cp 2: the split target
forward of a packed micro-batch (the ring isolating the documents, host copies of every rank's attention positions)
and the draft's ring on its shard equal the padded full-sequence forward and draft."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.parity import assert_parity, run_layout
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_REORDERED

pytestmark = pytest.mark.slow  # spawns 2 and 4 gloo ranks

LENGTHS = (19, 3, 14)
SEQ = 40  # the packed row of 36 tokens padded to a multiple of 2·cp·tp = 8
WORLD2 = {"cp2": (1, 2, False), "cp2-sparse": (1, 2, True), "tp2": (2, 1, False)}
WORLD4 = {"tp2cp2": (2, 2, False)}


def _chats():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(4)
    rows = {"input_ids": [], "loss_mask": [], "row": []}
    for i, n in enumerate((17, 3, 12, 22, 9)):
        rows["input_ids"].append(torch.randint(1, 96, (n,), generator=gen).tolist())
        rows["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
        rows["row"].append(i)
    return Dataset.from_dict(rows)


def _online_cp2(rank, world, folder):
    """This rank's packed shard through the split target and the draft's ring vs the padded full forward."""
    from helpers.parity import _sum, forward_backward, full_grads
    from recipe.config_memory import MemoryOptions
    from recipe.config import KernelOptions
    from recipe.data.vocab import VocabMap
    from recipe.model.draft import Eagle3Draft
    from recipe.model.ttt import TTTModel
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.parallelize import parallelize
    from recipe.parallel.topology import ParallelState
    from recipe.target.capture import TargetModel
    from recipe.target.registry import draft_config_for
    from recipe.target.split import SplitTarget
    from recipe.train.batches import BatchBuilder

    pstate = ParallelState(ParallelDims(world_size=world, tp=1, cp=2))
    target = TargetModel(folder, dtype=torch.float32, device="cpu")
    vocab = VocabMap.from_draft_ids(torch.arange(0, 96, 2), 96)
    common = dict(examples=_chats(), t2d=vocab.t2d, ttt_steps=4, seq_divisor=4)
    split = SplitTarget.from_state(target, pstate, "tiled", 4)
    local = BatchBuilder(target=split, dims=pstate.dims, cp_rank=pstate.cp_rank, packing=True, packing_tokens=80,
                         **common).build(list(range(5))).ttt
    full = BatchBuilder(target=target, **common).build(list(range(5))).ttt
    draft = Eagle3Draft(draft_config_for(target.config, 48), seed=2)  # a seed with some argmaxes agreeing
    draft.load_target_embeddings(target.embed_tokens_weight)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.lm_head_weight, vocab.draft_ids)
    model = TTTModel(draft, target.lm_head_weight, sparse_anchors=False)
    n_valid = full.valid_KBS.sum(dim=(1, 2))
    ref_model = copy.deepcopy(model)
    ref = forward_backward(ref_model, full, n_valid)
    par_model = parallelize(copy.deepcopy(model), pstate, MemoryOptions(attention_tile_size=4),
                            kernel_options=KernelOptions(attention="tiled"))
    loss, correct, valid = forward_backward(par_model, local, n_valid)
    return {"ref": (*ref, {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.requires_grad}),
            "par": (_sum(loss, pstate.cp_group), _sum(correct, pstate.cp_group), _sum(valid, pstate.cp_group),
                    full_grads(par_model, pstate.cp_group, pstate.tp_group)),
            "local_seq": local.position_ids_BS.shape, "rows": full.position_ids_BS.shape}


def _cases(rank, world, cases, folder=None):
    out = {name: run_layout(rank, world, tp=tp, cp=cp, K=7, seed=2, seq_len=SEQ, dtype=torch.float32,
                            sparse=sparse, lengths=LENGTHS, packing_tokens=64, tile_size=4)
           for name, (tp, cp, sparse) in cases.items()}
    if folder is not None:
        out["online-cp2"] = _online_cp2(rank, world, folder)
    return out


@pytest.fixture(scope="module")
def world2(tiny_target):
    return run_ranks(2, _cases, WORLD2, str(tiny_target))


@pytest.mark.parametrize("name", [*WORLD2, "online-cp2"])
def test_packed_layouts_on_two_ranks_equal_the_padded_single_process(world2, name):
    for rank, result in enumerate(world2):
        assert assert_parity(result[name], FP32_REORDERED, f"{name} rank {rank}") == 13
        if name == "online-cp2":  # five samples padded to 24, packed into one row of 64 (a cp shard of 32)
            assert tuple(result[name]["rows"]) == (5, 24) and tuple(result[name]["local_seq"]) == (1, 32)
        elif name.startswith("cp2"):
            assert result[name]["local_seq"] == SEQ // 2 and 0 < result[name]["local_valid"][0]


def test_packed_tp2_cp2_equals_the_padded_single_process():
    results = run_ranks(4, _cases, WORLD4)
    for rank, result in enumerate(results):
        assert assert_parity(result["tp2cp2"], FP32_REORDERED, f"tp2cp2 rank {rank}") == 13
