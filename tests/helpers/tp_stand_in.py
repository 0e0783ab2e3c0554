"""Test-only single-device stand-ins for the tensor-parallel tests (``tests/test_tp_layers.py``): the soft cross-entropy
reference and a small draft + TTT wrapper with the module names and config fields ``apply_tensor_parallel``'s plan
reads (``recipe.parallel.apply_tp``), built from plain ``nn.Linear`` layers."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def soft_ce(logits_BSV, target_logits_BSV, valid_BS):
    """Single-device reference: Σ_valid −Σ_v softmax(target)·log_softmax(logits); argmax matches among valid."""
    logp = torch.log_softmax(logits_BSV.float() if logits_BSV.dtype != torch.float64 else logits_BSV, -1)
    p = torch.softmax(target_logits_BSV.to(logp.dtype), -1)
    per_pos = -(p * logp).sum(-1)
    valid = valid_BS.bool()
    loss_sum = per_pos[valid].sum()
    correct = ((logits_BSV.argmax(-1) == target_logits_BSV.argmax(-1)) & valid).sum()
    return loss_sum, correct


class AttentionStandIn(nn.Module):
    """Stand-in for the draft attention: reshapes with -1 heads, GQA, causal softmax."""

    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv_heads
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x_BSX):
        b, s, _ = x_BSX.shape
        q = self.q_proj(x_BSX).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSX).view(b, s, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.groups, 1)
        v = self.v_proj(x_BSX).view(b, s, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MlpStandIn(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftStandIn(nn.Module):
    def __init__(self, hidden=8, heads=4, kv_heads=2, head_dim=4, inter=16, vd=8):
        super().__init__()
        self.config = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = AttentionStandIn(hidden, heads, kv_heads, head_dim)
        self.midlayer.mlp = MlpStandIn(hidden, inter)
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vd, bias=False)

    def forward(self, emb_BSH, h_BSH):
        h = h_BSH + self.midlayer.self_attn(torch.cat([emb_BSH, h_BSH], -1))
        h = h + self.midlayer.mlp(h)
        return self.lm_head(self.norm(h))


class TTTStandIn(nn.Module):
    """Stand-in TTT wrapper: draft, frozen target_head_d [Vd, H_t], swappable loss_fn."""

    def __init__(self, dtype, **kw):
        super().__init__()
        self.draft = DraftStandIn(**kw).to(dtype)
        self.register_buffer("target_head_d", torch.randn(self.draft.lm_head.out_features, 6, dtype=dtype))
        self.loss_fn = soft_ce

    def forward(self, emb_BSH, h_BSH, target_hidden_BSHt, valid_BS):
        target_logits = target_hidden_BSHt @ self.target_head_d.T
        return self.loss_fn(self.draft(emb_BSH, h_BSH), target_logits, valid_BS)
