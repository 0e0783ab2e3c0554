"""The project's host-facing collectives: flags, counts and sums agreed over a process group, on the run's device.

NCCL communicates CUDA tensors only; gloo takes CPU tensors. A flag or a count made on the CPU and handed to
``torch.distributed`` therefore passes every CPU (gloo) test and stops the first CUDA (NCCL) run. :class:`Collectives`
is the one way the project issues such collectives: every tensor is copied onto the run's device before the call
(CUDA under NCCL, CPU under gloo; one code path for both), checked to be there (:meth:`Collectives.check`, raising
:class:`CollectiveDeviceError`), and the result comes back to the caller's device. The run's
``recipe.parallel.topology.ParallelState`` owns one (``pstate.comm``); the dump, which has no parallel layout, makes
its own.

Not routed through here: the autograd collectives of tensor parallelism (``recipe.parallel.mappings``,
``recipe.parallel.tp_layers``) and the ring's send/recv (the ring kernel's ``RingExchange``), which communicate the
activations themselves and so run on their device; and DeepSpeed's own. ``tests/test_collectives.py`` walks the
source tree and fails on a ``torch.distributed`` collective called anywhere else.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class CollectiveDeviceError(RuntimeError):
    """A tensor about to enter a collective is not on the run's device (NCCL would reject it or hang)."""


def backend_device(group=None) -> torch.device:
    """The device the backend of ``group`` (default: the world) communicates on: ``cuda:<current device>`` under
    NCCL, else the CPU (gloo, or no process group at all)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives:
    """Small collectives over ``torch.distributed`` groups with every tensor on ``device`` (see the module docstring).

    Args:
        device: the run's device (a ``cuda`` device without an index means the current CUDA device).
    ``group=None`` in every method means the default (world) group. Each method is a collective: every rank of the
    group calls it, in the same order. Raises CollectiveDeviceError (see :meth:`check`).
    """

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def check(self, *tensors: torch.Tensor) -> None:
        """The runtime guard: CollectiveDeviceError naming the device unless every tensor is on ``self.device``."""
        for t in tensors:
            if t.device != self.device:
                raise CollectiveDeviceError(f"a {tuple(t.shape)} {t.dtype} tensor on {t.device} was about to enter a "
                                            f"collective of a run on {self.device}")

    def _all_reduce(self, values: torch.Tensor, op, group) -> torch.Tensor:
        home = values.device
        work = values.detach().to(self.device, copy=True)
        self.check(work)
        dist.all_reduce(work, op=op, group=group)
        return work.to(home)

    def sum(self, values: torch.Tensor, group=None) -> torch.Tensor:
        """Element-wise sum of ``values`` (any shape, dtype and device) over ``group``; a new tensor on the device
        ``values`` came from (``values`` itself is left unchanged)."""
        return self._all_reduce(values, dist.ReduceOp.SUM, group)

    def all_gather(self, values: torch.Tensor, group=None, out: list[torch.Tensor] | None = None
                   ) -> list[torch.Tensor]:
        """``[values of rank 0, values of rank 1, ...]`` of ``group``: every rank's tensor of the same shape and dtype,
        on the device ``values`` came from (no copy when that is the run's device, as activations are). ``out``: one
        contiguous tensor per rank on the run's device to receive them (views of a larger buffer, so the caller
        places the pieces without another copy); returned as given."""
        home = values.device
        work = values.detach().to(self.device).contiguous()
        received = out if out is not None else [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
        self.check(work, *received)
        dist.all_gather(received, work, group=group)
        return received if out is not None else [t.to(home) for t in received]

    def any(self, flag: bool, group=None) -> bool:
        """True on every rank iff ``flag`` is true on some rank of ``group`` (an int32 MAX all-reduce)."""
        return bool(self._all_reduce(torch.tensor([int(bool(flag))], dtype=torch.int32), dist.ReduceOp.MAX,
                                     group).item())

    def any_each(self, flags: list[bool], group=None) -> list[bool]:
        """Element-wise :meth:`any` of several flags in one int32 MAX all-reduce: entry i is True on every rank iff
        ``flags[i]`` is true on some rank of ``group`` (every rank passes as many flags)."""
        agreed = self._all_reduce(torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32), dist.ReduceOp.MAX,
                                  group)
        return [bool(v) for v in agreed.tolist()]

    def barrier(self, group=None) -> None:
        """Return once every rank of ``group`` has arrived: an all-reduce of one int32 on the run's device whose
        result is read back on the host (so the call blocks under NCCL too, whose collectives are asynchronous)."""
        self.sum(torch.zeros(1, dtype=torch.int32), group).item()

    def all_gather_object(self, obj, group=None) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` of ``group`` (picklable objects; ``dist.all_gather_object``).

        torch serialises the objects into tensors on ``torch.cuda.current_device()`` under NCCL, so that must be
        the run's device: CollectiveDeviceError otherwise (``torch.cuda.set_device`` was not called, or another one).
        """
        if dist.get_backend(group) == "nccl":
            current = torch.device("cuda", torch.cuda.current_device())
            if current != self.device:
                raise CollectiveDeviceError(f"all_gather_object under NCCL would serialise on {current}, but the run "
                                            f"is on {self.device}: call torch.cuda.set_device({self.device}) first")
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
