"""``--chain-conversations TOKENS``: whole conversations of one data file chained into multi-turn samples of up to
TOKENS tokens, so a long-context run trains on long samples made of short conversations.

Per data file (so ``--data-weights`` mixes chained files like any other), in three cached ``datasets`` steps:

1. **Prepare** (``Dataset.map``): each usable conversation is trimmed to the span a chain can hold: its first system
   turn (kept only when it opens a chain), then from its first user turn to its last assistant turn. Assistant turns
   before the first user turn (ShareGPT's split conversations often open so: they answer nothing) and user turns
   after the last answer (nothing supervises them) are dropped, so the chained turns alternate user/assistant as
   strict templates require; later conversations' system turns are dropped too (a template renders a system turn
   only at the start). Every dropped turn is counted (``ChainReport.dropped_turns``). The trimmed conversation's
   length L_i is what the target's chat template renders for it alone (``apply_chat_template``, tokens). A
   conversation with no user turn before an answer is a ``no_prompt`` skip; one the template cannot render a
   ``template_error`` skip.
2. **Plan** (:func:`plan_chains`): the usable conversations in an order shuffled by the run's ``--seed``
   (``numpy.random.default_rng(seed).permutation``), cut greedily into consecutive groups whose Σ L_i ≤ TOKENS; a
   conversation longer than TOKENS alone is a group of its own (cut at ``--max-length`` like any sample). The same
   file, seed and budget give the same chains on every machine.
3. **Chain** (``Dataset.from_generator``): each group's turns concatenated, in order, into one conversation
   ``[{role, content}]``. The sample is then tokenised and masked by ``recipe.data.chat_mask`` like any other: the
   template renders the chained turns (not concatenated token lists), so every assistant turn is supervised exactly
   as the template renders it in a long conversation (a reasoning template drops the ``<think>`` blocks of the turns
   before the last user turn, as it would at inference). A chain renders to at most Σ L_i tokens when the template
   injects a default system prompt into each lone conversation (SmolLM2, Qwen) and to Σ L_i otherwise (turn
   boundaries are special tokens).

Each step carries an explicit fingerprint (the rows' fingerprint, the tokenizer, TOKENS, the seed), so the cached
``datasets`` examples and ``recipe.dump`` reuse chains built before and rebuild them when one of them changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import numpy as np

from recipe.data.sources import ROW_FEATURES
from recipe.data.sources import fingerprint as _hash

CHAIN_VERSION = "chain-v1"  # bump when trimming / planning / joining changes

PREPARED_FEATURES = datasets.Features({**ROW_FEATURES, "length": datasets.Value("int64"),
                                       "dropped": datasets.Value("int64"),
                                       "system": datasets.Value("bool")})


@dataclass
class ChainReport:
    """What chaining made of one data file: ``conversations`` chained (usable rows), ``samples`` built,
    ``multi`` samples holding two or more conversations, ``dropped_turns`` (trimmed at the edges, module
    docstring), ``budget`` (TOKENS) and ``lengths``: the planned Σ L_i of every sample (tokens)."""

    path: str
    budget: int
    conversations: int = 0
    samples: int = 0
    multi: int = 0
    dropped_turns: int = 0
    lengths: list[int] = field(default_factory=list)

    def summary(self) -> str:
        """One line: ``path: 180 conversations -> 12 chained samples (11 of >= 2) of ≤ 4096 tokens; planned
        lengths min/median/max 950/3987/4090; 25 turns dropped at conversation edges``."""
        if not self.lengths:
            return f"{self.path}: no conversation to chain"
        lo, mid, hi = min(self.lengths), int(np.median(self.lengths)), max(self.lengths)
        return (f"{self.path}: {self.conversations} conversations -> {self.samples} chained samples ({self.multi} "
                f"of >= 2) of <= {self.budget} tokens; planned lengths min/median/max {lo}/{mid}/{hi}; "
                f"{self.dropped_turns} turns dropped at conversation edges")


def trim_for_chain(messages: list[dict]) -> tuple[list[dict], int]:
    """(the turns a chain keeps of one conversation, how many were dropped): a leading system turn, then the span
    from the first user turn to the last assistant turn (module docstring, step 1). An empty list when no user turn
    comes before an assistant turn."""
    system = [messages[0]] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    last_answer = max((i for i, m in enumerate(rest) if m["role"] == "assistant"), default=-1)
    if first_user is None or last_answer < first_user:
        return [], len(messages)
    span = [m for m in rest[first_user:last_answer + 1] if m["role"] != "system"]
    kept = system + span
    return kept, len(messages) - len(kept)


def join_chain(conversations: list[list[dict]]) -> tuple[list[dict], int]:
    """(one conversation: the trimmed ``conversations`` in order, the first one's system turn kept and the others'
    dropped; how many system turns were dropped)."""
    out, dropped = [], 0
    for k, turns in enumerate(conversations):
        if turns and turns[0]["role"] == "system" and k > 0:
            turns, dropped = turns[1:], dropped + 1
        out.extend(dict(m) for m in turns)
    return out, dropped


def plan_chains(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Groups of indices into ``lengths`` (tokens per conversation, all ≥ 1): a permutation of all indices by
    ``numpy.random.default_rng(seed)``, cut greedily into consecutive groups with Σ length ≤ ``budget`` (a
    conversation longer than ``budget`` is a group alone). Every index appears in exactly one group.

    Raises:
        ValueError: ``budget`` < 1.
    """
    if budget < 1:
        raise ValueError(f"chain budget must be a positive number of tokens, got {budget}")
    groups: list[list[int]] = []
    total = 0
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        if groups and total + lengths[i] <= budget:
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def _prepare_batch(batch: dict, tokenizer) -> dict:
    out = {key: [] for key in PREPARED_FEATURES}
    for j, messages in enumerate(batch["messages"]):
        reason, detail, length, dropped = batch["reason"][j], batch["detail"][j], 0, 0
        if not reason:
            messages, dropped = trim_for_chain(messages)
            if not messages:
                reason, detail, dropped = "no_prompt", "no user turn before an assistant turn", 0
            else:
                try:
                    length = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
                                 ["input_ids"])
                except Exception as err:  # noqa: BLE001 - templates raise their own errors
                    messages, reason, detail, dropped = [], "template_error", str(err)[:80], 0
        system = bool(messages) and messages[0]["role"] == "system"
        for key, value in zip(out, (batch["row"][j], messages, reason, detail, batch["source"][j], length,
                                    dropped, system)):
            out[key].append(value)
    return out


def _generate_chains(files: tuple[str, ...], groups: tuple[tuple[int, ...], ...], key: str):
    del key  # only part of the builder's cache key
    rows = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
    for group in groups:
        picked = [rows[i] for i in group]
        messages, _ = join_chain([r["messages"] for r in picked])
        yield {"row": picked[0]["row"], "messages": messages, "reason": "", "detail": "", "source": picked[0]["source"]}


def chain_rows(rows: datasets.Dataset, name: str, tokenizer, tokenizer_key: str, budget: int, seed: int,
               cache_dir: str | None = None, num_proc: int = 1) -> tuple[datasets.Dataset, dict, ChainReport]:
    """One data file's normalised rows (``recipe.data.sources.ROW_FEATURES``) -> (its chained rows, same features,
    ``row`` = the first chained conversation's row; the outcomes of the rows that cannot be chained as
    ``{"row", "reason", "detail"}`` lists (their own skip reasons, ``no_prompt``, ``template_error``); the
    :class:`ChainReport`). ``tokenizer_key``: the tokenizer's fingerprint (``examples.tokenizer_fingerprint``).

    Raises:
        ValueError: naming the file when no conversation of it can be chained.
    """
    prepared = rows.map(_prepare_batch, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
                        fn_kwargs={"tokenizer": tokenizer}, features=PREPARED_FEATURES,
                        new_fingerprint=_hash(CHAIN_VERSION, rows._fingerprint, tokenizer_key),
                        desc="measuring conversations to chain")
    reasons, lengths, system = (list(prepared[key]) for key in ("reason", "length", "system"))
    good = [i for i, r in enumerate(reasons) if not r]
    bad_rows = prepared.select([i for i, r in enumerate(reasons) if r]).select_columns(["row", "reason", "detail"])
    bad = {key: list(bad_rows[key]) for key in ("row", "reason", "detail")}
    if not good:
        raise ValueError(f"{name}: no conversation to chain ({len(reasons)} rows, none with a user turn before an "
                         "answer that the template renders)")
    groups = [[good[i] for i in g] for g in plan_chains([lengths[i] for i in good], budget, seed)]
    report = ChainReport(path=name, budget=budget, conversations=len(good), samples=len(groups),
                         multi=sum(len(g) > 1 for g in groups),
                         lengths=[sum(lengths[i] for i in g) for g in groups])
    report.dropped_turns = sum(list(prepared["dropped"])) + sum(system[i] for g in groups for i in g[1:])
    key = _hash(CHAIN_VERSION, prepared._fingerprint, budget, seed)
    chained = datasets.Dataset.from_generator(
        _generate_chains, features=ROW_FEATURES, cache_dir=cache_dir, fingerprint=key,
        gen_kwargs={"files": tuple(f["filename"] for f in prepared.cache_files),  # tuples: one shard
                    "groups": tuple(map(tuple, groups)), "key": key})
    return chained, bad, report
