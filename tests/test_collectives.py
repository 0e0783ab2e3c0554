"""Collectives on the run's device: the source-tree check, the runtime guard, and the helpers on 2 gloo ranks.

NCCL takes CUDA tensors only, gloo takes CPU tensors, so a collective handed a CPU tensor passes every CPU test and
stops the first GPU run. Two checks catch that on a CPU-only machine:

- ``test_no_collective_outside_the_helpers`` parses the project's source (``recipe/``, ``kernels/``, ``run.py``,
  ``scripts/``) and fails on any reference to a ``torch.distributed`` (or ``deepspeed.comm``) collective outside
  ``recipe/parallel/collectives.py`` and the autograd/ring modules that communicate activations on their own device;
- the guard ``Collectives.check``, and the helpers handing the collective a tensor on the run's device whatever device
  the caller's tensor was on (tested with a run device that is not the CPU).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.ranks import run_ranks
from recipe.parallel.collectives import CollectiveDeviceError, Collectives, backend_device

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("recipe", "kernels", "run.py", "scripts")
ALLOWED = {
    "recipe/parallel/collectives.py",  # the helpers
    "recipe/parallel/mappings.py",     # TP autograd all-reduce / all-gather of activations
    "recipe/parallel/tp_layers.py",    # TP gather of shards, vocab-parallel cross-entropy statistics
    "kernels/ring_attention.py",       # the ring's K/V send/recv
}
DIST_MODULES = ("torch.distributed", "deepspeed.comm")
# every torch.distributed function that communicates (tensors or objects); each must exist in torch (checked below)
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "send_object_list",
    "recv_object_list",
}
SUBMODULES = ("nn", "_functional_collectives", "distributed_c10d")  # functional / autograd / raw collectives


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted path, from every import in the module (functions' local imports included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def collective_uses(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line name"`` for every reference to a collective of torch.distributed / deepspeed.comm in ``source``
    (calls, references such as ``dist.isend`` handed to ``P2POp``, and ``from ... import`` of one)."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # only whole chains
    found = set()
    for node in ast.walk(tree):
        paths = []
        if isinstance(node, (ast.Attribute, ast.Name)) and id(node) not in inner:
            paths.append(_dotted(node, aliases))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            paths += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            paths += [a.name for a in node.names]
        for path in filter(None, paths):
            for module in DIST_MODULES:
                if path.startswith(module + "."):
                    name = path[len(module) + 1:].split(".")[0]
                    if name in COLLECTIVES or name in SUBMODULES:
                        found.add((node.lineno, path))
    return [f"{filename}:{line} {path}" for line, path in sorted(found)]


def project_collective_uses(root: Path) -> list[str]:
    """:func:`collective_uses` over the project's source files under ``root``, the allowed modules left out."""
    files = []
    for entry in SOURCES:
        path = root / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
    out = []
    for file in files:
        rel = file.relative_to(root).as_posix()
        if rel not in ALLOWED:
            out += collective_uses(file.read_text(), rel)
    return out


def test_no_collective_outside_the_helpers():
    uses = project_collective_uses(ROOT)
    assert not uses, ("torch.distributed collectives called outside recipe/parallel/collectives.py (route them through "
                      "ParallelState.comm so their tensors are on the run's device):\n  " + "\n  ".join(uses))


def test_the_source_check_sees_every_form():
    for name in COLLECTIVES:
        assert hasattr(dist, name), f"torch.distributed.{name} does not exist: the check would never see it"
    source = """
import torch
import torch.distributed as dist
from torch import distributed as d2
from torch.distributed import all_gather_object as ago
from deepspeed import comm as dscomm
import torch.distributed.nn.functional as dfn

def f(t, group):
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)   # line 10
    torch.distributed.barrier()                              # 11
    d2.broadcast(t, 0)                                       # 12
    ago([None], 1)                                           # 13
    op = dist.P2POp(dist.isend, t, 1)                        # 14
    dscomm.all_reduce(t)                                     # 15
    dfn.all_reduce(t)                                        # 16
    return dist.get_rank(group), dist.get_world_size(), dist.is_initialized(), dist.ReduceOp.SUM
"""
    td = "torch.distributed"
    assert collective_uses(source, "x.py") == [
        f"x.py:5 {td}.all_gather_object", f"x.py:7 {td}.nn.functional", f"x.py:10 {td}.all_reduce",
        f"x.py:11 {td}.barrier", f"x.py:12 {td}.broadcast", f"x.py:13 {td}.all_gather_object",
        f"x.py:14 {td}.P2POp", f"x.py:14 {td}.isend", "x.py:15 deepspeed.comm.all_reduce",
        f"x.py:16 {td}.nn.functional.all_reduce"]


def test_the_source_check_fails_on_a_cpu_flag_in_the_loop(tmp_path):
    """What stopped the first NCCL run: a flag made on the CPU and all-reduced in the training loop."""
    (tmp_path / "recipe" / "train").mkdir(parents=True)
    (tmp_path / "recipe" / "train" / "loop.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n\ndef agreed(flag):\n"
        "    t = torch.tensor([int(flag)])\n    dist.all_reduce(t)\n    return bool(t)\n")
    assert project_collective_uses(tmp_path) == ["recipe/train/loop.py:7 torch.distributed.all_reduce"]


class _Stop(Exception):
    pass


def test_guard_rejects_a_tensor_off_the_run_device():
    comm = Collectives("meta")
    comm.check(torch.empty(3, device="meta"))
    with pytest.raises(CollectiveDeviceError, match=r"a \(3,\) torch.int32 tensor on cpu .* a run on meta"):
        comm.check(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("call", ["sum", "any", "barrier"])
def test_helpers_hand_the_collective_a_tensor_on_the_run_device(monkeypatch, call):
    """Run device "meta" (not the CPU): every helper copies the caller's CPU values there before the collective."""
    seen = []

    def fake_all_reduce(t, op=None, group=None):
        seen.append(t.device)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    comm = Collectives("meta")
    with pytest.raises(_Stop):
        {"sum": lambda: comm.sum(torch.ones(2, dtype=torch.float64)), "any": lambda: comm.any(True),
         "barrier": comm.barrier}[call]()
    assert seen == [torch.device("meta")]


def test_object_gather_under_nccl_needs_the_current_cuda_device_to_be_the_run_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    with pytest.raises(CollectiveDeviceError, match=r"serialise on cuda:1, but the run is on cuda:0"):
        Collectives("cuda:0").all_gather_object("x")
    with pytest.raises(_Stop):  # the right device: handed on to torch
        Collectives("cuda:1").all_gather_object("x")


def _helpers_worker(rank, world_size):
    comm = Collectives(backend_device())
    pair = dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    ints = comm.sum(torch.tensor([rank + 1, 10], dtype=torch.int64))
    floats = comm.sum(torch.tensor([0.25 * (rank + 1)], dtype=torch.float64), pair)
    alone = comm.sum(torch.tensor([float(rank)]), solo)
    source = torch.tensor([1.0])
    comm.sum(source)  # the caller's tensor is left as it was
    comm.barrier()
    objects = comm.all_gather_object({"rank": rank, "err": None if rank else "x"})
    return {"device": str(comm.device), "ints": ints.tolist(), "ints_dtype": str(ints.dtype), "floats": floats.tolist(),
            "alone": alone.tolist(), "source": source.tolist(), "any_rank1": comm.any(rank == 1),
            "any_none": comm.any(False), "objects": objects}


@pytest.mark.slow
def test_helpers_on_two_gloo_ranks():
    results = run_ranks(2, _helpers_worker)
    for rank, r in enumerate(results):
        assert r["device"] == "cpu" and r["ints"] == [3, 20] and r["ints_dtype"] == "torch.int64"
        assert r["floats"] == [0.75] and r["alone"] == [float(rank)] and r["source"] == [1.0]
        assert r["any_rank1"] is True and r["any_none"] is False
        assert r["objects"] == [{"rank": 0, "err": "x"}, {"rank": 1, "err": None}]
