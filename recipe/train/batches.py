"""Sample indices -> this rank's TTT micro-batch, online (the target runs now) or offline (the store).

Every TTT shift is computed on the full, padded sequence (``recipe.model.ttt.make_ttt_batch``) and only then is the
batch zigzag-split across context-parallel ranks (``recipe.parallel.cp_shard``), so no rank needs its neighbour's
tokens. Online with cp > 1, each cp rank runs the target on the whole micro-batch itself: the target's forward is a
small part of a step next to the draft's K unrolled steps, and replicating it needs no communication, where running it
once per cp group would need a scatter of [B, S, 3·H_t] activations. Tensor-parallel ranks read the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.model.ttt import TTTBatch, make_ttt_batch, target_in_draft_vocab


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class MicroBatch:
    ttt: TTTBatch            # this rank's (cp-sharded) TTT batch, on the training device
    samples: int             # samples in the micro-batch (whole, not per cp rank)
    supervised_tokens: int   # loss-mask ones over the whole micro-batch


class BatchBuilder:
    """Builds micro-batches from an examples dataset (online) or a hidden-state store (offline).

    Args:
        examples: ``datasets.Dataset`` with ``input_ids``/``loss_mask`` columns (online) or None.
        store: ``recipe.data.store.HiddenStateStore`` (offline) or None.
        target: ``recipe.model.target.TargetModel`` (online) or None.
        lm_head_VH: [V, H_t] target lm_head (for the in-draft-vocab mask), any float dtype.
        t2d: [V] bool draft-vocabulary mask.
        ttt_steps: K.  seq_divisor: pad the sequence to a multiple of this (2·cp·tp).
        cp_size, cp_rank: context-parallel layout (1, 0 for none).
        device, dtype: where and in which float dtype the draft consumes the batch.
    """

    def __init__(self, *, examples=None, store=None, target=None, lm_head_VH, t2d, ttt_steps, seq_divisor,
                 cp_size=1, cp_rank=0, device=torch.device("cpu"), dtype=torch.float32, vocab_chunk=1024):
        if (examples is None) == (store is None):
            raise ValueError("BatchBuilder needs exactly one of examples (online) or store (offline)")
        if examples is not None and target is None:
            raise ValueError("online mode needs the target model")
        self.examples, self.store, self.target = examples, store, target
        self.lm_head_VH, self.t2d = lm_head_VH, t2d
        self.ttt_steps, self.seq_divisor = ttt_steps, seq_divisor
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.device, self.dtype, self.vocab_chunk = device, dtype, vocab_chunk

    def __len__(self) -> int:
        return len(self.examples) if self.examples is not None else len(self.store)

    def _load(self, index: int) -> dict[str, torch.Tensor]:
        if self.examples is not None:
            row = self.examples[index]
            return {"input_ids": torch.tensor(row["input_ids"]), "loss_mask": torch.tensor(row["loss_mask"])}
        return self.store.get(index)

    def build(self, indices: list[int]) -> MicroBatch:
        """The TTT micro-batch of samples ``indices`` for this rank."""
        samples = [self._load(i) for i in indices]
        tokens = [(s["input_ids"].long(), s["loss_mask"].long()) for s in samples]
        seq = round_up(max(len(ids) for ids, _ in tokens), self.seq_divisor)
        b = len(indices)
        input_ids = torch.zeros(b, seq, dtype=torch.long)
        loss_mask = torch.zeros(b, seq, dtype=torch.long)
        attention = torch.zeros(b, seq, dtype=torch.long)
        for row, (ids, mask) in enumerate(tokens):
            input_ids[row, :len(ids)], loss_mask[row, :len(ids)], attention[row, :len(ids)] = ids, mask, 1
        aux, last = self._hidden(samples, input_ids, attention, seq)
        in_vocab = target_in_draft_vocab(last, self.lm_head_VH.to(last.device, last.dtype), self.t2d.to(last.device),
                                         self.vocab_chunk)
        ttt = make_ttt_batch(input_ids.to(aux.device), loss_mask.to(aux.device), attention.to(aux.device),
                             aux, last, in_vocab, self.ttt_steps)
        if self.cp_size > 1:
            from recipe.parallel.cp_shard import shard_ttt_batch

            ttt = shard_ttt_batch(ttt, self.cp_size, self.cp_rank)
        ttt = ttt.to(self.device)
        ttt.aux_hidden_BSA = ttt.aux_hidden_BSA.to(self.dtype)
        ttt.target_hidden_BLH = ttt.target_hidden_BLH.to(self.dtype)
        return MicroBatch(ttt=ttt, samples=b, supervised_tokens=int(loss_mask.sum()))

    def _hidden(self, samples, input_ids, attention, seq) -> tuple[torch.Tensor, torch.Tensor]:
        if self.target is not None:
            cap = self.target.capture(input_ids.to(self.target.device), attention.to(self.target.device))
            return cap.aux_hidden_BSA, cap.last_hidden_BSH
        aux_rows, last_rows = [], []
        for sample in samples:
            pad = seq - sample["aux_hidden"].shape[0]
            aux_rows.append(torch.nn.functional.pad(sample["aux_hidden"].float(), (0, 0, 0, pad)))
            last_rows.append(torch.nn.functional.pad(sample["last_hidden"].float(), (0, 0, 0, pad)))
        return torch.stack(aux_rows), torch.stack(last_rows)
