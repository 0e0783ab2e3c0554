"""Dynamic draft trees from an exported EAGLE-3 draft (EAGLE-2, Li et al. 2024, "dynamic draft tree"; EAGLE-3 keeps it).

After the anchors are extended (as for chain drafting, ``recipe.eval.draft_runtime``), the tree grows one depth per
draft forward:

- depth 1: the ``topk`` most likely draft tokens at the last anchor ``n``; each node's score is its log-probability;
- depth ``d + 1``: the ``topk`` best-scored nodes of depth ``d`` (all of depth 1) are *expanded*: each reads
  ``(its parent's output hidden, its token)`` at RoPE position ``n + d``, attending every anchor's step-0 entry and
  the entries of its own ancestors and itself (a tree attention mask over the draft's KV cache: for a path it is
  the key set of TTT step ``d``, as in chain drafting); each expanded node gets its ``topk`` most likely children,
  scored ``parent score + log p(child)`` (the log-probability of the whole path under the draft);
- finally the ``budget`` best-scored nodes of the whole tree are kept. A child never scores above its parent and
  ties go to the shallower node, so the kept set contains the ancestors of each of its nodes.

The tree's KV entries are dropped at the next call (the draft cache is cropped to the anchors, and the accepted
tokens are extended with the target's own features).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from recipe.eval.draft_runtime import DraftKVCache, EagleDrafter, window_mask
from recipe.eval.tree import DraftTree, TreeSpec


class TreeDraftKVCache(DraftKVCache):
    """``DraftKVCache`` that, while ``allowed_QK`` is set ([m, cache length after this call's keys] bool, True:
    query i reads key j), attends by that mask instead of by positions (scaled dot-product attention, softmax scale
    1/sqrt(D), grouped-query heads shared as in the draft layer). With a ``window`` the mask is also limited to the
    keys at positions ``p - window < q <= p`` of each query at ``p`` (``window_mask``), and keys outside every
    query's window are left out."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__(window)
        self.allowed_QK: torch.Tensor | None = None

    def attend(self, causal_attention, q_BHSD, k_BHkvSD, v_BHkvSD, position_ids_BS, key_valid_BS):
        if self.allowed_QK is None:
            return super().attend(causal_attention, q_BHSD, k_BHkvSD, v_BHkvSD, position_ids_BS, key_valid_BS)
        self._append(k_BHkvSD, v_BHkvSD, position_ids_BS)
        if self.allowed_QK.shape != (q_BHSD.shape[2], self.k_BHkvSD.shape[2]):
            raise ValueError(f"tree mask {tuple(self.allowed_QK.shape)} does not fit {q_BHSD.shape[2]} queries "
                             f"over {self.k_BHkvSD.shape[2]} keys")
        allowed_QK, k, v = self.allowed_QK, self.k_BHkvSD, self.v_BHkvSD
        if self.window is not None:
            keep = self.in_window(position_ids_BS).nonzero()[:, 0]
            allowed_QK = allowed_QK[:, keep] & window_mask(position_ids_BS[0], self.pos_BS[0, keep], self.window)
            k, v = k[:, :, keep], v[:, :, keep]
        return F.scaled_dot_product_attention(q_BHSD, k, v, attn_mask=allowed_QK[None, None], enable_gqa=True)


class EagleTreeDrafter(EagleDrafter):
    """``EagleDrafter`` that also proposes dynamic draft trees (the ``TreeDrafter`` interface of
    ``recipe.eval.tree``); ``propose`` (chain drafting) still works on the same cache."""

    def __init__(self, draft, window: int | None = None, columns=None):
        super().__init__(draft, window, columns)
        self.cache = TreeDraftKVCache(window)
        self.to_target = self.draft_to_target.tolist()

    def begin(self) -> None:
        super().begin()
        self.cache = TreeDraftKVCache(self.window)

    def _log_probs(self, hidden_SH: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.draft.logits(hidden_SH).float(), dim=-1)

    @torch.no_grad()
    def propose_tree(self, aux_SA: torch.Tensor, next_ids_S: torch.Tensor, spec: TreeSpec) -> DraftTree:
        """The anchors' aux features [m, A] and next tokens [m] -> a ``DraftTree`` of at most ``spec.budget`` nodes
        (target ids) and depth ``spec.depth`` below the root ``next_ids_S[-1]``."""
        h_root = self.extend(aux_SA, next_ids_S)[-1]
        anchors, last = self.committed, self.committed - 1
        vd = int(self.draft.config.draft_vocab_size)
        top = self._log_probs(h_root).topk(min(spec.topk, vd))
        ids = top.indices.tolist()  # draft ids
        scores = top.values.tolist()
        parents, depths = [-1] * len(ids), [1] * len(ids)
        rows: dict[int, list[int]] = {-1: []}  # node -> cache rows of its ancestors' and its own entries
        frontier, hidden = list(range(len(ids))), {-1: h_root}
        for d in range(1, spec.depth):
            base = len(self.cache)
            allowed = torch.zeros(len(frontier), base + len(frontier), dtype=torch.bool, device=self.device)
            allowed[:, :anchors] = True
            for j, node in enumerate(frontier):
                rows[node] = rows[parents[node]] + [base + j]
                allowed[j, rows[node]] = True
            hidden_in = torch.stack([hidden[parents[node]] for node in frontier])[None]
            tokens_in = torch.tensor([ids[node] for node in frontier], device=self.device)[None]
            pos = torch.full((1, len(frontier)), last + d, device=self.device)
            self.cache.allowed_QK = allowed
            try:
                out_BSH, _ = self.draft.step(hidden_in, tokens_in, pos, kv_cache=self.cache)
            finally:
                self.cache.allowed_QK = None
            child = self._log_probs(out_BSH[0]).topk(min(spec.topk, vd))
            new = []
            for j, node in enumerate(frontier):
                hidden[node] = out_BSH[0, j]
                for tok, lp in zip(child.indices[j].tolist(), child.values[j].tolist()):
                    new.append(len(ids))
                    ids.append(tok)
                    scores.append(scores[node] + min(lp, 0.0))  # never above the parent, also after rounding
                    parents.append(node)
                    depths.append(d + 1)
            frontier = sorted(new, key=lambda i: -scores[i])[: spec.topk]
        keep = sorted(range(len(ids)), key=lambda i: (-scores[i], depths[i], i))[: spec.budget]
        keep.sort(key=lambda i: (depths[i], i))
        index = {node: j for j, node in enumerate(keep)}
        return DraftTree(tokens=[int(self.to_target[ids[i]]) for i in keep],
                         parents=[index[parents[i]] if parents[i] >= 0 else -1 for i in keep])
