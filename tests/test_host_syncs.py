"""No needless host syncs or S×S masks in the training step, checked on the CPU by what the code hands where:

- the tile loops decide their (query tile, key tile) pairs from the host copies the batch builder attaches
  (``kernels.host_positions``), on one device and in the ring, forward and (checkpointed) recompute, with the same
  numbers as the fallback that reads the tensors themselves;
- offline micro-batches are built one ahead in a background thread (``StepBatches``): the same batches in the same
  order as building them one by one, their counts known before any is built; pinned memory only for CUDA;
- the target capture drops a right-padding mask (no dense [B, 1, S, S] mask) and keeps the real rows and the TTT
  losses; other masks are passed on.
The loop's once-per-step finite check: ``tests/test_finite_check.py``.
"""
from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_REORDERED, assert_close_rel

from recipe.data.store import FIELDS, HiddenStateStore
from recipe.data.vocab import VocabMap

K, TILE = 3, 4
MICRO = [[0, 3], [5, 1], [7, 2]]


def _vocab():
    return VocabMap.from_draft_ids(torch.arange(0, 96, 2), 96)


def _builder(store_dir, cp=1, rank=0, **kwargs):
    from recipe.parallel.dims import ParallelDims
    from recipe.train.batches import BatchBuilder

    return BatchBuilder(store=HiddenStateStore(store_dir), t2d=_vocab().t2d, ttt_steps=K, seq_divisor=2 * cp,
                        dims=ParallelDims(cp, cp=cp), cp_rank=rank, **kwargs)


def _model(store_dir, attention):
    from recipe.model.draft import Eagle3Draft
    from recipe.model.draft_config import Eagle3DraftConfig
    from recipe.model.ttt import TTTModel

    meta = HiddenStateStore(store_dir).meta
    config = Eagle3DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, vocab_size=96, draft_vocab_size=48, target_hidden_size=meta.hidden_size,
                               aux_layer_ids=list(meta.aux_layer_ids), rope_theta=500.0)
    draft = Eagle3Draft(config, seed=0)
    vocab = _vocab()
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    head = torch.randn(96, meta.hidden_size, generator=torch.Generator().manual_seed(0))
    draft.midlayer.self_attn.causal_attention = attention
    return TTTModel(draft, head, sparse_anchors=False)


class PairLog:
    """Wraps ``kernels.tiled_attention.readable_pairs``: records the storages of every tile it is handed."""

    def __init__(self, monkeypatch_setattr):
        import kernels.tiled_attention as tiled

        self.calls: list[list[torch.Tensor]] = []
        inner = tiled.readable_pairs

        def logged(q_tiles, k_tiles, v_tiles):
            self.calls.append(list(q_tiles) + list(k_tiles) + list(v_tiles))
            return inner(q_tiles, k_tiles, v_tiles)
        monkeypatch_setattr(tiled, "readable_pairs", logged)

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for call in self.calls for t in call}


def _host_storages(*tensors) -> set[int]:
    from kernels.host_positions import host_copies

    return {c.untyped_storage().data_ptr() for t in tensors for c in host_copies(t).per_rank}


def _fallback_copy(ttt):
    """The batch with fresh position/validity tensors: no host copies attached (the inference callers' case)."""
    return dataclasses.replace(ttt, position_ids_BS=ttt.position_ids_BS.clone(), key_valid_BS=ttt.key_valid_BS.clone())


def _run(model, ttt):
    model.zero_grad(set_to_none=True)
    out = model(ttt)
    (out.loss_sum_K * torch.tensor([1.0, 0.7, 0.4])).sum().backward()
    return out.loss_sum_K.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_host_copies_follow_aliases_not_copies():
    import gc

    from kernels.host_positions import attach_host_copies, host_block_meta, host_copy

    pos = torch.arange(8).expand(2, 8).clone()
    per_rank = [torch.tensor([[0, 1, 6, 7]] * 2), torch.tensor([[2, 3, 4, 5]] * 2)]
    local = attach_host_copies(pos[:, :4].clone(), per_rank, rank=1)
    assert host_copy(local) is per_rank[1] and host_copy(local, 0) is per_rank[0]
    assert host_copy(local.detach()) is per_rank[1]  # ZeRO-3 hands submodules input.detach()
    copy_ = local.clone()  # new memory: no entry (a CPU tensor is its own host copy, but not another rank's)
    assert host_copy(copy_) is copy_ and host_copy(copy_, 0) is None
    assert host_block_meta(local, local.clone(), None, key_rank=0) is None
    with pytest.raises(ValueError, match="CPU tensor of shape"):
        attach_host_copies(local, [per_rank[0][:, :2]])
    alias, ptr = local.detach(), local.data_ptr()
    del local
    gc.collect()
    assert host_copy(alias, 0) is None  # the entry died with the tensor it was attached to
    assert ptr == alias.data_ptr()


@pytest.mark.parametrize("checkpoint_steps", [False, True])
def test_tiled_pairs_come_from_host_copies(tiny_target_and_store, monkeypatch, checkpoint_steps):
    from kernels.host_positions import host_copies
    from kernels.tiled_attention import TiledCausalAttention

    _, store_dir = tiny_target_and_store
    batch = _builder(store_dir).build([0, 3, 5]).ttt
    assert host_copies(batch.position_ids_BS) is not None and host_copies(batch.key_valid_BS) is not None
    model = _model(store_dir, TiledCausalAttention(TILE))
    model.checkpoint_steps = checkpoint_steps
    log = PairLog(monkeypatch.setattr)
    loss, grads = _run(model, batch)
    assert len(log.calls) == K * (2 if checkpoint_steps else 1)  # once per step's forward (and its recompute)
    assert all(t.device.type == "cpu" for call in log.calls for t in call)
    assert log.storages() <= _host_storages(batch.position_ids_BS, batch.key_valid_BS)  # never the batch's own

    fallback = _fallback_copy(batch)
    log.calls.clear()
    ref_loss, ref_grads = _run(model, fallback)
    assert log.storages() <= {fallback.position_ids_BS.untyped_storage().data_ptr(),
                              fallback.key_valid_BS.untyped_storage().data_ptr()}
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def _ring_worker(rank, world_size, store_dir):
    import torch.distributed as dist

    from kernels.attention_backends import make_causal_attention
    from kernels.host_positions import host_copies

    class Patch:
        def __init__(self):
            self.undo = []

        def setattr(self, obj, name, value):
            self.undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    patch = Patch()
    log = PairLog(patch.setattr)
    try:
        batch = _builder(store_dir, cp=world_size, rank=rank).build([0, 3, 5]).ttt
        copies = host_copies(batch.key_valid_BS)
        model = _model(store_dir, make_causal_attention("tiled", TILE, "cpu", dist.group.WORLD))
        loss, grads = _run(model, batch)
        host_calls = len(log.calls)
        from_host = log.storages() <= _host_storages(batch.position_ids_BS, batch.key_valid_BS)
        log.calls.clear()
        ref_loss, ref_grads = _run(model, _fallback_copy(batch))
        return {"host_calls": host_calls, "from_host": from_host, "fallback_calls": len(log.calls),
                "ranks": (len(copies.per_rank), copies.rank), "loss": (loss, ref_loss),
                "same_grads": all(torch.equal(grads[n], ref_grads[n]) for n in grads)}
    finally:
        for obj, name, value in reversed(patch.undo):
            setattr(obj, name, value)


@pytest.mark.slow  # spawns 2 gloo ranks
def test_ring_pairs_come_from_host_copies(tiny_target_and_store):
    _, store_dir = tiny_target_and_store
    for rank, r in enumerate(run_ranks(2, _ring_worker, str(store_dir))):
        assert r["ranks"] == (2, rank)
        assert r["host_calls"] == K * 2  # forward only: one per hop per step; the backward reuses them
        assert r["from_host"], rank
        assert r["fallback_calls"] == K * 2  # without copies: the received blocks, also decided once per hop
        loss, ref_loss = r["loss"]
        assert torch.equal(loss, ref_loss) and r["same_grads"], rank


# ---- offline batches: one ahead, same batches, pinned only for CUDA -----------------------------------------------
class ThreadStore(HiddenStateStore):
    """Records which thread read which fields."""

    def __init__(self, path):
        super().__init__(path)
        self.reads: list[tuple[str, tuple[str, ...]]] = []

    def get(self, i, rows=None, fields=FIELDS):
        self.reads.append((threading.current_thread().name, tuple(fields)))
        return super().get(i, rows=rows, fields=fields)


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 1)])
def test_prefetch_gives_the_same_batches_in_the_same_order(tiny_target_and_store, cp, rank):
    from recipe.train.step_batches import StepBatches

    _, store_dir = tiny_target_and_store
    plain = _builder(store_dir, cp, rank)
    # each micro-batch's extent over it and another dp rank's samples (ZeRO-3 call counts): carried to the batch
    extents = [plain.call_extent([ix, [20 + m, 11]]) for m, ix in enumerate(MICRO)]
    expected = [plain.build(ix, extent=e) for ix, e in zip(MICRO, extents)]
    builder = _builder(store_dir, cp, rank)
    builder.store = ThreadStore(store_dir)
    step = StepBatches(builder, MICRO, extents)
    assert torch.equal(step.local_valid_K, torch.stack([b.ttt.valid_KBS.sum(dim=(1, 2)) for b in expected]).sum(0))
    assert torch.equal(step.supervised_K, torch.stack([b.supervised_K for b in expected]).sum(0))
    assert step.supervised_tokens == sum(b.supervised_tokens for b in expected)
    assert step.shape == (2, 2, max(b.ttt.input_ids_KBS.shape[-1] for b in expected) * cp)  # samples, rows, tokens
    got = list(step)
    assert len(got) == len(expected)
    for m, (a, b) in enumerate(zip(got, expected)):
        assert (a.samples, a.supervised_tokens) == (b.samples, b.supervised_tokens) and torch.equal(
            a.supervised_K, b.supervised_K)
        assert a.ttt.call_extent == b.ttt.call_extent == extents[m]
        for name in a.ttt.tensor_fields():
            x, y = getattr(a.ttt, name), getattr(b.ttt, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (m, name)
    hidden = [name for name, fields in builder.store.reads if "aux_hidden" in fields or "last_hidden" in fields]
    assert hidden and all(name.startswith("batch-prefetch") for name in hidden)  # the store reads ran ahead


def test_pin_memory_only_for_cuda(tiny_target_and_store, monkeypatch):
    _, store_dir = tiny_target_and_store
    pinned = []

    def fake_pin(self, *args, **kwargs):  # no CUDA here: record the request, keep the tensor
        pinned.append(tuple(self.shape))
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    cpu = _builder(store_dir, device="cpu")
    assert not cpu.pin_memory
    cpu.build([0, 3])
    assert pinned == []
    cuda = _builder(store_dir, device="cuda")  # only read, never moved: no GPU on this machine
    assert cuda.pin_memory
    ttt = cuda.read(cuda.tokens([0, 3]))
    assert sorted(pinned) == sorted(tuple(getattr(ttt, name).shape) for name in ttt.tensor_fields())


# ---- the target capture without a right-padding mask ------------------------------------------------------------
def _padded_batch():
    gen = torch.Generator().manual_seed(5)
    lengths = (21, 13, 30)
    ids = torch.zeros(len(lengths), 32, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 96, (n,), generator=gen)
        mask[row, :n] = 1
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    return ids, mask, loss_mask


def test_is_right_padded():
    from recipe.target.capture import is_right_padded

    assert is_right_padded(torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]]))
    assert is_right_padded(torch.ones(2, 3, dtype=torch.bool))
    assert not is_right_padded(torch.tensor([[0, 1, 1]]))  # left padding
    assert not is_right_padded(torch.tensor([[1, 0, 1]]))  # a hole
    assert not is_right_padded(torch.tensor([[1, 2, 0]]))


def test_capture_without_the_mask_equals_it_on_real_rows(tiny_target, monkeypatch):
    import recipe.target.capture as target_module
    from recipe.model.ttt import make_ttt_batch, target_in_draft_vocab
    from recipe.target.capture import TargetModel

    target = TargetModel(tiny_target, dtype=torch.float32, device="cpu")
    masks = []
    forward = target.decoder.forward
    monkeypatch.setattr(target.decoder, "forward",
                        lambda *a, **kw: masks.append(kw.get("attention_mask")) or forward(*a, **kw))
    ids, mask, loss_mask = _padded_batch()
    fast = target.capture(ids, mask)
    assert masks[-1] is None  # right padding on the CPU: no mask, so no dense [B, 1, S, S] one
    left = torch.flip(mask, [1])
    target.capture(torch.flip(ids, [1]), left)
    assert torch.equal(masks[-1], left)  # left padding keeps its mask
    with monkeypatch.context() as m:
        m.setattr(target_module, "is_right_padded", lambda _mask: False)
        masked = target.capture(ids, mask)
    assert masks[-1] is not None
    real = mask.bool()
    # the same decoder on the same real rows; only the attention kernel's masking differs (fp32 rounding)
    for a, b in ((fast.aux_hidden_BSA, masked.aux_hidden_BSA), (fast.last_hidden_BSH, masked.last_hidden_BSH)):
        assert_close_rel(a[real], b[real], FP32_REORDERED, "hidden states")
    assert torch.equal(fast.argmax_BS[real], masked.argmax_BS[real])

    vocab = _vocab()
    draft_model = _model_for_target(target, vocab)
    outs = []
    for cap in (fast, masked):
        ttt = make_ttt_batch(ids, loss_mask, mask, cap.aux_hidden_BSA, cap.last_hidden_BSH,
                             target_in_draft_vocab(cap.argmax_BS, vocab.t2d), K)
        outs.append(draft_model(ttt))
    assert torch.equal(outs[0].valid_K, outs[1].valid_K) and outs[0].valid_K.min() > 0
    assert torch.equal(outs[0].correct_K, outs[1].correct_K)
    assert_close_rel(outs[0].loss_sum_K, outs[1].loss_sum_K, FP32_REORDERED, "loss sums")


def _model_for_target(target, vocab):
    from recipe.model.draft import Eagle3Draft
    from recipe.model.draft_config import Eagle3DraftConfig
    from recipe.model.ttt import TTTModel

    config = Eagle3DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, vocab_size=96, draft_vocab_size=48, target_hidden_size=target.hidden_size,
                               aux_layer_ids=list(target.aux_layer_ids), rope_theta=500.0)
    draft = Eagle3Draft(config, seed=0)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    return TTTModel(draft, copy.deepcopy(target.lm_head_weight.detach()), sparse_anchors=False)
