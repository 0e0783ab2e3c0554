"""The target at decoding time: a Hugging Face causal LM with a ``DynamicCache`` kept across calls and the EAGLE-3
aux hidden states captured by forward hooks on the chosen decoder layers (the layers' outputs, as in
``recipe.target.capture``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from recipe.target.capture import capture_layer_outputs


@dataclass
class TargetStep:
    """One cached forward over m new tokens: ``logits_SV`` [r, V] (fp32) of the last r of them (r = m unless the
    forward kept fewer rows: ``CachedTarget.forward``'s ``logits_rows``) and ``aux_SA`` [m, 3·H_t] for all m."""

    logits_SV: torch.Tensor
    aux_SA: torch.Tensor


class CachedTarget:
    """Incremental forward passes of a ``transformers`` causal LM for one sequence (batch 1).

    Args:
        model: a ``PreTrainedModel`` causal LM (e.g. ``TargetModel.model``), eval mode.
        aux_layer_ids: decoder layers whose outputs form the aux features (empty: no capture).
    ``forward(ids)`` appends tokens after the cached ones; ``crop(n)`` keeps the first ``n`` cached positions;
    ``keep(indices)`` keeps chosen cache entries (a tree's accepted path).
    """

    def __init__(self, model, aux_layer_ids: list[int] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        self.layers = model.get_decoder().layers
        self.aux_layer_ids = list(aux_layer_ids)
        self.cache = DynamicCache()

    def begin(self) -> None:
        self.cache = DynamicCache()

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    def crop(self, length: int) -> None:
        """Drop cached positions ``>= length`` (ValueError if fewer are cached)."""
        remove = len(self) - length
        if remove < 0:
            raise ValueError(f"cannot crop a target cache of {len(self)} positions to {length}")
        if remove:
            self.cache.crop(-remove)

    def keep(self, indices: list[int]) -> None:
        """Keep the cache entries at ``indices`` (increasing), in that order, in every layer. Raises ValueError for
        an index out of range or a cache layer that cannot be re-indexed (only full-attention ``DynamicLayer``s)."""
        n = len(self)
        if any(not 0 <= i < n for i in indices) or any(a >= b for a, b in zip(indices, indices[1:])):
            raise ValueError(f"cache indices must be increasing and within 0..{n - 1}, got {indices}")
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise ValueError(f"cannot re-index a {type(layer).__name__} cache layer (tree verification needs "
                                 "full-attention layers)")
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    @torch.no_grad()
    def forward(self, input_ids: list[int] | torch.Tensor, positions: list[int] | None = None,
                tree_mask: torch.Tensor | None = None, logits_rows: int | None = None) -> TargetStep:
        """Run the target over ``input_ids`` (m new tokens), extending the cache.

        ``logits_rows``: the logits of only the last r = ``logits_rows`` inputs are computed and returned (the
        model's ``logits_to_keep``: ``lm_head`` runs on those rows only); None: all m. A prefill reads one row, and
        the [m, V] fp32 logits of a long prompt would not fit (an 8B target's 128k-token prompt: 128k · 128256 ·
        4 bytes = 63 GiB, plus the model-dtype copy).

        Without ``positions``/``tree_mask``: positions ``len(self) ..`` under causal attention. With them (tree
        verification): RoPE ``positions`` [m] and ``tree_mask`` [m, m] bool (True: input i reads input j); every
        input also reads the whole cache. The mask goes to the model as a prepared 4D additive float mask
        [1, 1, m, len(self) + m] (0 readable, dtype min otherwise), which transformers passes through unchanged
        (``masking_utils``: "If the mask is already 4D, simply return as-is") to its eager or SDPA attention.
        """
        ids_BS = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, -1)
        kwargs = {}
        if tree_mask is not None:
            m, dtype = ids_BS.shape[1], self.model.dtype
            allowed = torch.ones(m, len(self) + m, dtype=torch.bool, device=self.device)
            allowed[:, len(self):] = tree_mask.to(self.device)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            kwargs["attention_mask"] = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        if positions is not None:
            kwargs["position_ids"] = torch.as_tensor(positions, dtype=torch.long, device=self.device).view(1, -1)
        if logits_rows is not None:
            if logits_rows < 1:
                raise ValueError(f"logits_rows must be >= 1, got {logits_rows}")
            kwargs["logits_to_keep"] = logits_rows
        with capture_layer_outputs(self.layers, self.aux_layer_ids) as captured:
            out = self.model(input_ids=ids_BS, past_key_values=self.cache, use_cache=True, **kwargs)
        aux = (torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)[0] if self.aux_layer_ids
               else torch.empty(ids_BS.shape[1], 0, device=self.device))
        return TargetStep(logits_SV=out.logits[0].float(), aux_SA=aux)
