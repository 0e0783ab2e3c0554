"""Sample indices -> this rank's TTT micro-batch, online (the target runs now) or offline (the store).

Every TTT shift is computed on the full, padded token sequence (``recipe.model.ttt.make_ttt_batch``; every rank
has the tokens) and only then is the batch zigzag-split across context-parallel ranks (``recipe.parallel.cp_shard``),
so no rank needs its neighbour's tokens. The hidden states are local: offline a cp rank reads only its rows of the
store (``rows_needed``); online with cp > 1 the target itself runs context-parallel
(``recipe.model.target_cp.CPTarget``): each cp rank computes the aux states of its zigzag positions and the last hidden
states of its label rows, never the full sequence's. Tensor-parallel ranks read the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.data.store import DTYPES
from recipe.model.ttt import TTTBatch, make_ttt_batch, target_in_draft_vocab


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class MicroBatch:
    ttt: TTTBatch            # this rank's (cp-sharded) TTT batch, on the training device
    samples: int             # samples in the micro-batch (whole, not per cp rank)
    supervised_tokens: int   # loss-mask ones over the whole micro-batch
    supervised_K: torch.Tensor  # [K] int64 supervised positions per TTT step, whole micro-batch


def supervised_per_step(loss_mask_BS: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[K] int64: supervised positions of each TTT step k over a right-padded [B, S] loss mask: anchors p whose
    step-k label ``t[p+2+k]`` has loss mask 1 (``make_ttt_batch``'s ``valid`` without the in-vocabulary term)."""
    mask = loss_mask_BS.long()
    return torch.stack([mask[:, k + 2:].sum() for k in range(ttt_steps)])


class BatchBuilder:
    """Builds micro-batches from an examples dataset (online) or a hidden-state store (offline).

    Args:
        examples: ``datasets.Dataset`` with ``input_ids``/``loss_mask`` columns (online) or None.
        store: ``recipe.data.store.HiddenStateStore`` (offline) or None.
        target: online, a ``recipe.model.target.TargetModel`` (cp = 1) or a ``recipe.model.target_cp.CPTarget``
            over this rank's cp group (cp > 1); None offline.
        t2d: [V] bool draft-vocabulary mask; copied once to the target's device online (where the target's argmax
            is computed), kept on the CPU offline (where the store's ``target_argmax`` is read).
    The in-draft-vocabulary flag of a position is the lookup ``t2d[target argmax]``: the argmax comes from the store
    (computed at dump time) or from ``TargetModel.capture`` (on the target's device, in its dtype); no
    full-vocabulary matmul runs here.
        ttt_steps: K.  seq_divisor: pad the sequence to a multiple of this (2·cp·tp).
        cp_size, cp_rank: context-parallel layout (1, 0 for none).
        device, dtype: where and in which float dtype the draft consumes the batch.
    """

    def __init__(self, *, examples=None, store=None, target=None, t2d, ttt_steps, seq_divisor,
                 cp_size=1, cp_rank=0, device=torch.device("cpu"), dtype=torch.float32):
        if (examples is None) == (store is None):
            raise ValueError("BatchBuilder needs exactly one of examples (online) or store (offline)")
        if examples is not None and target is None:
            raise ValueError("online mode needs the target model")
        if examples is not None and cp_size > 1:
            from recipe.model.target_cp import CPTarget

            if not isinstance(target, CPTarget):
                raise ValueError(f"online training with cp_size={cp_size} needs a recipe.model.target_cp.CPTarget, "
                                 f"got {type(target).__name__}")
        self.examples, self.store, self.target = examples, store, target
        self.t2d = t2d.to(target.device) if target is not None else t2d
        self.ttt_steps, self.seq_divisor = ttt_steps, seq_divisor
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.device, self.dtype = device, dtype

    def __len__(self) -> int:
        return len(self.examples) if self.examples is not None else len(self.store)

    def _tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.examples is not None:
            row = self.examples[index]
            return torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"])
        sample = self.store.get(index, fields=("input_ids", "loss_mask"))
        return sample["input_ids"], sample["loss_mask"]

    def rows_needed(self, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(aux rows, target rows) this rank reads of a padded length-``seq`` sample; (None, None): all rows.

        Under CP a rank needs the aux states of its zigzag positions P only, and the target's last hidden state at
        the label positions ``P + 1 + k`` (k < K, clamped to the end) — its chunks plus K rows after each.
        """
        if self.cp_size == 1:
            return None, None
        from recipe.parallel.cp_shard import label_rows, zigzag_indices

        return zigzag_indices(seq, self.cp_size, self.cp_rank), label_rows(seq, self.cp_size, self.cp_rank,
                                                                           self.ttt_steps)

    def build(self, indices: list[int]) -> MicroBatch:
        """The TTT micro-batch of samples ``indices`` for this rank."""
        tokens = [self._tokens(i) for i in indices]
        tokens = [(ids.long(), mask.long()) for ids, mask in tokens]
        seq = round_up(max(len(ids) for ids, _ in tokens), self.seq_divisor)
        b = len(indices)
        input_ids = torch.zeros(b, seq, dtype=torch.long)
        loss_mask = torch.zeros(b, seq, dtype=torch.long)
        attention = torch.zeros(b, seq, dtype=torch.long)
        for row, (ids, mask) in enumerate(tokens):
            input_ids[row, :len(ids)], loss_mask[row, :len(ids)], attention[row, :len(ids)] = ids, mask, 1
        if self.target is not None and self.cp_size > 1:
            ttt = self._cp_online(input_ids, loss_mask, attention)
        else:
            aux, last, argmax = self._hidden(indices, [len(ids) for ids, _ in tokens], input_ids, attention, seq)
            in_vocab = target_in_draft_vocab(argmax, self.t2d)
            ttt = make_ttt_batch(input_ids.to(aux.device), loss_mask.to(aux.device), attention.to(aux.device),
                                 aux, last, in_vocab, self.ttt_steps)
            if self.cp_size > 1:
                from recipe.parallel.cp_shard import shard_ttt_batch

                ttt = shard_ttt_batch(ttt, self.cp_size, self.cp_rank)
        ttt = ttt.to(self.device)
        ttt.aux_hidden_BSA = ttt.aux_hidden_BSA.to(self.dtype)
        ttt.target_hidden_BLH = ttt.target_hidden_BLH.to(self.dtype)
        return MicroBatch(ttt=ttt, samples=b, supervised_tokens=int(loss_mask.sum()),
                          supervised_K=supervised_per_step(loss_mask, self.ttt_steps))

    def _cp_online(self, input_ids, loss_mask, attention) -> TTTBatch:
        """This rank's TTT batch from the context-parallel target forward (``CPTarget.capture``): the shifts are
        made on the full token sequence with empty hidden states, the batch is sharded, then the local aux states
        and label rows are put in (``shard_ttt_batch`` orders the label rows as ``cp_shard.label_rows`` does)."""
        from recipe.parallel.cp_shard import shard_ttt_batch

        dev = self.target.device
        cap = self.target.capture(input_ids, attention, self.ttt_steps)
        b, s = input_ids.shape
        empty = torch.empty(b, s, 0, dtype=cap.aux_hidden_BSA.dtype, device=dev)
        ttt = make_ttt_batch(input_ids.to(dev), loss_mask.to(dev), attention.to(dev), empty, empty,
                             target_in_draft_vocab(cap.argmax_BS, self.t2d), self.ttt_steps)
        ttt = shard_ttt_batch(ttt, self.cp_size, self.cp_rank)
        if ttt.target_hidden_BLH.shape[1] != cap.label_hidden_BUH.shape[1]:
            raise AssertionError(f"label rows: the shard reads {ttt.target_hidden_BLH.shape[1]}, the CP target "
                                 f"computed {cap.label_hidden_BUH.shape[1]}")
        ttt.aux_hidden_BSA, ttt.target_hidden_BLH = cap.aux_hidden_BSA, cap.label_hidden_BUH
        return ttt

    def _hidden(self, indices, lengths, input_ids, attention, seq
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, seq, A] aux and [B, seq, H_t] last hidden states (target or store dtype) and the [B, seq] int64
        target argmax. Online all three are on the target's device; offline on the CPU, and only the hidden-state
        rows this rank needs are read from the store (``rows_needed``); the others stay zero and are never used by
        this rank's shard."""
        if self.target is not None:
            cap = self.target.capture(input_ids.to(self.target.device), attention.to(self.target.device))
            return cap.aux_hidden_BSA, cap.last_hidden_BSH, cap.argmax_BS
        aux_rows, label_rows = self.rows_needed(seq)
        meta = self.store.meta
        dtype = DTYPES[meta.dtype]
        aux = torch.zeros(len(indices), seq, meta.aux_width, dtype=dtype)
        last = torch.zeros(len(indices), seq, meta.hidden_size, dtype=dtype)
        argmax = torch.zeros(len(indices), seq, dtype=torch.int64)
        for b, (index, n) in enumerate(zip(indices, lengths)):
            if aux_rows is None:
                sample = self.store.get(index, fields=("target_argmax", "aux_hidden", "last_hidden"))
                aux[b, :n], last[b, :n] = sample["aux_hidden"], sample["last_hidden"]
                argmax[b, :n] = sample["target_argmax"]
                continue
            rows_a, rows_l = aux_rows[aux_rows < n], label_rows[label_rows < n]
            aux[b, rows_a] = self.store.get(index, rows=rows_a, fields=("aux_hidden",))["aux_hidden"]
            last[b, rows_l] = self.store.get(index, rows=rows_l, fields=("last_hidden",))["last_hidden"]
            argmax[b, :n] = self.store.get(index, fields=("target_argmax",))["target_argmax"]
        return aux, last, argmax
