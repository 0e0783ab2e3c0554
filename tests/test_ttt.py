"""TTT: batch construction, soft CE, and the whole K-step forward/backward against a dense-mask reference."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import cases

from helpers.tolerance import FP32_REORDERED, assert_close_rel
from kernels.block_attention import block_attention
from recipe.model.draft import Eagle3Draft
from recipe.model.loss import soft_ce
from recipe.model.ttt import TTTBatch, TTTModel, make_ttt_batch, target_in_draft_vocab, ttt_objective
from recipe.target.head import lm_head_argmax

S = 13


def build_case(seed: int, K: int, lengths=(S, 9)):
    """A draft with a random vocab map, its target head, and a TTT batch with padding (rows of different length)."""
    return cases.build_case(seed, K, seq_len=S, lengths=lengths)


# ---------------------------------------------------------------- dense reference (independent of the model code)
def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x_BHSD, pos_BS, theta):
    d = x_BHSD.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos_BS[..., None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x_BHSD[..., : d // 2], x_BHSD[..., d // 2:]
    return x_BHSD * cos + torch.cat([-x2, x1], -1) * sin


def dense_reference(draft: Eagle3Draft, head_VH, batch: TTTBatch, aux_BSA):
    """Naive TTT: keys of all steps concatenated, an explicit [S, S*(k+1)] mask, one softmax."""
    cfg, p = draft.config, dict(draft.named_parameters())
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    head_d = head_VH[torch.nonzero(draft.t2d).flatten()]
    b, s = batch.position_ids_BS.shape
    pos = batch.position_ids_BS
    h = aux_BSA @ p["fc.weight"].T
    keys, values, losses, corrects = [], [], [], []
    for k in range(batch.num_steps):
        emb = p["embed_tokens.weight"][batch.input_ids_KBS[k]]
        x = torch.cat([rms(emb, p["midlayer.input_layernorm.weight"], eps),
                       rms(h, p["midlayer.hidden_norm.weight"], eps)], -1)

        def proj(name, heads):
            return (x @ p[f"midlayer.self_attn.{name}_proj.weight"].T).view(b, s, heads, d).transpose(1, 2)

        q, key, val = rope(proj("q", nh), pos + k, cfg.rope_theta), rope(proj("k", nkv), pos + k, cfg.rope_theta), \
            proj("v", nkv)
        keys.append(key)
        values.append(val)
        k_all = torch.cat(keys, 2).repeat_interleave(nh // nkv, 1)  # [B, H, S*(k+1), D]
        v_all = torch.cat(values, 2).repeat_interleave(nh // nkv, 1)
        eye = torch.eye(s, dtype=torch.bool)
        causal = (pos[:, None, :] <= pos[:, :, None]) & batch.key_valid_BS[:, None, :]  # [B, Sq, Sk]
        mask = torch.cat([causal] + [eye.expand(b, s, s)] * k, dim=2)  # [B, S, S*(k+1)]
        scores = (q @ k_all.transpose(-1, -2)) / math.sqrt(d)
        attn = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1) @ v_all
        h = h + attn.transpose(1, 2).reshape(b, s, -1) @ p["midlayer.self_attn.o_proj.weight"].T
        y = rms(h, p["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (F.silu(y @ p["midlayer.mlp.gate_proj.weight"].T) * (y @ p["midlayer.mlp.up_proj.weight"].T))
        h = h + mlp @ p["midlayer.mlp.down_proj.weight"].T
        logits = rms(h, p["norm.weight"], eps) @ p["lm_head.weight"].T
        target = batch.target_hidden_BLH[:, batch.target_row_KS[k]] @ head_d.T
        per_pos = -(torch.softmax(target, -1) * torch.log_softmax(logits, -1)).sum(-1)
        valid = batch.valid_KBS[k]
        losses.append(per_pos[valid].sum())
        corrects.append((logits.argmax(-1) == target.argmax(-1))[valid].sum())
    return torch.stack(losses), torch.stack(corrects)


@pytest.mark.parametrize("K", [1, 3, 7])
def test_ttt_forward_and_every_gradient_match_dense_reference(K):
    draft, head_VH, batch = build_case(seed=K, K=K)
    ref_draft = copy.deepcopy(draft)
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    aux = batch.aux_hidden_BSA.clone().requires_grad_(True)
    aux_ref = batch.aux_hidden_BSA.clone().requires_grad_(True)
    out = model(TTTBatch(**{**batch.__dict__, "aux_hidden_BSA": aux}))
    ref_loss_K, ref_correct_K = dense_reference(ref_draft, head_VH, batch, aux_ref)

    assert out.loss_sum_K.dtype == torch.float32 and out.loss_sum_K.shape == (K,)
    assert_close_rel(out.loss_sum_K, ref_loss_K, FP32_REORDERED, "loss_sum_K")
    assert torch.equal(out.correct_K, ref_correct_K)
    assert torch.equal(out.valid_K, batch.valid_KBS.sum(dim=(1, 2)))
    assert out.valid_K.min() > 0 and out.correct_K.sum() > 0  # the comparison is not vacuous

    weights = torch.rand(K, generator=torch.Generator().manual_seed(7)) + 0.5  # distinct weight per step
    (weights * out.loss_sum_K).sum().backward()
    (weights * ref_loss_K).sum().backward()
    ref_params = dict(ref_draft.named_parameters())
    checked = 0
    for name, param in draft.named_parameters():
        if not param.requires_grad:
            assert param.grad is None and name == "embed_tokens.weight"
            continue
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert_close_rel(param.grad, ref_params[name].grad, FP32_REORDERED, name)
        checked += 1
    assert checked == 13
    assert_close_rel(aux.grad, aux_ref.grad, FP32_REORDERED, "aux_hidden_BSA")


def test_fully_masked_row_is_finite_and_does_not_touch_other_rows():
    draft, head_VH, batch = build_case(seed=11, K=3, lengths=(S, 0))
    assert not batch.key_valid_BS[1].any() and not batch.valid_KBS[:, 1].any()
    model = TTTModel(draft, head_VH, sparse_anchors=False)
    out = model(batch)
    assert torch.isfinite(out.loss_sum_K).all()
    ttt_objective(out, out.valid_K).backward()
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.requires_grad)
    # the same first row alone gives the same sums
    alone = TTTBatch(input_ids_KBS=batch.input_ids_KBS[:, :1], valid_KBS=batch.valid_KBS[:, :1],
                     position_ids_BS=batch.position_ids_BS[:1], key_valid_BS=batch.key_valid_BS[:1],
                     aux_hidden_BSA=batch.aux_hidden_BSA[:1], target_hidden_BLH=batch.target_hidden_BLH[:1],
                     target_row_KS=batch.target_row_KS)
    out_alone = TTTModel(copy.deepcopy(draft), head_VH, sparse_anchors=False)(alone)
    assert_close_rel(out_alone.loss_sum_K, out.loss_sum_K, FP32_REORDERED, "row alone")
    assert torch.equal(out_alone.correct_K, out.correct_K)


def test_target_head_accepts_full_or_draft_rows():
    draft, head_VH, _ = build_case(seed=1, K=1)
    ids = draft.draft_token_ids()
    full, rows = TTTModel(draft, head_VH, sparse_anchors=False), TTTModel(draft, head_VH[ids], sparse_anchors=False)
    assert torch.equal(full.target_head_d, head_VH[ids]) and torch.equal(rows.target_head_d, head_VH[ids])
    assert "target_head_d" not in full.state_dict()
    assert "target_head_d" not in dict(full.named_parameters())
    with pytest.raises(ValueError, match="draft_vocab_size=8"):
        TTTModel(draft, head_VH[:50], sparse_anchors=False)


def test_causal_attention_is_swappable_and_called_with_anchor_positions():
    draft, head_VH, batch = build_case(seed=3, K=3)
    calls = []

    def recording(q, k, v, q_pos, k_pos, k_valid):
        calls.append((k.shape, q_pos.clone(), k_pos.clone(), k_valid.clone()))
        return block_attention(q, k, v, q_pos, k_pos, k_valid)

    baseline = TTTModel(draft, head_VH, sparse_anchors=False)(batch).loss_sum_K.detach()
    draft.midlayer.self_attn.causal_attention = recording
    swapped = TTTModel(draft, head_VH, sparse_anchors=False)(batch).loss_sum_K.detach()
    assert torch.equal(baseline, swapped)
    assert len(calls) == 3
    for k_shape, q_pos, k_pos, k_valid in calls:  # every step reads step 0's block at the anchor positions
        assert k_shape == (2, 2, S, 8)
        assert torch.equal(q_pos, batch.position_ids_BS) and torch.equal(k_pos, batch.position_ids_BS)
        assert torch.equal(k_valid, batch.key_valid_BS)
    draft.midlayer.self_attn.causal_attention = lambda q, k, v, *a: (torch.zeros_like(q), q.new_zeros(q.shape[:3]))
    assert not torch.allclose(TTTModel(draft, head_VH, sparse_anchors=False)(batch).loss_sum_K, baseline)


def test_make_ttt_batch_shifts_exactly():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    in_vocab = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    aux, last = torch.randn(2, 6, 9), torch.randn(2, 6, 3)
    batch = make_ttt_batch(ids, loss_mask, attention, aux, last, in_vocab, K=2)
    assert torch.equal(batch.input_ids_KBS, torch.tensor([
        [[11, 12, 13, 14, 15, 0], [21, 22, 23, 0, 0, 0]],
        [[12, 13, 14, 15, 0, 0], [22, 23, 0, 0, 0, 0]]]))
    # valid[k, p] = loss_mask[p+2+k] & in_vocab[p+1+k] & attention[p] & (p+2+k < S)
    assert torch.equal(batch.valid_KBS, torch.tensor([
        [[1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
        [[1, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]], dtype=torch.bool))
    assert torch.equal(batch.target_row_KS, torch.tensor([[1, 2, 3, 4, 5, 5], [2, 3, 4, 5, 5, 5]]))
    assert torch.equal(batch.position_ids_BS, torch.arange(6).expand(2, 6))
    assert torch.equal(batch.key_valid_BS, attention.bool())
    assert batch.aux_hidden_BSA is aux and batch.target_hidden_BLH is last
    assert batch.input_ids_KBS.dtype == torch.int64 and batch.valid_KBS.dtype == torch.bool
    moved = batch.to("cpu")
    assert set(TTTBatch.per_position_fields) <= set(moved.__dict__) and torch.equal(moved.valid_KBS, batch.valid_KBS)
    with pytest.raises(ValueError, match="K=0"):
        make_ttt_batch(ids, loss_mask, attention, aux, last, in_vocab, K=0)
    with pytest.raises(ValueError, match="loss_mask_BS"):
        make_ttt_batch(ids, loss_mask[:, :5], attention, aux, last, in_vocab, K=1)


def test_valid_mask_follows_the_convention_elementwise():
    g = torch.Generator().manual_seed(5)
    b, s, k_steps = 3, 11, 4
    attention = torch.ones(b, s, dtype=torch.bool)
    attention[1, 7:] = False
    attention[2, :2] = False  # left padding: anchors there are not valid
    loss_mask = (torch.rand(b, s, generator=g) < 0.7) & attention
    in_vocab = torch.rand(b, s, generator=g) < 0.6
    batch = make_ttt_batch(torch.zeros(b, s, dtype=torch.int64), loss_mask, attention, torch.zeros(b, s, 3),
                           torch.zeros(b, s, 1), in_vocab, k_steps)
    expected = torch.zeros(k_steps, b, s, dtype=torch.bool)
    for k in range(k_steps):
        for row in range(b):
            for p in range(s):
                expected[k, row, p] = bool(p + 2 + k < s and loss_mask[row, p + 2 + k]
                                           and in_vocab[row, p + 1 + k] and attention[row, p])
    assert torch.equal(batch.valid_KBS, expected) and expected.any()


def test_lm_head_argmax_chunked_equals_unchunked_and_in_vocab_is_its_lookup():
    g = torch.Generator().manual_seed(2)
    last, head = torch.randn(3, 10, 16, generator=g), torch.randn(50, 16, generator=g)
    t2d = torch.rand(50, generator=g) < 0.5
    argmax = (last @ head.T).argmax(-1)
    for chunk in (1, 3, 7, 30, 1000):
        got = lm_head_argmax(last, head, chunk_size=chunk)
        assert got.dtype == torch.int64 and torch.equal(got, argmax)
    assert torch.equal(lm_head_argmax(last.double(), head.to(torch.bfloat16)),  # in the head's dtype
                       (last.to(torch.bfloat16) @ head.to(torch.bfloat16).T).argmax(-1))
    direct = t2d[argmax]
    assert torch.equal(target_in_draft_vocab(argmax, t2d), direct)
    assert torch.equal(target_in_draft_vocab(argmax.to(torch.int32), t2d), direct)  # the store's int32 ids
    assert direct.any() and not direct.all()
    with pytest.raises(ValueError, match="chunk_size"):
        lm_head_argmax(last, head, chunk_size=0)
    with pytest.raises(ValueError, match="does not fit lm_head"):
        lm_head_argmax(last[..., :8], head)


def test_soft_ce_matches_direct_formula_and_ignores_invalid_positions():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64).requires_grad_(True)
    target = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    target[0, 1] = logits[0, 1].detach() * 2  # same argmax -> a match
    valid = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    loss_sum, correct = soft_ce(logits, target, valid)
    expected, matches = 0.0, 0
    for bi in range(2):
        for si in range(5):
            if valid[bi, si]:
                z, t = logits[bi, si].detach().tolist(), target[bi, si].tolist()
                lse_z = math.log(sum(math.exp(v) for v in z))
                norm_t = sum(math.exp(v) for v in t)
                expected += -sum(math.exp(tv) / norm_t * (zv - lse_z) for zv, tv in zip(z, t))
                matches += int(max(range(7), key=z.__getitem__) == max(range(7), key=t.__getitem__))
    # float64 against the formula in Python floats, a few dozen operations apart: ~1e-15, bound 1e-12
    assert abs(loss_sum.item() - expected) < 1e-12 and correct.item() == matches and matches >= 1
    loss_sum.backward()
    grad_expected = (torch.softmax(logits.detach(), -1) - torch.softmax(target, -1)) * valid[..., None]
    torch.testing.assert_close(logits.grad, grad_expected, rtol=1e-12, atol=1e-12)
    half = soft_ce(logits.detach().float(), target.float(), valid)[0]
    assert half.dtype == torch.float32 and abs(half.item() - expected) < 1e-4  # fp32: ~10 terms of ~1, ≤ 1e-5
    with pytest.raises(ValueError, match="shapes"):
        soft_ce(logits, target[:, :4], valid)


def test_ttt_objective_weights_steps_and_guards_empty_counts():
    from recipe.model.ttt import TTTOutput
    out = TTTOutput(loss_sum_K=torch.tensor([4.0, 6.0, 3.0]), correct_K=torch.zeros(3, dtype=torch.int64),
                    valid_K=torch.tensor([2, 3, 0]))
    value = ttt_objective(out, torch.tensor([2, 3, 0]))
    # ~10 float32 operations on values ≤ 6: each rounding ≤ u·6 ≈ 3.6e-7, so ≤ 4e-6 absolute in all
    assert abs(value.item() - (4.0 / 2 + 0.8 * 6.0 / 3 + 0.64 * 3.0 / 1)) < 4e-6
    assert abs(ttt_objective(out, [4, 4, 4]).item() - (1.0 + 0.8 * 1.5 + 0.64 * 0.75)) < 4e-6
