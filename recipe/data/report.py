"""SkipReport: what became of every source record of a conversation file (kept, truncated, skipped by reason);
DataReport: the SkipReports of all data files of a run, what chaining built (``recipe.data.chain.ChainReport``) and
the samples' lengths against ``--max-length`` (``recipe.data.lengths.LengthReport``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from rich.console import Group
from rich.table import Table

from recipe.data.chain import ChainReport
from recipe.data.conversations import SKIP_REASONS
from recipe.data.lengths import LengthReport

MAX_EXAMPLE_ROWS = 5


@dataclass
class SkipReport:
    """Counts per outcome for one file.

    ``kept``: examples kept; ``truncated``: how many of the kept ones were cut to ``max_length``;
    ``skipped``: reason → count (reasons are keys of ``conversations.SKIP_REASONS``);
    ``example_rows``: reason → the first few source row numbers skipped for it;
    ``first_detail``: reason → the detail message of the first row skipped for it (e.g. ``turn 1 has from='robot'``).
    """

    path: str
    kept: int = 0
    truncated: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    example_rows: dict[str, list[int]] = field(default_factory=dict)
    first_detail: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_outcomes(cls, path: str, rows: Iterable[int], reasons: Iterable[str], truncated: Iterable[bool],
                      details: Iterable[str] | None = None):
        """Build from per-record outcomes: ``reason == ""`` means kept."""
        report = cls(path=str(path))
        counts: Counter[str] = Counter()
        rows, reasons = list(rows), list(reasons)
        details = [""] * len(rows) if details is None else details
        for row, reason, cut, detail in zip(rows, reasons, truncated, details):
            if not reason:
                report.kept += 1
                report.truncated += int(cut)
                continue
            counts[reason] += 1
            report.first_detail.setdefault(reason, detail)
            examples = report.example_rows.setdefault(reason, [])
            if len(examples) < MAX_EXAMPLE_ROWS:
                examples.append(int(row))
        report.skipped = dict(counts.most_common())
        return report

    @property
    def total(self) -> int:
        """Number of source records read."""
        return self.kept + sum(self.skipped.values())

    def table(self) -> Table:
        """A rich table: one line for kept (and truncated), one per skip reason with example rows."""
        table = Table(title=f"Conversations: {self.path}")
        table.add_column("outcome")
        table.add_column("rows", justify="right")
        table.add_column("share", justify="right")
        table.add_column("example rows / meaning")
        total = max(self.total, 1)
        table.add_row("kept", str(self.kept), f"{self.kept / total:.1%}", "")
        table.add_row("  of which truncated", str(self.truncated), f"{self.truncated / total:.1%}", "cut to max_length")
        for reason, count in self.skipped.items():
            rows = ", ".join(map(str, self.example_rows.get(reason, [])))
            table.add_row(f"skipped: {reason}", str(count), f"{count / total:.1%}",
                          f"{rows} ({SKIP_REASONS.get(reason, '')}; first: {self.first_detail.get(reason, '')})")
        table.add_row("total", str(self.total), "100.0%", "")
        return table

    def summary(self) -> str:
        """One line, e.g. ``kept 180/200 (truncated 3); skipped: bad_content 12 [rows 4, 9], ...``."""
        parts = [f"{reason} {count} [rows {', '.join(map(str, self.example_rows.get(reason, [])))}]"
                 for reason, count in self.skipped.items()]
        return f"kept {self.kept}/{self.total} (truncated {self.truncated}); skipped: {'; '.join(parts) or 'none'}"


@dataclass
class DataReport:
    """What became of every source record of every data file of a run: one :class:`SkipReport` per file, in
    reading order (``recipe.data.examples.build_examples``); ``chains``: one :class:`ChainReport` per chained file
    (``--chain-conversations``; with chaining a file's kept/truncated lines count chained samples, its skip lines
    source records); ``lengths``: the length before truncation of every kept sample of every file (before
    ``--data-weights`` mixing, which may use a part of them)."""

    files: list[SkipReport]
    chains: list[ChainReport] = field(default_factory=list)
    lengths: LengthReport | None = None

    @property
    def kept(self) -> int:
        return sum(r.kept for r in self.files)

    @property
    def truncated(self) -> int:
        return sum(r.truncated for r in self.files)

    @property
    def total(self) -> int:
        """Number of source records read over all files."""
        return sum(r.total for r in self.files)

    def table(self) -> Group:
        """The per-file tables (:meth:`SkipReport.table`), a line of totals when there are several files, a line per
        chained file (:meth:`ChainReport.summary`) and the length histogram with its warning
        (:meth:`LengthReport.table`)."""
        parts = [r.table() for r in self.files]
        if len(self.files) > 1:
            parts.append(f"all {len(self.files)} files: kept {self.kept}/{self.total} (truncated {self.truncated})")
        parts += [f"chained: {c.summary()}" for c in self.chains]
        if self.lengths is not None:
            parts.append(self.lengths.table())
        return Group(*parts)

    def summary(self) -> str:
        """One line per file: ``path: kept …; skipped: …`` (:meth:`SkipReport.summary`)."""
        return "\n".join(f"{r.path}: {r.summary()}" for r in self.files)
