"""The EAGLE-3 draft model ``LlamaForCausalLMEagle3`` (docs/algorithm.md, "The draft"): fc over aux states, one
decoder layer, lm_head.

Module names are exactly the export keys (docs/algorithm.md, "Export format"): ``fc``, ``midlayer.{hidden_norm,
input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``,
``lm_head``, buffers ``d2t`` / ``t2d``; ``embed_tokens`` (the target's, frozen) is not exported. Single-device code:
attention reshapes with ``-1`` heads so tensor parallelism can shard the projections from outside, and the
causal-block function is the attribute ``midlayer.self_attn.causal_attention`` so context parallelism can swap in its
ring version.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels.block_attention import block_attention
from kernels.ttt_attention import TTTKVCache
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.model.small_ops import EAGER_SMALL_OPS, SmallOps
from recipe.model.sparse_anchors import gather_rows
from recipe.model.tiled_mlp import MLPTiling, tiled_norm_mlp

EXPORT_EXCLUDED_KEYS = ("embed_tokens.weight",)  # the target's frozen embedding: inference engines take their own


def is_exported(name: str) -> bool:
    """Whether the draft state-dict entry ``name`` (``draft.`` prefix allowed) belongs in checkpoints' consolidated
    draft and the export: everything but the frozen target embedding."""
    return name.removeprefix("draft.") not in EXPORT_EXCLUDED_KEYS


class Eagle3RMSNorm(nn.Module):
    """RMSNorm with transformers' ``LlamaRMSNorm`` parameters (``weight`` [H], ones; ``variance_epsilon``) and numbers,
    computed by ``ops.rms_norm`` (``recipe.model.small_ops``: eager, or compiled with ``kernels.compile_small_ops``)."""

    ops: SmallOps = EAGER_SMALL_OPS

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x_BSH, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H concatenation ``[input_layernorm(emb), hidden_norm(h)]``; no biases.
    RoPE and the TTT merge are ``ops.rope`` / ``ops.ttt_merge`` (``recipe.model.small_ops``)."""

    ops: SmallOps = EAGER_SMALL_OPS

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.head_dim = config.head_dim
        width_q = config.num_attention_heads * config.head_dim
        width_kv = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, width_q, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, width_kv, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, width_kv, bias=False)
        self.o_proj = nn.Linear(width_q, config.hidden_size, bias=False)
        # (q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS) -> (out_BHSD, lse_BHS); CP replaces it.
        self.causal_attention = block_attention

    def forward(self, x_BS2H, cos_BSD, sin_BSD, position_ids_BS, key_valid_BS, kv_cache, queries=None) -> torch.Tensor:
        """x_BS2H [B, S, 2H]; cos/sin [B, S, D] at the RoPE positions; returns [B, S, H] (see ``TTTKVCache``).

        ``queries``: None (a query at every row) or a ``recipe.model.sparse_anchors.QueryRows``: with its
        ``index_BN`` [B, N] int64, keys and values at every row of x, queries (and the output, [B, N, H]) only at
        those rows, whose anchor positions are its ``positions_BN``."""
        b, s, _ = x_BS2H.shape
        k_BHSD = self.ops.rope(self.k_proj(x_BS2H).view(b, s, -1, self.head_dim).transpose(1, 2), cos_BSD, sin_BSD)
        v_BHSD = self.v_proj(x_BS2H).view(b, s, -1, self.head_dim).transpose(1, 2)
        extra = {"merge": self.ops.ttt_merge} if isinstance(kv_cache, TTTKVCache) else {}
        if queries is not None and queries.index_BN is not None:  # only TTTKVCache takes query positions
            index_BN, extra["query_positions_BS"] = queries.index_BN, queries.positions_BN
            x_BS2H, cos_BSD, sin_BSD = (gather_rows(t, index_BN) for t in (x_BS2H, cos_BSD, sin_BSD))
            s = index_BN.shape[1]
        q_BHSD = self.ops.rope(self.q_proj(x_BS2H).view(b, s, -1, self.head_dim).transpose(1, 2), cos_BSD, sin_BSD)
        out_BHSD = kv_cache.attend(self.causal_attention, q_BHSD, k_BHSD, v_BHSD, position_ids_BS, key_valid_BS,
                                   **extra)
        return self.o_proj(out_BHSD.transpose(1, 2).reshape(b, s, -1))


class Eagle3MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``, no biases; the product is ``ops.act_mul``
    (``recipe.model.small_ops``)."""

    ops: SmallOps = EAGER_SMALL_OPS

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_mul(self.gate_proj(x_BSH), self.up_proj(x_BSH), self.act_fn))


class Eagle3DecoderLayer(nn.Module):
    """The draft's midlayer: attention over ``cat([input_layernorm(emb), hidden_norm(h)])``, residual stream ``h``.

    ``mlp_tiling``: a ``recipe.model.tiled_mlp.MLPTiling`` (None, the default: untiled): when set and the sequence
    is longer than one tile, ``post_attention_layernorm`` + ``mlp`` run in sequence tiles recomputed in backward
    (``tiled_norm_mlp``); ``recipe.parallel.parallelize`` sets it from ``memory.mlp_tile_size``.
    """

    mlp_tiling: MLPTiling | None = None

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.hidden_norm = Eagle3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = Eagle3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = Eagle3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, emb_BSH, hidden_BSH, cos_BSD, sin_BSD, position_ids_BS, key_valid_BS, kv_cache, queries=None):
        """Returns the layer output [B, S, H] (before the final norm): ``h + attn(...)``, then ``+ mlp(norm(.))``.
        ``queries`` (``Eagle3Attention.forward``, a ``QueryRows``): with its ``index_BN`` the output is [B, N, H],
        the rows ``index_BN`` only (keys and values still from every row); the MLP tiles as a sequence of its
        ``seq_len`` would."""
        x_BS2H = torch.cat([self.input_layernorm(emb_BSH), self.hidden_norm(hidden_BSH)], dim=-1)
        compact = queries is not None and queries.index_BN is not None
        residual_BSH = gather_rows(hidden_BSH, queries.index_BN) if compact else hidden_BSH
        h_BSH = residual_BSH + self.self_attn(x_BS2H, cos_BSD, sin_BSD, position_ids_BS, key_valid_BS, kv_cache,
                                              queries)
        tiling = self.mlp_tiling
        seq_len = h_BSH.shape[1] if queries is None else queries.seq_len
        if tiling is not None and tiling.applies_to(seq_len):
            tiles = -(-seq_len // tiling.tile_size)
            if queries is None or queries.dense:  # tiles of tile_size, then empty ones up to the count
                return h_BSH + tiled_norm_mlp(self.post_attention_layernorm, self.mlp, h_BSH, tiling, min_tiles=tiles)
            return h_BSH + tiled_norm_mlp(self.post_attention_layernorm, self.mlp, h_BSH, tiling, tiles)
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: ``fc`` (3·H_t -> H), frozen ``embed_tokens`` (V x H), ``midlayer``, ``norm``,
    ``lm_head`` (H -> Vd).

    Buffers: ``d2t`` int64 [Vd] (target id = i + d2t[i]) and ``t2d`` bool [V]; both persistent and exported. Until
    ``set_vocab_map`` they are the identity map of the first Vd target ids. Weights are initialised from ``seed``.
    """

    def __init__(self, config: Eagle3DraftConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = Eagle3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.to_llama_config())  # non-persistent buffers only
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.init_weights(seed=seed)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to``, ``.bfloat16``, ``.cuda``...) keeping the RoPE inverse frequencies float32.

        A bf16 copy would be off by up to 2^-9 (~0.2%) of ``position * freq``: whole radians at long context.
        """
        rope = self.rotary_emb
        kept = {name: buf.detach().clone() for name, buf in rope.named_buffers(recurse=False)}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            setattr(rope, name, value.to(getattr(rope, name).device))
        return self

    # ---- initialisation and loading -------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None, generator: torch.Generator | None = None) -> None:
        """Deterministic init: every weight matrix (embedding included) ~ N(0, initializer_range), norms = 1.

        Values are drawn on the CPU in float32 from ``generator`` (or a fresh one seeded with ``seed``) in parameter
        registration order, so the same seed gives the same full weights on every rank and device. Raises ValueError
        when neither or both of ``seed`` and ``generator`` are given.
        """
        if (seed is None) == (generator is None):
            raise ValueError("init_weights needs exactly one of seed= or generator=")
        gen = generator if generator is not None else torch.Generator().manual_seed(int(seed))
        std = self.config.initializer_range
        for param in self.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                param.copy_(values)

    @torch.no_grad()
    def load_target_embeddings(self, weight_VH: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] into the frozen ``embed_tokens``; ValueError on a shape mismatch."""
        if tuple(weight_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding shape {tuple(weight_VH.shape)} != draft embed_tokens shape "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)")
        self.embed_tokens.weight.copy_(weight_VH)

    @torch.no_grad()
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocab map (d2t int [Vd] offsets, t2d bool [V]); ValueError if shapes or contents disagree."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise ValueError(f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                             f"draft_vocab_size={cfg.draft_vocab_size}, vocab_size={cfg.vocab_size}")
        ids = d2t.to(torch.int64).cpu() + torch.arange(cfg.draft_vocab_size)
        if not torch.equal(torch.nonzero(t2d.bool().cpu()).flatten(), ids):
            raise ValueError("vocab map is inconsistent: t2d's True ids are not the sorted draft ids i + d2t[i]")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.bool())

    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, [Vd] int64: ``arange(Vd) + d2t``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_lm_head_from_target(self, target_lm_head_weight_VH: torch.Tensor,
                                 draft_ids: torch.Tensor | None = None) -> None:
        """Copy the target lm_head rows of the draft ids (default ``draft_token_ids()``) into ``lm_head``.

        Requires hidden_size == target_hidden_size (else ValueError) and a [V, H] weight.
        """
        cfg = self.config
        if cfg.hidden_size != cfg.target_hidden_size:
            raise ValueError(f"cannot initialise lm_head from the target: hidden_size={cfg.hidden_size} != "
                             f"target_hidden_size={cfg.target_hidden_size}")
        if tuple(target_lm_head_weight_VH.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target lm_head shape {tuple(target_lm_head_weight_VH.shape)} cannot initialise the "
                             f"draft lm_head: need (vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")
        ids = self.draft_token_ids() if draft_ids is None else draft_ids
        self.lm_head.weight.copy_(target_lm_head_weight_VH[ids.to(target_lm_head_weight_VH.device)])

    # ---- forward pieces -------------------------------------------------------------------------------------
    def project_aux(self, aux_hidden_BSA: torch.Tensor) -> torch.Tensor:
        """Step-0 hidden state ``fc(aux)``: [B, S, 3·H_t] (any float dtype) -> [B, S, H] in the weights' dtype."""
        return self.fc(aux_hidden_BSA.to(self.fc.weight.dtype))

    def step(self, hidden_BSH, input_ids_BS, position_ids_BS, key_valid_BS=None, kv_cache=None, queries=None):
        """One TTT step of the decoder layer. Returns ``(hidden_out_BSH, kv_cache)``.

        Args:
            hidden_BSH: [B, S, H] step-0 ``project_aux(aux)`` or the previous step's output.
            input_ids_BS: [B, S] int64 target token ids (``t[p+1+k]`` at step k).
            position_ids_BS: [B, S] int64 anchor positions p (global under CP); RoPE uses
                ``kv_cache.rope_positions(p)`` (= p + k for a ``TTTKVCache``).
            key_valid_BS: [B, S] bool, False where the step-0 key is padding (None: all valid).
            kv_cache: a ``TTTKVCache`` (None: a new one, i.e. step 0), or any object with the same two methods.
            queries: None, or a ``recipe.model.sparse_anchors.QueryRows`` (the sparse path): with its
                ``index_BN``, keys/values at every row, everything else (and the output, [B, N, H]) only at those
                rows (step 0).
        The output is the layer's pre-norm hidden state; ``logits`` turns it into draft-vocab logits.
        """
        kv_cache = TTTKVCache() if kv_cache is None else kv_cache
        emb_BSH = self.embed_tokens(input_ids_BS).to(hidden_BSH.dtype)
        cos_BSD, sin_BSD = self.rotary_emb(hidden_BSH, kv_cache.rope_positions(position_ids_BS))
        hidden_out = self.midlayer(emb_BSH, hidden_BSH, cos_BSD, sin_BSD, position_ids_BS, key_valid_BS, kv_cache,
                                   queries)
        return hidden_out, kv_cache

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits ``lm_head(norm(h))``: [B, S, H] -> [B, S, Vd]."""
        return self.lm_head(self.norm(hidden_BSH))
