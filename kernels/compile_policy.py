"""The one compile policy of the recipe's compiled functions (flex attention, ``kernels.flex_attention``; the draft's
small ops, ``recipe.model.small_ops``): ``torch.compile(fn, fullgraph=True)`` that counts its compiles and never runs
the function uncompiled behind the caller's back.

Dynamo by itself falls back to running the Python function eagerly in three cases, each silently slow: past its
``recompile_limit`` (per code object), at a graph break, and (with ``suppress_errors``) when the backend fails.
:class:`CompiledFunction` calls the compiled function under ``fail_on_recompile_limit_hit=True`` and
``suppress_errors=False`` with ``fullgraph=True``, so each of them raises instead, and turns the raise into the
caller's own error class (``error``) with a message that says what would have happened and what to do
(``consequence``, ``limit_remedy``, ``failure_remedy``). Every compile (every graph handed to the backend) is counted
and logged on the caller's logger: ``"<name> compile #n (dynamic=..., backend ...): input shapes [...]"``.

Shapes. ``dynamic`` is ``torch.compile``'s own switch (True: every size symbolic from the first call; False: none,
unless marked). ``dynamic_dims`` marks chosen dims of chosen positional arguments dynamic on every call
(``torch._dynamo.maybe_mark_dynamic``), so with ``dynamic=False`` exactly those dims are symbolic and every other
size is a compile-time constant: the small ops mark their row dims (batch, sequence, rows) and keep the feature
widths (hidden, head dim, heads, vocabulary) static. Dynamo still specialises a marked size of 0 or 1, so a first
call with one batch row compiles once more at the first call with two. Duck sizing is off (``use_duck_shape=False``:
two sizes equal at the first call would otherwise share one symbol, and a guard on one would specialise both) and a
Python float argument is specialised (``specialize_float``: left symbolic, Dynamo restarts its analysis after the
backend compiled the graph, so every graph compiled twice).

The planner's fake-tensor trace (``kernels.tracing``) never compiles: with ``traced_fn`` given, a call in the tracing
mode runs it instead (the eager function: the compiled graphs keep what AOTAutograd's min-cut partitioner picks for
backward, in practice no more).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from kernels.tracing import is_tracing


class CompileError(RuntimeError):
    """A compiled function of the recipe would have run uncompiled (recompile limit, graph break, backend failure);
    the subclass says whose (``kernels.flex_attention.FlexCompileError``,
    ``recipe.model.small_ops.SmallOpsCompileError``)."""


class CompiledFunction:
    """``torch.compile(fn, dynamic=dynamic, fullgraph=True)`` that counts its compiles and raises ``error`` where
    Dynamo would fall back to ``fn`` uncompiled (module docstring).

    Args: fn the function; name what messages and logs call it; dynamic ``torch.compile``'s switch; recompile_limit
    Dynamo's ``recompile_limit`` for it (compiles of its code object); backend the Dynamo backend, a name
    ("inductor"; the CPU tests use "aot_eager" or "eager") or a backend callable; error the exception class raised
    (a :class:`CompileError`); consequence what running it uncompiled would do ("so the run stops here" included);
    limit_remedy / failure_remedy what to do about a recompile limit / a failed compile ("" for nothing);
    dynamic_dims per positional argument, the dims marked dynamic on every call (None: none); log the logger of the
    compile lines; traced_fn run instead in the tracing mode (None: compiled there too).
    Attributes: ``compiles`` (graphs compiled so far), ``calls``, ``last_shapes`` (shapes of the latest compile's
    first four tensor inputs). Calling it raises ``error`` (the Dynamo exception chained) when Dynamo hits the
    recompile limit, breaks the graph (``fullgraph``) or the backend fails.
    """

    def __init__(self, fn: Callable, *, name: str, dynamic: bool, recompile_limit: int, backend="inductor",
                 error: type[CompileError] = CompileError, consequence: str = "so the run stops here",
                 limit_remedy: str = "", failure_remedy: str = "",
                 dynamic_dims: tuple[tuple[int, ...], ...] | None = None, log: logging.Logger | None = None,
                 traced_fn: Callable | None = None):
        self.fn, self.name, self.dynamic = fn, name, dynamic
        self.recompile_limit, self.backend = recompile_limit, backend
        self.error, self.consequence = error, consequence
        self.limit_remedy, self.failure_remedy = limit_remedy, failure_remedy
        self.dynamic_dims, self.traced_fn = dynamic_dims, traced_fn
        self.log = log if log is not None else logging.getLogger(__name__)
        self.compiles = self.calls = 0
        self.last_shapes: list[tuple] = []
        self._compiled = None

    def _compile_graph(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend  # import cost: torch._dynamo.backends.registry

        self.compiles += 1
        self.last_shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)][:4]
        self.log.info("%s compile #%d (dynamic=%s, backend %s): input shapes %s", self.name, self.compiles,
                      self._dynamic_label(), self._backend_name(), self.last_shapes)
        return lookup_backend(self.backend)(gm, example_inputs)

    def _backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")

    def _dynamic_label(self):
        return self.dynamic if self.dynamic_dims is None else "marked"

    def __call__(self, *args, **kwargs):
        if self.traced_fn is not None and is_tracing():
            return self.traced_fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, backend=self._compile_graph, dynamic=self.dynamic, fullgraph=True)
        self.calls += 1
        # import cost: torch's compiler stack (dynamo, fx), loaded only when a compiled function runs
        from torch._dynamo import config as dynamo_config
        from torch._dynamo import maybe_mark_dynamic
        from torch._dynamo.exc import (BackendCompilerFailed, FailOnRecompileLimitHit, InternalTorchDynamoError,
                                       Unsupported)
        from torch.fx.experimental import _config as shape_config

        for arg, dims in zip(args, self.dynamic_dims or ()):
            for dim in dims:
                maybe_mark_dynamic(arg, dim)
        # the float arguments specialised, duck sizing off (module docstring); skipped where a torch lacks the switch
        floats = {"specialize_float": True} if hasattr(dynamo_config, "specialize_float") else {}
        duck = {"use_duck_shape": False} if hasattr(shape_config, "use_duck_shape") else {}
        try:
            with dynamo_config.patch(recompile_limit=self.recompile_limit, fail_on_recompile_limit_hit=True,
                                     suppress_errors=False, **floats), shape_config.patch(**duck):
                return self._compiled(*args, **kwargs)
        except FailOnRecompileLimitHit as exc:
            remedy = f", or {self.limit_remedy}" if self.limit_remedy else ""
            raise self.error(
                f"{self.name} reached its recompile limit ({self.recompile_limit} compiles, dynamic="
                f"{self._dynamic_label()}; latest input shapes {self.last_shapes}); {self.consequence}. Set "
                f"TORCH_LOGS=recompiles to see why it recompiled{remedy}") from exc
        except (Unsupported, BackendCompilerFailed, InternalTorchDynamoError) as exc:  # graph break, backend failure
            raise self.error(
                f"{self.name} could not be compiled ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}; "
                f"input shapes {self.last_shapes}); {self.consequence}"
                f"{'. ' + self.failure_remedy if self.failure_remedy else ''}") from exc

    def __deepcopy__(self, memo):
        """Shared, not copied: a deep copy of a model holding it (the tests' reference drafts) calls the same compiled
        function (Dynamo's cache belongs to ``fn``'s code object anyway)."""
        return self

    def stats(self) -> dict:
        """``{"compiles", "calls", "dynamic", "recompile_limit", "last_shapes"}`` (JSON-able)."""
        return {"compiles": self.compiles, "calls": self.calls, "dynamic": self._dynamic_label(),
                "recompile_limit": self.recompile_limit, "last_shapes": [list(s) for s in self.last_shapes]}


def compile_on(value, device) -> bool:
    """A compile switch resolved for ``device`` (``kernels.compile_small_ops``): true/false as given, ``"auto"`` on
    for CUDA and off elsewhere (Inductor needs a C++ compiler on the CPU, and the recipe's CPU runs are tests and
    demos). Raises ValueError for any other value."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        return torch.device(device).type == "cuda"
    raise ValueError(f'a compile switch must be true, false or "auto", got {value!r}')
