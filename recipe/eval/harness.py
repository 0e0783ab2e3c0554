"""Evaluate exported drafts against their target: greedy reference once per prompt, then speculative decoding for
every (draft, k) and, optionally, tree decoding per draft, each output checked token for token against the
reference (lossless check)."""
from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from recipe.eval.draft_runtime import load_draft_export
from recipe.eval.prompts import Prompt, prompt_ids
from recipe.eval.report import category_table, summarise_run, tau_table
from recipe.eval.speculative import Generation, check_lossless, greedy_generate, speculative_generate
from recipe.eval.target_runtime import CachedTarget
from recipe.eval.tree import TreeSpec, tree_speculative_generate
from recipe.eval.tree_draft import EagleTreeDrafter


def evaluate(target_dir: str | Path, drafts: dict[str, Path], prompts: list[Prompt], ks: list[int],
             max_new_tokens: int, device: str | torch.device | None = None,
             console: Console | None = None, draft_dtype: torch.dtype | None = None,
             tree: TreeSpec | None = None) -> dict:
    """τ and speed of each draft export in ``drafts`` (label -> folder) at each k in ``ks`` (chain drafting) and,
    with ``tree``, of dynamic-tree drafting with that shape (``recipe.eval.tree``).

    The target runs in float32 (so batched verification and one-token decoding agree to the last bit as far as
    possible); each draft in ``draft_dtype`` (None: the export's own dtype, see ``load_draft_export``); EOS is the
    tokenizer's. Returns ``{"target", "num_prompts", "max_new_tokens", "greedy_tokens_per_s", "draft_dtypes":
    {label: "bfloat16" | "float32" | ...}, "runs": [summarise_run(...), ...]}`` in ``drafts`` × ``ks`` order, and
    with ``tree`` also ``"tree": spec.as_dict()`` and ``"tree_runs"``: one ``summarise_run`` per draft, with
    ``num_draft_tokens`` = the tree depth (per-position counts are per depth). Raises
    ``MismatchError`` naming the prompt when speculative output differs from greedy decoding; ValueError for an
    unloadable export (names the folder).
    """
    from recipe.model.target import TargetModel

    console = console or Console(stderr=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configs = {label: _aux_ids(path) for label, path in drafts.items()}
    aux_ids = next(iter(configs.values()))
    model = TargetModel(target_dir, aux_layer_ids=aux_ids, dtype=torch.float32, device=dev)
    tokenizer = model.load_tokenizer()
    eos = tokenizer.eos_token_id
    ids = [prompt_ids(tokenizer, p) for p in prompts]

    reference: list[Generation] = []
    plain = CachedTarget(model.model)
    for p, prompt in zip(prompts, ids):
        reference.append(greedy_generate(plain, prompt, max_new_tokens, eos))
    greedy_tps = sum(len(g.tokens) for g in reference) / max(sum(g.seconds for g in reference), 1e-9)
    console.print(f"greedy reference: {len(prompts)} prompts, {sum(len(g.tokens) for g in reference)} tokens, "
                  f"{greedy_tps:.1f} tokens/s")

    runs, tree_runs, dtypes = [], [], {}
    for label, path in drafts.items():
        target = CachedTarget(model.model, configs[label])
        draft = load_draft_export(path, model.embed_tokens_weight, device=dev, dtype=draft_dtype)
        dtypes[label] = str(draft.fc.weight.dtype).removeprefix("torch.")
        drafter = EagleTreeDrafter(draft)
        for k in ks:
            gens = []
            for p, prompt, ref in zip(prompts, ids, reference):
                gen = speculative_generate(target, drafter, prompt, k, max_new_tokens, eos)
                check_lossless(p.name, ref, gen)
                gens.append(gen)
            runs.append(summarise_run(label, k, prompts, gens, reference))
            console.print(f"{label} k={k}: τ = {runs[-1]['tau']:.3f}")
        if tree is not None:
            gens = []
            for p, prompt, ref in zip(prompts, ids, reference):
                gen = tree_speculative_generate(target, drafter, prompt, tree, max_new_tokens, eos)
                check_lossless(p.name, ref, gen)
                gens.append(gen)
            tree_runs.append({**summarise_run(label, tree.depth, prompts, gens, reference), "tree": tree.as_dict()})
            console.print(f"{label} tree {tree.as_dict()}: τ = {tree_runs[-1]['tau']:.3f}")
    console.print(tau_table(runs))
    if tree is not None:
        console.print(tau_table(tree_runs, title=f"Acceptance length τ (dynamic tree: top-{tree.topk}, depth "
                                                 f"{tree.depth}, {tree.budget} draft tokens; greedy verification)",
                                k_label="depth"))
    console.print(category_table(runs + tree_runs))
    extra = {"tree": tree.as_dict(), "tree_runs": tree_runs} if tree is not None else {}
    return {"target": str(target_dir), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "greedy_tokens_per_s": greedy_tps, "draft_dtypes": dtypes, "runs": runs, **extra}


def _aux_ids(path: Path) -> list[int]:
    """The aux layer ids of an export's ``config.json``; ValueError naming the file when unreadable."""
    import json

    from recipe.export import CONFIG_FILE
    from recipe.model.draft_config import Eagle3DraftConfig

    file = Path(path) / CONFIG_FILE
    try:
        return Eagle3DraftConfig.from_hf_dict(json.loads(file.read_text())).aux_layer_ids
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read the draft config ({exc})") from None
