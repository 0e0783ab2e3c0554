"""Prompts at a chosen context length for ``python -m recipe.eval --context-lengths``.

Two ways to get a prompt of about L tokens of context:

- **inserted context** (``context_prompts``): every prompt is preceded by about L tokens of real earlier
  conversation, whole ``(user, assistant)`` turn pairs of conversations from ``--context-data`` (ShareGPT or OpenAI
  form, read by ``recipe.data.conversations``), rendered by the target's chat template before the final user turn.
  The conversations are drawn by seed (one ``random.Random`` per seed, length and prompt), each contributing a
  prefix of its turn pairs, as long as the running total stays at or below L; drawing stops at 95 % of L (or after
  ``MAX_DRAWS`` conversations). A conversation with a user turn equal to the prompt's text is never used. The final
  user turn is the prompt (``unrelated``) or a request about the inserted text (``about-context``, one of
  ``ABOUT_CONTEXT_REQUESTS`` drawn by the same seed).
- **bucketed prompts** (``bucket_prompts``): prompts that are long by themselves are measured (their chat-template
  token count) and each goes to the largest listed length at or below its count; shorter ones are skipped (counted).

``ContextPrompt.context_tokens`` is the context's measured size in tokens: the rendered prompt's tokens minus those
of its final user turn rendered alone (inserted context), or the whole rendered prompt (bucketed prompts).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from recipe.data.conversations import iter_rows
from recipe.eval.prompts import Prompt, prompt_ids

CONTEXT_REQUESTS = ("unrelated", "about-context")
MAX_DRAWS = 400  # conversations drawn at most to fill one prompt's context
FILL = 0.95  # drawing stops once the context reaches this fraction of the length
EXCERPT_CHARS = 160

ABOUT_CONTEXT_REQUESTS = {
    "summarise": "Summarise the conversation above in one short paragraph.",
    "list-points": "List the main points of the conversation above as a numbered list.",
    "quote": "Quote, word for word, the three key sentences of the assistant's answers in the conversation above.",
    "question": 'Earlier in this conversation the user asked: "{excerpt}" What did the assistant answer? Answer '
                "from the conversation above.",
}
"""Requests of ``--context-request about-context`` (name -> text; the name becomes the prompt's category).
``{excerpt}``: the start of the inserted context's first user turn (at most ``EXCERPT_CHARS`` characters, whole
words, whitespace collapsed)."""


@dataclass(frozen=True)
class ContextPrompt:
    """One prompt at one context length: ``name`` (the prompt's, ``@L`` appended), ``category`` (the prompt's, or the
    about-context request's name), ``ids`` (the rendered prompt's token ids), ``context_tokens`` (see the module
    docstring), ``length`` (the bucket's L in tokens), ``messages`` (the rendered turns; the last is the request)."""

    name: str
    category: str
    ids: list[int]
    context_tokens: int
    length: int
    messages: list[dict] = field(default_factory=list)


@dataclass
class ContextData:
    """Conversations usable as inserted context: ``pairs[c]`` the whole ``(user, assistant)`` turn pairs of
    conversation c, in order (system turns and turns before the first user turn left out; a conversation stops at its
    first turn out of alternation);
    ``skipped``: rows of the files that could not be used, by reason (``recipe.data.conversations.SKIP_REASONS``,
    plus ``no_turn_pair``)."""

    pairs: list[list[tuple[dict, dict]]]
    skipped: Counter

    def skip_note(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"


def read_context_data(files: list[str | Path], limit: int | None = None) -> ContextData:
    """The conversations of ``files`` (``.json``/``.jsonl``, ShareGPT or OpenAI form; at most ``limit`` rows a file)
    as turn pairs. Raises ValueError naming the file for a whole-file problem (``recipe.data.conversations``) or when
    no conversation has a turn pair."""
    pairs, skipped = [], Counter()
    for file in files:
        for row in iter_rows(file, limit=limit):
            if row.reason:
                skipped[row.reason] += 1
                continue
            turns = [m for m in row.messages if m["role"] != "system"]
            while turns and turns[0]["role"] != "user":  # a split conversation may open with the assistant
                turns = turns[1:]
            conv = []
            for i in range(0, len(turns) - 1, 2):
                if (turns[i]["role"], turns[i + 1]["role"]) != ("user", "assistant"):
                    break
                conv.append((turns[i], turns[i + 1]))
            if conv:
                pairs.append(conv)
            else:
                skipped["no_turn_pair"] += 1
    if not pairs:
        raise ValueError(f"{', '.join(map(str, files))}: no conversation with a (user, assistant) turn pair to use "
                         f"as context (skipped: {dict(skipped)})")
    return ContextData(pairs=pairs, skipped=skipped)


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the target's chat template with the generation prompt, tokenised
    without extra special tokens (as ``recipe.eval.prompts.prompt_ids``)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _PairCosts:
    """Tokens each turn pair adds before a final user turn (rendered with and without it; cached)."""

    def __init__(self, tokenizer, data: ContextData):
        self.tokenizer, self.data, self.cache = tokenizer, data, {}
        self.probe = [{"role": "user", "content": "?"}]
        self.base = len(render_ids(tokenizer, self.probe))

    def __call__(self, c: int, j: int) -> int:
        if (c, j) not in self.cache:
            user, assistant = self.data.pairs[c][j]
            self.cache[c, j] = len(render_ids(self.tokenizer, [user, assistant] + self.probe)) - self.base
        return self.cache[c, j]


def draw_context(data: ContextData, costs, length: int, rng: random.Random, exclude: str = "") -> list[dict]:
    """Whole turn pairs of conversations drawn by ``rng`` whose summed cost (``costs(c, j)``: tokens of pair j of
    conversation c) stays <= ``length``: each drawn conversation adds its first pairs while they fit; drawing stops
    at ``FILL``·length or after ``MAX_DRAWS`` conversations. Conversations with a user turn equal to ``exclude`` are
    skipped. Returns the turns in order (empty for ``length`` 0)."""
    turns, total = [], 0
    if length <= 0:
        return turns
    n = len(data.pairs)
    for c in rng.sample(range(n), min(n, MAX_DRAWS)):
        if total >= FILL * length:
            break
        if exclude and any(user["content"].strip() == exclude.strip() for user, _ in data.pairs[c]):
            continue
        for j, (user, assistant) in enumerate(data.pairs[c]):
            cost = costs(c, j)
            if total + cost > length:
                break
            turns += [user, assistant]
            total += cost
    return turns


def about_context_request(context: list[dict], rng: random.Random) -> tuple[str, str]:
    """``(name, text)`` of a request about ``context`` drawn by ``rng`` from ``ABOUT_CONTEXT_REQUESTS``."""
    name = rng.choice(sorted(ABOUT_CONTEXT_REQUESTS))
    first_user = " ".join(next(m["content"] for m in context if m["role"] == "user").split())
    excerpt = first_user if len(first_user) <= EXCERPT_CHARS else \
        first_user[:EXCERPT_CHARS].rsplit(" ", 1)[0] + " ..."
    return name, ABOUT_CONTEXT_REQUESTS[name].format(excerpt=excerpt)


def context_prompts(tokenizer, prompts: list[Prompt], data: ContextData, lengths: list[int], seed: int,
                    request: str = "unrelated") -> dict[int, list[ContextPrompt]]:
    """Every prompt at every length of ``lengths`` with inserted context (module docstring); deterministic in
    ``seed``. ``request``: ``"unrelated"`` (the prompt's text is the final user turn) or ``"about-context"`` (a
    request about the inserted context; then every length must be > 0). Returns ``{L: [ContextPrompt, ...]}`` in
    prompt order. Raises ValueError for an unknown request, ``about-context`` at length 0, or a length at which no
    context could be drawn (every conversation's first turn pair is longer)."""
    if request not in CONTEXT_REQUESTS:
        raise ValueError(f"context request {request!r}: choose from {', '.join(CONTEXT_REQUESTS)}")
    if request == "about-context" and min(lengths) <= 0:
        raise ValueError("--context-request about-context needs context lengths > 0 (a request about no context)")
    costs = _PairCosts(tokenizer, data)
    out: dict[int, list[ContextPrompt]] = {}
    for length in lengths:
        bucket = []
        for i, prompt in enumerate(prompts):
            rng = random.Random(f"context:{seed}:{length}:{i}")
            context = draw_context(data, costs, length, rng, exclude=prompt.text)
            if length > 0 and not context:
                raise ValueError(f"no earlier turns of the context data fit in {length} tokens (prompt "
                                 f"{prompt.name!r}): choose a longer context length")
            category, text = prompt.category, prompt.text
            if request == "about-context":
                category, text = about_context_request(context, rng)
            final = [{"role": "user", "content": text}]
            ids = render_ids(tokenizer, context + final)
            context_tokens = len(ids) - len(render_ids(tokenizer, final))
            bucket.append(ContextPrompt(name=f"{prompt.name}@{length}", category=category, ids=ids,
                                        context_tokens=context_tokens, length=length, messages=context + final))
        out[length] = bucket
    return out


def bucket_prompts(tokenizer, prompts: list[Prompt], lengths: list[int],
                   max_tokens: int | None = None) -> tuple[dict[int, list[ContextPrompt]], Counter]:
    """Prompts that are long by themselves, bucketed by their measured length: each rendered prompt (one user turn,
    ``prompt_ids``) goes to the largest of ``lengths`` at or below its token count. Returns ``({L: [ContextPrompt,
    ...]}, skipped)`` with ``skipped["shorter_than_lengths"]`` (below the smallest length) and, with
    ``max_tokens``, ``skipped["too_long_for_target"]`` (more tokens than that)."""
    out: dict[int, list[ContextPrompt]] = {length: [] for length in lengths}
    skipped: Counter = Counter()
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
        if max_tokens is not None and len(ids) > max_tokens:
            skipped["too_long_for_target"] += 1
            continue
        fits = [length for length in lengths if length <= len(ids)]
        if not fits:
            skipped["shorter_than_lengths"] += 1
            continue
        out[fits[-1]].append(ContextPrompt(name=prompt.name, category=prompt.category, ids=ids,
                                           context_tokens=len(ids), length=fits[-1],
                                           messages=[{"role": "user", "content": prompt.text}]))
    return out, skipped
