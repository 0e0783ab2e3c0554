"""Choosing the causal-block attention: one name per registered backend (``kernels.registry``), ``auto`` per
device, one factory for the three callers (the single-device training block, each hop of the sequence-split
strategy under context parallelism, the inference KV cache).

Every backend computes the same function ``(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS) -> (out,
lse)`` — query i reads key j iff ``k_valid[j]`` and ``k_pos[j] <= q_pos[i]``, GQA, out 0 and lse -inf on rows with no
readable key, differentiable in q, k, v including through lse — exactly (no approximation beyond float rounding):

  tiled  pure PyTorch (``kernels.tiled_attention``): the reference and the fallback. Any device, any float dtype
         (float64 included), memory O(S·D + tile²); ``tile_size=None`` on one device is the dense
         ``block_attention`` (O(S²) memory).
  sdpa   the fused CPU kernel of PyTorch's SDPA with its LSE (``kernels.sdpa_attention``) inside the same tile loops
         (the tiles give the causal skipping between tiles and bound the memory of a general mask). CPU only; float32,
         float64, bfloat16 inputs (computes in the accumulation dtype).
  flex   ``torch.nn.attention.flex_attention``, compiled (``kernels.flex_attention``). CUDA only (torch 2.13 has no
         flex backward on CPU); float32 and bfloat16; ``tile_size`` unused (flex's own 128-position blocks). One
         dynamic-shape compile for all lengths, never an uncompiled fallback (``FlexCompileError``), and one block
         mask per micro-batch reused by the TTT steps and the recompute.

``auto`` (:func:`resolve_attention_backend`, the one rule the run, the benchmarks and the planner use): the first
registered backend that claims the device type (``AttentionBackend.auto_on``) and can run there, else the fallback
(``tiled``): ``flex`` on CUDA, ``sdpa`` on CPU (measured fastest exact CPU kernel: docs/results/attention_cpu.json,
step_cpu.json), ``tiled`` elsewhere or when the installed torch lacks the fused op.

Across a split sequence (a context-parallel group of more than one rank) the block is built by the registered
sequence-split strategy the ``kernels.sequence_parallel`` switch names (``ring``: ``kernels.ring_attention``).
Every built-in backend and strategy module registers itself when imported; each is imported below, one line each.
"""
from __future__ import annotations

import torch

import kernels.flex_attention  # noqa: F401 - registers "flex" (the built-ins: one import each)
import kernels.ring_attention  # noqa: F401 - registers the "ring" sequence-split strategy
import kernels.sdpa_attention  # noqa: F401 - registers "sdpa"
from kernels.registry import (DEFAULT_SEQUENCE_PARALLEL, attention_backend, attention_backend_names,
                              sequence_parallel)
from kernels.tiled_attention import TiledCausalAttention, check_tile_size  # registers "tiled"


def backend_names() -> tuple[str, ...]:
    """The registered backend names (``kernels.registry.attention_backend_names``) with every built-in one loaded
    (this module imports them): ``("tiled", "sdpa", "flex")`` plus any a caller registered; "auto" not included."""
    return attention_backend_names()


def resolve_attention_backend(name: str, device) -> str:
    """The backend ``name`` ("auto" or a registered name, ``attention_backend_names()``) stands for on ``device``
    (str or torch.device): "auto" by the rule of the module docstring.

    Raises ValueError naming the backend and the allowed values when ``name`` is unknown, and naming the device when
    the backend cannot run there (``sdpa`` off CPU or without the fused op, ``flex`` off CUDA).
    """
    if not isinstance(name, str) or (name != "auto" and name not in attention_backend_names()):
        attention_backend(str(name))  # raises, naming the allowed values
    kind = torch.device(device).type
    backends = [attention_backend(n) for n in attention_backend_names()]

    def refusal(backend):
        return None if backend.refusal is None else backend.refusal(kind)

    if name == "auto":
        claimed = [b.name for b in backends if kind in b.auto_on and refusal(b) is None]
        return claimed[0] if claimed else next(b.name for b in backends if b.fallback)
    why = refusal(attention_backend(name))
    if why is not None:
        here = ", ".join(repr(n) for n in ("auto", *(b.name for b in backends if refusal(b) is None)))
        raise ValueError(f"attention backend {name!r} {why}; allowed here: {here}")
    return name


def backend_runs_on(name: str, device) -> bool:
    """Whether backend ``name`` (a registered name) runs on ``device`` as itself (``resolve_attention_backend``
    neither refuses it nor maps it to another backend)."""
    try:
        return resolve_attention_backend(name, device) == name
    except ValueError:
        return False


def make_causal_attention(backend: str, tile_size: int | None, device, cp_group=None,
                          sequence_parallel_name: str = DEFAULT_SEQUENCE_PARALLEL):
    """The causal-block callable for ``midlayer.self_attn.causal_attention`` (training or inference).

    Args:
        backend: "auto" or a registered backend name (resolved by ``resolve_attention_backend`` for ``device``).
        tile_size: positions per query/key tile (``memory.attention_tile_size``; None: one tile per block / per
            zigzag chunk; with ``tiled`` on one device, the dense block). Unused by a backend with its own blocking
            (``flex``).
        device: where the attention runs (str or torch.device).
        cp_group: the context-parallel process group; None or a group of one rank gives the single-device block
            (``AttentionBackend.single_device``), a larger group the sequence-split strategy over it.
        sequence_parallel_name: the registered strategy across the split sequence (``kernels.sequence_parallel``;
            ``ring``: ``kernels.ring_attention``, zigzag shards).
    Returns ``TiledCausalAttention`` / ``block_attention`` / ``FlexCausalAttention`` on one device, a
    ``RingCausalAttention`` with the backend's per-pair kernel under the ring (flex: one pair per hop).
    Raises ValueError for an unknown backend or one that cannot run on ``device`` (naming both and the allowed
    values), an unknown strategy (naming the registered ones), or a ``tile_size`` that is not a positive integer
    or None.
    """
    chosen = attention_backend(resolve_attention_backend(backend, device))
    check_tile_size(tile_size)
    if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        return sequence_parallel(sequence_parallel_name).build(chosen, tile_size, device, cp_group)
    if chosen.single_device is not None:
        return chosen.single_device(tile_size, device)
    return TiledCausalAttention(tile_size, chosen.kernel())
