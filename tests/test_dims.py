"""ParallelDims validation/config parsing and the rank-grid math, cross-checked against DeepSpeed's ProcessTopology."""
import re

import pytest
from deepspeed.runtime.pipe.topology import ProcessTopology

from helpers.tp_reference import group_rank_lists
from recipe.parallel.dims import (ParallelDims, ParallelismOptions, RankCoord, check_tp_divides, rank_coords,
                                  seq_divisor)

GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 2, 2), (2, 3, 4), (1, 4, 2), (4, 1, 3)]


@pytest.mark.parametrize("dp,cp,tp", GRIDS)
def test_rank_grid_matches_deepspeed_topology(dp, cp, tp):
    topo = ProcessTopology(axes=["dp", "cp", "tp"], dims=[dp, cp, tp])
    for rank in range(dp * cp * tp):
        ds = topo.get_coord(rank)
        assert rank_coords(rank, dp, cp, tp) == RankCoord(ds.dp, ds.cp, ds.tp)
        c = rank_coords(rank, dp, cp, tp)
        assert (c.dp * cp + c.cp) * tp + c.tp == rank  # tp fastest, then cp, then dp
    for axis in ("dp", "cp", "tp"):
        assert group_rank_lists(axis, dp, cp, tp) == sorted(topo.get_axis_comm_lists(axis))
    assert group_rank_lists("dp_cp", dp, cp, tp) == [topo.filter_match(tp=t) for t in range(tp)]


def test_rank_grid_explicit_layout():
    # tp fastest, then cp, then dp: dp=2, cp=2, tp=2
    assert rank_coords(5, 2, 2, 2) == RankCoord(dp=1, cp=0, tp=1)
    assert group_rank_lists("tp", 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_rank_lists("cp", 2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_rank_lists("dp", 2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_rank_lists("dp_cp", 2, 2, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="outside the grid"):
        rank_coords(8, 2, 2, 2)
    with pytest.raises(ValueError, match="unknown axis"):
        group_rank_lists("pp", 2, 2, 2)


def test_dims_infer_and_derived():
    d = ParallelDims(world_size=8, tp=2, cp=2)
    assert (d.dp, d.dp_cp, d.seq_divisor) == (2, 4, 8)
    assert seq_divisor(cp=3, tp=2) == 12
    assert d.coords(5) == RankCoord(1, 0, 1)
    assert group_rank_lists("dp_cp", d.dp, d.cp, d.tp) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    one = ParallelDims(world_size=1)
    assert (one.dp, one.cp, one.tp, one.seq_divisor) == (1, 1, 1, 2)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=8, tp=2, cp=1, dp=3), "dp·cp·tp = 6 must equal world_size"),
    (dict(world_size=6, tp=4, cp=1), "cannot infer dp"),
    (dict(world_size=4, tp=0, cp=1), "tp must be an integer >= 1"),
    (dict(world_size=4, tp=2, cp=-1), "cp must be an integer >= 1"),
    (dict(world_size=4, tp=2, cp=1, dp=0), "dp must be an integer >= 1 or -1"),
])
def test_dims_errors_list_every_degree(kwargs, needle):
    with pytest.raises(ValueError) as err:
        ParallelDims(**kwargs)
    msg = str(err.value)
    assert needle in msg
    for name in ("world_size", "dp", "cp", "tp"):
        assert re.search(rf"\b{name}=-?\d+", msg), (name, msg)


def _run_dims(section, world_size, overrides=None) -> ParallelDims:
    """The layout as the run makes it: the section parsed once (``recipe.config.load_sections``), the command line's
    degrees over it and the world size applied (``RunSections.resolve``)."""
    return ParallelismOptions.from_section(section).with_overrides(overrides).dims(world_size)


def test_parallelism_section_to_dims():
    d = _run_dims({"tp_size": 2, "cp_size": 1}, world_size=4)
    assert (d.dp, d.cp, d.tp, d.cp_enabled) == (2, 1, 2, False)
    d = _run_dims({"tp_size": 2}, world_size=8, overrides={"cp_size": 2, "tp_size": None})
    assert (d.dp, d.cp, d.tp, d.cp_enabled) == (2, 2, 2, True)
    d = _run_dims(None, world_size=2, overrides={"tp_size": 2})
    assert (d.dp, d.cp, d.tp) == (1, 1, 2)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pp_size', 'tp'\].*known keys: "
                                         r"\['tp_size', 'cp_size', 'dp_size'\]"):
        _run_dims({"tp": 2, "pp_size": 1}, world_size=2)
    with pytest.raises(ValueError, match=r"'parallelism.cp_size' must be an integer >= 1, got 0"):
        _run_dims({"cp_size": 0}, world_size=2)
    with pytest.raises(ValueError, match=r"'parallelism.tp_size' must be an integer >= 1, got -2"):
        _run_dims({}, world_size=2, overrides={"tp_size": -2})
    with pytest.raises(ValueError, match=r"got '2'"):
        _run_dims({"tp_size": "2"}, world_size=2)
    with pytest.raises(ValueError, match="must equal world_size"):
        _run_dims({"tp_size": 2, "dp_size": 2}, world_size=2)


def test_check_tp_divides_names_every_bad_dimension():
    check_tp_divides(2, {"num_attention_heads": 4, "num_key_value_heads": 2, "draft_vocab_size": 32,
                         "intermediate_size": 64})
    with pytest.raises(ValueError) as err:
        check_tp_divides(4, {"num_attention_heads": 8, "num_key_value_heads": 2, "draft_vocab_size": 30,
                             "intermediate_size": 64})
    msg = str(err.value)
    assert "tp=4" in msg and "num_key_value_heads=2" in msg and "draft_vocab_size=30" in msg
    assert "num_attention_heads" not in msg and "intermediate_size" not in msg
