"""Process start-up under every launcher: this process's rank, the world and the rendezvous for torch.distributed.

torch's ``env://`` rendezvous reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; ``launcher_environment``
maps the launcher's variables onto them. The first row whose rank variable is set wins (under a Slurm allocation
`mpirun`/`mpiexec` ranks also inherit SLURM_PROCID, their node's, so the MPI rows come first):

    launcher    rank / world size / local rank                                      MASTER_ADDR/PORT set by
    deepspeed   RANK / WORLD_SIZE / LOCAL_RANK (local, pdsh, --no_ssh; --launcher   the launcher
                mpich through its launcher_helper, --launcher impi)
    torchrun    the same, with TORCHELASTIC_RUN_ID                                  torchrun
    openmpi     OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE / ..._LOCAL_RANK         nobody (*)
    mvapich     MV2_COMM_WORLD_RANK / MV2_COMM_WORLD_SIZE / ..._LOCAL_RANK           nobody (*)
    mpich/impi  PMI_RANK / PMI_SIZE / a local-rank variable (below)                  nobody (*)
    slurm       SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID (srun's tasks)   nobody (*)
    pmix        PMIX_RANK / PMI_SIZE / the local-rank variables of mpich/impi       nobody (*)
    python      none of the above: one process                                      127.0.0.1, a free port

The local rank of a PMI world is the first of MPI_LOCALRANKID, PALS_LOCAL_RANKID, PMI_LOCAL_RANK, SLURM_LOCALID,
FLUX_TASK_LOCAL_ID that is set (Hydra, Cray PALS and ALPS, Slurm's pmi2, Flux).

(*) DeepSpeed's openmpi/mvapich/slurm runners export neither (its mpich/impi runners pass ``-genv MASTER_ADDR``) but
pass on the lines of ``.deepspeed_env``: put ``MASTER_ADDR=<rank 0's host>`` there, or export it yourself. A missing
MASTER_PORT is 29500 (DeepSpeed's default); a world of one (`srun -n1`) without MASTER_ADDR gets the local free-port
rendezvous, and so does every plain `python run.py` (an exported MASTER_ADDR/PORT is ignored there: two such runs on
one node would take the same port). Several MPI processes without MASTER_ADDR are left to DeepSpeed's discovery in
``deepspeed.init_distributed`` (mpi4py, or Azure ML's Open MPI variables) where it can run, else an error. DeepSpeed
then picks the backend (nccl on CUDA, gloo on CPU).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from recipe.parallel.collectives import Collectives

DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT: the runner's --master_port, mpi_discovery's
# local rank of a PMI/PMIx world: Hydra (MPICH, Intel MPI), Cray PALS, Cray ALPS, Slurm's pmi2/pmix plugins, Flux
_LOCAL = ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "FLUX_TASK_LOCAL_ID")
_LAUNCHERS = (  # name, rank variable, world-size variables, local-rank variables (the first one set is used)
    ("openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("mvapich", "MV2_COMM_WORLD_RANK", ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",)),
    ("mpich/impi", "PMI_RANK", ("PMI_SIZE",), _LOCAL),
    # only a task of a job step (srun) has SLURM_STEP_NUM_TASKS: an sbatch script itself has SLURM_PROCID=0 and the
    # allocation's SLURM_NTASKS, and a plain `python run.py` in it is one process
    ("slurm", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS",), ("SLURM_LOCALID",)),
    ("pmix", "PMIX_RANK", ("PMI_SIZE",), _LOCAL),
)
_MPI = {"openmpi", "mvapich", "mpich/impi", "pmix"}  # worlds that DeepSpeed's mpi_discovery (mpi4py) can see


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local rendezvous (one-process runs, the demo's launcher, benchmarks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _integer(environ: Mapping[str, str], name: str, launcher: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{launcher} launcher: {name}={environ[name]!r} is not an integer") from None


def launcher_ranks(environ: Mapping[str, str]) -> tuple[str, int, int, int]:
    """(the launcher that started this process, its rank, the world size, its local rank) by the module docstring's
    table; ``environ`` is only read. For tools that split work by rank without a rendezvous of their own
    (``recipe.regenerate``); :func:`launcher_environment` adds the rendezvous.

    Raises ValueError: a rank variable without its world size, or (several processes) without a local rank; a value
    that is not an integer; a world size below 1 or a rank or local rank outside [0, world size).
    """
    if "RANK" in environ:
        name = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "deepspeed"
        row = (name, "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",))
    else:
        row = next((r for r in _LAUNCHERS if r[1] in environ and (r[0] != "slurm" or r[2][0] in environ)),
                   ("python", None, (), ()))
    name, rank_var, size_vars, local_vars = row
    rank, size, local = 0, 1, 0
    if rank_var is not None:
        size_var = next((v for v in size_vars if v in environ), None)
        if size_var is None:
            raise ValueError(f"{name} launcher: {rank_var} is set but {' or '.join(size_vars)} is not: the world "
                             f"size is unknown (unset {rank_var} if no launcher started this process)")
        rank, size = _integer(environ, rank_var, name), _integer(environ, size_var, name)
        local_var = next((v for v in local_vars if v in environ), None)
        if local_var is not None:
            local = _integer(environ, local_var, name)
        elif size > 1:
            raise ValueError(f"{name} launcher: {rank_var} is set but {' or '.join(local_vars)} is not: this "
                             f"process's local rank (its device) is unknown")
        if size < 1 or not 0 <= rank < size or not 0 <= local < size:
            raise ValueError(f"{name} launcher: inconsistent {rank_var}={rank}, {size_var}={size}, "
                             f"{local_var or 'local rank'}={local}: the ranks must lie in [0, world size)")
    return name, rank, size, local


def launcher_environment(environ: Mapping[str, str], mpi4py: bool = False) -> tuple[str, dict[str, str]]:
    """(the launcher that started this process, the variables to set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) by the module docstring's table; ``environ`` is only read. No MASTER_* where the rendezvous is left
    to DeepSpeed: several MPI processes without MASTER_ADDR and ``mpi4py`` (importable here), or Azure ML's Open MPI.

    Raises ValueError: what :func:`launcher_ranks` raises; several processes without MASTER_ADDR that DeepSpeed
    cannot discover (the message says how to export it).
    """
    name, rank, size, local = launcher_ranks(environ)
    found = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local)}
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if name == "python":  # a rendezvous of its own: an exported MASTER_PORT would collide with other such runs
        found.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    elif addr:
        found.update(MASTER_ADDR=addr, MASTER_PORT=port or str(DEFAULT_PORT))
    elif size == 1:
        found.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port or str(free_port()))
    elif not ((mpi4py and name in _MPI)
              or (name == "openmpi" and "AZUREML_EXPERIMENT_ID" in environ and "DLTS_JOB_ID" not in environ)):
        raise ValueError(
            f"{name} launcher: {size} processes but MASTER_ADDR is not set: every process needs rank 0's host "
            f"address (and MASTER_PORT, else {DEFAULT_PORT}). Export it to every process: a 'MASTER_ADDR=<host>' "
            "line in ./.deepspeed_env (`deepspeed --launcher openmpi|mvapich|slurm` passes it on), `mpirun -x "
            "MASTER_ADDR=<host>`, or `export MASTER_ADDR=<host>` before `srun`; or start through `deepspeed` "
            "(pdsh, --no_ssh, --launcher mpich|impi) or torchrun, which set it"
            + (", or install mpi4py for DeepSpeed's MPI discovery" if name in _MPI else ""))
    return name, found


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The GPU of local rank ``local_rank`` among the ``visible`` ones: the local rank, or 0 when the scheduler
    gives each task one GPU of its own (``srun --gpus-per-task=1``: every task sees one). Raises ValueError when a
    rank's local rank exceeds the GPUs it sees otherwise."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise ValueError(f"local rank {local_rank} but this process sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): let each rank see all of its node's GPUs "
                     "or exactly one")


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The caching allocator's settings variables (the second is torch's newer, device-neutral name)."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def default_cuda_alloc_conf(environ=os.environ, cuda: bool | None = None) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` when CUDA is there (``cuda``; None:
    ``torch.cuda.is_available()``) and the user set neither ``ALLOC_CONF_VARS``; returns the setting in force (None
    when none is). The planner's allocator slack (``recipe.plan.states.ALLOCATOR_SLACK``) assumes expandable
    segments: with fixed-size segments, blocks freed between the K TTT steps and their recomputes are cached in
    segments a larger request cannot reuse. Must run before the first CUDA allocation (the allocator reads it
    once); ``run.py`` calls it first thing."""
    for name in ALLOC_CONF_VARS:
        if name in environ:
            return environ[name]
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return None
    environ[ALLOC_CONF_VARS[0]] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


def init_distributed(timeout=None) -> tuple[torch.device, bool]:
    """Initialise torch.distributed through DeepSpeed with the process group's ``timeout`` (a ``datetime.timedelta``;
    None: DeepSpeed's default, 30 min, ``DEEPSPEED_TIMEOUT``); return (this rank's device, whether this call created
    the default process group — the caller that created it destroys it at exit; an embedding program keeps its own).

    The rank comes from whichever launcher started the process (``launcher_environment``; rank 0 prints which), an
    initialised group is used as it is. Sets ``OMP_NUM_THREADS=1`` when the launcher left it unset and several ranks
    share the machine (the DeepSpeed launcher does not; oversubscribed CPU threads make multi-rank runs crawl).

    Raises ValueError from ``launcher_environment``, or when the group DeepSpeed's discovery formed is not the world
    the launcher described, e.g. mpi4py built for another MPI (every process alone); the group is then destroyed.
    """
    created = not dist.is_initialized()
    if created:
        name, found = launcher_environment(os.environ, mpi4py=importlib.util.find_spec("mpi4py") is not None)
        os.environ.update(found)
        if found["RANK"] == "0":
            rendezvous = f"{found['MASTER_ADDR']}:{found['MASTER_PORT']}" if "MASTER_ADDR" in found else "discovery"
            print(f"init_distributed: launcher {name}, {found['WORLD_SIZE']} process(es), rendezvous {rendezvous}",
                  file=sys.stderr, flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    import deepspeed  # import cost: deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        local_rank = cuda_device_index(local_rank, torch.cuda.device_count())
        os.environ["LOCAL_RANK"] = str(local_rank)  # DeepSpeed's engine picks its device by LOCAL_RANK too
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cpu":
        clear_stale_build_locks()
    deepspeed.init_distributed(**({} if timeout is None else {"timeout": timeout}))
    formed = (dist.get_rank(), dist.get_world_size())
    if created and formed != (int(found["RANK"]), int(found["WORLD_SIZE"])):
        dist.destroy_process_group()
        raise ValueError(f"{name} launcher described rank {found['RANK']} of {found['WORLD_SIZE']}, but the process "
                         f"group is rank {formed[0]} of {formed[1]}: set MASTER_ADDR (and MASTER_PORT) yourself")
    return device, created


STALE_BUILD_LOCK_S = 1200  # a JIT build lock older than this is a killed build's: the build takes ~2 min on 2 cores


def clear_stale_build_locks(root: str | None = None, max_age_s: float = STALE_BUILD_LOCK_S) -> list[str]:
    """Remove torch C++-extension build locks left by a killed build; returns the removed paths.

    DeepSpeed JIT-compiles its CPU shared-memory all-reduce op (``deepspeed_shm_comm``) the first time a process group
    is set up on a CPU-only machine; torch's ``cpp_extension`` holds ``<build dir>/lock`` while ninja runs (about two
    minutes on 2 cores) and every other process waits for it to go away, with no timeout. A build killed on the way
    (a job's time limit, a test timeout, Ctrl-C) leaves the file behind and every later run waits forever. The lock
    holds no process id, so its age decides: one older than ``max_age_s`` is removed (printed to stderr).
    ``root``: the extensions folder (default ``TORCH_EXTENSIONS_DIR``, else torch's default build root).
    """
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root  # import cost: torch's C++ toolchain helpers

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    removed = []
    for dirpath, _, files in os.walk(root):
        if "lock" not in files:
            continue
        lock = os.path.join(dirpath, "lock")
        try:
            if time.time() - os.stat(lock).st_mtime > max_age_s:
                os.unlink(lock)
                removed.append(lock)
                print(f"removed a stale build lock (a killed build's): {lock}", file=sys.stderr, flush=True)
        except OSError:  # another process removed it, or it is not ours to remove
            continue
    return removed


def close_process_group(device: torch.device, barrier: bool) -> None:
    """Destroy the default process group; with ``barrier`` (every rank got here normally) after a barrier, so that no
    rank tears its connections down while a peer is still inside the last collective: gloo's transport threads abort
    the process (SIGABRT, a launcher exit code of 250) when a peer's connection closes under a pending operation.
    Without ``barrier`` (an error path, where a peer may be gone) the group is destroyed at once; so it is when the
    barrier fails because a peer left on its own error path (its error is that rank's to report)."""
    if barrier and dist.get_world_size() > 1:
        try:
            Collectives(device).barrier()
        except RuntimeError:  # DistBackendError included: a peer closed its connections first
            pass
    dist.destroy_process_group()


def release_shm_buffer() -> None:
    """Remove this rank's DeepSpeed shared-memory all-reduce buffer from /dev/shm, if there is one.

    DeepSpeed's CPU backend creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
    (66 MiB of RAM) when all ranks share the machine (the deepspeed launcher sets LOCAL_SIZE) and never unlinks
    it, so every run leaks one per rank. Call at the end of the run: peers mapped it at start-up, and unlinking
    a name leaves existing mappings valid.
    """
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass


def rank0_first(fn, comm):
    """Run ``fn`` on global rank 0, then on the others (so caches written by rank 0 are hits elsewhere); the
    agreement goes through ``comm`` (the run's ``recipe.parallel.collectives.Collectives``). When ``fn`` raises on
    rank 0, the other ranks raise a ValueError with its message instead of running ``fn`` (rather than waiting for
    rank 0 forever)."""
    if dist.get_rank() == 0:
        try:
            out = fn()
        except Exception as exc:
            comm.all_gather_object(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc))
            raise
        comm.all_gather_object(None)
        return out
    failure = comm.all_gather_object(None)[0]
    if failure is not None:
        raise ValueError(failure)
    return fn()
