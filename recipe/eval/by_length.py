"""τ by context length: every draft on prompts grouped by context length (``recipe.eval.context``), the target's
prefill and greedy reference computed once per prompt for all drafts, k and the tree.

For each prompt the target runs over the prompt once (``prefill_prompt``); greedy decoding, then every draft's
chain decoding at each k and its tree decoding, continue from that prefill (the target's cache is cropped back to
the prompt between them), and each output is checked token for token against the greedy one (``MismatchError``
naming the prompt otherwise). With several drafts whose aux layers differ, the target captures the union of their
layers once and each draft reads its own columns.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from recipe.eval.context import ContextPrompt
from recipe.eval.draft_runtime import draft_window, export_aux_layer_ids, load_draft_export
from recipe.eval.length_report import length_entry, length_table
from recipe.eval.prompts import Prompt
from recipe.eval.speculative import (
    MismatchError,
    check_lossless,
    greedy_generate,
    prefill_prompt,
    speculative_generate,
)
from recipe.eval.tree import TreeSpec, tree_speculative_generate
from recipe.eval.tree_draft import EagleTreeDrafter
from recipe.model.packed_linear import pack_linear_layers
from recipe.target.capture import TargetModel
from recipe.target.runtime import CachedTarget, TargetStep


class AuxColumns:
    """A ``CachedTarget`` seen by one draft: the same cache, the aux features of that draft's layers only
    (``columns``: indices into the target's captured aux width)."""

    def __init__(self, target: CachedTarget, columns: torch.Tensor):
        self.target, self.columns = target, columns

    def __len__(self) -> int:
        return len(self.target)

    def begin(self) -> None:
        self.target.begin()

    def crop(self, length: int) -> None:
        self.target.crop(length)

    def keep(self, indices: list[int]) -> None:
        self.target.keep(indices)

    def forward(self, input_ids, positions=None, tree_mask=None, logits_rows=None) -> TargetStep:
        step = self.target.forward(input_ids, positions=positions, tree_mask=tree_mask, logits_rows=logits_rows)
        return TargetStep(logits_SV=step.logits_SV, aux_SA=step.aux_SA[:, self.columns])


def _columns(union: list[int], ids: list[int], width: int) -> torch.Tensor:
    """Aux columns of layers ``ids`` in the concatenation of ``union``'s layers (each ``width`` wide)."""
    return torch.cat([torch.arange(union.index(i) * width, (union.index(i) + 1) * width) for i in ids])


ON_MISMATCH = ("stop", "record")
"""What a speculative output that differs from greedy decoding does: raise ``MismatchError`` (stop), or go into the
length's ``mismatches`` and decoding goes on (record: a bf16 target's near-ties, where memory and time are wanted)."""


def device_peaks(device: torch.device) -> dict | None:
    """The CUDA allocator's peaks since the last reset (``max_memory_allocated`` / ``max_memory_reserved``, bytes)
    and the device's used bytes (``mem_get_info``); None on other devices."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device), "device_used": total - free}


def _checked(name: str, ref, gen, mismatches: list[str] | None):
    """``check_lossless``; with a ``mismatches`` list (``on_mismatch="record"``) the error's message goes there."""
    try:
        check_lossless(name, ref, gen)
    except MismatchError as exc:
        if mismatches is None:
            raise
        mismatches.append(str(exc))
    return gen


def max_target_positions(config) -> int | None:
    """The target's ``max_position_embeddings`` (None when its config has none)."""
    return getattr(config, "max_position_embeddings", None)


def evaluate_by_length(target_dir: str | Path, drafts: dict[str, Path], buckets: dict[int, list[ContextPrompt]],
                       ks: list[int], max_new_tokens: int, device: str | torch.device | None = None,
                       console: Console | None = None, draft_dtype: torch.dtype | None = None,
                       tree: TreeSpec | None = None, target_dtype: torch.dtype | None = None,
                       window: int | None | dict[str, int | None] = None, eos_token_id: int | None = None,
                       on_mismatch: str = "stop") -> dict:
    """τ of every draft export in ``drafts`` (label -> folder) at each k of ``ks`` and, with ``tree``, of tree
    drafting, for each context length of ``buckets`` (``{L: prompts}``, from ``recipe.eval.context``).

    ``target_dtype``: the target's dtype (None: float32 on every device, see ``recipe.eval.harness.evaluate``); ``draft_dtype`` as in
    ``recipe.eval.harness.evaluate``; ``window``: the drafts' sliding window in positions (``DraftKVCache``; None: full attention), or a
    ``{label: window}`` dict giving each draft its own;
    ``eos_token_id``: the tokenizer's EOS (decoding stops after it; None: only ``max_new_tokens`` stops);
    ``on_mismatch``: one of :data:`ON_MISMATCH`.
    Returns ``{"target", "target_dtype", "max_new_tokens", "draft_window_size" (``window`` when one for all, else
    None), "draft_dtypes", "draft_window_sizes" ({label: window}), "tree",
    "lengths": [length_entry(...), ...]}``, one entry per length in increasing order (``length_report``), each with
    ``prefill_seconds`` (the prompts' target prefills, counted in every run's ``seconds``), ``device_memory``
    (:func:`device_peaks` over that length, null off CUDA) and ``mismatches`` (empty unless recorded).
    Raises ``MismatchError`` naming the prompt when a speculative output differs from greedy decoding (with
    ``on_mismatch="stop"``), ValueError
    for an unloadable export or a prompt that with ``max_new_tokens`` and the drafted tokens would pass the target's
    ``max_position_embeddings`` (naming the prompt, its tokens and the limit).
    """
    console = console or Console(stderr=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = target_dtype or torch.float32
    aux = {label: export_aux_layer_ids(path) for label, path in drafts.items()}
    union = sorted({i for ids in aux.values() for i in ids})
    model = TargetModel(target_dir, aux_layer_ids=union, dtype=dtype, device=dev)
    limit = max_target_positions(model.config)
    extra = max(max(ks), tree.budget if tree is not None else 0) + 1
    for length, prompts in buckets.items():
        for p in prompts:
            if limit is not None and len(p.ids) + max_new_tokens + extra > limit:
                raise ValueError(f"prompt {p.name!r} at context {length}: {len(p.ids)} tokens + {max_new_tokens} new "
                                 f"+ {extra} drafted pass the target's max_position_embeddings {limit}")
    if dev.type == "cpu":
        pack_linear_layers(model.model)
    eos = eos_token_id
    target = CachedTarget(model.model, union)
    width = int(model.config.hidden_size)
    views, drafters, dtypes = {}, {}, {}
    for label, path in drafts.items():
        views[label] = AuxColumns(target, _columns(union, aux[label], width).to(dev))
        draft = load_draft_export(path, model.embed_tokens_weight, device=dev, dtype=draft_dtype)
        dtypes[label] = str(draft.fc.weight.dtype).removeprefix("torch.")
        if dev.type == "cpu":
            pack_linear_layers(draft)
        drafters[label] = EagleTreeDrafter(draft, window=draft_window(window, label))

    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch {on_mismatch!r}: choose from {', '.join(ON_MISMATCH)}")
    entries = []
    for length in sorted(buckets):
        prompts = buckets[length]
        greedy, chains, trees = [], {(lb, k): [] for lb in drafts for k in ks}, {lb: [] for lb in drafts}
        mismatches: list[str] | None = [] if on_mismatch == "record" else None
        prefill_seconds = 0.0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for p in prompts:
            shared = prefill_prompt(target, p.ids)
            prefill_seconds += shared.seconds
            ref = greedy_generate(target, p.ids, max_new_tokens, eos, shared=shared)
            greedy.append(ref)
            for label in drafts:
                view = views[label]
                own = replace(shared, aux_SA=shared.aux_SA[:, view.columns])
                for k in ks:
                    gen = speculative_generate(view, drafters[label], p.ids, k, max_new_tokens, eos, shared=own)
                    chains[label, k].append(_checked(p.name, ref, gen, mismatches))
                if tree is not None:
                    gen = tree_speculative_generate(view, drafters[label], p.ids, tree, max_new_tokens, eos,
                                                    shared=own)
                    trees[label].append(_checked(p.name, ref, gen, mismatches))
        as_prompts = [Prompt(name=p.name, category=p.category, text="") for p in prompts]
        entry = length_entry(length, prompts, as_prompts, greedy, chains, trees if tree is not None else None, tree)
        entry.update(prefill_seconds=prefill_seconds, device_memory=device_peaks(dev), mismatches=mismatches or [])
        entries.append(entry)
        console.print(f"context {length}: {len(prompts)} prompts, mean context {entry['mean_context_tokens']:.0f} "
                      f"tokens; τ = {entry['tau']:.3f} ± {entry['tau_se']:.3f}" if prompts else
                      f"context {length}: no prompts")
    console.print(length_table(entries))
    return {"target": str(target_dir), "target_dtype": str(dtype).removeprefix("torch."),
            "max_new_tokens": max_new_tokens, "draft_window_size": None if isinstance(window, dict) else window,
            "draft_dtypes": dtypes,
            "draft_window_sizes": {label: draft_window(window, label) for label in drafts},
            "tree": tree.as_dict() if tree is not None else None, "lengths": entries}
