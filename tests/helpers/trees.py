"""A drafted tree checked against chain drafting: every node's children are the top-k of the chain draft's logits
after the node's path."""
from __future__ import annotations


def assert_children_are_topk(tree_out, reference, draft, aux, nxt, topk: int) -> None:
    """For each inner node of ``tree_out`` (``propose_tree``'s result), run ``reference`` (an ``EagleDrafter``) along
    the node's path from ``extend(aux, nxt)``; the node's children (as draft ids) must be the ``topk`` largest of
    ``draft.logits`` there. AssertionError names the node and its path."""
    to_draft = {int(t): d for d, t in enumerate(reference.draft_to_target.tolist())}
    for node in {p for p in tree_out.parents if p >= 0}:
        path, j = [], node
        while j >= 0:
            path.insert(0, tree_out.tokens[j])
            j = tree_out.parents[j]
        reference.begin()
        hidden = reference.extend(aux, nxt)[-1]
        for step, tok in enumerate(path, start=1):
            hidden = reference.chain_step(hidden, tok, step)
        children = {to_draft[t] for t, p in zip(tree_out.tokens, tree_out.parents) if p == node}
        assert children == set(draft.logits(hidden).topk(topk).indices.tolist()), (node, path)
