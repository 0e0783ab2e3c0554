"""The draft's small ops, eager or compiled: the RMS norms, RoPE, the SwiGLU product, the TTT merge (the causal
block's attention and the diagonal keys, ``kernels.ttt_attention.merge_diagonal``) and the soft cross-entropy
(``recipe.model.loss.soft_ce_sums``). The ``kernels`` section's ``compile_small_ops`` switch
(``recipe.config.KernelOptions``; ``"auto"``: on for CUDA, off on the CPU) picks which.

Each op is a pure function of tensors (weights are arguments, never closed over), so the modules around it stay as
they are for tensor parallelism and ZeRO-3 (their hooks gather a weight before the module's forward, which then hands
it to the op), and an op called inside ``torch.utils.checkpoint`` is recomputed as any function. The compiled ones
are ``kernels.compile_policy.CompiledFunction`` s (flex attention's policy): ``fullgraph``, every compile counted
and logged (logger ``recipe.model.small_ops``), never an uncompiled fallback. A failed compile raises
:class:`SmallOpsCompileError` naming the switch that turns them off; so does an op past its recompile limit
(:data:`SMALL_OPS_RECOMPILE_LIMIT` compiles of its code object).

Shapes (docs/architecture.md, "Compiled small ops"): static feature widths, symbolic row counts. Every size that is a
model constant (hidden H, head dim D, heads, MLP width I, draft vocabulary Vd) is a compile-time constant, so the
generated kernels are tiled for the real widths; the batch and sequence dims (B, S, a loss chunk's rows, the sparse
path's anchors) and the TTT merge's diagonal depth N are marked dynamic on every call (:data:`DYNAMIC_DIMS`), so one
graph serves every length the batch builder produces. Not length buckets: padding S up to a bucket would copy every
activation these memory-bound ops read (as much traffic as the op itself), and a compile per distinct length (the
builder pads only to a multiple of 2·cp·tp) would pass any cap within a few hundred steps. Dynamo specialises sizes 0
and 1 and guards on grad mode, dtype, strides and ``requires_grad``, so each op compiles a few graphs: one batch row
(the chunked loss's [1, c, Vd]) against several, a last loss chunk of one position, an empty one (ZeRO-3's equal call
counts), N = 1 against N > 1, training against validation (no grad), a trainable input against a frozen one (the
embedding). The norm, the op with the most, compiles 7 graphs for a chunked, checkpointed training step and a
validation step of the tiny test case; micro-batches of one and of several samples in one run double that. The cap,
:data:`SMALL_OPS_RECOMPILE_LIMIT` = 32 per op, leaves room for it and stops a compile per length within 32 lengths.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Callable

import torch
from transformers.models.llama.modeling_llama import rotate_half

from kernels.compile_policy import CompiledFunction, CompileError
from kernels.ttt_attention import merge_diagonal
from recipe.model.loss import check_soft_ce_shapes, soft_ce, soft_ce_sums

SWITCH = "kernels.compile_small_ops"
"""The run config field that turns the compiled small ops on and off (``recipe.config.KernelOptions``)."""

SMALL_OPS_RECOMPILE_LIMIT = 32
"""Compiles of one small op (of its code object) allowed in one process before :class:`SmallOpsCompileError`
(Dynamo's ``recompile_limit`` for it; module docstring, "Shapes")."""

log = logging.getLogger(__name__)


class SmallOpsCompileError(CompileError):
    """A compiled small op would run uncompiled (recompile limit, graph break, backend failure); the message names the
    op, its input shapes and the switch that runs the small ops uncompiled."""


def rms_norm(x_BSH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' ``LlamaRMSNorm`` computes it: ``weight · (x / sqrt(mean(x², -1) + eps))``, the
    normalisation in float32 and cast back to x's dtype before the weight. x [..., H], weight [H]; returns [..., H]
    in the promoted dtype of weight and x."""
    x32 = x_BSH.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight_H * x32.to(x_BSH.dtype)


def rope(x_BHSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """RoPE of one of q or k, as transformers' ``apply_rotary_pos_emb`` computes it (``x·cos + rotate_half(x)·sin``,
    cos/sin [B, S, D] broadcast over the heads of x [B, H, S, D]); returns [B, H, S, D]."""
    return (x_BHSD * cos_BSD.unsqueeze(1)) + (rotate_half(x_BHSD) * sin_BSD.unsqueeze(1))


def act_mul(gate_BSI: torch.Tensor, up_BSI: torch.Tensor, act: torch.nn.Module) -> torch.Tensor:
    """The gated MLP's product ``act(gate) · up`` (SwiGLU with ``act`` = SiLU), [B, S, I] each; ``act`` the config's
    activation module (``transformers.activations.ACT2FN[hidden_act]``; a compiled graph is guarded on its type).
    Its ``forward`` is called, not the module: it has no parameters, and the hooks DeepSpeed ZeRO-3 puts on every
    module are excluded from compilation (``torch.compiler.disable``), so calling them would break the graph."""
    return act.forward(gate_BSI) * up_BSI


@dataclass(frozen=True)
class CheckedSoftCE:
    """``soft_ce`` (``(logits_BSV, target_logits_BSV, valid_BS) -> (loss_sum, correct)``) with its shape check in
    Python and its arithmetic through ``sums`` (the compiled ``soft_ce_sums``)."""

    sums: Callable

    def __call__(self, logits_BSV, target_logits_BSV, valid_BS):
        check_soft_ce_shapes(logits_BSV, target_logits_BSV, valid_BS)
        return self.sums(logits_BSV, target_logits_BSV, valid_BS)


@dataclass(frozen=True)
class SmallOps:
    """The small ops the draft's modules and the TTT model call (module docstring); the defaults are the eager ones.

    ``rms_norm(x, weight, eps)``, ``rope(x_BHSD, cos, sin)``, ``act_mul(gate, up, act)``, ``ttt_merge(out, lse, q,
    k_BHkvSND, v_BHkvSND) -> (out, lse)`` (``kernels.ttt_attention.merge_diagonal``), ``soft_ce(logits, target,
    valid) -> (loss_sum, correct)`` (the single-device loss; under tensor parallelism the vocab-parallel one,
    ``recipe.parallel.tp_layers.vocab_parallel_soft_ce``, takes its place uncompiled: it all-reduces between its
    steps). ``compiled``: whether they are the compiled ones.
    """

    rms_norm: Callable = rms_norm
    rope: Callable = rope
    act_mul: Callable = act_mul
    ttt_merge: Callable = merge_diagonal
    soft_ce: Callable = soft_ce
    compiled: bool = False

    def compiled_functions(self) -> dict[str, CompiledFunction]:
        """``{op name: CompiledFunction}`` of the compiled ops (empty for the eager set)."""
        out = {}
        for f in fields(self):
            op = getattr(self, f.name)
            op = op.sums if isinstance(op, CheckedSoftCE) else op
            if isinstance(op, CompiledFunction):
                out[f.name] = op
        return out

    def stats(self) -> dict:
        """``{op name: CompiledFunction.stats()}`` (JSON-able; empty for the eager set)."""
        return {name: op.stats() for name, op in self.compiled_functions().items()}


EAGER_SMALL_OPS = SmallOps()
"""The eager small ops: the modules' default (``compile_small_ops`` false)."""

_ROWS_3D = ((0, 1),)  # [B, S, ...]: batch and sequence dynamic
DYNAMIC_DIMS = {
    "rms_norm": _ROWS_3D,
    "rope": ((0, 2), (0, 1), (0, 1)),
    "act_mul": _ROWS_3D * 2,
    "ttt_merge": ((0, 2), (0, 2), (0, 2), (0, 2, 3), (0, 2, 3)),
    "soft_ce": _ROWS_3D * 3,
}
"""Per op, per tensor argument, the dims marked dynamic (the row dims; module docstring, "Shapes")."""


def compile_small_ops(backend="inductor", recompile_limit: int = SMALL_OPS_RECOMPILE_LIMIT) -> SmallOps:
    """A fresh compiled set (each op a ``CompiledFunction`` on ``backend``: "inductor" in runs; the CPU tests use
    "aot_eager", AOTAutograd's joint graph without code generation). Prefer :func:`process_small_ops`: Dynamo's
    cache and recompile count belong to each op's code object, so two sets in one process share them."""
    eager = {"rms_norm": rms_norm, "rope": rope, "act_mul": act_mul, "ttt_merge": merge_diagonal,
             "soft_ce": soft_ce_sums}

    def compiled(name: str) -> CompiledFunction:
        return CompiledFunction(
            eager[name], name=f"small op {name}", dynamic=False, recompile_limit=recompile_limit, backend=backend,
            error=SmallOpsCompileError, dynamic_dims=DYNAMIC_DIMS[name], log=log, traced_fn=eager[name],
            consequence="it is not run uncompiled behind your back, so the run stops here",
            limit_remedy=f'set "compile_small_ops": false in the kernels section of the DeepSpeed JSON '
                         f"({SWITCH}) to run the small ops uncompiled",
            failure_remedy=f'Set "compile_small_ops": false in the kernels section of the DeepSpeed JSON '
                           f"({SWITCH}) to run the small ops uncompiled")

    return SmallOps(rms_norm=compiled("rms_norm"), rope=compiled("rope"), act_mul=compiled("act_mul"),
                    ttt_merge=compiled("ttt_merge"), soft_ce=CheckedSoftCE(compiled("soft_ce")), compiled=True)


_PROCESS: dict = {}


def process_small_ops(backend="inductor") -> SmallOps:
    """The process's compiled set on ``backend`` (created on first use; one per backend, module docstring)."""
    if backend not in _PROCESS:
        _PROCESS[backend] = compile_small_ops(backend)
    return _PROCESS[backend]


def small_ops_stats() -> dict:
    """The counters of the process's compiled set on "inductor", the one runs use (:meth:`SmallOps.stats`); empty
    before its first use."""
    ops = _PROCESS.get("inductor")
    return {} if ops is None else ops.stats()


def install_small_ops(model, ops: SmallOps):
    """Make the TTT ``model``'s draft call ``ops``: its norms, attention (RoPE, TTT merge) and MLP, and the model's
    loss where it is the single-device ``soft_ce`` (the vocab-parallel loss of tp > 1 is kept). Returns ``model``."""
    draft = model.draft
    for module in draft.modules():
        if "ops" in type(module).__dict__:  # the draft's modules that call small ops (recipe.model.draft)
            module.ops = ops
    if model.loss_fn is soft_ce or isinstance(model.loss_fn, CheckedSoftCE):
        model.loss_fn = ops.soft_ce
    return model
