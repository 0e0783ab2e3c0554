"""Process start-up: rank discovery under every launcher, and DeepSpeed's leaked /dev/shm all-reduce buffer."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.lifecycle.distributed import (EXPANDABLE_SEGMENTS, clear_stale_build_locks, default_cuda_alloc_conf,
                                      free_port, launcher_environment, release_shm_buffer)

ROOT = Path(__file__).resolve().parent.parent
MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}


def _world(rank, size, local):
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local), **MASTER}


@pytest.mark.parametrize("name, env, expected", [
    ("deepspeed", {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1"},
     _world(3, 4, 1)),
    ("torchrun", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none"}, _world(2, 4, 0)),
    # deepspeed --launcher impi: -env RANK/LOCAL_RANK per process, -genv WORLD_SIZE/MASTER_*; Hydra adds PMI_*
    ("deepspeed", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "PMI_RANK": "5", "PMI_SIZE": "8"},
     _world(5, 8, 1)),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, _world(3, 4, 1)),
    ("mvapich", {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
     _world(1, 2, 1)),
    ("mpich/impi", {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2"}, _world(6, 8, 2)),
    ("mpich/impi", {"PMI_RANK": "6", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "2"}, _world(6, 8, 2)),  # Cray PALS
    # srun -n 4 inside an allocation of 8 tasks: the step's task count is the world
    ("slurm", {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"},
     _world(3, 4, 1)),
    ("slurm", {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"}, _world(3, 4, 1)),
    # srun --mpi=pmi2: Slurm's plugin sets PMI_RANK / PMI_SIZE, the local rank is Slurm's; Cray ALPS; Flux
    ("mpich/impi", {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8",
                    "SLURM_LOCALID": "1"}, _world(5, 8, 1)),
    ("mpich/impi", {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1"}, _world(5, 8, 1)),
    ("mpich/impi", {"PMI_RANK": "5", "PMI_SIZE": "8", "FLUX_TASK_LOCAL_ID": "1"}, _world(5, 8, 1)),
    ("pmix", {"PMIX_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, _world(1, 2, 1)),
    # precedence: torchrun started by mpirun (one per node): RANK is the global rank, OMPI's the node's
    ("torchrun", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x",
                  "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     _world(5, 8, 1)),
    # mpirun / mpiexec inside a Slurm allocation: the ranks inherit their node's SLURM_PROCID; MPI wins
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, _world(3, 4, 1)),
    ("mpich/impi", {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "SLURM_PROCID": "1",
                    "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, _world(3, 4, 1)),
    # srun --mpi=pmix: PMIX_RANK without PMI_SIZE, Slurm's variables name the world
    ("slurm", {"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"},
     _world(1, 2, 1)),
])
def test_launcher_variables_map_to_torch_distributed(name, env, expected):
    environ = {**env, **MASTER, "PATH": "/usr/bin"}
    before = dict(environ)
    assert launcher_environment(environ) == (name, expected)
    assert environ == before  # only read


@pytest.mark.parametrize("env", [
    {"PATH": "/usr/bin", "HOME": "/root"},
    {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},  # exported for a later srun: not this run's rendezvous
    # the batch script of `sbatch -n 16` itself: no job step, so a plain `python run.py` there is one process
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"},
])
def test_plain_python_is_one_process_on_a_free_local_port(env):
    name, found = launcher_environment(env)
    assert name == "python"
    assert {k: found[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert 0 < int(found["MASTER_PORT"]) < 65536 and found["MASTER_PORT"] != "29500"
    assert set(found) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def test_a_task_that_sees_one_gpu_uses_it_whatever_its_local_rank():
    from recipe.lifecycle.distributed import cuda_device_index

    assert [cuda_device_index(r, 8) for r in range(8)] == list(range(8))
    assert cuda_device_index(5, 1) == 0  # srun --gpus-per-task=1
    with pytest.raises(ValueError, match="local rank 5 but this process sees 4 GPUs"):
        cuda_device_index(5, 4)


def test_world_of_one_without_master_addr_uses_a_local_rendezvous():  # srun -n1
    name, found = launcher_environment({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"})
    assert (name, found["RANK"], found["WORLD_SIZE"], found["MASTER_ADDR"]) == ("slurm", "0", "1", "127.0.0.1")
    assert int(found["MASTER_PORT"]) > 0


def test_missing_master_port_is_deepspeeds_default():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "MASTER_ADDR": "node0"}
    assert launcher_environment(env)[1] == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
    {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"},
    {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"},
    {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
])
def test_several_processes_without_master_addr_is_an_error_naming_it(env):
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set") as err:
        launcher_environment(env)
    assert ".deepspeed_env" in str(err.value) and "2 processes" in str(err.value)


def test_without_master_addr_mpi_worlds_are_left_to_deepspeeds_discovery_when_it_can_run():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    with pytest.raises(ValueError, match="install mpi4py"):
        launcher_environment(ompi)
    assert launcher_environment(ompi, mpi4py=True) == ("openmpi", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    aml = {**ompi, "AZUREML_EXPERIMENT_ID": "x"}  # DeepSpeed's patch_aml_env_for_torch_nccl_backend
    assert "MASTER_ADDR" not in launcher_environment(aml)[1]
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launcher_environment({**aml, "DLTS_JOB_ID": "y"})  # DeepSpeed skips the AML patch on DLTS
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}  # srun alone: no MPI world
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launcher_environment(slurm, mpi4py=True)


@pytest.mark.parametrize("env, message", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     r"inconsistent OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"inconsistent RANK=-1"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "2"}, r"inconsistent .*SLURM_LOCALID=2"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0", "MPI_LOCALRANKID": "0"}, r"inconsistent .*PMI_SIZE=0"),
    ({"MV2_COMM_WORLD_RANK": "one", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0"},
     r"MV2_COMM_WORLD_RANK='one' is not an integer"),
    ({"RANK": "0"}, r"RANK is set but WORLD_SIZE is not"),
    ({"PMIX_RANK": "0"}, r"PMIX_RANK is set but PMI_SIZE is not"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, r"PMI_RANK is set but MPI_LOCALRANKID or PALS_LOCAL_RANKID or .* is not"),
])
def test_inconsistent_launcher_variables_are_a_clear_value_error(env, message):
    with pytest.raises(ValueError, match=message):
        launcher_environment({**env, **MASTER})


_RANK_SCRIPT = """
import torch, torch.distributed as dist
from recipe.lifecycle.distributed import init_distributed, release_shm_buffer
device, created = init_distributed()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print("RESULT", dist.get_rank(), dist.get_world_size(), int(total.item()), created, device, flush=True)
release_shm_buffer()
dist.destroy_process_group()
"""
_LAUNCHER_PREFIXES = ("OMPI_", "MV2_", "PMI_", "PMIX_", "SLURM_", "AZUREML_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
                   "CROSS_SIZE", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID"}


@pytest.mark.slow
def test_two_processes_with_only_open_mpi_variables_form_one_world():
    """What `mpirun -n 2 -x MASTER_ADDR -x MASTER_PORT python run.py` gives each rank: no RANK, only OMPI_*."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)})
             for r in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    results = sorted(line.split()[1:] for out in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == [["0", "2", "3", "True", "cpu"], ["1", "2", "3", "True", "cpu"]], "\n".join(outputs)
    assert "init_distributed: launcher openmpi, 2 process(es)" in outputs[0]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_release_shm_buffer_removes_only_this_ranks_buffer(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # a port no real rendezvous uses
    monkeypatch.setenv("RANK", "1")
    prefix = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_"
    mine, peer = Path(prefix + "1"), Path(prefix + "0")
    try:
        mine.write_bytes(b"x")
        peer.write_bytes(b"x")
        release_shm_buffer()
        assert not mine.exists() and peer.exists()
        release_shm_buffer()  # nothing left to remove: no error
    finally:
        for path in (mine, peer):
            path.unlink(missing_ok=True)


@pytest.mark.slow
def test_run_py_reports_a_world_it_cannot_form_in_one_line(tmp_path):
    """`mpirun -n 2 python run.py ...` without MASTER_ADDR (and no mpi4py): exit 2, one message, no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0", COLUMNS="400")
    argv = [sys.executable, "run.py", "--ds_config", "ds_configs/zero0.json", "--target", str(tmp_path),
            "--data", str(tmp_path), "--output", str(tmp_path / "out")]
    proc = subprocess.run(argv, cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: openmpi launcher: 2 processes but MASTER_ADDR is not set" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_expandable_segments_are_set_on_cuda_unless_the_user_set_the_allocator():
    env = {}
    assert default_cuda_alloc_conf(env, cuda=True) == EXPANDABLE_SEGMENTS
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the user's setting wins, either name
        env = {name: "max_split_size_mb:128"}
        assert default_cuda_alloc_conf(env, cuda=True) == "max_split_size_mb:128"
        assert env == {name: "max_split_size_mb:128"}
    env = {}
    assert default_cuda_alloc_conf(env, cuda=False) is None and env == {}  # CPU: nothing to set



def test_a_killed_builds_lock_is_removed_and_a_live_one_kept(tmp_path, capsys):
    """torch's extension build waits with no timeout while ``<build dir>/lock`` exists: one older than the build can
    take is a killed build's and goes; a fresh one (a build running now in another process) stays."""
    stale, live = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert clear_stale_build_locks(str(tmp_path), max_age_s=1200) == [str(stale)]
    assert not stale.exists() and live.exists() and (tmp_path / "py311_cpu" / "deepspeed_shm_comm").is_dir()
    err = capsys.readouterr().err
    assert "stale build lock" in err and str(stale) in err
    assert clear_stale_build_locks(str(tmp_path), max_age_s=1200) == []
