"""The positions a run trains against the context the target serves (docs/algorithm.md, "Positions").

The draft rotates its queries and keys with the target's RoPE (``rope_theta``, ``rope_scaling``) and is exported with
the target's ``max_position_embeddings``, so a serving engine gives it the target's context. What the draft has
learnt is bounded by the longest sample it was trained on: the run plan states that length against the target's
``max_position_embeddings`` and warns when it is far shorter (:data:`FAR_SHORTER`), and ``run_config.json`` records
both (``"positions"``).

``--position-offset-max N`` (:func:`anchor_offset_positions`): anchor-offset position indices after LongSpec
(arXiv 2502.17421), so short samples teach long relative distances: the draft's position ids of a training sample
keep their first :data:`SINK_POSITIONS` values and the rest are shifted by one random offset in [0, N] for the
sample. The shift is monotone, so causality (which compares anchor positions) is unchanged; only RoPE sees it.
"""
from __future__ import annotations

import torch

FAR_SHORTER = 4
"""Warn when the longest training sample times this is still below the target's ``max_position_embeddings``: a 2k
draft of a 128k target (64x) warns, a 32k one (4x) does not. Published drafts trained at 2k lose much of their
acceptance by 8k of context."""


SINK_POSITIONS = 4
"""Positions 0..3 of every sample keep their ids under ``--position-offset-max`` (the attention sinks)."""


def anchor_offset_positions(indices: list[int], seq: int, offset_max: int, seed: int,
                            sinks: int = SINK_POSITIONS) -> torch.Tensor:
    """[B, S] int64 position ids of the samples ``indices`` (dataset indices, one row each) padded to ``seq``:
    ``p`` for ``p < sinks``, ``p + o`` after, with ``o`` drawn uniformly from [0, ``offset_max``] by a generator
    seeded with (``seed``, the sample's index): the same sample gets the same offset on every rank and in every
    layout. ``offset_max`` 0 gives ``arange(seq)`` in every row. Raises ValueError for a negative ``offset_max``."""
    if offset_max < 0:
        raise ValueError(f"position offset maximum must be >= 0, got {offset_max}")
    out = torch.arange(seq, dtype=torch.int64).repeat(len(indices), 1)
    if offset_max:
        for row, index in enumerate(indices):
            gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (1 << 63))
            out[row, sinks:] += int(torch.randint(0, offset_max + 1, (1,), generator=gen))
    return out


def longest_sample(builder) -> int:
    """Tokens of the longest training sample of a ``recipe.train.batches.BatchBuilder`` (:func:`longest_of`)."""
    return longest_of(builder.examples, builder.store)


def longest_of(examples, store) -> int:
    """Tokens of the longest sample of a store's index (offline, ``store`` not None) or of the examples'
    ``input_ids`` lengths (online, computed by Arrow without reading the tokens out); 0 when there are none."""
    if store is not None:
        return max(store.lengths, default=0)
    import pyarrow.compute as pc  # import cost: pyarrow

    lengths = pc.list_value_length(examples.with_format("arrow")["input_ids"])
    return int(pc.max(lengths).as_py() or 0)


def position_plan(longest: int, draft_config) -> dict:
    """The ``run_config.json`` record: ``longest_sample_tokens``, the target's ``max_position_embeddings``,
    ``rope_theta`` and ``rope_scaling`` the draft trains and is exported with, and ``far_shorter`` (the warning's
    condition: ``FAR_SHORTER · longest < max_position_embeddings``)."""
    serve = int(draft_config.max_position_embeddings)
    return {"longest_sample_tokens": int(longest), "max_position_embeddings": serve,
            "rope_theta": draft_config.rope_theta, "rope_scaling": draft_config.rope_scaling,
            "far_shorter": FAR_SHORTER * int(longest) < serve}


def position_lines(plan: dict) -> list[str]:
    """The run-plan line (and the warning when ``plan["far_shorter"]``) for a :func:`position_plan` record."""
    scaling = plan["rope_scaling"]
    rope = f"rope_theta {plan['rope_theta']:g}" + (
        f", {scaling.get('rope_type', scaling.get('type'))} scaling factor {scaling.get('factor')}" if scaling else "")
    longest, serve = plan["longest_sample_tokens"], plan["max_position_embeddings"]
    lines = [f"positions: longest training sample {longest:,} tokens; the target serves up to "
             f"max_position_embeddings {serve:,} ({rope}), which the export keeps"]
    if plan["far_shorter"]:
        lines.append(f"[yellow]warning[/yellow]: the longest training sample ({longest:,} tokens) is far shorter "
                     f"than the context the target serves ({serve:,}): the draft never attends over longer "
                     "distances in training and its acceptance is expected to fall in long conversations; train on "
                     "longer samples (--max-length and long data, docs/data.md)")
    return lines


def run_positions(parts) -> dict:
    """:func:`position_plan` of a built run (``recipe.train.setup.RunParts``)."""
    return position_plan(longest_sample(parts.builder), parts.draft_config)
