"""Tensor-parallel linear layers and the vocab-parallel soft cross-entropy.

Every layer is built from the FULL single-device ``nn.Linear`` and keeps this rank's contiguous shard, so all layouts
start from the same weights for the same seed. Sharded parameters carry ``tensor_model_parallel = True`` (read by
DeepSpeed's ``is_model_parallel_parameter`` so the global grad norm sums each shard once), and ``partition_dim``
(the dim our export and the layout-free checkpoint gather along).

Shapes: ``tp`` = size of the tensor-parallel group, ``r`` = this rank in it; shard ``r`` of a dim of size n is
``[r·n/tp, (r+1)·n/tp)``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recipe.parallel.mappings import copy_to_tp_region, group_rank, group_size, reduce_from_tp_region


def shard_tensor(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous shard of ``full`` along ``dim`` (a detached copy). ValueError unless tp divides it."""
    size = group_size(group)
    if full.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is not divisible by the tensor-parallel size {size}")
    return full.detach().chunk(size, dim=dim)[group_rank(group)].clone()


def mark_tp(tensor: torch.Tensor, partition_dim: int) -> torch.Tensor:
    """Tag ``tensor`` as a TP shard along ``partition_dim`` (the attributes DeepSpeed and our export read)."""
    tensor.tensor_model_parallel = True
    tensor.partition_dim = partition_dim
    return tensor


def gather_tensor(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along ``dim`` in rank order (a new detached tensor, no autograd)."""
    shard = shard.detach().contiguous()
    if group_size(group) == 1:
        return shard.clone()
    parts = [torch.empty_like(shard) for _ in range(group_size(group))]
    dist.all_gather(parts, shard, group=group)
    return torch.cat(parts, dim=dim)


class _ShardedLinear(nn.Module):
    partition_dim: int

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.group = group
        self.tp_size = group_size(group)
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, tp={self.tp_size}, partition_dim={self.partition_dim}"


class ColumnParallelLinear(_ShardedLinear):
    """``y = x Wᵀ + b`` with W [out, in] split along out (partition_dim 0).

    Input x [..., in] replicated over the group; output [..., out/tp], this rank's columns (not gathered). Backward
    sums dx over the group (``copy_to_tp_region``). Bias, if any, is split like the output. ``enter_region=False``
    skips the mapping: the caller has applied ``copy_to_tp_region`` once for several layers reading the same x (the
    tiled MLP, ``recipe.parallel.apply_tp.mlp_tiling``).
    """
    partition_dim = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, group) -> "ColumnParallelLinear":
        """Keep this rank's rows of the full ``linear.weight`` [out, in] (and bias [out])."""
        bias = None if linear.bias is None else shard_tensor(linear.bias, 0, group)
        layer = cls(shard_tensor(linear.weight, 0, group), bias, group)
        for p in (layer.weight, layer.bias):
            if p is not None:
                mark_tp(p, 0)
                p.requires_grad_(linear.weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor, enter_region: bool = True) -> torch.Tensor:
        return F.linear(copy_to_tp_region(x, self.group) if enter_region else x, self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = x Wᵀ + b`` with W [out, in] split along in (partition_dim 1).

    Input x [..., in/tp] already sharded (the output of a column-parallel layer); the partial products are summed over
    the group (``reduce_from_tp_region``); output [..., out] replicated. Bias, if any, is replicated and added once
    after the sum (it is not a TP parameter). ``reduce=False`` returns this rank's partial product ``x Wᵀ`` [..., out]
    without the all-reduce (and without the bias): the caller sums once over the group, e.g. after concatenating
    sequence tiles (``recipe.parallel.apply_tp.mlp_tiling``); ValueError then if the layer has a bias.
    """
    partition_dim = 1

    @classmethod
    def from_linear(cls, linear: nn.Linear, group) -> "RowParallelLinear":
        """Keep this rank's columns of the full ``linear.weight`` [out, in]; copy the bias whole."""
        weight = shard_tensor(linear.weight, 1, group)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        layer = cls(weight, bias, group)
        mark_tp(layer.weight, 1)
        for p in (layer.weight, layer.bias):
            if p is not None:
                p.requires_grad_(linear.weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if not reduce:
            if self.bias is not None:
                raise ValueError("RowParallelLinear(reduce=False) returns partial sums: a bias would be added tp times")
            return F.linear(x, self.weight)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelLMHead(ColumnParallelLinear):
    """The draft's lm_head [Vd, H] split along the draft vocabulary: rank r scores draft ids
    ``[vocab_start, vocab_end)``. Output: logits shard [..., Vd/tp]; feed it to :func:`vocab_parallel_soft_ce`."""

    @property
    def vocab_start(self) -> int:
        return group_rank(self.group) * self.weight.shape[0]

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.weight.shape[0]


class _VocabParallelSoftCE(torch.autograd.Function):
    """Σ_valid (lse(x) − E_p[x]) with p = softmax(y); both softmaxes over the vocab dim sharded across ``group``.

    Uses −Σ_v p_v log_softmax(x)_v = lse(x) − Σ_v p_v x_v (since Σ p = 1). Gradients:
    ∂/∂x = softmax(x) − p;  ∂/∂y = −p ⊙ (x − E_p[x]); both zero at invalid positions.
    """

    @staticmethod
    def forward(ctx, x, y, valid, group):
        parallel = group_size(group) > 1
        cdt = torch.promote_types(x.dtype, torch.float32)
        x_c, y_c = x.to(cdt), y.to(cdt)
        maxes = torch.stack([x_c.amax(-1), y_c.amax(-1)])               # [2, B, S]
        if parallel:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        max_x, max_y = maxes
        exp_y = torch.exp(y_c - max_y.unsqueeze(-1))
        sums = torch.stack([torch.exp(x_c - max_x.unsqueeze(-1)).sum(-1), exp_y.sum(-1), (exp_y * x_c).sum(-1)])
        if parallel:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_x, sum_y, sum_yx = sums
        lse_x = max_x + sum_x.log()
        mean_x = sum_yx / sum_y                                           # E_p[x], [B, S]
        loss_sum = torch.where(valid, lse_x - mean_x, torch.zeros_like(lse_x)).sum()

        # Global argmax = smallest global index attaining the global max (torch.argmax on the full tensor).
        offset = group_rank(group) * x.shape[-1]
        sentinel = torch.iinfo(torch.int64).max
        cand = torch.stack([
            torch.where(x_c.amax(-1) == max_x, x_c.argmax(-1) + offset, sentinel),
            torch.where(y_c.amax(-1) == max_y, y_c.argmax(-1) + offset, sentinel)])
        if parallel:
            dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
        correct = ((cand[0] == cand[1]) & valid).sum()

        # softmax = exp(v - max) / sum in backward: more accurate in fp32 than exp(v - lse) (lse carries |lse|·eps).
        ctx.save_for_backward(x, y, valid, max_x, sum_x, max_y, sum_y, mean_x)
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        x, y, valid, max_x, sum_x, max_y, sum_y, mean_x = ctx.saved_tensors
        cdt = max_x.dtype
        x_c, y_c = x.to(cdt), y.to(cdt)
        scale = (valid.to(cdt) * grad_loss).unsqueeze(-1)                  # [B, S, 1]
        p = torch.exp(y_c - max_y.unsqueeze(-1)) / sum_y.unsqueeze(-1)
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            q = torch.exp(x_c - max_x.unsqueeze(-1)) / sum_x.unsqueeze(-1)
            grad_x = ((q - p) * scale).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_y = (-p * (x_c - mean_x.unsqueeze(-1)) * scale).to(y.dtype)
        return grad_x, grad_y, None, None


def vocab_parallel_soft_ce(logits_BSVl: torch.Tensor, target_logits_BSVl: torch.Tensor, valid_BS: torch.Tensor,
                           group) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy with the draft vocabulary sharded over the tensor-parallel ``group``.

    Same contract as the single-device ``soft_ce(logits_BSV, target_logits_BSV, valid_BS)``:
    ``loss_sum = Σ_{valid (b,s)} −Σ_v softmax(target)_v · log_softmax(logits)_v`` (a 0-dim tensor, fp32 — fp64 for
    fp64 inputs) and ``correct = #valid positions where argmax(logits) == argmax(target)`` (0-dim int64; ties go to
    the smallest global index, as ``torch.argmax``). Inputs: this rank's vocab shards [B, S, Vd/tp] (equal sizes on
    every rank, rank order = vocab order), ``valid_BS`` bool/0-1 [B, S] identical on every rank. Full logits are never
    gathered: three all-reduces of [B, S]-sized tensors (max, sums, argmax). Differentiable in both logits.
    """
    if logits_BSVl.shape != target_logits_BSVl.shape:
        raise ValueError(f"logits {tuple(logits_BSVl.shape)} and target logits {tuple(target_logits_BSVl.shape)} "
                         "must have the same shape")
    if valid_BS.shape != logits_BSVl.shape[:-1]:
        raise ValueError(f"valid mask {tuple(valid_BS.shape)} must match logits {tuple(logits_BSVl.shape[:-1])}")
    return _VocabParallelSoftCE.apply(logits_BSVl, target_logits_BSVl, valid_BS.bool(), group)
