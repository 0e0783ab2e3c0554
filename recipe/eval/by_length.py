"""The evaluation engine: τ of drafts against their target on prompts grouped by context length
(``evaluate_by_length``); plain evaluation (``evaluate``) is its one-length case.

Drafts are read by ``recipe.eval.draft_runtime.read_draft`` (every layout ``run.py --init-draft`` reads); each reads
the aux layers its config states, else the target's default ones. The target captures the union of the drafts' aux
layers once and each draft reads its own columns. For each prompt the target runs over the prompt once
(``prefill_prompt``); the greedy reference (``GreedyReference``), then every draft's chain decoding at each k and its
tree decoding, continue from that prefill (the target's cache is cropped back to the prompt between them), and each
output is checked token for token against the greedy one (``MismatchError`` naming the prompt otherwise).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoConfig

from recipe.eval.context import ContextPrompt
from recipe.eval.draft_runtime import build_draft, draft_window, read_draft
from recipe.eval.length_report import length_entry, length_table
from recipe.eval.prompts import Prompt, prompt_ids
from recipe.eval.report import category_table, tau_table
from recipe.eval.speculative import (
    Generation,
    MismatchError,
    check_lossless,
    greedy_generate,
    greedy_generate_batched,
    prefill_prompt,
    speculative_generate,
)
from recipe.eval.tree import TreeSpec, tree_speculative_generate
from recipe.eval.tree_draft import EagleTreeDrafter
from recipe.model.packed_linear import pack_linear_layers
from recipe.target.capture import TargetModel, load_tokenizer
from recipe.target.files import split_gguf
from recipe.target.runtime import CachedTarget

ON_MISMATCH = ("stop", "record")
"""What a speculative output that differs from greedy decoding does: raise ``MismatchError`` (stop), or go into the
length's ``mismatches`` and decoding goes on (record: a bf16 target's near-ties, where memory and time are wanted)."""
REFERENCE_MODES = ("sequential", "batched")
"""How the greedy reference of the lossless check is decoded (``GreedyReference``)."""


def target_config(target_dir: str | Path):
    """The target's HF config (a folder's config.json or a ``*.gguf`` file's metadata); FileNotFoundError naming a
    missing path."""
    folder, kwargs = split_gguf(target_dir)
    return AutoConfig.from_pretrained(folder, **kwargs)


def prompt_token_limit(config, max_new_tokens: int, ks: list[int], tree: TreeSpec | None) -> int | None:
    """The most prompt tokens that leave room, within the target's ``max_position_embeddings``, for
    ``max_new_tokens`` and one verification of the most drafted tokens (the largest k or tree budget, + 1 for the
    token verified with them); None when the config has no limit."""
    limit = getattr(config, "max_position_embeddings", None)
    drafted = max(max(ks), tree.budget if tree is not None else 0) + 1
    return None if limit is None else limit - max_new_tokens - drafted


def device_peaks(device: torch.device) -> dict | None:
    """The CUDA allocator's peaks since the last reset (``max_memory_allocated`` / ``max_memory_reserved``, bytes)
    and the device's used bytes (``mem_get_info``); None on other devices."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device), "device_used": total - free}


def load(target_dir: str | Path, drafts: dict[str, Path], config, device: torch.device,
         draft_dtype: torch.dtype | None, target_dtype: torch.dtype, window: int | None | dict[str, int | None],
         ) -> tuple[CachedTarget, dict[str, EagleTreeDrafter], dict[str, str]]:
    """``(target, drafters, dtype names)``: every draft read (``read_draft`` against the target's HF ``config``),
    then the target in ``target_dtype`` with its KV cache capturing the union of their aux layers, then per label
    an ``EagleTreeDrafter`` reading its own aux columns, in ``draft_dtype`` (None: its own). On the CPU the target's
    and float32 drafts' linear layers are packed once for oneDNN (``recipe.model.packed_linear``)."""
    read = {label: read_draft(path, config) for label, path in drafts.items()}
    union = sorted({i for _, cfg in read.values() for i in cfg.aux_layer_ids})
    model = TargetModel(target_dir, aux_layer_ids=union, dtype=target_dtype, device=device)
    if device.type == "cpu":
        pack_linear_layers(model.model)
    width = int(model.config.hidden_size)
    drafters, dtypes = {}, {}
    for label, (tensors, cfg) in read.items():
        draft = build_draft(tensors, cfg, model.embed_tokens_weight, device=device, dtype=draft_dtype,
                            source=drafts[label])
        dtypes[label] = str(draft.fc.weight.dtype).removeprefix("torch.")
        if device.type == "cpu":
            pack_linear_layers(draft)  # a float32 draft; other dtypes keep nn.Linear
        columns = torch.cat([torch.arange(union.index(i) * width, (union.index(i) + 1) * width)
                             for i in cfg.aux_layer_ids]).to(device)
        drafters[label] = EagleTreeDrafter(draft, window=draft_window(window, label),
                                           columns=None if cfg.aux_layer_ids == union else columns)
    return CachedTarget(model.model, union), drafters, dtypes


class GreedyReference:
    """The lossless check's greedy reference of one length's ``prompts``, decoded in ``mode`` (``REFERENCE_MODES``).

    ``sequential``: ``of(i, shared)`` decodes prompt i alone from its shared prefill, timed. ``batched``: all
    prompts in one left-padded batch first (``greedy_generate_batched``: about P times fewer target forwards),
    ``seconds`` nan, except the shortest prompt (the most padding), which ``of`` also decodes alone, timed
    (``MismatchError`` naming it when the two differ). ``check(i, gen, shared, mismatches)`` checks speculative
    output ``gen`` against prompt i's reference; an untimed batched row is first re-decoded alone (a P-row batch may
    round a near-tie differently), so only a disagreement with one-prompt greedy decoding counts: ``MismatchError``
    naming the prompt, or its message appended to ``mismatches`` when that is a list. Returns ``gen``.
    """

    def __init__(self, target: CachedTarget, prompts: list[ContextPrompt], max_new_tokens: int, eos: int | None,
                 mode: str):
        self.target, self.prompts, self.max_new_tokens, self.eos = target, prompts, max_new_tokens, eos
        self.gens: list[Generation | None] = [None] * len(prompts)
        self.alone = set(range(len(prompts)))
        if mode == "batched" and prompts:
            rows = greedy_generate_batched(target.model, [p.ids for p in prompts], max_new_tokens, eos)
            self.gens = [Generation(tokens=tokens, seconds=math.nan) for tokens in rows]
            self.alone = {min(range(len(prompts)), key=lambda i: len(prompts[i].ids))}

    def _alone(self, i: int, shared) -> Generation:
        return greedy_generate(self.target, self.prompts[i].ids, self.max_new_tokens, self.eos, shared=shared)

    def of(self, i: int, shared) -> Generation:
        if i in self.alone:
            self.alone.discard(i)
            alone, batched = self._alone(i, shared), self.gens[i]
            if batched is not None and alone.tokens != batched.tokens:
                raise MismatchError(f"prompt {self.prompts[i].name!r}: batched greedy decoding differs from decoding "
                                    f"it alone ({len(batched.tokens)} vs {len(alone.tokens)} tokens)")
            self.gens[i] = alone
        return self.gens[i]

    def check(self, i: int, gen: Generation, shared, mismatches: list[str] | None) -> Generation:
        ref = self.gens[i]
        if ref.tokens != gen.tokens and not ref.timed:  # batched, not yet decoded alone
            self.gens[i] = ref = Generation(tokens=self._alone(i, shared).tokens, seconds=math.nan)
        try:
            check_lossless(self.prompts[i].name, ref, gen)
        except MismatchError as exc:
            if mismatches is None:
                raise
            mismatches.append(str(exc))
        return gen


def measure_length(target: CachedTarget, drafters: dict[str, EagleTreeDrafter], length: int,
                   prompts: list[ContextPrompt], ks: list[int], tree: TreeSpec | None, max_new_tokens: int,
                   eos: int | None, reference: str, mismatches: list[str] | None) -> dict:
    """The ``length_entry`` of one context length: every draft at every k and its tree on ``prompts``, each prompt
    prefilled once, with ``prefill_seconds``, ``device_memory`` (:func:`device_peaks` over it) and ``mismatches``."""
    refs = GreedyReference(target, prompts, max_new_tokens, eos, reference)
    chains = {(label, k): [] for label in drafters for k in ks}
    trees = {label: [] for label in drafters}
    prefill_seconds, dev = 0.0, target.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i, p in enumerate(prompts):
        shared = prefill_prompt(target, p.ids)
        prefill_seconds += shared.seconds
        refs.of(i, shared)
        for label, drafter in drafters.items():
            for k in ks:
                gen = speculative_generate(target, drafter, p.ids, k, max_new_tokens, eos, shared=shared)
                chains[label, k].append(refs.check(i, gen, shared, mismatches))
            if tree is not None:
                gen = tree_speculative_generate(target, drafter, p.ids, tree, max_new_tokens, eos, shared=shared)
                trees[label].append(refs.check(i, gen, shared, mismatches))
    entry = length_entry(length, prompts, refs.gens, chains, trees if tree is not None else None, tree)
    entry.update(prefill_seconds=prefill_seconds, device_memory=device_peaks(dev), mismatches=mismatches or [])
    return entry


def evaluate_by_length(target_dir: str | Path, drafts: dict[str, Path], buckets: dict[int, list[ContextPrompt]],
                       ks: list[int], max_new_tokens: int, device: str | torch.device | None = None,
                       console: Console | None = None, draft_dtype: torch.dtype | None = None,
                       tree: TreeSpec | None = None, target_dtype: torch.dtype | None = None,
                       window: int | None | dict[str, int | None] = None, eos_token_id: int | None = None,
                       on_mismatch: str = "stop", reference: str = "sequential") -> dict:
    """τ of every draft in ``drafts`` (label -> path, any layout ``read_draft`` reads) at each k of ``ks`` and, with
    ``tree``, of dynamic-tree drafting, for each context length of ``buckets`` (``{L: prompts}``,
    ``recipe.eval.context``).

    ``target_dtype``: the target's (None: float32 on every device, so batched verification and one-token decoding
    agree to the last bit as far as possible; in bfloat16 they round differently and near-tied logits can fail the
    lossless check); ``draft_dtype``: the drafts' (None: each its own); ``window``: the drafts' sliding window in
    positions (``DraftKVCache``; None: full attention), or a ``{label: window}`` dict; ``eos_token_id``: decoding
    stops after it (None: only ``max_new_tokens``); ``on_mismatch``: one of :data:`ON_MISMATCH`; ``reference``: one of
    :data:`REFERENCE_MODES`.
    Returns ``{"target", "target_dtype", "max_new_tokens", "reference", "draft_window_size" (``window`` when one for
    all, else None), "draft_dtypes", "draft_window_sizes" ({label: window}), "tree", "lengths": [entry, ...]}``, one
    ``measure_length`` entry per length in increasing order. Raises ``MismatchError`` naming the prompt (with
    ``on_mismatch="stop"``); ValueError for an unknown mode, an unloadable draft, or a prompt longer than
    :func:`prompt_token_limit` (naming it, its tokens and the limit).
    """
    for name, value, choices in (("on_mismatch", on_mismatch, ON_MISMATCH), ("reference", reference, REFERENCE_MODES)):
        if value not in choices:
            raise ValueError(f"{name}={value!r}: choose from {', '.join(choices)}")
    console = console or Console(stderr=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = target_dtype or torch.float32
    config = target_config(target_dir)
    most = prompt_token_limit(config, max_new_tokens, ks, tree)
    for length, prompts in buckets.items():
        for p in prompts:
            if most is not None and len(p.ids) > most:
                raise ValueError(f"prompt {p.name!r} at context {length}: {len(p.ids)} tokens + {max_new_tokens} new "
                                 f"+ the drafted pass the target's max_position_embeddings "
                                 f"{config.max_position_embeddings} (at most {most} prompt tokens fit)")
    target, drafters, dtypes = load(target_dir, drafts, config, dev, draft_dtype, dtype, window)
    entries = []
    for length in sorted(buckets):
        entry = measure_length(target, drafters, length, buckets[length], ks, tree, max_new_tokens, eos_token_id,
                               reference, [] if on_mismatch == "record" else None)
        entries.append(entry)
        console.print(f"context {length}: {entry['num_prompts']} prompts, mean context "
                      f"{entry['mean_context_tokens']:.0f} tokens; τ = {entry['tau']:.3f} ± {entry['tau_se']:.3f}"
                      if entry["num_prompts"] else f"context {length}: no prompts")
    console.print(length_table(entries))
    return {"target": str(target_dir), "target_dtype": str(dtype).removeprefix("torch."),
            "max_new_tokens": max_new_tokens, "reference": reference,
            "draft_window_size": None if isinstance(window, dict) else window, "draft_dtypes": dtypes,
            "draft_window_sizes": {label: draft_window(window, label) for label in drafts},
            "tree": tree.as_dict() if tree is not None else None, "lengths": entries}


def evaluate(target_dir: str | Path, drafts: dict[str, Path], prompts: list[Prompt], ks: list[int],
             max_new_tokens: int, console: Console | None = None, tree: TreeSpec | None = None, **engine) -> dict:
    """Plain evaluation: :func:`evaluate_by_length` at the one length 0, each prompt one user turn through the
    target's chat template (``prompt_ids``), EOS the tokenizer's; ``engine``: its other keyword arguments.

    Returns its dict with the entry's ``runs``, ``tree_runs`` (with ``tree`` only: neither key without one),
    ``mismatches``, ``prefill_seconds`` and ``device_memory`` in place of ``lengths``, and ``tau`` /
    ``num_draft_tokens`` of the first draft at the first k, ``tau_tree`` of its tree (None without one),
    ``num_prompts`` and ``greedy_tokens_per_s`` (the timed greedy prompts: all of them, or the shortest with
    ``reference="batched"``). Prints the τ and category tables.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    console = console or Console(stderr=True)
    tokenizer = load_tokenizer(target_dir)
    bucket = [ContextPrompt(name=p.name, category=p.category, ids=prompt_ids(tokenizer, p), context_tokens=0,
                            length=0) for p in prompts]
    result = evaluate_by_length(target_dir, drafts, {0: bucket}, ks, max_new_tokens, console=console, tree=tree,
                                eos_token_id=tokenizer.eos_token_id, **engine)
    entry = result.pop("lengths")[0]
    runs, tree_runs = entry["runs"], entry["tree_runs"]
    console.print(tau_table(runs))
    if tree is not None:
        console.print(tau_table(tree_runs, title=f"Acceptance length τ (dynamic tree: top-{tree.topk}, depth "
                                                 f"{tree.depth}, {tree.budget} draft tokens; greedy verification)",
                                k_label="depth"))
    console.print(category_table(runs + tree_runs))
    if tree is None:  # as a chain-only run always wrote it: no tree keys
        del result["tree"], entry["tree_runs"]
    return {"tau": runs[0]["tau"], "tau_tree": entry["tau_tree"], "num_draft_tokens": runs[0]["num_draft_tokens"],
            "num_prompts": len(prompts), **result, "greedy_tokens_per_s": runs[0]["greedy_tokens_per_s"],
            **{key: entry[key] for key in ("runs", "tree_runs", "mismatches", "prefill_seconds", "device_memory")
               if key in entry}}
