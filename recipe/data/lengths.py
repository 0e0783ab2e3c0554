"""The lengths of a run's samples against ``--max-length``: a histogram (rich), the count cut at ``--max-length``,
and the warning when ``--max-length`` is far above the longest sample.

Rule of the warning: fewer than ``RARE`` (1 %) of the samples (tokens as the chat template renders them, before
truncation) reach ``max_length / FAR_BELOW`` (FAR_BELOW = 4) tokens; in particular whenever the longest sample is
shorter than that, and a few outliers do not silence it. A run at that ``--max-length`` then pays for long-context
memory and parallelism but (almost) never trains a position beyond a quarter of it: ShareGPT's conversations are
1–2k tokens, so the 128k recipe on ShareGPT alone trains on the samples a 2k run sees. The remedies are chaining
(``--chain-conversations``, ``recipe.data.chain``) and long-document data (docs/data.md, "Long-context data").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rich.bar import Bar
from rich.console import Group
from rich.table import Table

FAR_BELOW = 4
RARE = 0.01
FIRST_EDGE = 256  # the histogram's first bin is [0, 256] tokens; each next one doubles, up to max_length


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


@dataclass
class LengthReport:
    """``lengths``: every kept sample's token count before truncation; ``max_length``: the run's ``--max-length``."""

    max_length: int
    lengths: list[int] = field(default_factory=list)

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
        if (message := self.warning()) is not None:
            parts.append(f"[bold yellow]warning[/bold yellow]: {message}")
        return Group(*parts)
