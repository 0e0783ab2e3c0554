"""The FLOP model (recipe.model.flops) against ``torch.utils.flop_counter.FlopCounterMode`` on the tiny draft, for
every memory switch, and per rank under tp = 2 and cp = 2 (gloo); the device peak table.

The counter counts matrix products (``aten.mm``: the linear layers and the target head; ``aten.bmm``: attention).
The comparison is exact (integers) up to two stated differences: the dense reference block computes every (query,
key) pair, n² per sample, where the model counts the n(n+1)/2 causal ones (the test passes the dense count as
``pairs``); and at TTT step 1 the single diagonal key's PV product is an einsum over a size-1 axis, a broadcast
multiply the counter does not see (2·d per position in its forward, 4·d in its backward, again 2·d in a step
checkpoint's recompute). The teacher rows are the U distinct label rows the code projects (one per position but
the first of each sample)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from helpers.cases import PARITY, build_case
from helpers.ranks import run_ranks
from kernels.attention_backends import make_causal_attention
from recipe.model.flops import (DraftShape, Recompute, StepFlops, TargetShape, causal_pairs, device_peak_tflops,
                                speed_fields, step_flops)
from recipe.model.tiled_mlp import MLPTiling
from recipe.model.ttt import TTTModel

K, B, S = 3, 2, 13


def _count(model: TTTModel, batch) -> dict[str, int]:
    """FlopCounterMode over one forward + backward: {"mm": linear layers + target head, "bmm": attention}."""
    with FlopCounterMode(display=False) as counter:
        out = model(batch)
        (out.loss_sum_K * torch.arange(1.0, K + 1)).sum().backward()
    flops = counter.get_flop_counts()["Global"]
    assert set(flops) <= {torch.ops.aten.mm, torch.ops.aten.bmm}, flops  # nothing else to compare
    return {"mm": flops.get(torch.ops.aten.mm, 0), "bmm": flops.get(torch.ops.aten.bmm, 0)}


def _unseen_diagonal(shape: DraftShape, positions: int, checkpoint_steps: bool) -> int:
    """Step 1's PV product over its one diagonal key (module docstring): forward 2·d, backward 4·d per position."""
    return 0 if shape.ttt_steps < 2 else 2 * shape.attention_width * positions * (3 + int(checkpoint_steps))


def _linear(flops: dict[str, int]) -> int:
    return sum(v for part, v in flops.items() if part != "attention")


SWITCHES = {  # name: (TTTModel keywords, MLP tile, attention: "dense" block or "tiled" with one-position tiles)
    "plain": ({}, None, "dense"),
    "checkpoint_steps": ({"checkpoint_steps": True}, None, "dense"),
    "chunked_loss": ({"loss_chunk_size": 5}, None, "dense"),
    "chunked_loss_teacher_streamed": ({"loss_chunk_size": 5, "teacher_logits_once": False}, None, "dense"),
    "teacher_per_step": ({"teacher_logits_once": False}, None, "dense"),
    "tiled_mlp": ({}, 4, "dense"),
    "tiled_mlp_checkpoint_steps": ({"checkpoint_steps": True}, 4, "dense"),
    "all_flash_attention": ({"checkpoint_steps": True, "loss_chunk_size": 7}, 5, "tiled"),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_hardware_flops_equal_the_counter_for_every_switch(name):
    kw, mlp_tile, attention = SWITCHES[name]
    draft, head_VH, batch = build_case(seed=0, K=K, lengths=(S, S))
    model = TTTModel(draft, head_VH, **kw, sparse_anchors=False)
    if mlp_tile is not None:
        model.draft.midlayer.mlp_tiling = MLPTiling(mlp_tile)
    if attention == "tiled":  # one-position tiles: exactly the causal pairs, flash-style backward
        model.draft.midlayer.self_attn.causal_attention = make_causal_attention("tiled", 1, "cpu")
    counted = _count(model, batch)
    shape = DraftShape.of_config(draft.config, K)
    recompute = Recompute(checkpoint_steps=model.checkpoint_steps, chunked_loss=model.loss_chunk_size is not None,
                          teacher_once=model.teacher_logits_once, mlp_tile=mlp_tile,
                          attention_backward=2.5 if attention == "tiled" else 2.0)
    rows = B * int(torch.unique(batch.target_row_KS).numel())
    flops = step_flops(shape, [S] * B, recompute, teacher_rows=rows,
                       pairs=None if attention == "tiled" else B * S * S)
    assert counted["mm"] == _linear(flops.hardware)
    assert counted["bmm"] == flops.hardware["attention"] - _unseen_diagonal(shape, B * S, model.checkpoint_steps)
    assert flops.hardware_total > flops.model_total or name == "plain"
    if name == "plain":  # no recompute: model FLOPs are what ran
        assert flops.model == flops.hardware


def test_model_flops_formula_by_hand_and_its_defaults():
    """The per-position formula of docs/benchmarks.md on the tiny shape, and the defaults (teacher rows = positions,
    causal pairs) against the test's exact inputs."""
    draft, _, _ = build_case(seed=0, K=K)
    shape = DraftShape.of_config(draft.config, K)
    h, i, d, vd, ht = 32, 48, 32, 8, 24
    n_layer = 2 * h * (4 + 2 * 2) * 8 + d * h + 3 * h * i
    assert (shape.fc_params, shape.layer_params, shape.lm_head_params, shape.target_head_params) == (
        3 * ht * h, n_layer, h * vd, ht * vd)
    flops = step_flops(shape, [S, 9])
    p, pairs = S + 9, S * (S + 1) // 2 + 9 * 10 // 2
    assert causal_pairs([S, 9]) == pairs and flops.positions == p
    assert flops.model == {"fc": 4 * 3 * ht * h * p, "layer": 6 * K * n_layer * p, "lm_head": 6 * K * h * vd * p,
                           "target_head": 2 * ht * vd * p,
                           "attention": 3 * 4 * d * (K * pairs + p * (0 + 1 + 2)), "target_forward": 0}
    frozen = step_flops(DraftShape.of_config(draft.config, K, freeze_lm_head=True), [S, 9])
    assert frozen.model["lm_head"] == 4 * K * h * vd * p
    # the code projects U = n - 1 rows per sample (no step reads row 0): one row per sample less than the model
    assert flops.model_total - step_flops(shape, [S, 9], teacher_rows=p - 2).model_total == 2 * 2 * ht * vd
    with pytest.raises(ValueError, match="lengths"):
        step_flops(shape, [-1])


def test_online_target_forward_and_speed_fields():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, vocab_size=500)
    target = TargetShape.of_config(cfg)
    per_layer = 64 * (4 + 2 * 2) * 16 + 64 * 64 + 3 * 64 * 96
    assert (target.layers, target.layer_params, target.attention_width) == (3, per_layer, 64)
    draft, _, _ = build_case(seed=0, K=K)
    shape = DraftShape.of_config(draft.config, K)
    flops = step_flops(shape, [10], target=target, supervised=4)
    assert flops.model["target_forward"] == 2 * 3 * per_layer * 10 + 4 * 64 * 3 * 55 + 2 * 64 * 500 * 4
    assert step_flops(shape, [10]).model["target_forward"] == 0  # offline
    fields = speed_fields(4e12, 2.0, 2, 989.0)
    assert fields == {"model_tflops_per_gpu": 1.0, "mfu": pytest.approx(1 / 989)}
    assert speed_fields(4e12, 2.0, 2, None)["mfu"] is None


def test_device_peaks_by_name_and_dtype():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", bf16) == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe", bf16) == 756.0
    assert device_peak_tflops("NVIDIA H200", bf16) == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", bf16) == 312.0
    assert device_peak_tflops("NVIDIA L40S", bf16) == 362.0 and device_peak_tflops("NVIDIA B200", bf16) == 2250.0
    assert device_peak_tflops("NVIDIA H100 NVL", bf16) is None  # not listed
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", fp32) is None  # the bf16 peak is not fp32's
    assert device_peak_tflops("NVIDIA GeForce RTX 4090", bf16) is None and device_peak_tflops(None, bf16) is None


# ---- per rank under tp = 2 and cp = 2 ------------------------------------------------------------------------------
L = 20  # two rows of 20 real tokens: no padding, a multiple of 2·cp·tp


def _layout_counts(rank, world_size, layout):
    from recipe.config import KernelOptions
    from recipe.config_memory import MemoryOptions
    from recipe.parallel.dims import ParallelDims
    from recipe.parallel.parallelize import parallelize
    from recipe.parallel.cp_shard import shard_ttt_batch
    from recipe.parallel.topology import ParallelState

    draft, head_VH, batch = build_case(seed=2, K=K, lengths=(L, L), geometry=PARITY)
    single = _count(TTTModel(draft, head_VH, sparse_anchors=False), batch) if rank == 0 else None
    tp, cp = (2, 1) if layout == "tp2" else (1, 2)
    pstate = ParallelState(ParallelDims(world_size=world_size, tp=tp, cp=cp))
    draft, head_VH, batch = build_case(seed=2, K=K, lengths=(L, L), geometry=PARITY)
    model = parallelize(TTTModel(draft, head_VH, sparse_anchors=False), pstate, MemoryOptions(attention_tile_size=None),
                        kernel_options=KernelOptions("tiled"))
    if cp > 1:
        batch = shard_ttt_batch(batch, cp, pstate.cp_rank)
    elif tp > 1:  # the one-rank block, as the single-process run computes it
        from kernels.block_attention import block_attention
        model.draft.midlayer.self_attn.causal_attention = block_attention
    rows = int(torch.unique(batch.target_row_KS).numel())
    dist.barrier()
    return {"single": single, "rank": _count(model, batch), "rows": rows}


@pytest.mark.slow
def test_per_rank_flops_under_tp_and_cp_are_the_single_process_count_split():
    """tp 2: each rank computes half of everything but fc (replicated over tp); cp 2: each rank half of every
    linear layer (its zigzag half of the positions) and the target head over its own label rows (each zigzag chunk's
    rows plus the K - 1 after it: the ranks' rows overlap), its ring the zigzag chunks' key blocks, five per rank
    (flash-style backward)."""
    draft, _, _ = build_case(seed=2, K=K, lengths=(L, L), geometry=PARITY)
    shape = DraftShape.of_config(draft.config, K)
    fc, teacher = 4 * shape.fc_params * B * L, 2 * shape.target_head_params
    for layout in ("tp2", "cp2"):
        results = run_ranks(2, _layout_counts, layout)
        single = results[0]["single"]
        assert single["mm"] == _linear(step_flops(shape, [L] * B, teacher_rows=B * (L - 1)).model)
        for r in results:
            got = r["rank"]
            if layout == "tp2":
                assert got["mm"] == fc + (single["mm"] - fc) // 2 and 2 * got["bmm"] == single["bmm"]
                continue
            assert got["mm"] - teacher * B * r["rows"] == (single["mm"] - teacher * B * (L - 1)) // 2
            chunk = L // 4  # zigzag: rank r holds chunks r and 3 - r, which read 1 + 4 (or 2 + 3) key blocks
            ring = step_flops(shape, [L // 2] * B, Recompute(attention_backward=2.5), pairs=B * 5 * chunk * chunk)
            assert got["bmm"] == ring.hardware["attention"] - _unseen_diagonal(shape, B * L // 2, False)
        if layout == "cp2":
            # rank 0: rows 1 .. c + K - 1 and c - 1 rows clamped at the end; rank 1: its adjacent chunks' rows
            assert [r["rows"] for r in results] == [(chunk + K - 1) + (chunk - 1), 2 * chunk + K - 1]


def test_step_flops_is_a_plain_record():
    flops = step_flops(DraftShape(32, 48, 4, 2, 8, 8, 24, 1), [4])
    assert isinstance(flops, StepFlops) and flops.model_total == sum(flops.model.values())
