"""The lengths of a run's samples against ``--max-length``: a histogram (rich), the count cut at ``--max-length``,
and the warning when ``--max-length`` is far above the longest sample.

Rule of the warning: fewer than ``RARE`` (1 %) of the samples (tokens as the chat template renders them, before
truncation) reach ``max_length / FAR_BELOW`` (FAR_BELOW = 4) tokens; in particular whenever the longest sample is
shorter than that, and a few outliers do not silence it. A run at that ``--max-length`` then pays for long-context
memory and parallelism but (almost) never trains a position beyond a quarter of it: ShareGPT's conversations are
1–2k tokens, so the 128k recipe on ShareGPT alone trains on the samples a 2k run sees. The remedies are chaining
(``--chain-conversations``, ``recipe.data.chain``) and long-document data (docs/data.md, "Long-context data").

With a micro-batch of more than one sample (:attr:`LengthReport.micro_batch`, set by the run) the table also states
the padding share of the positions the draft computes, padded and packed (``data.packing``;
:meth:`LengthReport.padding_shares`: the samples in a seeded shuffled order, as the sampler draws them, cut into
micro-batches, each laid out by ``recipe.data.packing.micro_batch_layout``).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from rich.bar import Bar
from rich.console import Group
from rich.table import Table

from recipe.data.packing import micro_batch_layout

FAR_BELOW = 4
RARE = 0.01
FIRST_EDGE = 256  # the histogram's first bin is [0, 256] tokens; each next one doubles, up to max_length


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


@dataclass
class LengthReport:
    """``lengths``: every kept sample's token count before truncation; ``max_length``: the run's ``--max-length``;
    ``micro_batch``, ``packing``, ``packing_tokens``, ``seq_divisor``: the run's samples per micro-batch and its
    ``data`` section (``recipe.config_data.DataOptions``; None tokens: one row a micro-batch), for the padding
    line."""

    max_length: int
    lengths: list[int] = field(default_factory=list)
    micro_batch: int = 1
    packing: bool | str = "auto"
    packing_tokens: int | None = None
    seq_divisor: int = 1

    def for_batches(self, micro_batch: int, packing: bool | str, packing_tokens: int | None,
                    seq_divisor: int = 1) -> "LengthReport":
        """Set the run's micro-batch size and ``data`` section (the padding line); returns this report."""
        self.micro_batch, self.packing, self.packing_tokens, self.seq_divisor = (micro_batch, packing, packing_tokens,
                                                                                 seq_divisor)
        return self

    def padding_shares(self, seed: int = 0) -> tuple[float, float]:
        """(padded, packed): the share of padding among the positions of the run's micro-batches, one sample per
        right-padded row and packed (under :attr:`packing`; true where it is false, so the line shows what packing
        would save); (0, 0) without samples."""
        cut = [min(n, self.max_length) for n in self.lengths]
        random.Random(seed).shuffle(cut)
        positions = {False: 0, True: 0}
        for start in range(0, len(cut), self.micro_batch):
            batch = cut[start:start + self.micro_batch]
            positions[False] += micro_batch_layout(batch, False, None, self.seq_divisor).positions
            positions[True] += micro_batch_layout(batch, self.packing or True, self.packing_tokens,
                                                  self.seq_divisor).positions
        tokens = sum(cut)
        return tuple(1 - tokens / positions[p] if positions[p] else 0.0 for p in (False, True))

    def padding_line(self) -> str | None:
        """One line with both shares (:meth:`padding_shares`) and, with a ``packing_tokens`` budget, how many
        samples (cut at ``max_length``) are longer than it: each gets a row of its own, packed with nothing; None for
        micro-batches of one sample (no padding)."""
        if self.micro_batch < 2 or not self.lengths:
            return None
        padded, packed = self.padding_shares()
        rows = "one row a micro-batch" if self.packing_tokens is None else f"rows of {self.packing_tokens} tokens"
        over = sum(min(n, self.max_length) > self.packing_tokens for n in self.lengths) if self.packing_tokens else 0
        alone = (f"; {over} of {len(self.lengths)} samples are longer than data.packing_tokens {self.packing_tokens} "
                 "and get a row of their own, packed with nothing") if over else ""
        return (f"padding: {padded:.1%} of the positions of micro-batches of {self.micro_batch} samples padded, "
                f"{packed:.1%} packed ({rows}); this run: data.packing {json.dumps(self.packing)}{alone}")

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    @property
    def truncated(self) -> int:
        """How many samples were cut at ``max_length``."""
        return sum(n > self.max_length for n in self.lengths)

    def bins(self) -> list[tuple[str, int]]:
        """``[(label, count)]``: (0, 256], (256, 512], … doubling up to ``max_length`` (the last edge), then
        ``> max_length (cut)``."""
        edges, edge = [], FIRST_EDGE
        while edge < self.max_length:
            edges.append(edge)
            edge *= 2
        edges.append(self.max_length)
        counts = [0] * (len(edges) + 1)
        for n in self.lengths:
            counts[next((b for b, e in enumerate(edges) if n <= e), len(edges))] += 1
        labels = [f"{_k(lo)}-{_k(hi)}" for lo, hi in zip([0] + edges, edges)]
        return list(zip(labels + [f"> {_k(self.max_length)} (cut)"], counts))

    def warning(self) -> str | None:
        """The far-above message (module docstring), or None."""
        quarter = -(-self.max_length // FAR_BELOW)
        reach = sum(n >= quarter for n in self.lengths)
        if not self.lengths or reach >= RARE * len(self.lengths):
            return None
        return (f"--max-length {self.max_length} is far above the samples: {reach} of {len(self.lengths)} reach "
                f"{quarter} tokens (max_length/{FAR_BELOW}; the rule: fewer than {RARE:.0%}), the longest is "
                f"{self.longest} tokens, so the run (almost) never trains the long positions it is sized for. For "
                f"long context chain conversations (--chain-conversations {_k(self.max_length)}) or add "
                "long-document data (docs/data.md, 'Long-context data'); otherwise lower --max-length")

    def table(self) -> Group:
        """The histogram as a rich table (length bin, samples, share, bar), the truncation count and the warning."""
        table = Table(title=f"Sample lengths (tokens) against --max-length {self.max_length}")
        table.add_column("tokens")
        table.add_column("samples", justify="right")
        table.add_column("share", justify="right")
        table.add_column("", width=40)
        bins = self.bins()
        top, total = max((c for _, c in bins), default=0) or 1, max(len(self.lengths), 1)
        for label, count in bins:
            table.add_row(label, str(count), f"{count / total:.1%}", Bar(top, 0, count, width=40))
        parts = [table, f"{len(self.lengths)} samples, longest {self.longest} tokens; truncated at --max-length: "
                        f"{self.truncated}"]
        if (padding := self.padding_line()) is not None:
            parts.append(padding)
        if (message := self.warning()) is not None:
            parts.append(f"[bold yellow]warning[/bold yellow]: {message}")
        return Group(*parts)
