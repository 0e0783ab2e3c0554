"""Process start-up for every launcher: `deepspeed`, `torchrun`, or plain `python` (one process).

The launchers export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; a plain `python run.py` has none, so
``init_distributed`` fills a one-process rendezvous on a free local port. DeepSpeed then picks the backend
(nccl on CUDA, gloo on CPU).
"""
from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local rendezvous (one-process runs, the demo's launcher, benchmarks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> tuple[torch.device, bool]:
    """Initialise torch.distributed through DeepSpeed; return (this rank's device, whether this call created the
    default process group — the caller that created it destroys it at exit; an embedding program keeps its own).

    Sets ``OMP_NUM_THREADS=1`` when the launcher left it unset and several ranks share the machine (the DeepSpeed
    launcher does not set it; oversubscribed CPU threads make multi-rank runs crawl).
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    created = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed()
    return device, created


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
