"""The context-parallel target forward (``recipe.target.split``) against the full single-process forward.

For every supported architecture (tiny random Llama, Qwen2, Qwen3, Mistral built locally), fp32 on CPU, with right
padding and K larger than a zigzag chunk (so label rows cross chunks): on cp ∈ {2, 4} gloo ranks each rank's aux states
equal the full forward's at its zigzag positions, its label rows equal the full forward's last hidden states at
``label_rows``, and the gathered argmax equals the full argmax; and ``BatchBuilder`` online at cp builds the same
TTTBatch shard as the full capture sharded. Unsupported targets (model type, sliding window) fail with clear errors.
"""
from __future__ import annotations

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.tiny_target import ARCHITECTURES, save_tiny_target
from helpers.tolerance import FP32_REORDERED

K = 7  # > the chunk length 6 of S = 48 at cp = 4
LENGTHS = (37, 48)
SEQ = 48


@pytest.fixture(scope="module")
def arch_targets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arch_targets")
    return {name: str(save_tiny_target(root / name, name)) for name in ARCHITECTURES}


def _batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(1, 96, (n,), generator=gen)
        mask[row, :n] = 1
    loss_mask = mask.clone()
    loss_mask[:, :5] = 0
    return ids, mask, loss_mask


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _cp_worker(rank, world_size, folders):
    import torch.distributed as dist

    from recipe.parallel.collectives import Collectives
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget

    ids, mask, _ = _batch()
    out = {}
    for name, folder in folders.items():
        target = SplitTarget(TargetModel(folder, dtype=torch.float32, device="cpu"), Collectives("cpu"),
                          dist.group.WORLD, world_size, rank, "auto", tile_size=4)
        cap = target.capture(ids, mask, K)
        out[name] = (cap.aux_hidden_BSA, cap.label_hidden_BUH, cap.argmax_BS)
    return out


@pytest.mark.slow  # spawns 2 and 4 gloo ranks
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_target_equals_full_forward(arch_targets, cp):
    from recipe.parallel.cp_shard import label_rows, zigzag_indices
    from recipe.target.capture import TargetModel

    ids, mask, _ = _batch()
    results = run_ranks(cp, _cp_worker, arch_targets)
    for name, folder in arch_targets.items():
        full = TargetModel(folder, dtype=torch.float32, device="cpu").capture(ids, mask)
        for rank, result in enumerate(results):
            aux, label, argmax = result[name]
            pos, rows = zigzag_indices(SEQ, cp, rank), label_rows(SEQ, cp, rank, K)
            assert aux.shape == (2, SEQ // cp, full.aux_hidden_BSA.shape[-1]), (name, rank)
            real = mask.bool()  # padded rows are unspecified: the full capture runs without the mask (right padding)
            assert _rel(aux[real[:, pos]], full.aux_hidden_BSA[:, pos][real[:, pos]]) <= FP32_REORDERED, \
                (name, cp, rank, "aux")
            assert label.shape[1] == rows.numel() < SEQ, (name, rank)
            assert _rel(label[real[:, rows]], full.last_hidden_BSH[:, rows][real[:, rows]]) <= FP32_REORDERED, \
                (name, cp, rank, "last")
            assert torch.equal(argmax[real], full.argmax_BS[real]), (name, cp, rank, "argmax")


def _builder_worker(rank, world_size, folder):
    import torch.distributed as dist
    from datasets import Dataset

    from recipe.parallel.collectives import Collectives
    from recipe.parallel.dims import ParallelDims
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget
    from recipe.train.batches import BatchBuilder

    ids, mask, loss_mask = _batch()
    rows = {"input_ids": [ids[b, :n].tolist() for b, n in enumerate(LENGTHS)],
            "loss_mask": [loss_mask[b, :n].tolist() for b, n in enumerate(LENGTHS)]}
    target = TargetModel(folder, dtype=torch.float32, device="cpu")
    t2d = torch.arange(96) % 3 != 0
    kwargs = dict(examples=Dataset.from_dict(rows), t2d=t2d, ttt_steps=K, seq_divisor=2 * world_size)
    cp_target = SplitTarget(target, Collectives("cpu"), dist.group.WORLD, world_size, rank, "tiled", tile_size=None)
    got = BatchBuilder(target=cp_target, dims=ParallelDims(world_size, cp=world_size), cp_rank=rank,
                       **kwargs).build([0, 1]).ttt
    full = BatchBuilder(target=target, **kwargs).build([0, 1]).ttt
    return got, full


@pytest.mark.slow  # spawns 2 gloo ranks
def test_online_builder_at_cp2_equals_sharded_full_capture(arch_targets):
    from recipe.parallel.cp_shard import label_rows, shard_ttt_batch

    _, mask, _ = _batch()
    for rank, (got, full) in enumerate(run_ranks(2, _builder_worker, arch_targets["qwen3"])):
        ref = shard_ttt_batch(full, 2, rank)
        for field in ("input_ids_KBS", "valid_KBS", "position_ids_BS", "key_valid_BS", "target_row_KS"):
            assert torch.equal(getattr(got, field), getattr(ref, field)), (rank, field)
        assert got.valid_KBS.any() and not got.valid_KBS.all()
        real = ref.key_valid_BS  # padded rows are unspecified (the full capture runs without the mask)
        assert _rel(got.aux_hidden_BSA[real], ref.aux_hidden_BSA[real]) <= FP32_REORDERED
        real_rows = mask.bool()[:, label_rows(SEQ, 2, rank, K)]
        assert _rel(got.target_hidden_BLH[real_rows], ref.target_hidden_BLH[real_rows]) <= FP32_REORDERED


def _split_worker(rank, world_size, folder, cp, tp):
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.topology import ParallelState
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget

    ids, mask, _ = _batch()
    pstate = ParallelState(ParallelDims(world_size, tp=tp, cp=cp))
    target = SplitTarget.from_state(TargetModel(folder, dtype=torch.float32, device="cpu"), pstate, "auto", 4)
    cap = target.capture(ids, mask, K)
    return pstate.cp_rank, pstate.tp_rank, cap, target.counts


@pytest.mark.slow  # spawns 2 and 4 gloo ranks
@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 2)])
def test_target_split_over_cp_tp_equals_full_forward(arch_targets, cp, tp):
    """Each of the cp·tp ranks runs the target on S/(cp·tp) positions; after the tp all-gather and the cp halo sum
    every rank holds its cp rank's aux states and label rows (equal to the full forward's there) and the argmax, and
    received exactly the counted bytes: (tp−1)/(cp·tp) of the sequence's aux + last hidden rows, the cp halo rows,
    the [B, S] argmax."""
    from recipe.parallel.cp_shard import label_rows, zigzag_indices
    from recipe.target.capture import TargetModel

    ids, mask, _ = _batch()
    full = TargetModel(arch_targets["llama"], dtype=torch.float32, device="cpu").capture(ids, mask)
    a, h = full.aux_hidden_BSA.shape[-1], full.last_hidden_BSH.shape[-1]
    real = mask.bool()
    for cp_rank, tp_rank, cap, counts in run_ranks(cp * tp, _split_worker, arch_targets["llama"], cp, tp):
        pos, rows = zigzag_indices(SEQ, cp, cp_rank), label_rows(SEQ, cp, cp_rank, K)
        where = (cp, tp, cp_rank, tp_rank)
        assert cap.aux_hidden_BSA.shape == (2, SEQ // cp, a), where
        assert _rel(cap.aux_hidden_BSA[real[:, pos]], full.aux_hidden_BSA[:, pos][real[:, pos]]) <= FP32_REORDERED, \
            where
        assert cap.label_hidden_BUH.shape == (2, rows.numel(), h), where
        assert _rel(cap.label_hidden_BUH[real[:, rows]], full.last_hidden_BSH[:, rows][real[:, rows]]) <= FP32_REORDERED, \
            where
        assert torch.equal(cap.argmax_BS[real], full.argmax_BS[real]), where
        assert counts.captures == 1 and counts.forward_positions == 2 * SEQ // (cp * tp), where
        assert counts.gathered_bytes == (tp - 1) * 2 * SEQ // (cp * tp) * (a + h) * 4, where
        assert counts.argmax_bytes == 2 * SEQ * 8, where
        # the summed halo holds every row one cp rank needs from another: at cp 2 the first K rows of chunk 1 (for
        # rank 0) and of chunk 3 (for rank 1), B = 2 samples
        halo = 2 * (2 * K if cp == 2 else 0) * h * 4
        assert counts.halo_bytes == halo, where


def test_single_rank_cp_target_equals_capture(arch_targets):
    """cp = 1 through the registry (the single-device block): the same states as the model's own attention."""
    from recipe.parallel.collectives import Collectives
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget

    ids, mask, _ = _batch()
    target = TargetModel(arch_targets["qwen2"], dtype=torch.float32, device="cpu")
    split = SplitTarget(target, Collectives("cpu"), None, 1, 0, "tiled", None)
    cap = split.capture(ids, mask, K)
    assert split.counts.halo_bytes == 0  # one cp rank holds every label row: no halo, no collective
    full = target.capture(ids, mask)
    assert target.config._attn_implementation == "sdpa"  # restored after the capture
    real = mask.bool()  # padded rows are unspecified: the full capture runs without the (right-padding) mask
    assert _rel(cap.aux_hidden_BSA[real], full.aux_hidden_BSA[real]) <= FP32_REORDERED
    rows = real[:, 1:]  # label rows 1..S-1
    assert _rel(cap.label_hidden_BUH[rows], full.last_hidden_BSH[:, 1:][rows]) <= FP32_REORDERED
    assert torch.equal(cap.argmax_BS[real], full.argmax_BS[real])


def test_unsupported_target_names_its_model_type(tmp_path):
    from transformers import Gemma2Config

    from recipe.target.registry import check_split_target

    with pytest.raises(ValueError, match=r"model_type 'gemma2'.*recipe\.dump.*--hidden-states"):
        check_split_target(Gemma2Config())
    for name in ARCHITECTURES:
        check_split_target(ARCHITECTURES[name][0]())


def test_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from recipe.parallel.collectives import Collectives
    from recipe.target.capture import TargetModel
    from recipe.target.split import SplitTarget

    config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    target = SplitTarget(TargetModel(tmp_path / "mistral", device="cpu"), Collectives("cpu"), None, 1, 0, "tiled")
    ids, mask, _ = _batch()
    with pytest.raises(ValueError, match="sliding window of 16 < sequence length 48"):
        target.capture(ids, mask, K)
