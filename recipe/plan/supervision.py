"""The supervised fraction of a run's data, measured for the planner: the share of the tokens the loss reads, which
decides what ``memory.sparse_anchors`` saves (``recipe.model.sparse_anchors``: TTT steps computed only at the
anchors the loss reads). ``python -m recipe.plan --data FILES`` plans the long-prompt/short-answer mask of that
fraction (``recipe.plan.spec.fraction_mask``) beside the dense plan when ``--supervised-fraction`` is not given.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataSupervision:
    """What the measurement read: ``examples`` samples of ``tokens`` tokens (int), ``supervised`` of them in the
    loss mask; ``fraction`` = supervised / tokens (float in (0, 1]); the data sources, the cut ``max_length``
    (tokens), the records read per file (``limit``, None: all) and the rows skipped (bad records, counted by
    ``recipe.data.examples``)."""

    fraction: float
    supervised: int
    tokens: int
    examples: int
    skipped: int
    sources: list[str]
    max_length: int
    limit: int | None

    def as_json(self) -> dict:
        return asdict(self)


def _tokenizer_folder(target: Path) -> Path:
    """The folder holding ``target``'s tokenizer: ``target`` itself, or the folder of a ``config.json`` path."""
    target = Path(target)
    return target.parent if target.is_file() and target.suffix == ".json" else target


def measure_supervision(data: list[str], target: Path, max_length: int, limit: int | None = None,
                        columns: dict[str, str] | None = None, weights: list[float] | None = None,
                        chain: int | None = None, seed: int = 0, cache_dir: str | None = None) -> DataSupervision:
    """The supervised fraction of ``data`` as the run builds its samples (``recipe.data.examples.build_examples``
    with the target's tokenizer and chat template, cut at ``max_length`` tokens, ``limit`` records per data file,
    the ``--data-column`` / ``--data-weights`` / ``--chain-conversations`` inputs and ``seed`` of run.py):
    supervised tokens / tokens over the samples kept (``recipe.data.examples.token_counts``).

    Raises ValueError (``recipe.plan.PlanError`` in the CLI) naming the input: a target folder without a tokenizer
    or chat template, a missing or unreadable data source, a source with no usable sample.
    """
    from recipe.data.examples import build_examples, token_counts  # import cost: pulls in datasets
    from recipe.target.capture import load_tokenizer  # import cost: pulls in transformers

    folder = _tokenizer_folder(target)
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as exc:  # FileNotFoundError names the folder and the missing files
        raise ValueError(f"--target {target}: the supervised fraction of --data needs the target's tokenizer: "
                         f"{str(exc).splitlines()[0]}") from None
    try:
        dataset, report = build_examples(data, tokenizer, max_length, cache_dir=cache_dir, limit=limit,
                                         columns=columns, weights=weights, seed=seed, chain=chain)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--data: {str(exc).splitlines()[0]}") from None
    tokens, supervised = token_counts(dataset)
    return DataSupervision(fraction=supervised / tokens, supervised=supervised, tokens=tokens,
                           examples=len(dataset), skipped=report.total - report.kept,
                           sources=[str(s) for s in data], max_length=max_length, limit=limit)
