"""Evaluate exported drafts against their target: greedy reference once per prompt, then speculative decoding for
every (draft, k) and, optionally, tree decoding per draft, each output checked token for token against the
reference (lossless check)."""
from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from recipe.eval.draft_runtime import draft_window, export_aux_layer_ids, load_draft_export
from recipe.eval.prompts import Prompt, prompt_ids
from recipe.eval.report import category_table, summarise_run, tau_table, tokens_per_s
from recipe.eval.speculative import (
    Generation,
    MismatchError,
    check_lossless,
    greedy_generate,
    greedy_generate_batched,
    speculative_generate,
)
from recipe.eval.tree import TreeSpec, tree_speculative_generate
from recipe.eval.tree_draft import EagleTreeDrafter
from recipe.model.packed_linear import pack_linear_layers
from recipe.target.capture import TargetModel
from recipe.target.runtime import CachedTarget

REFERENCE_MODES = ("sequential", "batched")


def evaluate(target_dir: str | Path, drafts: dict[str, Path], prompts: list[Prompt], ks: list[int],
             max_new_tokens: int, device: str | torch.device | None = None,
             console: Console | None = None, draft_dtype: torch.dtype | None = None,
             tree: TreeSpec | None = None, reference: str = "sequential", target_dtype: torch.dtype | None = None,
             window: int | None | dict[str, int | None] = None) -> dict:
    """τ and speed of each draft export in ``drafts`` (label -> folder) at each k in ``ks`` (chain drafting) and,
    with ``tree``, of dynamic-tree drafting with that shape (``recipe.eval.tree``).

    The target runs in ``target_dtype`` (None: float32 on every device, so batched verification and one-token
    decoding agree to the last bit as far as possible; in bfloat16 they round differently, and near-tied logits
    make the lossless check fail: seen on an H200 at the 4th new token); each draft in ``draft_dtype`` (None: the export's
    own dtype, see ``load_draft_export``), attending its last ``window`` positions only when set
    (``recipe.eval.draft_runtime.DraftKVCache``; a ``{label: window}`` dict gives each draft its own); EOS is the tokenizer's. Returns ``{"target", "num_prompts",
    "max_new_tokens", "reference", "greedy_tokens_per_s",
    "draft_dtypes": {label: "bfloat16" | "float32" | ...}, "runs": [summarise_run(...), ...]}`` in ``drafts`` × ``ks``
    order, and with ``tree`` also ``"tree": spec.as_dict()`` and ``"tree_runs"``: one ``summarise_run`` per draft,
    with ``num_draft_tokens`` = the tree depth (per-position counts are per depth).

    ``reference``: how the greedy reference of the lossless check is decoded (``GreedyReference``). ``"sequential"``:
    prompt by prompt (``greedy_generate``), each timed. ``"batched"``: all prompts in one batch
    (``greedy_generate_batched``, one forward per token for all of them: about P times fewer forwards), then the
    shortest prompt alone, timed and checked against its batched tokens. ``greedy_tokens_per_s`` and each run's
    ``speedup`` use the timed prompts only (``summarise_run``). On the CPU the target's and float32 drafts' linear
    layers are packed for oneDNN first (``recipe.model.packed_linear``). Raises
    ``MismatchError`` naming the prompt when speculative output differs from greedy decoding; ValueError for an
    unloadable export (names the folder).
    """
    if reference not in REFERENCE_MODES:
        raise ValueError(f"reference={reference!r}: choose from {', '.join(REFERENCE_MODES)}")
    console = console or Console(stderr=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configs = {label: export_aux_layer_ids(path) for label, path in drafts.items()}
    aux_ids = next(iter(configs.values()))
    model = TargetModel(target_dir, aux_layer_ids=aux_ids, device=dev,
                        dtype=target_dtype or torch.float32)
    if dev.type == "cpu":  # few-row forwards: weights packed once for oneDNN (recipe.model.packed_linear)
        pack_linear_layers(model.model)
    tokenizer = model.load_tokenizer()
    eos = tokenizer.eos_token_id
    ids = [prompt_ids(tokenizer, p) for p in prompts]

    refs = GreedyReference(model.model, prompts, ids, max_new_tokens, eos, reference, tokenizer.pad_token_id)
    greedy_tps = tokens_per_s([g for g in refs.gens if g.timed])
    console.print(f"greedy reference ({reference}): {len(prompts)} prompts, "
                  f"{sum(len(g.tokens) for g in refs.gens)} tokens; greedy decoding {greedy_tps:.1f} tokens/s")

    runs, tree_runs, dtypes = [], [], {}
    for label, path in drafts.items():
        target = CachedTarget(model.model, configs[label])
        draft = load_draft_export(path, model.embed_tokens_weight, device=dev, dtype=draft_dtype)
        dtypes[label] = str(draft.fc.weight.dtype).removeprefix("torch.")
        if dev.type == "cpu":
            pack_linear_layers(draft)  # a float32 draft; other dtypes keep nn.Linear
        drafter = EagleTreeDrafter(draft, window=draft_window(window, label))
        for k in ks:
            gens = [refs.check(i, speculative_generate(target, drafter, prompt, k, max_new_tokens, eos))
                    for i, prompt in enumerate(ids)]
            runs.append(summarise_run(label, k, prompts, gens, refs.gens))
            console.print(f"{label} k={k}: τ = {runs[-1]['tau']:.3f}")
        if tree is not None:
            gens = [refs.check(i, tree_speculative_generate(target, drafter, prompt, tree, max_new_tokens, eos))
                    for i, prompt in enumerate(ids)]
            tree_runs.append({**summarise_run(label, tree.depth, prompts, gens, refs.gens), "tree": tree.as_dict()})
            console.print(f"{label} tree {tree.as_dict()}: τ = {tree_runs[-1]['tau']:.3f}")
    console.print(tau_table(runs))
    if tree is not None:
        console.print(tau_table(tree_runs, title=f"Acceptance length τ (dynamic tree: top-{tree.topk}, depth "
                                                 f"{tree.depth}, {tree.budget} draft tokens; greedy verification)",
                                k_label="depth"))
    console.print(category_table(runs + tree_runs))
    extra = {"tree": tree.as_dict(), "tree_runs": tree_runs} if tree is not None else {}
    return {"target": str(target_dir), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "reference": reference, "greedy_tokens_per_s": greedy_tps, "draft_dtypes": dtypes, "runs": runs, **extra}


class GreedyReference:
    """The lossless check's greedy reference of every prompt (``evaluate``'s ``reference`` modes).

    ``gens[i]``: prompt i's greedy ``Generation``; its ``seconds`` are nan where it was not decoded alone (batched
    mode: every prompt but the shortest, whose padding is the most, which is also decoded alone, timed, and must
    agree with its batched tokens, else ``MismatchError`` naming it). ``check(i, gen)`` raises ``MismatchError`` when
    speculative output ``gen`` differs from prompt i's reference; a batched reference is first re-decoded alone for
    that prompt (a P-row batch may round a near-tie differently), so only a disagreement with one-prompt greedy
    decoding counts. Returns ``gen``.
    """

    def __init__(self, model, prompts: list[Prompt], ids: list[list[int]], max_new_tokens: int, eos: int | None,
                 mode: str, pad_token_id: int | None):
        self.prompts, self.ids, self.max_new_tokens, self.eos = prompts, ids, max_new_tokens, eos
        self.plain = CachedTarget(model)
        if mode == "sequential":
            self.gens = [self._alone(i) for i in range(len(ids))]
            return
        batched = greedy_generate_batched(model, ids, max_new_tokens, eos, pad_token_id or 0)
        self.gens = [Generation(tokens=tokens, seconds=float("nan")) for tokens in batched]
        shortest = min(range(len(ids)), key=lambda i: len(ids[i]))
        alone = self._alone(shortest)
        if alone.tokens != self.gens[shortest].tokens:
            raise MismatchError(f"prompt {prompts[shortest].name!r}: batched greedy decoding differs from decoding it "
                                f"alone ({len(self.gens[shortest].tokens)} vs {len(alone.tokens)} tokens)")
        self.gens[shortest] = alone

    def _alone(self, i: int) -> Generation:
        return greedy_generate(self.plain, self.ids[i], self.max_new_tokens, self.eos)

    def check(self, i: int, gen: Generation) -> Generation:
        ref = self.gens[i]
        if ref.tokens != gen.tokens and not ref.timed:  # batched, not yet decoded alone
            self.gens[i] = ref = Generation(tokens=self._alone(i).tokens, seconds=float("nan"))
        check_lossless(self.prompts[i].name, ref, gen)
        return gen
