"""Static estimate of one rank's memory for a TTT training step, by component (printed beside the measurement).

An order-of-magnitude model of what autograd keeps, read off the code paths (not a measurement):

- weights: trainable draft parameters (fc, midlayer, norms, lm_head; TP-split ones divided by tp) plus the frozen
  embedding [V, H] and target head rows [Vd/tp, H_t], in the training dtype.
- grads: one gradient per trainable parameter, training dtype.
- optimizer: AdamW, 8 B per trainable parameter (fp32 m, v), + 8 B (fp32 master weight and gradient) when training
  in a 16-bit dtype. Before ZeRO: ZeRO-1/2/3 divide this (and ZeRO-2/3 the grads, ZeRO-3 the weights) by dp·cp.
- aux_states: the batch's aux hidden states [N, 3·H_t] and target rows [N, H_t], and the K step outputs [N, H].
- logits / labels: full-logits path: per step the fp32 log-probabilities and soft labels [N, Vd/tp] (under TP the
  vocab-parallel CE keeps the logits and target logits, training dtype), plus the step in flight; chunked path: one
  chunk's four [c, Vd/tp] fp32 temporaries.
- attention: tiled (``attention_tile`` T, ``kernels.tiled_attention``; the ring under CP tiles each zigzag chunk):
  per step the output and LSE [B, H/tp, N, D+1] fp32 are kept, plus one (query tile, key tile) pair's four
  [B, H/tp, t, t] fp32 temporaries in flight, t = min(T, S) (S/cp/2 under CP). Dense (T None, cp = 1): the causal block
  keeps the masked scores and probabilities [B, H/tp, S, S] fp32 per step; with per-step checkpointing one step's
  temporaries exist at a time.
- layer: other decoder-layer activations per step (norms, concat, q/k/v, MLP), training dtype.

N = B·S/cp tokens on the rank. All values in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPONENTS = ("weights", "grads", "optimizer", "aux_states", "logits", "labels", "attention", "layer")


@dataclass(frozen=True)
class StepShape:
    """Geometry of one training step (counts; ``dtype_bytes`` 4 for fp32, 2 for bf16)."""

    seq_len: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    vocab: int
    target_hidden: int
    ttt_steps: int = 7
    batch: int = 1
    tp: int = 1
    cp: int = 1
    dtype_bytes: int = 4
    loss_chunk_size: int | None = None
    checkpoint_steps: bool = False
    attention_tile: int | None = None

    @property
    def local_tokens(self) -> int:
        """N = B·S/cp."""
        return self.batch * self.seq_len // self.cp


def trainable_params(s: StepShape) -> int:
    """Trainable draft parameters held by one TP rank."""
    h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    split = 2 * h * (qd + 2 * kvd) + qd * h + 3 * h * s.intermediate + h * s.draft_vocab
    return 3 * s.target_hidden * h + 4 * h + split // s.tp


def estimate_step_bytes(s: StepShape) -> dict[str, float]:
    """Bytes per component (``COMPONENTS``) and ``total`` for one forward + backward on one rank."""
    e, f4, n, k = s.dtype_bytes, 4, s.local_tokens, s.ttt_steps
    params = trainable_params(s)
    vd_local = s.draft_vocab // s.tp
    out = {"weights": (params + s.vocab * s.hidden + vd_local * s.target_hidden) * e,
           "grads": params * e,
           "optimizer": params * (8 + (8 if e < 4 else 0)),
           "aux_states": n * (4 * s.target_hidden * e + k * s.hidden * e)}
    if s.loss_chunk_size is None:
        kept = e if s.tp > 1 else f4
        out["logits"] = (k * kept + 2 * f4) * n * vd_local  # K kept + the step in flight
        out["labels"] = (k * kept + f4) * n * vd_local
    else:
        out["logits"] = 3 * f4 * min(s.loss_chunk_size, n) * vd_local
        out["labels"] = f4 * min(s.loss_chunk_size, n) * vd_local
    heads = s.heads // s.tp
    if s.cp > 1 or s.attention_tile is not None:
        seq_local = s.seq_len // s.cp  # positions of one sequence on the rank
        t = seq_local // 2 if s.cp > 1 else seq_local
        t = t if s.attention_tile is None else min(t, s.attention_tile)
        out["attention"] = 4 * s.batch * heads * t * t * f4 + k * n * heads * (s.head_dim + 1) * f4
    else:
        scores = s.batch * heads * s.seq_len ** 2 * f4
        out["attention"] = (2 if s.checkpoint_steps else k * 2 + 2) * scores
    per_step_layer = n * e * (6 * s.hidden + 2 * (s.heads + 2 * s.kv_heads) * s.head_dim // s.tp
                              + 3 * s.intermediate // s.tp)
    kept_kv = n * e * (s.hidden + 2 * s.kv_heads * s.head_dim // s.tp)
    out["layer"] = (k * kept_kv + 2 * per_step_layer) if s.checkpoint_steps else k * per_step_layer
    out["total"] = float(sum(out[c] for c in COMPONENTS))
    return {key: float(v) for key, v in out.items()}


def bytes_per_token(s: StepShape) -> dict[str, float]:
    """The sequence-dependent components divided by the rank's tokens N (the attention term grows with S)."""
    est = estimate_step_bytes(s)
    return {c: est[c] / s.local_tokens for c in ("aux_states", "logits", "labels", "attention", "layer")}
