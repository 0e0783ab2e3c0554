"""Process groups for dp × cp × tp, carved out of DeepSpeed's ``ProcessTopology``, and the mpu handed to DeepSpeed.

What DeepSpeed 0.19.8 asks of an ``mpu`` (read from runtime/engine.py, runtime/config.py, runtime/utils.py,
runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py, runtime/zero/partition_parameters.py, utils/groups.py,
utils/bwc.py), and what :class:`FlatMPU` answers:

- ``get_data_parallel_group/_world_size/_rank`` → the **dp×cp** group. DeepSpeed's ``groups`` module uses it as the
  data-parallel *and* (absent ``get_sequence_data_parallel_*``) the sequence-data-parallel group: the engine
  broadcasts initial parameters from its first rank, ZeRO 1/2/3 partition optimizer state / gradients / parameters
  over it and **average** gradients over it (divide by dp·cp), and ``DeepSpeedConfig`` takes its size as the batch
  world size (``train_batch_size = micro_batch · grad_accum · dp·cp``). ``get_data_parallel_group_ranks`` is used by
  the model-checkpointing helpers.
- ``get_model_parallel_group/_world_size/_rank`` and ``get_tensor_model_parallel_*`` → the **tp** group. Used for the
  grad-norm / overflow all-reduces (ZeRO 1/2/3 and ``clip_grad_norm_``), the checkpoint file name (mp_rank_XX) and
  the checkpoint's TP degree. In the norm, a parameter counts on every tp rank iff ``is_model_parallel_parameter(p)``
  (attribute ``tensor_model_parallel`` or ``model_parallel`` truthy), otherwise only on tp rank 0 — hence TP shards
  must be marked (tp_layers.mark_tp). ``partition_dim`` is not read by DeepSpeed; only our export reads it.
- Deliberately absent: ``get_sequence_parallel_*``, ``get_sequence_data_parallel_*`` and
  ``initialize_sequence_parallel``. With ``get_sequence_parallel_*`` present, ZeRO-3 partitioned over dp only and CP
  replicas drifted apart (docs/algorithm.md, "The flat mpu"); ``initialize_sequence_parallel`` makes ZeRO ignore
  the model-parallel group.
  Also absent: pipeline methods (pp = 1) and ``get_slice_parallel_*``.

Loss normalisation implied by this mpu: DeepSpeed averages gradients over the dp·cp ranks, so each rank must
back-propagate ``dp·cp · (its loss sum) / N_global`` for the averaged gradient to be that of the global mean loss
(N_global = valid positions over all ranks and micro-batches). TP ranks compute the same replicated loss; no tp
factor is needed. The training loop does this scaling.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import ProcessTopology

from recipe.parallel.collectives import Collectives, backend_device
from recipe.parallel.dims import AXES, ParallelDims


class ParallelState:
    """Owns the tp, cp, dp and dp×cp process groups of this rank (no module globals).

    Built collectively: every rank must construct it with the same ``dims`` after ``torch.distributed`` is
    initialised; every rank calls ``dist.new_group`` for every group of every axis in the same order. Raises
    ValueError when ``dims.world_size`` differs from the initialised world size.

    Attributes: ``dims``, ``rank`` (global), ``coord`` (dp, cp, tp indices), ``topology`` (DeepSpeed's), ``device``
    (the run's device: ``device`` if given, else the backend's, ``recipe.parallel.collectives.backend_device``),
    ``comm`` (the :class:`~recipe.parallel.collectives.Collectives` on that device, through which the run issues its
    flag/count/sum collectives), and per axis in {tp, cp, dp, dp_cp, cp_tp}: ``<axis>_group``, ``<axis>_ranks``
    (global ranks of this rank's group), ``<axis>_rank`` (index in it), ``<axis>_size``. ``cp_tp`` is every
    model-parallel rank of this rank's dp replica, ordered cp-major (``cp_tp_rank = cp_rank · tp + tp_rank``): the
    group over which the online target forward is split (``recipe.target.split``).
    """

    def __init__(self, dims: ParallelDims, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelState needs torch.distributed initialised (deepspeed.init_distributed())")
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"ParallelDims.world_size={dims.world_size} but torch.distributed has "
                             f"{dist.get_world_size()} processes")
        self.dims = dims
        self.rank = dist.get_rank()
        self.comm = Collectives(backend_device() if device is None else device)
        self.device = self.comm.device
        self.topology = ProcessTopology(axes=list(AXES), dims=[dims.dp, dims.cp, dims.tp])
        coord = self.topology.get_coord(self.rank)
        self.coord = dims.coords(self.rank)
        if (coord.dp, coord.cp, coord.tp) != tuple(self.coord):
            raise AssertionError(f"rank grid mismatch with DeepSpeed's topology: {coord} vs {self.coord}")
        for axis in ("tp", "cp", "dp", "dp_cp", "cp_tp"):
            group, ranks = None, None
            for member_ranks in self._comm_lists(axis):
                new = dist.new_group(ranks=member_ranks)
                if self.rank in member_ranks:
                    group, ranks = new, member_ranks
            setattr(self, f"{axis}_group", group)
            setattr(self, f"{axis}_ranks", ranks)
            setattr(self, f"{axis}_rank", ranks.index(self.rank))
            setattr(self, f"{axis}_size", len(ranks))

    def _comm_lists(self, axis: str) -> list[list[int]]:
        if axis == "dp_cp":  # ranks sharing the tp coordinate
            return [self.topology.filter_match(tp=t) for t in range(self.dims.tp)]
        if axis == "cp_tp":  # the model-parallel ranks of one dp replica, cp-major: index cp_rank·tp + tp_rank
            return [self.topology.filter_match(dp=d) for d in range(self.dims.dp)]
        return self.topology.get_axis_comm_lists(axis)

    def mpu(self) -> "FlatMPU":
        """The object to pass as ``deepspeed.initialize(mpu=...)`` (and ``deepspeed.zero.Init(mpu=...)``)."""
        return FlatMPU(self)

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, coord={tuple(self.coord)}, tp={self.tp_ranks}, cp={self.cp_ranks}, "
                f"dp={self.dp_ranks}, dp_cp={self.dp_cp_ranks}, cp_tp={self.cp_tp_ranks})")


class FlatMPU:
    """DeepSpeed's model-parallel unit: data-parallel = dp×cp, model-parallel = tp (see the module docstring)."""

    def __init__(self, state: ParallelState):
        self._state = state

    # data parallel (what ZeRO partitions and averages over)
    def get_data_parallel_group(self):
        return self._state.dp_cp_group

    def get_data_parallel_world_size(self) -> int:
        return self._state.dp_cp_size

    def get_data_parallel_rank(self) -> int:
        return self._state.dp_cp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._state.dp_cp_ranks)

    # model parallel = tensor parallel (what the grad norm sums over)
    def get_model_parallel_group(self):
        return self._state.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self._state.tp_size

    def get_model_parallel_rank(self) -> int:
        return self._state.tp_rank

    def get_tensor_model_parallel_group(self):
        return self._state.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._state.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self._state.tp_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._state.tp_ranks[0]
