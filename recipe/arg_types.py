"""The argparse types every entry point shares (``run.py``, ``recipe.dump``, ``recipe.eval``, ``recipe.plan``,
``recipe.demo``, the benchmarks): integer lists, the length syntax (``4k`` = 4096 tokens), positive and
non-negative numbers, and the ``--help`` formatter that shows defaults. No project imports."""
from __future__ import annotations

import argparse


def int_list(text: str, minimum: int | None = None) -> list[int]:
    """argparse type: ``"1,2,4"`` -> [1, 2, 4]. ArgumentTypeError naming the text when a part is not an integer,
    or (with ``minimum``) when the list is empty or a value is below it."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if minimum is not None and (not values or min(values) < minimum):
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """argparse type: a non-empty ``int_list`` of values >= 1 (parallel sizes, draft-token counts)."""
    return int_list(text, minimum=1)


def parse_length(text: str, minimum: int = 1) -> int:
    """``"4k"`` -> 4096, ``"1.5k"`` -> 1536, ``"512"`` -> 512 (tokens; k = 1024), the length syntax of
    ``recipe.plan``, ``recipe.bench`` and ``recipe.eval --context-lengths``; ValueError naming the text for anything
    else or a value below ``minimum``."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * 1024 if t.endswith("k") else float(t)
    except ValueError:
        raise ValueError(f"bad length {text!r}: expected an integer or a number followed by k (e.g. 4k)") from None
    if value < minimum or value != int(value):
        what = "positive whole number of tokens" if minimum == 1 else f"whole number of tokens >= {minimum}"
        raise ValueError(f"bad length {text!r}: must be a {what}")
    return int(value)


def length_list(text: str, minimum: int = 1) -> list[int]:
    """argparse type: ``"2k,4k,512"`` -> sorted distinct lengths in tokens (k = 1024), each >= ``minimum``;
    ArgumentTypeError otherwise (also for an empty list)."""
    try:
        values = sorted({parse_length(x, minimum) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths, got {text!r}")
    return values


def context_length_list(text: str) -> list[int]:
    """argparse type of ``recipe.eval --context-lengths``: ``length_list`` that also accepts 0 (no context)."""
    return length_list(text, minimum=0)


def length(text: str) -> int:
    """argparse type: :func:`parse_length` (``"32k"`` -> 32768); ArgumentTypeError naming the text otherwise."""
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> int:
    """argparse type: an integer >= 1; ArgumentTypeError naming the value otherwise."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0; ArgumentTypeError naming the value otherwise."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0; ArgumentTypeError naming the text otherwise."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0; ArgumentTypeError naming the text otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default, except where there is none (None, False) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" not in text and "default" not in text and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS and action.option_strings):
            text += " (default: %(default)s)"
        return text
