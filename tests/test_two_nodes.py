"""Two "nodes" on one machine: the same run started by two DeepSpeed launchers, as on a cluster without ssh
(``deepspeed --hostfile HOSTFILE --no_ssh --node_rank 0|1 --master_addr 127.0.0.1``; the hostfile names two hosts
of 2 slots), gloo on the CPU, tiny target, fp32 ZeRO-3 tp2·cp2 on 4 ranks. The tp groups are ranks {0, 1} and
{2, 3}, each within a node (tp ranks are adjacent, as on a cluster where tp wants the fast links); the cp ring (ranks
0 ↔ 2, 1 ↔ 3) and ZeRO's dp×cp group cross the node boundary.

- The curve equals the one-node run's (the same 4 ranks in one process group) bit for bit; every checkpoint holds
  every rank's files and a manifest that verifies; the export is complete and equals the one-node export.
- Without a shared filesystem (each launcher in its own folder, the same relative ``--output``): every rank stops at
  start-up with exit 2 and a message naming the ranks that do not see rank 0's files; nothing is trained.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.faults import same_curve
from helpers.ranks import run_ranks
from helpers.training import ROOT, run_training, train_argv, write_ds_config
from recipe.lifecycle.distributed import free_port

pytestmark = pytest.mark.slow  # two DeepSpeed launchers of 2 ranks each, and a 4-rank reference

STEPS = 4
HOSTFILE = "node-a slots=2\nnode-b slots=2\n"


def _launch(hostfile: Path, argv: list[str], cwds: tuple[Path, Path], log: Path) -> list[subprocess.Popen]:
    """Start both nodes' launchers (node rank N in folder ``cwds[N]``) with ``argv`` for run.py; their output goes
    to ``log``.N."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    procs, port = [], free_port()
    for node, cwd in enumerate(cwds):
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(ROOT / "run.py"), *argv]
        with open(f"{log}.{node}", "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen], log: Path, timeout: float = 600) -> tuple[list[int], list[str]]:
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [Path(f"{log}.{node}").read_text() for node in (0, 1)]


@pytest.fixture(scope="module")
def two_nodes(tiny_target_and_store, tmp_path_factory):
    target, store = tiny_target_and_store
    tmp = tmp_path_factory.mktemp("two_nodes")
    hostfile = tmp / "hostfile"
    hostfile.write_text(HOSTFILE)
    cfg = write_ds_config(tmp / "zero3.json", base="zero3.json", train_batch_size=4, parallelism=None)

    def argv(output):
        return train_argv(cfg, target, store, output, "--tp-size", "2", "--cp-size", "2", "--max-steps",
                          str(STEPS), "--save-every", "2", "--keep-checkpoints", "3")

    one_node = run_ranks(4, run_training, [argv(tmp / "one_node")])[0][0]
    codes, logs = _wait(_launch(hostfile, argv(tmp / "two_nodes"), (ROOT, ROOT), tmp / "two"), tmp / "two")
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    # no shared filesystem: each node's launcher in a folder of its own, --output relative to it
    nodes = (tmp / "node-a", tmp / "node-b")
    for folder in nodes:
        folder.mkdir()
    apart = _wait(_launch(hostfile, argv(Path("out")), nodes, tmp / "apart"), tmp / "apart")
    return tmp, one_node, logs, apart, nodes


def test_two_nodes_train_the_one_node_curve(two_nodes):
    tmp, one_node, logs, _, _ = two_nodes
    records = [json.loads(line) for line in (tmp / "two_nodes" / "metrics.jsonl").read_text().splitlines()]
    assert len(one_node) == STEPS and one_node[-1]["loss"] < one_node[0]["loss"]
    same_curve(one_node, records)
    # each launcher started its own node's two ranks; rank 0 is on node 0
    assert "init_distributed: launcher deepspeed, 4 process(es), rendezvous 127.0.0.1:" in logs[0]
    assert "--node_rank=1" in logs[1] and "init_distributed" not in logs[1]


def test_two_node_checkpoints_and_export_are_complete(two_nodes):
    from recipe.export import check_export, load_export
    from recipe.lifecycle.checkpoint import latest_tag
    from recipe.lifecycle.manifest import MANIFEST, verify
    from recipe.lifecycle.rng_state import rng_file

    tmp, _, _, _, _ = two_nodes
    root = tmp / "two_nodes" / "checkpoints"
    assert latest_tag(root) == f"step-{STEPS:08d}"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert not (root / ".partial").exists() or not any((root / ".partial").iterdir())
    for folder in root.glob("step-*"):
        assert verify(folder) is None, folder
        listed = set(json.loads((folder / MANIFEST).read_text())["files"])
        for rank in range(4):  # every rank's RNG and ZeRO-3 files, both nodes' ranks (tp rank r % 2, dp×cp r // 2)
            assert rng_file(rank) in listed, (folder, rank)
            for kind in ("model", "optim"):
                assert f"zero_pp_rank_{rank // 2}_mp_rank_{rank % 2:02d}_{kind}_states.pt" in listed, (folder, rank)
    assert check_export(tmp / "two_nodes" / "export") == []
    two, cfg = load_export(tmp / "two_nodes" / "export")
    one, one_cfg = load_export(tmp / "one_node" / "export")
    assert cfg == one_cfg and sorted(two) == sorted(one)
    for key in one:
        assert (two[key] == one[key]).all(), key


def test_without_a_shared_filesystem_every_rank_stops_at_start(two_nodes):
    _, _, _, (codes, logs), nodes = two_nodes
    assert codes == [2, 2], "\n".join(log[-3000:] for log in logs)
    text = " ".join(" ".join(logs).split())
    assert "error (rank 0): --output out is not one folder shared by every rank: rank(s) 2, 3" in text
    assert "error (rank 3): --output out is not one folder shared by every rank" in text
    for folder in nodes:  # nothing trained or checkpointed on either node, no probe file left
        out = folder / "out"
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
        assert not list(out.glob(".shared-probe-*"))
