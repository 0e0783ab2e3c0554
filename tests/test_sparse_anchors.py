"""Sparse anchors (``memory.sparse_anchors``, ``recipe.model.sparse_anchors``): each TTT step computed only at the
anchors some loss reads gives the dense path's loss sums, correct/valid counts, every parameter gradient and the aux
input gradient (fp32, rel ≤ 1e-5: ``helpers.tolerance.FP32_REORDERED``, the compacted path sums in
another order): on one process for every CPU attention backend, tiled and untiled, with step
checkpointing, the chunked loss, the tiled MLP and the teacher logits computed once or per step; on a
long-prompt/short-answer mask, with a row that has nothing supervised and a batch with nothing supervised at all
(zero gradients, every parameter still reached); on the real SmolLM2 target over ShareGPT; at tp2, cp2 and tp2·cp2
(gloo) against the single-process dense draft; under ZeRO 1-3 with a rank whose sets are empty; and over eight online
training steps. Also: flex's block mask on compacted queries, and the target argmax taken only at the rows the TTT
validity reads."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers.cases import answer_only, assert_same_run, build_case, run_model
from helpers.parity import assert_parity, run_layout
from helpers.ranks import run_ranks
from helpers.tolerance import FP32_AFTER_ADAM, FP32_CURVE, FP32_REORDERED, max_rel, within

from recipe.config import KernelOptions
from recipe.config_memory import MemoryOptions
from recipe.model import ttt_steps
from recipe.model.sparse_anchors import AUTO_SPARSE_SHARE, anchor_sets, needed_share, needed_steps, sparse_pays
from recipe.model.ttt import TTTBatch, TTTModel
from recipe.parallel.parallelize import parallelize

K = 4
SEQ = 16  # MEMORY geometry: rows of 13 and 9 tokens


def test_needed_sets_are_the_later_valid_steps_and_shrink():
    valid = torch.zeros(3, 2, 6, dtype=torch.bool)
    valid[0, 0, 1] = valid[2, 0, 4] = valid[1, 0, 2] = True  # row 1: nothing valid
    needed = needed_steps(valid)
    assert needed[0, 0].tolist() == [False, True, True, False, True, False]
    assert needed[1, 0].tolist() == [False, False, True, False, True, False]
    assert needed[2, 0].tolist() == [False, False, False, False, True, False]
    assert not needed[:, 1].any()
    positions = torch.arange(6).expand(2, 6) + 10
    rows = torch.stack([torch.arange(6) + k + 1 for k in range(3)]).clamp(max=5)
    sets = anchor_sets(valid, positions, rows)
    assert sets.counts_KB.tolist() == [[3, 0], [2, 0], [1, 0]]
    assert [t.tolist() for t in sets.index_K] == [[[1, 2, 4], [0, 0, 0]], [[2, 4], [0, 0]], [[4], [0]]]
    assert [t.tolist() for t in sets.select_K[1:]] == [[[1, 2], [0, 0]], [[1], [0]]]
    assert sets.positions_K[2].tolist() == [[14], [10]]
    assert [t.tolist() for t in sets.valid_K] == [[[True, False, False], [False] * 3], [[True, False], [False] * 2],
                                                  [[True], [False]]]
    # teacher rows: the distinct label rows of the live anchors (row 0: 1+1, 2+1, 4+1 | 2+2, 4+2->5 | 4+3->5)
    assert sets.teacher_rows_BU[0].tolist() == [2, 3, 4, 5]
    for k in range(3):
        want = sets.target_rows(rows, k)[0, : int(sets.counts_KB[k, 0])]
        got = sets.teacher_rows_BU[0][sets.teacher_index_K[k][0, : int(sets.counts_KB[k, 0])]]
        assert torch.equal(got, want), k


def _pair(batch_fn=None, seed=8, **switches):
    draft, head, batch = build_case(seed=seed, K=K, seq_len=SEQ)
    if batch_fn is not None:
        batch = batch_fn(batch)
    memory = MemoryOptions(attention_tile_size=switches.pop("tile", None), mlp_tile_size=switches.pop("mlp", None))
    backend = switches.pop("backend", "tiled")
    once = switches.pop("once", True)

    def run(sparse):
        model = TTTModel(copy.deepcopy(draft), head, sparse_anchors=sparse, **switches)
        model.teacher_logits_once = once
        return run_model(parallelize(model, None, memory, kernel_options=KernelOptions(backend)), batch)

    return run(True), run(False), batch


LONG_PROMPT = lambda batch: answer_only(batch, (4, 3))  # noqa: E731  a long prompt and a short answer per row
ONE_EMPTY_ROW = lambda batch: answer_only(batch, (6, 0))  # noqa: E731  row 1 supervises nothing

SWITCHES = {
    "dense-block": {}, "tiled": {"tile": 4}, "sdpa": {"backend": "sdpa", "tile": 5}, "sdpa-untiled": {"backend": "sdpa"},
    "ckpt-steps": {"checkpoint_steps": True, "tile": 4}, "chunked-loss": {"loss_chunk_size": 5},
    "tiled-mlp": {"mlp": 3}, "teacher-per-step": {"once": False},
    "all": {"backend": "sdpa", "tile": 3, "mlp": 5, "checkpoint_steps": True, "loss_chunk_size": 7},
}


@pytest.mark.parametrize("mask", [None, LONG_PROMPT, ONE_EMPTY_ROW], ids=["random", "long-prompt", "empty-row"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_sparse_matches_dense(name, mask):
    got, ref, batch = _pair(mask, **dict(SWITCHES[name]))
    assert_same_run(got, ref)
    if mask is not None:  # the case is sparse: step 0 needs under 60 % of the real positions, later steps fewer
        counts_KB = anchor_sets(batch.valid_KBS, batch.position_ids_BS, batch.target_row_KS).counts_KB
        assert counts_KB[0].sum() < 0.6 * batch.key_valid_BS.sum() and counts_KB[-1].sum() < counts_KB[0].sum()
        assert mask is not ONE_EMPTY_ROW or counts_KB[:, 1].sum() == 0


@pytest.mark.parametrize("checkpoint_steps", [False, True])
def test_nothing_supervised_gives_zero_gradients_everywhere(checkpoint_steps):
    def nothing(batch):
        return TTTBatch(**{**batch.__dict__, "valid_KBS": torch.zeros_like(batch.valid_KBS)})

    got, ref, _ = _pair(nothing, checkpoint_steps=checkpoint_steps, loss_chunk_size=4)
    out, grads, aux_grad = got
    assert out.loss_sum_K.abs().sum() == 0 and out.valid_K.sum() == 0 and out.correct_K.sum() == 0
    assert len(grads) == 13  # every trainable parameter reached (a grad tensor, not None: ZeRO's hooks fire)
    for name, grad in grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(grad, ref[1][name]), name
    assert torch.equal(aux_grad, torch.zeros_like(aux_grad))


@pytest.mark.slow
def test_sparse_matches_dense_on_smollm2_sharegpt(assets):
    """Two real ShareGPT conversations through SmolLM2-135M (fp32), the draft of its geometry with a 2048-token draft
    vocabulary: the template's mask (the system/user turns unsupervised) and a long-prompt/short-answer one."""
    from recipe.data.examples import build_examples
    from recipe.data.vocab import build_vocab_map
    from recipe.model.draft import Eagle3Draft
    from recipe.model.ttt import make_ttt_batch, target_in_draft_vocab
    from recipe.target.capture import TargetModel
    from recipe.target.registry import draft_config_for

    target = TargetModel(assets.target, dtype=torch.float32, device="cpu")
    examples, _ = build_examples(assets.conversations, target.load_tokenizer(), 192, limit=4)
    rows = examples.select(range(2))
    vocab = build_vocab_map(examples, target.vocab_size, 2048)
    s = max(len(r) for r in rows["input_ids"])
    ids = torch.zeros(2, s, dtype=torch.int64)
    loss = torch.zeros(2, s, dtype=torch.int64)
    attn = torch.zeros(2, s, dtype=torch.int64)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[b, :n], loss[b, :n], attn[b, :n] = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]), 1
    cap = target.capture(ids, attn)
    batch = make_ttt_batch(ids, loss, attn, cap.aux_hidden_BSA, cap.last_hidden_BSH,
                           target_in_draft_vocab(cap.argmax_BS, vocab.t2d), 3)
    supervised = batch.valid_KBS[0].sum().item() / attn.sum().item()
    assert 0.2 < supervised < 0.95, supervised  # the template's mask: prompts unsupervised, answers supervised
    draft = Eagle3Draft(draft_config_for(target.config, 2048), seed=0)
    draft.load_target_embeddings(target.embed_tokens_weight)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.lm_head_weight, vocab.draft_ids)
    head = target.lm_head_weight[vocab.draft_ids].clone()
    for case in (batch, answer_only(batch, (64, 48))):
        def run(sparse):
            model = TTTModel(copy.deepcopy(draft), head, loss_chunk_size=64, checkpoint_steps=True,
                             sparse_anchors=sparse)
            return run_model(parallelize(model, None, MemoryOptions(attention_tile_size=48, mlp_tile_size=40),
                                         kernel_options=KernelOptions("sdpa")), case)

        assert_same_run(run(True), run(False))
    long = answer_only(batch, (64, 48))
    needed = anchor_sets(long.valid_KBS, long.position_ids_BS, long.target_row_KS).counts_KB
    assert needed[0].sum() < 0.4 * attn.sum()  # the long-prompt case is sparse


SEQ_PAR = 24  # PARITY rows of 19 and 14 tokens padded to a multiple of 2·cp·tp = 8
# (tp, cp, answers, backend, tile, switches): the template-like random mask and long-prompt/short-answer masks (row 1
# empty); "-all": step checkpointing, the chunked loss and the tiled MLP on too
ALL = {"checkpoint_steps": True, "loss_chunk_size": 5, "mlp_tile_size": 3}
WORLD2 = {"tp2": (2, 1, None, "tiled", None, None), "tp2-long": (2, 1, (6, 0), "sdpa", 4, None),
          "cp2": (1, 2, None, "tiled", None, None), "cp2-long": (1, 2, (6, 0), "sdpa", 4, None),
          "cp2-long-all": (1, 2, (6, 2), "sdpa", 4, ALL), "tp2-all": (2, 1, None, "tiled", 4, ALL)}
WORLD4 = {"tp2cp2": (2, 2, None, "tiled", 4, None), "tp2cp2-long": (2, 2, (6, 2), "sdpa", None, None),
          "tp2cp2-long-all": (2, 2, (6, 0), "tiled", 4, ALL)}


def _layouts(rank, world, cases):
    return {name: run_layout(rank, world, tp=tp, cp=cp, K=3, seed=10, seq_len=SEQ_PAR, dtype=torch.float32,
                             attention_backend=backend, sparse=True, answers=answers, tile_size=tile, switches=sw)
            for name, (tp, cp, answers, backend, tile, sw) in cases.items()}


def _check_layouts(results, cases):
    for name, (tp, cp, answers, *_) in cases.items():
        needed = torch.zeros(3, dtype=torch.int64)
        for rank, result in enumerate(results):
            r = result[name]
            assert assert_parity(r, FP32_REORDERED, f"{name} rank {rank}") == 13
            if r["tp_rank"] == 0:
                needed += r["local_needed"]
            else:  # every rank of a tp group holds the same data, so the same set
                assert torch.equal(r["local_needed"], results[rank - r["tp_rank"]][name]["local_needed"]), name
        # the sparse path ran: the cp ranks' own sets add up to fewer anchors than positions, shrinking with k
        assert needed[0] < results[0][name]["real_positions"] and needed[-1] <= needed[0], (name, needed)
        if answers is not None:
            assert needed[0] < 0.5 * results[0][name]["real_positions"], (name, needed)


@pytest.mark.slow
def test_sparse_tp2_and_cp2_match_single_process_dense():
    _check_layouts(run_ranks(2, _layouts, WORLD2), WORLD2)


def _mixed(rank, world):
    """cp2, the cp ranks on different paths (rank 0 sparse, rank 1 dense, and the other way round), every switch."""
    return {order: run_layout(rank, world, tp=1, cp=2, K=3, seed=10, seq_len=SEQ_PAR, dtype=torch.float32,
                              attention_backend="tiled", sparse=order, answers=(6, 2), tile_size=4, switches=ALL)
            for order in ((True, False), (False, True))}


@pytest.mark.slow
def test_cp_ranks_on_different_paths_match_single_process_dense():
    """What ``"auto"`` may decide under cp (each rank its own shard's share): one ring, one rank compacted."""
    for rank, result in enumerate(run_ranks(2, _mixed)):
        for order, r in result.items():
            assert assert_parity(r, FP32_REORDERED, f"cp2 {order} rank {rank}") == 13


@pytest.mark.slow
def test_sparse_tp2_cp2_matches_single_process_dense():
    _check_layouts(run_ranks(4, _layouts, WORLD4), WORLD4)


def test_flex_block_mask_reads_compacted_queries():
    """The flex kernel's block mask and LSE with the sparse path's compacted queries (Sq ≠ Sk, non-decreasing
    positions with the padded rows' repeats, a query before every valid key): flex's eager CPU forward equals the
    dense block (its backward is flex's own for the same mask, CUDA only)."""
    from kernels.block_attention import block_attention
    from kernels.flex_attention import flex_block_attention

    g = torch.Generator().manual_seed(0)
    s = 300  # three 128-blocks of keys, the last one partial
    k = torch.randn(2, 2, s, 16, generator=g)
    v = torch.randn(2, 2, s, 16, generator=g)
    k_pos = torch.arange(s).expand(2, s)
    k_valid = torch.ones(2, s, dtype=torch.bool)
    k_valid[1, :5] = False  # left padding in row 1
    q_pos = torch.tensor([[0, 3, 130, 131, 140, 200, 260, 299, 299, 299],
                          [2, 4, 5, 127, 128, 129, 250, 251, 251, 251]])
    q = torch.randn(2, 4, q_pos.shape[1], 16, generator=g)
    out, lse = flex_block_attention(q, k, v, q_pos, k_pos, k_valid, 0.25, compiled=False)
    ref_out, ref_lse = block_attention(q, k, v, q_pos, k_pos, k_valid, scale=0.25)
    assert torch.isneginf(lse[1, :, :2]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    within(max_rel(lse[finite], ref_lse[finite]), FP32_REORDERED, "flex lse")
    within(max_rel(out, ref_out), FP32_REORDERED, "flex out")


def _zero_worker(rank, world):
    """Two AdamW steps under ZeRO stages 1, 2, 3 over 2 data-parallel ranks, dense vs sparse, with step checkpointing
    and the chunked loss; rank 0 supervises a short answer, rank 1 nothing (its sets are empty)."""
    from helpers.cases import zero3_two_steps

    results = {}
    for stage in (0, 1, 2, 3):
        # "mixed": rank 0 on the sparse path, rank 1 on the dense one (what "auto" may decide per rank)
        for sparse in (False, True, "mixed"):
            draft, head_VH, batch = build_case(seed=8, K=K, seq_len=SEQ)
            batch = answer_only(batch, (6, 3) if rank == 0 else (0, 0))
            mode = (rank == 0) if sparse == "mixed" else sparse
            model = TTTModel(draft, head_VH, loss_chunk_size=5, checkpoint_steps=True, sparse_anchors=mode)
            parallelize(model, None, MemoryOptions(attention_tile_size=4), kernel_options=KernelOptions("sdpa"))
            results[(stage, sparse)] = zero3_two_steps(model, batch, K, world, stage)
    return results


@pytest.mark.slow
def test_sparse_under_zero_stages_matches_dense():
    for rank, result in enumerate(run_ranks(2, _zero_worker)):
        for stage in (0, 1, 2, 3):
            for other in (True, "mixed"):
                (dense_loss, dense_params), (loss, params) = result[(stage, False)], result[(stage, other)]
                # rank 0: the first step changed the weights; rank 1 (nothing supervised): its local loss is 0
                assert not torch.equal(dense_loss[0], dense_loss[1]) if rank == 0 else not dense_loss.any()
                within(max_rel(loss, dense_loss), FP32_REORDERED, f"ZeRO-{stage} {other} loss")
                assert params.keys() == dense_params.keys()
                for name, value in dense_params.items():
                    within(max_rel(params[name], value), FP32_AFTER_ADAM, f"ZeRO-{stage} {other} {name}")


@pytest.mark.slow
def test_online_curve_with_and_without_sparse_anchors(assets, tmp_path):
    """Eight online steps (SmolLM2 on ShareGPT, fp32, one rank) with ``memory.sparse_anchors`` on and off, the
    chunked loss, step checkpointing and MLP tiles set: equal curves (rel ≤ ``FP32_CURVE``), the switch in
    run_config.json."""
    import json

    from helpers.training import assert_curves_close, run_training, write_ds_config

    def argv(name, sparse):
        memory = {"sparse_anchors": sparse, "loss_chunk_size": 64, "checkpoint_ttt_steps": True,
                  "attention_tile_size": 32, "mlp_tile_size": 48}
        config = write_ds_config(tmp_path / f"{name}.json", train_batch_size=2, scheduler=None, memory=memory)
        return ["--ds_config", str(config), "--target", str(assets.target), "--data", str(assets.conversations),
                "--output", str(tmp_path / name), "--max-length", "96", "--limit", "16", "--draft-vocab-size", "512",
                "--ttt-steps", "3", "--seed", "0", "--epochs", "2", "--max-steps", "8", "--lm-head-init", "random",
                "--cache-dir", str(tmp_path / "cache"), "--no-export"]

    dense, sparse = run_ranks(1, run_training, [argv("dense", False), argv("sparse", True)])[0]
    assert len(dense) == 8 and dense[0]["valid"][0] > 0
    assert_curves_close(dense, sparse, FP32_CURVE, "online, sparse anchors")
    for name, flag in (("dense", False), ("sparse", True)):
        assert json.loads((tmp_path / name / "run_config.json").read_text())["memory"]["sparse_anchors"] is flag


def test_target_argmax_only_at_the_rows_validity_reads():
    """``lm_head_argmax`` at ``validity_rows(loss_mask)`` only: the same tokens there, 0 elsewhere, and the TTT batch
    built from it has exactly the full argmax's validity (the in-vocabulary flag is read nowhere else)."""
    from recipe.model.ttt import make_ttt_batch, target_in_draft_vocab
    from recipe.target.head import lm_head_argmax, validity_rows

    g = torch.Generator().manual_seed(0)
    b, s, v, h = 2, 23, 50, 8
    last = torch.randn(b, s, h, generator=g)
    head = torch.randn(v, h, generator=g)
    loss = torch.rand(b, s, generator=g) < 0.3
    attention = torch.ones(b, s, dtype=torch.bool)
    attention[1, 17:] = False
    loss &= attention
    rows = validity_rows(loss)
    assert rows[:, :-1].equal(loss[:, 1:]) and not rows[:, -1].any()
    full = lm_head_argmax(last, head, 4)
    part = lm_head_argmax(last, head, 4, rows)
    assert torch.equal(part[rows], full[rows]) and not part[~rows].any() and not torch.equal(part, full)
    t2d = torch.rand(v, generator=g) < 0.5
    ids = torch.randint(0, v, (b, s), generator=g)
    batches = [make_ttt_batch(ids, loss, attention, torch.zeros(b, s, 3), last, target_in_draft_vocab(a, t2d), 4)
               for a in (full, part)]
    assert batches[0].valid_KBS.any() and torch.equal(batches[0].valid_KBS, batches[1].valid_KBS)


def test_bench_step_summary_pairs_sparse_with_dense():
    """``recipe.bench.step.summarise``: the sparse/dense ratios of the same backend, length and mask (median over
    rounds), x_vs_tiled within a path; the supervision masks select what ``supervised_mask`` says."""
    from recipe.bench.step import summarise
    from recipe.plan.spec import supervised_mask

    def row(backend, mask, sparse, seconds, peak, round_=0):
        return {"backend": backend, "length": 2048, "mask": mask, "sparse": sparse, "round": round_, "status": "ok",
                "seconds": seconds, "peak_bytes": peak}

    rows = [row("tiled", "long10", False, 10.0, 100), row("tiled", "long10", True, 2.0, 30),
            row("tiled", "long10", True, 4.0, 20, 1), row("sdpa", "long10", True, 1.0, 25)]
    by = {(e["backend"], e["sparse"]): e for e in summarise(rows)}
    assert by[("tiled", True)]["sparse_vs_dense"] == 0.3 and by[("tiled", True)]["peak_vs_dense"] == 0.3
    assert "sparse_vs_dense" not in by[("tiled", False)] and "sparse_vs_dense" not in by[("sdpa", True)]
    assert by[("sdpa", True)]["x_vs_tiled"] == 3.0
    assert supervised_mask("full", 1, 100).all() and supervised_mask("long10", 2, 100).sum() == 20
    assert abs(supervised_mask("sharegpt", 1, 1950).float().mean().item() - 135 / 195) < 1e-6


def test_auto_takes_the_sparse_path_only_where_it_pays(monkeypatch):
    """``sparse_anchors="auto"``: the share is step 0's compacted rows over the positions (the longest row's needed
    count / S); a long-prompt/short-answer batch runs sparse, a fully supervised one dense, and both give the dense
    numbers. A bad mode is a ValueError naming it."""
    valid = torch.zeros(2, 2, 10, dtype=torch.bool)
    valid[0, 0, :3] = True
    valid[1, 0, 5] = True  # row 0 needs 4 anchors (0, 1, 2, 5), row 1 none
    assert needed_share(valid) == 0.4 and sparse_pays("auto", valid) and not sparse_pays(False, valid)
    valid[0, 1, :9] = True
    assert needed_share(valid) == 0.9 > AUTO_SPARSE_SHARE
    assert not sparse_pays("auto", valid) and sparse_pays(True, valid)
    with pytest.raises(ValueError, match="'sometimes'"):
        sparse_pays("sometimes", valid)
    with pytest.raises(ValueError, match="sparse_anchors='yes'"):
        TTTModel(*build_case(seed=3, K=K, seq_len=SEQ)[:2], sparse_anchors="yes")

    draft, head_VH, batch = build_case(seed=3, K=K, seq_len=SEQ)
    long = answer_only(batch, (6, 3))
    share = needed_share(batch.valid_KBS)  # the template-like mask; at this threshold it is not "under" it
    assert needed_share(long.valid_KBS) < min(share, AUTO_SPARSE_SHARE)
    for case, threshold, sparse in ((long, AUTO_SPARSE_SHARE, True), (batch, share, False)):
        monkeypatch.setattr("recipe.model.sparse_anchors.AUTO_SPARSE_SHARE", threshold)
        calls = []
        model = TTTModel(copy.deepcopy(draft), head_VH, sparse_anchors="auto")
        monkeypatch.setattr("recipe.model.ttt.sparse_steps",
                            lambda m, b: calls.append(1) or ttt_steps.sparse_steps(m, b))
        got = run_model(model, case)
        assert calls == ([1] if sparse else [])
        assert_same_run(got, run_model(TTTModel(copy.deepcopy(draft), head_VH, sparse_anchors=False), case))
