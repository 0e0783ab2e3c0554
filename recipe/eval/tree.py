"""Tree speculative decoding with greedy verification (EAGLE-2/EAGLE-3 dynamic draft trees), one prompt at a time.

A round (known tokens ``t_0..t_n``, the target cache holding positions ``0..n``, the target's greedy next token
``t_{n+1}`` not yet cached):

1. the drafter receives the new anchors' aux features and the tokens after them (as for chain drafting) and
   returns a ``DraftTree``: ``N`` draft tokens, each with a parent (``-1``: the root ``t_{n+1}``), parents before
   children; a node at depth ``d`` (children of the root: depth 1) stands for position ``n + 1 + d``;
2. the target runs once over ``[t_{n+1}, tree tokens...]`` at positions ``n + 1 + depth`` with a tree attention
   mask: every input reads the cached prefix and its own ancestors (and itself), nothing else
   (``tree_attention_mask``; SpecInfer, Miao et al. 2023, "tree-based parallel decoding");
3. starting at the root, the child whose token equals the target's argmax at the current node is accepted, as long
   as there is one: the longest accepted path. The target's argmax at the path's last node is the bonus token;
   ``a + 1`` tokens are emitted and the target cache keeps the prefix, the root and the path's entries only
   (``CachedTarget.keep``), so it is again the cache of plain decoding.

With greedy verification the output equals plain greedy decoding token for token (check with
``recipe.eval.speculative.check_lossless``). τ is emitted tokens / verification steps, at most ``1 + depth``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from recipe.eval.speculative import Generation, PromptPrefill, prefill, stop_index
from recipe.target.runtime import CachedTarget


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the dynamic draft tree (EAGLE-2, Li et al. 2024, "dynamic draft tree"): ``topk`` children per
    expanded node and ``topk`` nodes expanded per depth, ``depth`` levels below the root, at most ``budget`` draft
    tokens verified per round. Raises ValueError for a value < 1."""

    topk: int = 4
    depth: int = 5
    budget: int = 16

    def __post_init__(self):
        for name in ("topk", "depth", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"tree {name} must be >= 1, got {getattr(self, name)}")

    def as_dict(self) -> dict:
        return {"topk": self.topk, "depth": self.depth, "budget": self.budget}


def add_tree_arguments(parser) -> None:
    """The ``--tree-topk/--tree-depth/--tree-budget`` flags of ``recipe.eval`` and ``recipe.demo`` (defaults of
    :class:`TreeSpec`; ``--tree-depth 0`` turns tree drafting off)."""
    parser.add_argument("--tree-topk", type=int, default=TreeSpec.topk,
                        help="tree drafting: children per expanded node and nodes expanded per depth")
    parser.add_argument("--tree-depth", type=int, default=TreeSpec.depth,
                        help="tree drafting: draft levels below the root, the most draft tokens one round can "
                        "accept (0: no tree drafting)")
    parser.add_argument("--tree-budget", type=int, default=TreeSpec.budget,
                        help="tree drafting: draft tokens verified per round")


def tree_from_args(args) -> "TreeSpec | None":
    """The TreeSpec of :func:`add_tree_arguments`' flags, None for ``--tree-depth 0``; ValueError for a value < 0."""
    return TreeSpec(topk=args.tree_topk, depth=args.tree_depth, budget=args.tree_budget) if args.tree_depth else None


@dataclass
class DraftTree:
    """Draft tokens (target ids) ``tokens[i]`` with ``parents[i]`` (index of an earlier node, or -1 for the root).
    Raises ValueError when a parent is not an earlier node or the lengths differ."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: node {i} has parent {p}, not an earlier node or -1")

    def depths(self) -> list[int]:
        """Depth of every node (children of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


class TreeDrafter(Protocol):
    """What tree speculative decoding needs from a draft (``recipe.eval.tree_draft.EagleTreeDrafter``)."""

    def begin(self) -> None:
        """Start a new sequence."""

    def propose_tree(self, aux_SA: torch.Tensor, next_ids_S: torch.Tensor, spec: TreeSpec) -> DraftTree:
        """New anchors' aux features [m, A] and the tokens that follow them [m] -> a draft tree below the root
        (the last of ``next_ids_S``) of at most ``spec.budget`` nodes and depth ``spec.depth``."""


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """[1 + N, 1 + N] bool, True where input ``i`` may read input ``j``: ``j`` is ``i`` or one of its ancestors.
    Input 0 is the root, input ``i + 1`` is node ``i`` of a tree with these ``parents``."""
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            allowed[i + 1] = allowed[p + 1]
        allowed[i + 1, i + 1] = True
    return allowed


def accepted_path(tree: DraftTree, greedy: list[int]) -> list[int]:
    """Longest path from the root whose every token equals the target's argmax at its parent. ``greedy[i]`` is the
    target's argmax after input ``i`` (0: root, ``i + 1``: node ``i``). Returns node indices, root excluded."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    path, cur = [], -1
    while True:
        want = greedy[cur + 1]
        nxt = next((c for c in children.get(cur, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


@torch.no_grad()
def tree_speculative_generate(target: CachedTarget, drafter: TreeDrafter, prompt_ids: list[int], spec: TreeSpec,
                              max_new_tokens: int, eos_token_id: int | None = None,
                              shared: PromptPrefill | None = None) -> Generation:
    """Tree speculative decoding with greedy verification (see the module docstring).

    Returns a ``Generation`` with ``k = spec.depth`` (the most draft tokens a round can accept). ``shared``: the
    prompt's ``PromptPrefill`` on this ``target``, reused (``recipe.eval.speculative.prefill``). Raises ValueError
    for an empty prompt or a tree over ``spec.budget`` nodes / deeper than ``spec.depth``.
    """
    start, tokens, new_aux, new_next = prefill(target, drafter, prompt_ids, shared)
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        tree = drafter.propose_tree(new_aux, new_next, spec)
        depths = tree.depths()
        if len(tree.tokens) > spec.budget or max(depths, default=0) > spec.depth:
            raise ValueError(f"drafter proposed a tree of {len(tree.tokens)} nodes and depth {max(depths)}, "
                             f"over budget={spec.budget} / depth={spec.depth}")
        cached = len(target)
        step = target.forward([tokens[-1], *tree.tokens], positions=[cached + d for d in [0, *depths]],
                              tree_mask=tree_attention_mask(tree.parents))
        greedy = step.logits_SV.argmax(dim=-1).tolist()
        path = accepted_path(tree, greedy)
        rows = [0] + [i + 1 for i in path]  # the root and the accepted nodes, as inputs of this forward
        new = [tree.tokens[i] for i in path] + [greedy[rows[-1]]]
        emitted = stop_index(new, max_new_tokens - len(tokens), eos_token_id)
        accepted.append(emitted - 1)
        target.keep(list(range(cached)) + [cached + r for r in rows])
        new_aux = step.aux_SA[rows]
        new_next = torch.tensor(new)
        tokens.extend(new[:emitted])
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, accepted=accepted, k=spec.depth)
