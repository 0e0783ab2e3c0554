"""The ``data`` section of the run JSON (ours, removed before DeepSpeed sees the config): how a micro-batch's
samples are laid out (docs/algorithm.md, "Packing"; ``recipe.data.packing``).

``packing``: ``"auto"`` (default), true or false; ``run.py --packing`` / ``--no-packing`` override it
(:meth:`DataOptions.with_flag`). ``packing_tokens``: the row budget in tokens (a positive integer; None, the default:
one row per micro-batch, at most micro-batch · ``--max-length`` tokens, never more positions than its padded rows).
The run narrows ``"auto"`` to false where packing would not be exact or is not faster: :meth:`DataOptions.for_target`
(an online target whose packed forward is untested) and :meth:`DataOptions.for_attention` (the untiled dense attention
block); the same rule on every device (the CPU measured 0.68x the padded step: docs/benchmarks.md, "Packing"). No
torch import: reading a config stays cheap.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipe.config_keys import DATA_SECTION, ConfigError, did_you_mean

_KEYS = ("packing", "packing_tokens")


@dataclass(frozen=True)
class DataOptions:
    """Our ``"data"`` section: ``packing`` (``"auto"``: pack a micro-batch of two or more samples where the packed rows
    hold fewer positions than the padded ones, on every layout (module docstring for where the run turns it off); true:
    pack every such micro-batch; false: one sample per right-padded row) and ``packing_tokens`` (the most tokens a
    packed row holds; None: one row per micro-batch). Packing changes the numbers only by float summation order (the
    kernels isolate the documents and every TTT shift stays inside its document)."""

    packing: bool | str = "auto"
    packing_tokens: int | None = None

    @classmethod
    def pop_from(cls, cfg: dict, path: Path | str) -> "DataOptions":
        """Remove and parse the ``data`` section of ``cfg``. Raises ConfigError naming the file and field for a
        section that is not an object, an unknown key (with the nearest valid name), a ``packing`` that is not
        true, false or "auto", or a ``packing_tokens`` that is not a positive integer (or null)."""
        section = cfg.pop(DATA_SECTION, None)
        section = {} if section is None else section
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: '{DATA_SECTION}' must be an object like {{\"packing\": \"auto\"}}")
        unknown = sorted(k for k in set(section) - set(_KEYS) if not k.startswith("_"))
        if unknown:
            hint = did_you_mean(unknown[0], _KEYS)
            raise ConfigError(f"{path}: unknown key(s) {unknown} in '{DATA_SECTION}'"
                              f"{'; did you mean ' + hint + '?' if hint else ''}; known keys: {list(_KEYS)}")
        packing = section.get("packing", cls.packing)
        if not isinstance(packing, bool) and packing != "auto":
            raise ConfigError(f"{path}: '{DATA_SECTION}.packing' must be true, false or \"auto\", got {packing!r}")
        tokens = section.get("packing_tokens", cls.packing_tokens)
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ConfigError(f"{path}: '{DATA_SECTION}.packing_tokens' must be a positive integer (tokens a packed "
                              f"row holds) or null (one row per micro-batch), got {tokens!r}")
        return cls(packing=packing, packing_tokens=tokens)

    def with_flag(self, packing: bool | None) -> "DataOptions":
        """A copy with ``run.py``'s ``--packing`` (True) / ``--no-packing`` (False) applied; None keeps the JSON's."""
        return self if packing is None else DataOptions(packing=bool(packing), packing_tokens=self.packing_tokens)

    def for_target(self, model_type: str | None, packs_documents: bool, path: Path | str) -> "DataOptions":
        """These options for an online run whose target is of ``model_type``: unchanged where its forward isolates
        packed documents (``packs_documents``: ``recipe.target.registry.TargetArch``) or packing is off; ``"auto"``
        becomes false otherwise (padded rows: exact for every target). Raises ConfigError naming the file, the field
        and the flag for packing true on such a target."""
        if packs_documents or self.packing is False:
            return self
        if self.packing is True:
            raise ConfigError(f"{path}: '{DATA_SECTION}.packing' (or run.py --packing) is true, but the online "
                              f"target's forward (model_type {model_type!r}) is not known to isolate packed documents; "
                              "use \"auto\" or false (padded rows), or train offline from a store (--hidden-states)")
        return DataOptions(packing=False, packing_tokens=self.packing_tokens)

    def for_attention(self, attention_tile_size) -> "DataOptions":
        """These options for a run whose draft attention has ``attention_tile_size`` (the resolved
        ``memory.attention_tile_size``): ``"auto"`` becomes false where it is None (untiled, the dense block scores
        every pair of a row: one packed row of the micro-batch's ΣL tokens would cost ΣL² scores against B·S² padded,
        more for any mix); otherwise unchanged."""
        if attention_tile_size is None and self.packing == "auto":
            return DataOptions(packing=False, packing_tokens=self.packing_tokens)
        return self

    def record(self) -> dict:
        """The section as JSON-able values (``run_config.json``'s ``data``)."""
        return {"packing": self.packing, "packing_tokens": self.packing_tokens}
