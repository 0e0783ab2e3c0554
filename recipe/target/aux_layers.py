"""Which target decoder layers feed the draft (EAGLE-3's aux hidden states): the default choice and its checks.

Aux layer id ``i`` is the output of decoder layer ``i`` (0-based); see docs/algorithm.md ("Aux hidden states").
Shared by the draft config (which records the ids) and the target capture (which hooks those layers).
"""
from __future__ import annotations


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default low/mid/high aux layers ``[1, L//2 - 1, L - 4]`` for a target with ``L`` decoder layers.

    Raises ValueError when ``num_layers < 7`` (the three ids would not be distinct and increasing).
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not ids[0] < ids[1] < ids[2]:
        raise ValueError(f"default aux layer ids {ids} for a {num_layers}-layer target are not distinct (needs at "
                         "least 7 decoder layers); pass aux_layer_ids explicitly")
    return ids


def validate_aux_layer_ids(aux_layer_ids, num_layers: int) -> list[int]:
    """Return ``aux_layer_ids`` as a list of ints; ValueError if empty, duplicated or outside ``[0, num_layers)``."""
    ids = [int(i) for i in aux_layer_ids]
    if not ids:
        raise ValueError("aux_layer_ids is empty; EAGLE-3 needs the ids of the decoder layers to capture")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {ids}: {bad} outside the target's decoder layers [0, {num_layers - 1}]")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux_layer_ids {ids} contains duplicates")
    return ids
