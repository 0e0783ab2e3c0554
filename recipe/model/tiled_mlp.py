"""The draft layer's ``post_attention_layernorm`` + MLP computed in sequence tiles, recomputed in backward (the
``memory.mlp_tile_size`` switch, ``recipe.config.MemoryOptions``).

Untiled, ``mlp(norm(h))`` on h [B, S, H] keeps for backward the norm's float32 copy of h, the norm output and four
[B, S, I] SwiGLU tensors (gate, up, act(gate), their product), and creates them all at once in forward. Tiled,
:func:`tiled_norm_mlp` splits h along S into tiles of ``tile_size`` positions (the last one ragged when the size
does not divide S) and runs ``norm`` + MLP on each tile under ``torch.utils.checkpoint(..., use_reentrant=False)``:
forward keeps only each tile's output [B, T, H] (the tile input is a view of h, which the residual keeps anyway);
backward recomputes one tile's intermediates when it reaches that tile and frees them before the next one. So the
[B, T, I] intermediates and the fp32 norm copy exist one tile at a time, in forward and in backward, for one extra
forward of the norm and the MLP (a second one when the per-TTT-step checkpointing, ``memory.checkpoint_ttt_steps``,
recomputes the whole layer: non-reentrant checkpoints nest).

Why non-reentrant checkpoints and not an ``autograd.Function`` like DeepSpeed's ``TiledMLP``
(``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``): that one runs the MLP per shard under ``no_grad`` in
forward and calls ``torch.autograd.backward`` per shard in its own backward, so each parameter receives one gradient
per shard and ZeRO's reduction must be held back by setting ``param.ds_grad_is_ready`` on every shard but the last
(and a caller must list the parameters). A non-reentrant checkpoint keeps the single autograd graph: every tile's
weight gradient flows into the parameter's one ``AccumulateGrad`` node, which the engine runs once per backward
with the summed gradient, so DeepSpeed's ZeRO-1/2/3 gradient hooks fire once, as untiled, with nothing to defer.
Under this project's tensor parallelism its per-shard recompute would also repeat the row-parallel all-reduce of
``down_proj`` in backward. Here the communication stays out of the recomputed function: ``MLPTiling.local_mlp``
computes this rank's partial sums without any forward collective (``recipe.parallel.apply_tp.mlp_tiling`` installs
the TP one: the column-parallel input mapping inside the tile — identity in forward, so nothing is re-sent in the
recompute; its backward all-reduce gives the norm the full gradient, so the replicated norm weight's gradient is the
untiled one on every tp rank — and ``down_proj`` called without its reduce), and ``MLPTiling.reduce`` sums the
concatenated [B, S, H] partial output once, outside the tiles (TP: ``reduce_from_tp_region``, all-reduce in forward,
identity in backward). Modules are called, never their raw ``.weight``, so ZeRO-3's module hooks gather the
parameters for each tile and again in the recompute (its ``stage3_max_reuse_distance`` keeps them gathered between
the tiles of one layer call).

Model code stays single-device: the decoder layer holds an ``MLPTiling`` (None: untiled) that
``recipe.parallel.parallelize.parallelize`` sets from the run's ``memory`` section.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _whole_mlp(mlp: nn.Module, x_BTH: torch.Tensor) -> torch.Tensor:
    return mlp(x_BTH)


def _identity(y_BSH: torch.Tensor) -> torch.Tensor:
    return y_BSH


@dataclass(frozen=True)
class MLPTiling:
    """How the decoder layer tiles its norm + MLP.

    ``tile_size``: positions per tile (a positive int; ValueError otherwise). ``local_mlp(mlp, x_BTH) -> y_BTH``:
    the MLP on one tile of the (replicated) norm output, returning this rank's contribution to the output, with no
    forward communication (default: ``mlp(x)``, the whole output on one device). ``reduce(y_BSH) -> y_BSH``: turns
    the concatenated contributions into the MLP output, called once per layer call outside the tiles (default:
    identity). Shapes [B, T, H] / [B, S, H], the activations' dtype.
    """

    tile_size: int
    local_mlp: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _whole_mlp
    reduce: Callable[[torch.Tensor], torch.Tensor] = _identity

    def __post_init__(self):
        size = self.tile_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mlp tile size {size!r} must be a positive integer")

    def applies_to(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` positions is tiled (more than one tile), else computed untiled."""
        return seq_len > self.tile_size


def tiled_norm_mlp(norm: nn.Module, mlp: nn.Module, h_BSH: torch.Tensor, tiling: MLPTiling,
                   num_tiles: int | None = None, min_tiles: int | None = None) -> torch.Tensor:
    """``mlp(norm(h))`` [B, S, H] computed ``tiling.tile_size`` positions at a time (module docstring).

    Args: ``norm`` the layer's ``post_attention_layernorm`` and ``mlp`` its MLP (modules, called per tile);
    ``h_BSH`` [B, S, H] the residual stream after attention (any float dtype; the output has the MLP's dtype,
    as untiled). Returns ``tiling.reduce(cat_t tiling.local_mlp(mlp, norm(h[:, t])))``: the same values as
    ``mlp(norm(h))`` up to float summation order (each row is computed alone, the weight gradients are summed over
    the tiles). With grad mode on each tile runs under a non-reentrant checkpoint; with it off (evaluation) the
    tiles run directly. ``num_tiles``: cut S into exactly that many near-equal tiles instead (some possibly empty;
    the sparse anchors' path: as many tiles as the dense sequence has, ``recipe.model.sparse_anchors.QueryRows``).
    ``min_tiles`` (with ``num_tiles`` None): at least that many tiles of ``tile_size``, the ones past S empty (the
    dense path on a rank shorter than the longest of its ZeRO group, ``recipe.model.call_extent``; the non-empty
    tiles, and so every number, are those without it).
    Raises ValueError for a tensor that is not 3-d.
    """
    if h_BSH.dim() != 3:
        raise ValueError(f"tiled_norm_mlp expects h [B, S, H], got shape {tuple(h_BSH.shape)}")
    local_mlp = tiling.local_mlp

    def tile(x_BTH: torch.Tensor) -> torch.Tensor:
        return local_mlp(mlp, norm(x_BTH))

    seq, size = h_BSH.shape[1], tiling.tile_size
    grad = torch.is_grad_enabled()
    parts = []
    tiles = ([h_BSH[:, start:start + size] for start in range(0, max(seq, (min_tiles or 0) * size), size)]
             if num_tiles is None else torch.tensor_split(h_BSH, num_tiles, dim=1))
    for x_BTH in tiles:
        parts.append(checkpoint(tile, x_BTH, use_reentrant=False, preserve_rng_state=False) if grad else tile(x_BTH))
    return tiling.reduce(torch.cat(parts, dim=1))
