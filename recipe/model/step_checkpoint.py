"""One TTT step of the draft under ``torch.utils.checkpoint`` (``memory.checkpoint_steps``): only the step's inputs
and its new K/V are kept, the decoder layer's intermediates are recomputed in backward."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from kernels.ttt_attention import TTTKVCache
from recipe.model.draft import Eagle3Draft


def checkpointed_step(draft: Eagle3Draft, hidden_BSH, input_ids_BS, position_ids_BS, key_valid_BS, kv_cache,
                      queries=None):
    """``draft.step`` under ``torch.utils.checkpoint``; returns ``(hidden_out_BSH, kv_cache)`` like it
    (``queries``: ``draft.step``'s, the sparse path's step-0 query rows).

    The cache is mutated by ``step`` (it appends the step's K/V), so it cannot be closed over: a recomputation in
    backward would see the later steps' keys. Instead the cache's tensors enter the checkpointed function as
    inputs, a fresh ``TTTKVCache`` is rebuilt from them on every (re)computation, and the step's new K/V leave
    as outputs; the caller's cache is then extended with them.
    Raises TypeError on a ``kv_cache`` that is neither None nor a ``TTTKVCache``.
    """
    if kv_cache is not None and not isinstance(kv_cache, TTTKVCache):
        raise TypeError(f"checkpoint_steps needs a TTTKVCache, got {type(kv_cache).__name__}")
    state = _cache_tensors(kv_cache)
    block_meta = (position_ids_BS, key_valid_BS) if kv_cache is None or kv_cache.block is None \
        else kv_cache.block[2:]

    def run(hidden, ids, positions, key_valid, block_pos, block_valid, *cache_state):
        cache = _cache_from_tensors(cache_state, block_pos, block_valid)
        hidden_out, cache = draft.step(hidden, ids, positions, key_valid, cache, queries)
        new_k, new_v = (cache.block[0], cache.block[1]) if not cache.diag_k else (cache.diag_k[-1],
                                                                                   cache.diag_v[-1])
        return hidden_out, new_k, new_v

    hidden_out, new_k, new_v = checkpoint(run, hidden_BSH, input_ids_BS, position_ids_BS, key_valid_BS, *block_meta,
                                          *state, use_reentrant=False, preserve_rng_state=False)
    cache = TTTKVCache() if kv_cache is None else kv_cache
    if cache.block is None:
        cache.block = (new_k, new_v, position_ids_BS, key_valid_BS)
    else:
        cache.diag_k.append(new_k)
        cache.diag_v.append(new_v)
    return hidden_out, cache


def _cache_tensors(cache: TTTKVCache | None) -> tuple[torch.Tensor, ...]:
    """(K_0, V_0, K_1, V_1, ...) of a TTT cache (empty before step 0)."""
    if cache is None or cache.block is None:
        return ()
    pairs = [(cache.block[0], cache.block[1])] + list(zip(cache.diag_k, cache.diag_v))
    return tuple(t for pair in pairs for t in pair)


def _cache_from_tensors(state, block_pos_BS, block_valid_BS) -> TTTKVCache:
    """Inverse of ``_cache_tensors``, given the causal block's key positions [B, S] and validity ([B, S] or None)."""
    cache = TTTKVCache()
    if state:
        cache.block = (state[0], state[1], block_pos_BS, block_valid_BS)
        cache.diag_k, cache.diag_v = list(state[2::2]), list(state[3::2])
    return cache
