"""Choose the draft's causal-block attention from the outside: the ring under context parallelism, the tiled
(flash-style) block on one cp rank, or the dense block when tiling is switched off.

The draft attention calls ``midlayer.self_attn.causal_attention(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)``
(``recipe.model.draft``); its single-device default is the dense ``kernels.block_attention.block_attention``.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def install_causal_attention(draft: nn.Module, tile_size: int | None, cp_group: dist.ProcessGroup | None = None,
                             cp_size: int = 1):
    """Set ``draft.midlayer.self_attn.causal_attention`` and return it.

    ``cp_size > 1``: ring attention over ``cp_group`` (zigzag shards), tiles of at most ``tile_size`` positions
    inside each zigzag chunk. ``cp_size == 1``: ``TiledCausalAttention(tile_size)``, or the dense block when
    ``tile_size`` is None. Raises ValueError when ``tile_size`` is not a positive integer or None, or when
    ``cp_size > 1`` and ``cp_group`` is None.
    """
    from kernels.tiled_attention import check_tile_size

    check_tile_size(tile_size)
    if cp_size > 1:
        if cp_group is None:
            raise ValueError(f"cp_size={cp_size} needs the cp process group")
        from kernels.ring_attention import make_ring_causal_attention

        attention = make_ring_causal_attention(cp_group, tile_size=tile_size)
    elif tile_size is not None:
        from kernels.tiled_attention import TiledCausalAttention

        attention = TiledCausalAttention(tile_size)
    else:
        from kernels.block_attention import block_attention

        attention = block_attention
    draft.get_submodule("midlayer.self_attn").causal_attention = attention
    return attention
