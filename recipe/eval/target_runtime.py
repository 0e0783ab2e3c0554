"""The target at decoding time: a Hugging Face causal LM with a ``DynamicCache`` kept across calls and the EAGLE-3
aux hidden states captured by forward hooks on the chosen decoder layers (the layers' outputs, as in
``recipe.model.target``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from recipe.model.target import capture_layer_outputs


@dataclass
class TargetStep:
    """One cached forward over new tokens: ``logits_SV`` [m, V] (fp32) and ``aux_SA`` [m, 3·H_t] for those tokens."""

    logits_SV: torch.Tensor
    aux_SA: torch.Tensor


class CachedTarget:
    """Incremental forward passes of a ``transformers`` causal LM for one sequence (batch 1).

    Args:
        model: a ``PreTrainedModel`` causal LM (e.g. ``TargetModel.model``), eval mode.
        aux_layer_ids: decoder layers whose outputs form the aux features (empty: no capture).
    ``forward(ids)`` appends tokens after the cached ones; ``crop(n)`` keeps the first ``n`` cached positions.
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

    @torch.no_grad()
    def forward(self, input_ids: list[int] | torch.Tensor) -> TargetStep:
        """Run the target over ``input_ids`` (m new tokens at positions ``len(self) ..``), extending the cache."""
        ids_BS = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, -1)
        with capture_layer_outputs(self.layers, self.aux_layer_ids) as captured:
            out = self.model(input_ids=ids_BS, past_key_values=self.cache, use_cache=True)
        aux = (torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)[0] if self.aux_layer_ids
               else torch.empty(ids_BS.shape[1], 0, device=self.device))
        return TargetStep(logits_SV=out.logits[0].float(), aux_SA=aux)
