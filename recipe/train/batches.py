"""Sample indices -> this rank's TTT micro-batch, online (the target runs now) or offline (the store).

Every TTT shift is computed on the full, padded token sequence (``recipe.model.ttt.make_ttt_batch``; every rank
has the tokens) and only then is the batch zigzag-split across context-parallel ranks (``recipe.parallel.cp_shard``),
so no rank needs its neighbour's tokens. The hidden states are local: offline a cp rank reads only its rows of the
store (``rows_needed``); online with ``dims.cp_enabled``, or tp > 1 for a target whose attention the ring runs
(``recipe.target.registry.splits_target``), the target itself runs split over the cp·tp ranks
(``recipe.target.split.SplitTarget``): each rank runs it on 1/(cp·tp) of the sequence, then each cp rank has the aux
states of its zigzag positions and the last hidden states of its label rows, never the full sequence's.
Tensor-parallel ranks read the same samples.
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kernels.documents import document_positions, token_positions
from kernels.host_positions import attach_host_copies
from recipe.data.packing import RowLayout, check_packing, micro_batch_layout
from recipe.data.store import DTYPES
from recipe.model.call_extent import CallExtent
from recipe.model.ttt import TTTBatch, make_ttt_batch, target_in_draft_vocab
from recipe.parallel.cp_shard import label_rows, shard_ttt_batch, zigzag_indices, zigzag_split
from recipe.parallel.dims import ParallelDims
from recipe.target.head import validity_rows
from recipe.target.split import SplitTarget
from recipe.train.positions import anchor_offset_positions


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class MicroBatch:
    ttt: TTTBatch            # this rank's (cp-sharded) TTT batch, on the training device
    samples: int             # samples in the micro-batch (whole, not per cp rank)
    supervised_tokens: int   # loss-mask ones over the whole micro-batch
    supervised_K: torch.Tensor  # [K] int64 (CPU) supervised positions per TTT step, whole micro-batch


@dataclass
class HostTokens:
    """The host (CPU) side of one micro-batch, known before any hidden state is read or any target runs.

    ``input_ids_BS`` / ``loss_mask_BS`` / ``attention_BS``: [B, S] int64, the samples placed as ``layout`` says
    (``recipe.data.packing.RowLayout``: one per row, or packed several to a row), padded to S (a multiple of the seq
    divisor) with 0; ``attention_BS`` 1 on tokens. ``argmax_BS``: [B, S] int64 the store's ``target_argmax`` (0 on
    padding) offline, None online (the target computes it). ``lengths``: the real length of each sample (in
    ``indices`` order). ``documents_BS``: [B, S] int64 the document of each position of a packed layout
    (``RowLayout.documents``), None unpacked; ``positions_BS`` then its attention positions
    (``kernels.documents.document_positions``: the document and the position within it), else None.
    """

    indices: list[int]
    lengths: list[int]
    input_ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    attention_BS: torch.Tensor
    argmax_BS: torch.Tensor | None = None
    layout: RowLayout | None = None
    documents_BS: torch.Tensor | None = None
    positions_BS: torch.Tensor | None = None

    @property
    def samples(self) -> int:
        return len(self.indices)

    @property
    def seq(self) -> int:
        """S, the padded length (whole sequence, not per cp rank)."""
        return self.attention_BS.shape[1]


def supervised_per_step(loss_mask_BS: torch.Tensor, ttt_steps: int,
                        documents_BS: torch.Tensor | None = None) -> torch.Tensor:
    """[K] int64: supervised positions of each TTT step k over a right-padded [B, S] loss mask: anchors p whose
    step-k label ``t[p+2+k]`` has loss mask 1 (``make_ttt_batch``'s ``valid`` without the in-vocabulary term); with
    ``documents_BS`` (a packed batch) only labels in the anchor's document count, as in the padded batch."""
    mask = loss_mask_BS.long()
    if documents_BS is None:
        return torch.stack([mask[:, k + 2:].sum() for k in range(ttt_steps)])
    docs = documents_BS.long()
    return torch.stack([(mask[:, k + 2:] * (docs[:, k + 2:] == docs[:, :-(k + 2)])).sum() for k in range(ttt_steps)])


class BatchBuilder:
    """Builds micro-batches from an examples dataset (online) or a hidden-state store (offline).

    Args:
        examples: ``datasets.Dataset`` with ``input_ids``/``loss_mask`` columns (online) or None.
        store: ``recipe.data.store.HiddenStateStore`` (offline) or None.
        target: online, a ``recipe.target.capture.TargetModel`` (run whole on this rank; cp = 1) or a
            ``recipe.target.split.SplitTarget`` (split over this rank's cp·tp group; required when
            ``dims.cp_enabled``); None offline.
        t2d: [V] bool draft-vocabulary mask; copied once to the target's device online (where the target's argmax
            is computed), kept on the CPU offline (where the store's ``target_argmax`` is read).
    The in-draft-vocabulary flag of a position is the lookup ``t2d[target argmax]``: the argmax comes from the store
    (computed at dump time) or from ``TargetModel.capture`` (on the target's device, in its dtype); no
    full-vocabulary matmul runs here.
        ttt_steps: K.  seq_divisor: pad the sequence to a multiple of this (the run's ``dims.seq_divisor``, 2·cp·tp;
            a multiple of 2·cp, so that every padded length splits into the 2·cp zigzag chunks).
        dims, cp_rank: the run's layout (``recipe.parallel.dims.ParallelDims``; default one process) and this rank's
            index in its cp group. ``dims.cp_enabled`` alone decides whether the batch is zigzag-split (where the
            split at cp = 1 is the identity, ``zigzag_split``, it runs unconditionally).
        device, dtype: where and in which float dtype the draft consumes the batch.
        argmax_chunk_size: positions per argmax matmul of a whole-sequence ``TargetModel`` (a ``SplitTarget`` has its
            own).
        position_offset_max, seed: ``--position-offset-max``: > 0 replaces the draft's position ids by
            ``recipe.train.positions.anchor_offset_positions`` (sinks kept, the rest shifted per sample); 0 leaves
            them as ``make_ttt_batch`` made them.
        packing, packing_tokens: the ``data`` section's switch (``recipe.data.packing.PACKING_MODES``; false, the
            default here: one sample per padded row; ``run.py`` passes the run's, "auto" unless set) and the row
            budget in tokens (``micro_batch_layout``; None: one row per micro-batch). A packed
            micro-batch's samples are documents of their rows: positions restart per document, every TTT shift stays
            inside it, the online target's forward isolates them (``TargetModel.capture``'s ``position_ids_BS``,
            ``SplitTarget.capture``'s ``positions_BS``) and so does the draft's attention (docs/algorithm.md,
            "Packing"); loss sums, counts and gradients equal the padded batch's up to float summation order.
        packed_target: online with a whole ``TargetModel``, a ``SplitTarget`` of one rank around it (None: none):
            the packed micro-batches' target forward, through the project's causal block (documents isolated tile
            by tile or by flex's block mask) instead of transformers' dense block-diagonal mask over the whole row;
            padded micro-batches keep the ``TargetModel``.

    Host vs device. Offline, everything up to the finished CPU ``TTTBatch`` is host work (``tokens``, ``read``; on a
    CUDA device the CPU batch is put in pinned memory there) and ``build`` copies it to the device with
    ``non_blocking=True``; ``StepBatches`` runs the next micro-batch's ``read`` in a background thread. ``build``
    attaches host copies of the batch's positions and key validity for every cp rank to the device tensors
    (``kernels.host_positions``), from which the attention decides its tile pairs without a device sync.
    """

    def __init__(self, *, examples=None, store=None, target=None, t2d, ttt_steps, seq_divisor,
                 dims: ParallelDims = ParallelDims(world_size=1), cp_rank=0, device=torch.device("cpu"),
                 dtype=torch.float32, argmax_chunk_size=1024, position_offset_max=0, seed=0,
                 packing: bool | str = False, packing_tokens: int | None = None, packed_target=None):
        if (examples is None) == (store is None):
            raise ValueError("BatchBuilder needs exactly one of examples (online) or store (offline)")
        if examples is not None and target is None:
            raise ValueError("online mode needs the target model")

        if seq_divisor % (2 * dims.cp):
            raise ValueError(f"seq_divisor={seq_divisor} is not a multiple of 2·cp = {2 * dims.cp} (the zigzag "
                             f"chunks; the run passes dims.seq_divisor = 2·cp·tp)")
        self.split_target = isinstance(target, SplitTarget)
        if examples is not None and dims.cp_enabled and not self.split_target:
            raise ValueError(f"online training with cp_size={dims.cp} needs a recipe.target.split.SplitTarget, "
                             f"got {type(target).__name__}")
        self.examples, self.store, self.target = examples, store, target
        self.packed_target = packed_target
        self.argmax_chunk_size = argmax_chunk_size
        self.position_offset_max, self.seed = position_offset_max, seed
        self.packing, self.packing_tokens = check_packing(packing), packing_tokens
        self.t2d = t2d.to(target.device) if target is not None else t2d
        self.ttt_steps, self.seq_divisor = ttt_steps, seq_divisor
        self.dims, self.cp_rank = dims, cp_rank
        self.device, self.dtype = device, dtype
        self.pin_memory = torch.device(device).type == "cuda"  # pinned host buffers only feed a CUDA device
        self._store_lock = threading.Lock()  # the store's file handles are shared with the prefetch thread
        self._executor: ThreadPoolExecutor | None = None
        self._store_lengths: list[int] | None = None  # the store's sample lengths, read from its index once

    def __len__(self) -> int:
        return len(self.examples) if self.examples is not None else len(self.store)

    def _store_get(self, index: int, **kwargs) -> dict[str, torch.Tensor]:
        with self._store_lock:
            return self.store.get(index, **kwargs)

    def _tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.examples is not None:
            row = self.examples[index]
            return torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"])
        sample = self._store_get(index, fields=("input_ids", "loss_mask"))
        return sample["input_ids"], sample["loss_mask"]

    def sample_lengths(self, indices: list[int]) -> list[int]:
        """The token count of each sample of ``indices``, from the store's index (offline; no sample is read) or
        the examples' ``input_ids`` (online)."""
        if self.examples is not None:
            return [len(self.examples[i]["input_ids"]) for i in indices]
        if self._store_lengths is None:
            self._store_lengths = self.store.lengths
        return [self._store_lengths[i] for i in indices]

    def call_extent(self, groups: list[list[int]]) -> CallExtent:
        """The ``TTTBatch.call_extent`` of one micro-batch from every dp rank's sample indices ``groups`` (one list
        per dp rank, this rank's included; an empty list counts as nothing): each rank's padded length is computed
        as ``tokens`` pads it, on the host, so every rank of the ZeRO group gets the same extent without a
        collective (``recipe.model.call_extent``). Local to a cp rank (the sizes / cp)."""
        return self.extent_of(self.layouts(groups))

    def layouts(self, groups: list[list[int]]) -> list[RowLayout]:
        """The layout of each dp rank's micro-batch of ``groups`` (sample indices per dp rank; empty lists left
        out), on the host."""
        return [self.layout(self.sample_lengths(ix)) for ix in groups if ix]

    def extent_of(self, layouts: list[RowLayout]) -> CallExtent:
        """:meth:`call_extent` of the micro-batches already laid out (:meth:`layouts`)."""
        return CallExtent.of([(layout.rows, layout.seq) for layout in layouts], self.dims.cp)

    def layout(self, lengths: list[int]) -> RowLayout:
        """Where samples of ``lengths`` tokens go in a micro-batch (``recipe.data.packing.micro_batch_layout``: padded
        rows, or packed ones under ``packing``); host arithmetic, the same on every rank."""
        return micro_batch_layout(lengths, self.packing, self.packing_tokens, self.seq_divisor)

    def rows_needed(self, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(aux rows, target rows) this rank reads of a padded length-``seq`` sample; (None, None): all rows.

        Under CP a rank needs the aux states of its zigzag positions P only, and the target's last hidden state at
        the label positions ``P + 1 + k`` (k < K, clamped to the end) — its chunks plus K rows after each.
        """
        if not self.dims.cp_enabled:
            return None, None
        cp = self.dims.cp
        return zigzag_indices(seq, cp, self.cp_rank), label_rows(seq, cp, self.cp_rank, self.ttt_steps)

    def tokens(self, indices: list[int]) -> HostTokens:
        """The CPU tokens of samples ``indices`` placed as ``layout`` says (offline also the store's
        ``target_argmax``); no hidden state is read."""
        tokens = [self._tokens(i) for i in indices]
        tokens = [(ids.long(), mask.long()) for ids, mask in tokens]
        lengths = [len(ids) for ids, _ in tokens]
        layout = self.layout(lengths)
        b, seq = layout.rows, layout.seq
        input_ids = torch.zeros(b, seq, dtype=torch.long)
        loss_mask = torch.zeros(b, seq, dtype=torch.long)
        attention = torch.zeros(b, seq, dtype=torch.long)
        argmax = None if self.store is None else torch.zeros(b, seq, dtype=torch.int64)
        for p in layout.placements:
            ids, mask = tokens[p.slot]
            cols = slice(p.offset, p.offset + p.length)
            input_ids[p.row, cols], loss_mask[p.row, cols], attention[p.row, cols] = ids, mask, 1
            if argmax is not None:
                argmax[p.row, cols] = self._store_get(indices[p.slot], fields=("target_argmax",))["target_argmax"]
        documents = positions = None
        if layout.packed:
            documents, token_pos = layout.documents()
            positions = document_positions(documents, token_pos)
        return HostTokens(list(indices), lengths, input_ids, loss_mask, attention, argmax, layout, documents,
                          positions)

    def local_valid(self, host: HostTokens) -> torch.Tensor:
        """[K] int64 (CPU): this cp rank's valid positions per TTT step of an OFFLINE micro-batch, from its tokens
        and the store's argmax only: the ``valid_KBS.sum((1, 2))`` of the batch ``build`` makes (the same
        ``make_ttt_batch`` and zigzag split, with empty hidden states)."""
        if host.argmax_BS is None:
            raise ValueError("local_valid needs the store's target_argmax (offline mode)")
        empty = torch.empty(*host.attention_BS.shape, 0)
        ttt = make_ttt_batch(host.input_ids_BS, host.loss_mask_BS, host.attention_BS, empty, empty,
                             target_in_draft_vocab(host.argmax_BS, self.t2d), self.ttt_steps, host.documents_BS)
        return self._cp_part(ttt.valid_KBS, 2).sum(dim=(1, 2))

    def read(self, host: HostTokens) -> TTTBatch:
        """OFFLINE: this rank's finished TTT batch on the CPU (hidden states in the store dtype), its tensors in
        pinned memory when the device is CUDA. Host work only (store reads, shifts, zigzag split), safe to run in a
        background thread."""
        aux, last = self._hidden(host)
        ttt = make_ttt_batch(host.input_ids_BS, host.loss_mask_BS, host.attention_BS, aux, last,
                             target_in_draft_vocab(host.argmax_BS, self.t2d), self.ttt_steps, host.documents_BS)
        if self.dims.cp_enabled:  # at cp = 1 the shard would still compact the target rows (the label rows only)
            ttt = shard_ttt_batch(ttt, self.dims.cp, self.cp_rank)
        if self.pin_memory:
            ttt = dataclasses.replace(ttt, **{name: getattr(ttt, name).pin_memory() for name in ttt.tensor_fields()})
        return ttt

    def build(self, indices: list[int], staged: tuple[HostTokens, TTTBatch] | None = None,
              extent: CallExtent | None = None) -> MicroBatch:
        """The TTT micro-batch of samples ``indices`` for this rank, on the device. ``staged``: ``(tokens(indices),
        read(...))`` made beforehand (offline prefetch, ``StepBatches``); None reads now. ``extent``: the batch's
        ``call_extent`` (``call_extent`` of every dp rank's samples; None: its own)."""
        host = staged[0] if staged is not None else self.tokens(indices)
        if staged is not None:
            ttt = staged[1]
        elif self.store is not None:
            ttt = self.read(host)
        elif self.split_target:
            ttt = self._cp_online(host, self.target)
        elif host.layout.packed and self.packed_target is not None:
            ttt = self._cp_online(host, self.packed_target)
        else:
            rope = None if host.positions_BS is None else token_positions(host.positions_BS)  # restart per document
            cap = self.target.capture(host.input_ids_BS, host.attention_BS, self.argmax_chunk_size,
                                      validity_rows(host.loss_mask_BS), position_ids_BS=rope)  # argmax where read
            dev = cap.aux_hidden_BSA.device
            ttt = make_ttt_batch(host.input_ids_BS.to(dev), host.loss_mask_BS.to(dev), host.attention_BS.to(dev),
                                 cap.aux_hidden_BSA, cap.last_hidden_BSH,
                                 target_in_draft_vocab(cap.argmax_BS, self.t2d), self.ttt_steps,
                                 None if host.documents_BS is None else host.documents_BS.to(dev))
        host_valid = ttt.valid_KBS if ttt.valid_KBS.device.type == "cpu" else None
        ttt = dataclasses.replace(ttt, call_extent=extent,
                                  **{name: getattr(ttt, name).to(self.device, non_blocking=True)
                                     for name in ttt.tensor_fields()})
        ttt.aux_hidden_BSA = ttt.aux_hidden_BSA.to(self.dtype)
        ttt.target_hidden_BLH = ttt.target_hidden_BLH.to(self.dtype)
        positions = host.positions_BS  # --position-offset-max 0: the positions make_ttt_batch made, untouched
        if self.position_offset_max:
            positions = self._offset_positions(host)
            ttt.position_ids_BS = self._cp_part(positions, 1).to(self.device)
        self._attach_host_copies(ttt, host, positions, host_valid)
        return MicroBatch(ttt=ttt, samples=host.samples, supervised_tokens=int(host.loss_mask_BS.sum()),
                          supervised_K=supervised_per_step(host.loss_mask_BS, self.ttt_steps, host.documents_BS))

    def _offset_positions(self, host: HostTokens) -> torch.Tensor:
        """[B, S] int64 the draft's positions under ``--position-offset-max`` (``anchor_offset_positions``): per
        sample (per document of a packed row, whose positions restart at 0: the same values as the sample padded
        alone), then encoded with the documents (``kernels.documents.document_positions``) when packed."""
        if host.documents_BS is None:
            return anchor_offset_positions(host.indices, host.seq, self.position_offset_max, self.seed)
        local = token_positions(host.positions_BS)
        for p in host.layout.placements:
            local[p.row, p.offset:p.offset + p.length] = anchor_offset_positions(
                [host.indices[p.slot]], p.length, self.position_offset_max, self.seed)[0]
        return document_positions(host.documents_BS, local)

    def _cp_part(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This cp rank's zigzag part of a full-sequence tensor along ``dim`` (at cp = 1 an exact copy of all of it:
        ``zigzag_split`` of one rank is the identity, tests/test_cp_shard.py)."""
        return zigzag_split(x, self.dims.cp, self.cp_rank, dim)

    def _attach_host_copies(self, ttt: TTTBatch, host: HostTokens, positions_BS: torch.Tensor | None = None,
                            host_valid: torch.Tensor | None = None) -> None:
        """Attach to the batch's positions and key validity their values on every cp rank, on the CPU (positions:
        the zigzag arithmetic of ``positions_BS``, the full [B, S] ids, default ``arange(S)``; validity: the
        padding), for the attention's pair decision; and to ``valid_KBS`` this rank's CPU copy ``host_valid`` when
        the batch was built on the CPU (the sparse anchors' sets, ``recipe.model.sparse_anchors``, are then decided
        without a device sync)."""
        b, s = host.attention_BS.shape
        pos = torch.arange(s, dtype=torch.int64).expand(b, s) if positions_BS is None else positions_BS
        valid = host.attention_BS.bool()
        per_pos = [zigzag_split(pos, self.dims.cp, r, 1) for r in range(self.dims.cp)]  # one copy each at cp = 1
        per_valid = [zigzag_split(valid, self.dims.cp, r, 1) for r in range(self.dims.cp)]
        attach_host_copies(ttt.position_ids_BS, per_pos, self.cp_rank)
        attach_host_copies(ttt.key_valid_BS, per_valid, self.cp_rank)
        if host_valid is not None and ttt.valid_KBS is not host_valid:
            attach_host_copies(ttt.valid_KBS, host_valid)

    def prefetch(self, host: HostTokens) -> Future:
        """Start ``read(host)`` in the builder's background thread (one worker: reads run in submission order);
        the future's result is the ``staged`` argument of ``build`` (with ``host``)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        return self._executor.submit(lambda: (host, self.read(host)))

    def _cp_online(self, host: HostTokens, target: SplitTarget) -> TTTBatch:
        """This rank's TTT batch from the split target forward (``SplitTarget.capture`` of ``target``, packed
        documents isolated by their attention positions): the shifts are made on the full token sequence with empty
        hidden states, the batch is sharded, then the local aux states and label rows are put in
        (``shard_ttt_batch`` orders the label rows as ``cp_shard.label_rows`` does)."""
        dev = target.device
        cap = target.capture(host.input_ids_BS, host.attention_BS, self.ttt_steps, validity_rows(host.loss_mask_BS),
                             positions_BS=host.positions_BS)
        b, s = host.input_ids_BS.shape
        empty = torch.empty(b, s, 0, dtype=cap.aux_hidden_BSA.dtype, device=dev)
        docs = None if host.documents_BS is None else host.documents_BS.to(dev)
        ttt = make_ttt_batch(host.input_ids_BS.to(dev), host.loss_mask_BS.to(dev), host.attention_BS.to(dev), empty,
                             empty, target_in_draft_vocab(cap.argmax_BS, self.t2d), self.ttt_steps, docs)
        ttt = shard_ttt_batch(ttt, self.dims.cp, self.cp_rank)
        if ttt.target_hidden_BLH.shape[1] != cap.label_hidden_BUH.shape[1]:
            raise AssertionError(f"label rows: the shard reads {ttt.target_hidden_BLH.shape[1]}, the CP target "
                                 f"computed {cap.label_hidden_BUH.shape[1]}")
        ttt.aux_hidden_BSA, ttt.target_hidden_BLH = cap.aux_hidden_BSA, cap.label_hidden_BUH
        return ttt

    def _hidden(self, host: HostTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """OFFLINE: [B, S, A] aux and [B, S, H_t] last hidden states on the CPU in the store dtype, each sample's rows
        where ``host.layout`` placed it; only the rows this rank needs are read from the store (``rows_needed``);
        the others stay zero and are never used by this rank's shard."""
        aux_rows, label_rows = self.rows_needed(host.seq)
        meta = self.store.meta
        dtype = DTYPES[meta.dtype]
        aux = torch.zeros(host.attention_BS.shape[0], host.seq, meta.aux_width, dtype=dtype)
        last = torch.zeros(host.attention_BS.shape[0], host.seq, meta.hidden_size, dtype=dtype)
        for p in host.layout.placements:
            index, row, start, end = host.indices[p.slot], p.row, p.offset, p.offset + p.length
            if aux_rows is None:
                sample = self._store_get(index, fields=("aux_hidden", "last_hidden"))
                aux[row, start:end], last[row, start:end] = sample["aux_hidden"], sample["last_hidden"]
                continue
            rows_a = aux_rows[(aux_rows >= start) & (aux_rows < end)]
            rows_l = label_rows[(label_rows >= start) & (label_rows < end)]
            aux[row, rows_a] = self._store_get(index, rows=rows_a - start, fields=("aux_hidden",))["aux_hidden"]
            last[row, rows_l] = self._store_get(index, rows=rows_l - start, fields=("last_hidden",))["last_hidden"]
        return aux, last
