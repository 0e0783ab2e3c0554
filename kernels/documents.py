"""Document-qualified positions: several documents packed into one sequence, isolated in every attention kernel
(docs/algorithm.md, "Packing").

A packed row holds several documents one after another; each document's positions restart at 0 (its RoPE is the
unpacked sample's) and no query may read a key of another document. Rather than a second tensor beside the positions
every kernel and ring hop reads, the document is encoded in the positions' high bits: the *attention position* of
token t of document d is ``d·2³² + t`` (:func:`document_positions`). Every kernel's rule becomes

    query at q reads key at k  iff  k is valid  and  document_start(q) <= k <= q,

``document_start(q) = q − (q mod 2³²)`` (:func:`readable`): the upper bound is the causal rule the kernels always
had, the lower one keeps the query inside its document. An unpacked row is document 0 throughout, its attention
positions are the plain positions, and the lower bound (0) never binds: nothing changes for it, bit for bit. The
positions stay one int64 tensor, so the causal-block signature ``(q, k, v, q_pos, k_pos, k_valid)``, the ring's
travelling key metadata and the host copies from which the tile loops decide their pairs
(``kernels.host_positions``) carry the documents without a change: a tile pair or ring hop whose keys all lie in
documents before the queries' is skipped on the host, as one whose keys all lie after them always was.

The RoPE position of an anchor is :func:`token_positions` of its attention position (``TTTKVCache.rope_positions``).
Limits: token positions in [0, 2³²), documents in [0, 2³¹).
"""
from __future__ import annotations

import torch

DOCUMENT_SHIFT = 32
"""The bit at which the document index starts in an attention position."""

POSITION_MASK = (1 << DOCUMENT_SHIFT) - 1
"""The token position's bits of an attention position."""

MAX_DOCUMENTS = 1 << (63 - DOCUMENT_SHIFT)
"""Document indices must be below this (the attention position stays a non-negative int64)."""

_INT64_MAX = torch.iinfo(torch.int64).max


def document_positions(document_BS: torch.Tensor, position_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] int64 attention positions ``document·2³² + position`` of document indices and token positions (both
    [B, S] integer tensors, broadcastable). Raises ValueError (checked on CPU tensors only, no device sync) for a
    position outside [0, 2³²) or a document outside [0, 2³¹)."""
    document, position = document_BS.long(), position_BS.long()
    if document.device.type == "cpu" and position.numel() and document.numel():
        if int(position.min()) < 0 or int(position.max()) > POSITION_MASK:
            raise ValueError(f"token positions must lie in [0, 2^{DOCUMENT_SHIFT}), got [{int(position.min())}, "
                             f"{int(position.max())}]")
        if int(document.min()) < 0 or int(document.max()) >= MAX_DOCUMENTS:
            raise ValueError(f"document indices must lie in [0, {MAX_DOCUMENTS}), got [{int(document.min())}, "
                             f"{int(document.max())}]")
    return (document << DOCUMENT_SHIFT) | position


def token_positions(positions: torch.Tensor) -> torch.Tensor:
    """The token position within its document of each attention position (``positions mod 2³²``; int64)."""
    return positions.long() & POSITION_MASK


def document_start(positions: torch.Tensor) -> torch.Tensor:
    """The attention position of the first token of each position's document (``positions − positions mod 2³²``);
    for an unpacked position (document 0) that is 0."""
    positions = positions.long()
    return positions - (positions & POSITION_MASK)


def readable(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The position part of every kernel's mask (broadcasting int64 tensors): ``document_start(q) <= k <= q``, i.e.
    the key is at or before the query and in the same document. Validity (padding) is the caller's."""
    return (k_pos <= q_pos) & (k_pos >= document_start(q_pos))


def has_readable_key(q_pos_BS: torch.Tensor, k_pos_BS: torch.Tensor, k_valid_BS: torch.Tensor) -> torch.Tensor:
    """[B, Sq] bool: query i has at least one valid key j with ``readable(q_pos[i], k_pos[j])``, for any order of
    the keys: the valid key positions sorted per row, then two binary searches per query (the keys at or before q
    minus those before its document's start). O((Sq + Sk)·log Sk), no [Sq, Sk] tensor; no device sync."""
    keys = k_pos_BS.long().masked_fill(~k_valid_BS.bool(), _INT64_MAX).sort(dim=1).values.contiguous()
    q_pos = q_pos_BS.long().contiguous()
    at_or_before = torch.searchsorted(keys, q_pos, right=True)
    before_document = torch.searchsorted(keys, document_start(q_pos), right=False)
    return at_or_before > before_document


def _tile_lengths(n: int, tile_size: int | None) -> list[int]:
    """``ceil(n / tile_size)`` near-equal lengths summing to ``n`` (``torch.tensor_split``'s; one for None)."""
    parts = 1 if tile_size is None else max(1, -(-n // tile_size))
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def document_tiles(positions_BS: torch.Tensor, tile_size: int | None) -> tuple[int, ...] | None:
    """Tile lengths (summing to S) that cut the columns of host positions [B, S] at every document boundary of any
    row, each run between two boundaries cut into ``ceil(len / tile_size)`` near-equal tiles (``torch.tensor_split``'s
    lengths; None: the run is one tile); None when no row changes document (an unpacked block: the tile loops keep
    their fixed tiles, bit for bit). With the tiles aligned to the documents, a pair of tiles lies in one document
    (and is computed as a causal or full block) or in none the queries read (and is skipped), instead of a fixed tile
    straddling a boundary and paying a dense mask over both documents (docs/algorithm.md, "Packing")."""
    if positions_BS.dim() != 2 or positions_BS.shape[1] < 2:
        return None
    docs = positions_BS.long() >> DOCUMENT_SHIFT
    change = (docs[:, 1:] != docs[:, :-1]).any(dim=0)
    if not bool(change.any()):
        return None
    bounds = [0, *(torch.nonzero(change).flatten() + 1).tolist(), positions_BS.shape[1]]
    lengths: list[int] = []
    for start, end in zip(bounds, bounds[1:]):
        lengths += _tile_lengths(end - start, tile_size)
    return tuple(lengths)


def chunk_document_tiles(positions_BS: torch.Tensor, tile_size: int | None,
                         chunks: int) -> tuple[tuple[int, ...], bool]:
    """(tile lengths summing to S, whether any chunk holds a document boundary) of host positions [B, S] cut into
    ``chunks`` equal chunks (``torch.tensor_split``: a context-parallel shard's zigzag chunks), each chunk cut as
    :func:`document_tiles` cuts it, or, without a boundary in it, into the fixed tiles the tile loops cut
    (``ceil(len / tile_size)`` near-equal ones; one for None). Without any boundary the lengths are exactly the
    fixed tiling's."""
    lengths: list[int] = []
    documents = False
    for part in torch.tensor_split(positions_BS, chunks, dim=1):
        cut = document_tiles(part, tile_size)
        documents = documents or cut is not None
        lengths += _tile_lengths(part.shape[1], tile_size) if cut is None else cut
    return tuple(lengths), documents


def packed_positions(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] int64 attention positions of a packed batch from its document ids [B, S] (non-negative; a document is
    a run of equal ids along a row): :func:`document_positions` of each position's document and its offset from the
    document's first position (the token positions restart at 0 in every document)."""
    docs = document_ids_BS.long()
    b, s = docs.shape
    index = torch.arange(s, device=docs.device).expand(b, s)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return document_positions(docs, index - first)
