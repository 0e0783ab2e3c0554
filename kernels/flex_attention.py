"""Flex attention (``torch.nn.attention.flex_attention``, public PyTorch) for the causal block on CUDA.

The mask is a ``mask_mod(b, h, q_idx, kv_idx) = k_valid[b, kv] & (q_start[b, q] <= k_pos[b, kv] <= q_pos[b, q])``
over the captured GLOBAL positions and validity (``q_start``: the start of the query's packed document,
``kernels.documents``; 0 unpacked), so one function serves one device, every ring hop and an inference KV cache. The
``BlockMask`` is built from per-block position ranges (``flex_block_mask``: O((S/128)²) work and memory, no S x S
mask is ever evaluated): blocks no query can read are skipped, fully readable ones run without the mask_mod, the
rest apply it. ``flex_attention`` is called compiled on CUDA (:class:`CompiledFlex`, created lazily on first use);
importing this module touches neither CUDA nor the compiler.

Compile policy (never silently slow). Uncompiled flex materialises the full [B, H, Sq, Sk] scores, so on CUDA it must
never run uncompiled: a call with ``compiled=False`` on CUDA raises :class:`FlexCompileError`, and the compiled
function is ``torch.compile(flex_attention, dynamic=True, fullgraph=True)`` called under Dynamo's
``fail_on_recompile_limit_hit`` (past ``recompile_limit`` Dynamo would otherwise fall back to the uncompiled function
without an error) and ``suppress_errors=False`` (a failed compile raises instead of running eager). ``fullgraph``
turns a graph break, which would also run flex eagerly, into an error. The softmax scale, a Python float, is
specialised (Dynamo's ``specialize_float``): left symbolic, Dynamo's float-to-tensor pass restarts the analysis after
the backend has compiled the graph, so every graph was compiled twice (seen with ``aot_eager``,
``tests/test_flex_compiled.py``); the scale is fixed per model. Every compile is counted and logged
(``flex_compile_stats``; logger ``kernels.flex_attention``). The machinery is ``kernels.compile_policy``'s
(``CompiledFunction``), which the draft's compiled small ops share (``recipe.model.small_ops``).

Why dynamic shapes and not length buckets: training lengths vary per micro-batch (the batch is padded to its longest
sample), and under a static policy every new length is a new compile (tens of seconds for flex forward + backward
on a GPU); buckets would bound the count but pad the attention's q/k/v (extra copies and up to a bucket's worth of
wasted work), and a useful ladder from 128 to 128k still holds dozens of buckets. ``dynamic=True`` makes the
sequence length, batch and the block mask's block counts symbolic from the first call, with duck sizing off
(``use_duck_shape=False``: otherwise two sizes that happen to be equal at the first call, a tile length and the head
count say, share one symbol, and a guard on one specialises both). Dynamo still specialises sizes 0 and 1, so a first
call of a single block (a micro-batch of <= 128 tokens) compiles once more at the first longer one, and guards on
strides: each call variant compiles at most twice, whatever the lengths that follow (``tests/test_flex_policy.py``,
``tests/test_flex_compiled.py``). The variants: with and without autograd (training, validation), under CP the
ring's detached pair forward and its recompute, and in the eval's KV cache the prefill (the projection's strided
views), the concatenated cache and single-token queries (three layouts: three compiles).
``FLEX_RECOMPILE_LIMIT`` leaves room for those with margin; a run that exceeds it is told so instead of crawling.

The ``BlockMask`` depends only on the query/key positions and the key validity, which are the same tensors for every
TTT step of a micro-batch and for the per-step recompute in backward: :class:`BlockMaskCache` keeps the masks of the
live position tensors (keyed by the tensors' identity, storage and version, dropped when the tensors are freed), so
one mask is built per micro-batch and reused by the K steps and the recompute.

What is supported where (torch 2.13): on CUDA forward and backward, including the gradient through the returned
LSE, in float32 and bfloat16 (LSE float32); Inductor's kernel needs a head dim of at least 16. On CPU the eager
(uncompiled, O(Sq·Sk) memory) forward only: ``flex_attention`` refuses a CPU input that requires grad, and
Inductor's CPU flex kernel is inference-only and returns no LSE. The CPU tests (``tests/test_flex_compiled.py``) run
the compiled path through AOTAutograd with Dynamo's ``aot_eager`` backend (``compiled=CompiledFlex(backend=
"aot_eager")``, torch's device check lifted for the test): the same joint graph, LSE gradient, captured mask tensors
and grouped-query heads as on CUDA, with flex's reference implementation in place of the Triton kernels.

In the ring (``make_flex_kernel``) the backward cannot be handed the final LSE, so each hop's block is recomputed under
autograd and the final merge's gradient is pulled through its own (out, lse)
(``kernels.tiled_attention.recompute_block_backward``): one extra block forward per hop, and no per-hop graph (or
received K/V block) is kept alive between forward and backward.
"""
from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict

import torch

from kernels.block_attention import accum_dtype
from kernels.compile_policy import CompiledFunction, CompileError
from kernels.documents import document_start, has_readable_key
from kernels.registry import AttentionBackend, BlockKernel, register_attention_backend
from kernels.tiled_attention import check_block_shapes, keys_valid, recompute_block_backward
from kernels.tracing import flex_stand_in, is_tracing

FLEX_BLOCK = 128
"""flex attention's default sparse block size (positions per query and key block)."""

FLEX_DYNAMIC = True
"""The compile policy: one dynamic-shape kernel for every sequence length and batch (module docstring)."""

FLEX_RECOMPILE_LIMIT = 16
"""Compiles of flex allowed in one process before :class:`FlexCompileError` (Dynamo's ``recompile_limit`` for it)."""

_INT64_MAX, _INT64_MIN = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
log = logging.getLogger(__name__)


class FlexCompileError(CompileError):
    """Flex attention would run uncompiled on CUDA (materialising [B, H, Sq, Sk] scores): asked for explicitly, or
    Dynamo reached its recompile limit, or the compile failed. The message says which and what to do."""


class CompiledFlex(CompiledFunction):
    """``torch.compile(fn, dynamic=dynamic, fullgraph=True)`` that counts its compiles and never falls back to the
    uncompiled function (module docstring, "Compile policy"; the machinery is ``kernels.compile_policy``'s, shared
    with the draft's compiled small ops).

    Args: fn the function (default ``torch.nn.attention.flex_attention``); dynamic the dynamic-shape policy
    (default ``FLEX_DYNAMIC``); recompile_limit the compiles allowed (default ``FLEX_RECOMPILE_LIMIT``); backend the
    Dynamo backend that compiles each graph ("inductor"; the CPU tests use "eager" to check the policy).
    Attributes: ``compiles`` (graphs compiled so far), ``calls``, ``last_shapes`` (the shapes of the latest
    compile's tensor inputs). Calling it raises :class:`FlexCompileError` when Dynamo hits the recompile limit, breaks
    the graph (``fullgraph``) or the backend fails (the original exception chained).
    """

    def __init__(self, fn=None, *, dynamic: bool = FLEX_DYNAMIC, recompile_limit: int = FLEX_RECOMPILE_LIMIT,
                 backend: str = "inductor"):
        if fn is None:
            # import cost: torch.nn.attention.flex_attention
            from torch.nn.attention.flex_attention import flex_attention as fn
        super().__init__(fn, name="flex attention", dynamic=dynamic, recompile_limit=recompile_limit,
                         backend=backend, error=FlexCompileError,
                         consequence="running it uncompiled would materialise the full attention scores, so the run "
                                     "stops here",
                         limit_remedy="raise kernels.flex_attention.FLEX_RECOMPILE_LIMIT", log=log)


_COMPILED: dict[str, CompiledFlex] = {}


def _compiled_flex() -> CompiledFlex:
    """The process's :class:`CompiledFlex` of ``flex_attention`` (Dynamo's compile cache is per process anyway),
    created on the first call."""
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = CompiledFlex()
    return _COMPILED["flex"]


def flex_compile_stats() -> dict:
    """The compiled flex's counters (:meth:`CompiledFlex.stats`); zeros before its first use."""
    if "flex" not in _COMPILED:
        return {"compiles": 0, "calls": 0, "dynamic": FLEX_DYNAMIC, "recompile_limit": FLEX_RECOMPILE_LIMIT,
                "last_shapes": []}
    return _COMPILED["flex"].stats()


def _identity(t: torch.Tensor | None):
    """(key, weakref to the storage's owner) of a position/validity tensor; None for None."""
    if t is None:
        return None, None
    base = t if t._base is None else t._base
    return (t.data_ptr(), str(t.device), t.dtype, tuple(t.shape), t.stride(), t._version), weakref.ref(base)


class BlockMaskCache:
    """The flex ``BlockMask`` (and the has-a-readable-key flags) of the most recent position/validity tensors.

    An entry is reused while the tensors it was built from are alive and unmodified: its key is each tensor's data
    pointer, shape, strides and version, and a weak reference to the tensor's base tells whether that memory still
    belongs to it (while the base lives, no other tensor can occupy it; views and the copies autograd hands back
    from saved tensors share the key, so the backward's recompute finds the forward's mask). Holds at most ``capacity``
    entries (least recently used dropped) and drops entries whose tensors were freed, so masks never outlive a
    micro-batch for long. ``hits`` / ``misses`` count lookups.
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.hits = self.misses = 0
        self._entries: OrderedDict = OrderedDict()

    def get(self, q_pos_BS, k_pos_BS, k_valid_BS, block_size: int = FLEX_BLOCK):
        """(block_mask, has_key [B, 1, Sq] bool) for these tensors (``flex_block_mask``; built on a miss)."""
        ids = [_identity(t) for t in (q_pos_BS, k_pos_BS, k_valid_BS)]
        key = (tuple(i[0] for i in ids), block_size)
        entry = self._entries.get(key)
        if entry is not None and all(ref is None or ref() is not None for ref in entry[0]):
            self.hits += 1
            self._entries.move_to_end(key)
            return entry[1], entry[2]
        self.misses += 1
        value = flex_block_mask(q_pos_BS, k_pos_BS, k_valid_BS, block_size), _has_key(q_pos_BS, k_pos_BS, k_valid_BS)
        self._entries[key] = (tuple(i[1] for i in ids), *value)
        for stale in [k for k, e in self._entries.items() if any(r is not None and r() is None for r in e[0])]:
            del self._entries[stale]
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)


def _pad(x_BS: torch.Tensor, length: int, value) -> torch.Tensor:
    return torch.cat([x_BS, x_BS.new_full((x_BS.shape[0], length - x_BS.shape[1]), value)], dim=1)


def _ordered(blocks_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [B, 1, nq] int32, indices [B, 1, nq, nk] int32): per query block the count of True key blocks and
    their indices first (ascending), the form ``BlockMask.from_kv_blocks`` takes."""
    num = blocks_BQK.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def flex_block_mask(q_pos_BS: torch.Tensor, k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor | None,
                    block_size: int = FLEX_BLOCK):
    """The ``BlockMask`` of "query i reads key j iff k_valid[j] and document_start(q_pos[i]) <= k_pos[j] <=
    q_pos[i]" (``kernels.documents.readable``) for [B, Sq] / [B, Sk] int64 positions and [B, Sk] bool validity
    (None: all valid), on their device, broadcast over heads.

    Per (query block, key block): skipped when no valid key is at or before the block's latest query and at or after
    the start of its earliest query's document; "full" (no mask_mod) when every key of the block is valid, at or
    before the block's earliest query and in its latest query's document (so every pair is readable); otherwise the
    mask_mod decides per element. Positions are padded to whole blocks (padding keys invalid) so the mask_mod never
    indexes past its tensors. Raises ValueError when ``block_size`` is not a positive integer.
    """
    from torch.nn.attention.flex_attention import BlockMask  # import cost: torch.nn.attention.flex_attention

    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"flex block size must be a positive integer, got {block_size!r}")
    b, sq = q_pos_BS.shape
    sk = k_pos_BS.shape[1]
    nq, nk = -(-sq // block_size), -(-sk // block_size)
    valid = keys_valid(k_pos_BS, k_valid_BS)
    q_pos = _pad(q_pos_BS.long(), nq * block_size, _INT64_MIN)
    q_start = document_start(q_pos)
    k_pos = _pad(k_pos_BS.long(), nk * block_size, _INT64_MAX)
    k_ok = _pad(valid, nk * block_size, False)
    real_q = _pad(torch.ones_like(q_pos_BS, dtype=torch.bool), nq * block_size, False).view(b, nq, block_size)
    q_blocks = q_pos.view(b, nq, block_size)
    q_last = q_blocks.amax(dim=-1)
    q_first = q_blocks.masked_fill(~real_q, _INT64_MAX).amin(dim=-1)
    k_blocks, ok_blocks = k_pos.view(b, nk, block_size), k_ok.view(b, nk, block_size)
    k_first = k_blocks.masked_fill(~ok_blocks, _INT64_MAX).amin(dim=-1)
    k_latest = k_blocks.masked_fill(~ok_blocks, _INT64_MIN).amax(dim=-1)
    k_last = k_blocks.amax(dim=-1)
    readable = ((k_first[:, None, :] <= q_last[:, :, None])
                & (k_latest[:, None, :] >= document_start(q_first)[:, :, None]))
    full = (ok_blocks.all(dim=-1)[:, None, :] & (k_last[:, None, :] <= q_first[:, :, None])
            & (k_first[:, None, :] >= document_start(q_last)[:, :, None]))
    partial_num, partial_idx = _ordered(readable & ~full)
    full_num, full_idx = _ordered(full)

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        k = k_pos[b_idx, kv_idx]
        return k_ok[b_idx, kv_idx] & (k <= q_pos[b_idx, q_idx]) & (k >= q_start[b_idx, q_idx])

    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(sq, sk))


def _has_key(q_pos_BS, k_pos_BS, k_valid_BS) -> torch.Tensor:
    """[B, 1, Sq] bool: the query has at least one readable key (``kernels.documents.has_readable_key``)."""
    return has_readable_key(q_pos_BS, k_pos_BS, keys_valid(k_pos_BS, k_valid_BS))[:, None, :]


def flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None, scale=None, *,
                         compiled: "bool | CompiledFlex" = True, block_size: int = FLEX_BLOCK,
                         masks: BlockMaskCache | None = None):
    """``block_attention``'s (out, lse) through flex attention; differentiable in q, k, v (through lse too) on CUDA.

    q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (GQA), positions [B, Sq] / [B, Sk] int64, k_valid [B, Sk] bool or None.
    Returns out [B, H, Sq, D] in q's dtype (0 on rows with no readable key) and lse [B, H, Sq] in the accumulation
    dtype (-inf there). ``compiled=False`` runs flex's eager path (O(Sq·Sk) memory; on CPU forward only, with inputs
    that do not require grad); a :class:`CompiledFlex` is called as given, on any device (the CPU tests pass one on
    Dynamo's ``aot_eager`` backend). ``masks``: a :class:`BlockMaskCache` to take the block mask from (None: built
    here).
    In the tracing mode (``kernels.tracing``) the flex call is ``flex_stand_in`` (same memory, no values).
    Raises :class:`FlexCompileError` for ``compiled=False`` on CUDA (and from the compiled call, see
    :class:`CompiledFlex`), NotImplementedError (torch's) for a CPU call that needs gradients.
    """
    # import cost: torch.nn.attention.flex_attention
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if compiled is False and q_BHSD.is_cuda:
        raise FlexCompileError("flex attention was asked to run uncompiled on CUDA, which materialises the full "
                               f"[B, H, Sq, Sk] = {[*q_BHSD.shape[:3], k_BHkvSD.shape[2]]} scores; call it compiled")
    if masks is not None:
        block_mask, has_key = masks.get(q_pos_BS, k_pos_BS, k_valid_BS, block_size)
    else:
        block_mask = flex_block_mask(q_pos_BS, k_pos_BS, k_valid_BS, block_size)
        has_key = _has_key(q_pos_BS, k_pos_BS, k_valid_BS)
    fn = compiled if isinstance(compiled, CompiledFlex) else _compiled_flex() if compiled else flex_attention
    if is_tracing():  # the planner's fake-tensor trace (kernels.tracing): a memory-equivalent stand-in
        fn = flex_stand_in
    out, aux = fn(q_BHSD, k_BHkvSD, v_BHkvSD, block_mask=block_mask, scale=scale, enable_gqa=True,
                  return_aux=AuxRequest(lse=True))
    lse = aux.lse.to(accum_dtype(q_BHSD.dtype))
    return (torch.where(has_key[..., None], out, torch.zeros_like(out)),
            torch.where(has_key, lse, torch.full_like(lse, float("-inf"))))


def make_flex_kernel(masks: BlockMaskCache | None = None, compiled: CompiledFlex | None = None) -> BlockKernel:
    """Flex attention as the ``BlockKernel`` of the tile loops (the ring), with its own block-mask cache (so the
    backward's per-pair recompute reuses the forward's mask of the same saved key block). ``compiled``: the
    :class:`CompiledFlex` to call on every device (default: the process's Inductor one on CUDA, flex's eager
    forward on the CPU).

    Inputs stay in their dtype (bf16 runs bf16, LSE float32); forward on CUDA (compiled) or CPU (eager), backward on
    CUDA only. In the ring the backward cannot be handed the final LSE, so each pair is recomputed under autograd and
    the final merge's gradient is pulled through its own (out, lse) (``recompute_block_backward``).
    """
    masks = BlockMaskCache() if masks is None else masks

    def pair_forward(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale):
        q, k, v = (t.detach() for t in (q_BHSD, k_BHkvSD, v_BHkvSD))
        return flex_block_attention(q, k, v, q_pos_BS, k_pos_BS, k_valid_BS, scale,
                                    compiled=compiled or q.is_cuda, masks=masks)

    def pair_differentiable(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale):
        return flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale,
                                    compiled=compiled or q_BHSD.is_cuda, masks=masks)

    kernel = BlockKernel("flex", pair_forward, recompute_block_backward(pair_differentiable),
                         compute_dtype=lambda dtype: dtype)
    kernel.forward.masks = masks  # reachable for tests and counters
    return kernel


FLEX_KERNEL = make_flex_kernel()
"""A flex ``BlockKernel`` with its own mask cache (``make_causal_attention`` makes a fresh one per attention)."""


class FlexCausalAttention:
    """Callable with the draft's causal-block signature ``(q, k, v, q_pos, k_pos, k_valid) -> (out, lse)`` on one
    device: one compiled flex call (its 128-position blocks do the causal skipping; memory O(S·D), so no tile size),
    differentiated by flex's own backward. The block mask of a micro-batch's positions is built once and reused by
    every TTT step and the recompute (``masks``, a :class:`BlockMaskCache`). ``compiled``: the :class:`CompiledFlex`
    to call on every device (default: the process's Inductor one on CUDA, flex's eager forward on the CPU). Raises
    ValueError (naming the shapes) when they disagree, :class:`FlexCompileError` as :class:`CompiledFlex` does."""

    def __init__(self, masks: BlockMaskCache | None = None, compiled: CompiledFlex | None = None):
        self.masks = BlockMaskCache() if masks is None else masks
        self.compiled = compiled

    def __call__(self, q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS=None):
        check_block_shapes(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, "flex attention")
        scale = 1.0 / math.sqrt(q_BHSD.shape[-1])
        return flex_block_attention(q_BHSD, k_BHkvSD, v_BHkvSD, q_pos_BS, k_pos_BS, k_valid_BS, scale,
                                    compiled=self.compiled or q_BHSD.is_cuda, masks=self.masks)

    def __repr__(self) -> str:
        return "FlexCausalAttention()"


def _refusal(device_type: str) -> str | None:
    if device_type == "cuda":
        return None
    return f"needs a CUDA device, got {device_type!r} (flex attention has no backward on CPU in this torch)"


register_attention_backend(AttentionBackend("flex", make_flex_kernel, lambda tile_size, device: FlexCausalAttention(),
                                            refusal=_refusal, auto_on=("cuda",), uses_tiles=False, order=2))
"""``flex``: compiled flex attention, CUDA only; ``auto`` on CUDA; its own 128-position blocks (no tile size, one
pair per ring hop); a fresh block-mask cache per causal block built."""
