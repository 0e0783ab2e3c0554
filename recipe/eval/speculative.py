"""Greedy decoding and chain speculative decoding with greedy verification (temperature 0), one prompt at a time.

Round of speculative decoding (known tokens ``t_0..t_n``, target cache holding positions ``0..n``, target's greedy
next token ``t_{n+1}`` not yet in its cache):

1. the drafter receives the aux features of the anchors accepted since its last call and the tokens after them,
   and proposes ``k`` target ids ``d_1..d_k``;
2. the target runs once over ``[t_{n+1}, d_1, ..., d_k]``; draft token ``d_i`` is accepted while it equals the
   target's argmax at the previous position; with ``a`` accepted, the target's argmax after the last accepted one
   is the bonus token; ``a + 1`` tokens are emitted (``d_1..d_a`` and the bonus) and the target cache is cropped
   to ``0..n+1+a``; positions ``n+1..n+1+a`` become the drafter's next anchors, with the target's features.

Acceptance length τ = emitted tokens / verification steps (docs/algorithm.md, "Acceptance length τ"). Tokens past
``max_new_tokens`` or the EOS token are not emitted and not counted. With greedy verification the output equals
plain greedy decoding of the target token for token (lossless); ``check_lossless`` turns a mismatch into an error
naming the prompt.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from recipe.target.runtime import CachedTarget


class Drafter(Protocol):
    """What speculative decoding needs from a draft (``recipe.eval.draft_runtime.EagleDrafter``)."""

    def begin(self) -> None:
        """Start a new sequence."""

    def propose(self, aux_SA: torch.Tensor, next_ids_S: torch.Tensor, k: int) -> list[int]:
        """New anchors' aux features [m, A] and the tokens that follow them [m] -> k proposed target ids."""


@dataclass
class Generation:
    """Output of one decoding run: ``tokens`` (new ids only), ``seconds`` (wall), and for speculative decoding
    ``accepted`` (draft tokens accepted per verification step, after truncation) and ``k``."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)
    k: int = 0

    @property
    def timed(self) -> bool:
        """Whether ``seconds`` was measured (a batched greedy reference leaves it nan for prompts not decoded alone)."""
        return not math.isnan(self.seconds)

    @property
    def verify_steps(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (accepted + 1); nan without verification steps."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else float("nan")


class MismatchError(RuntimeError):
    """Speculative output differs from greedy decoding (the decoder is not lossless)."""


def stop_index(tokens: list[int], budget: int, eos_token_id: int | None) -> int:
    """How many of ``tokens`` to emit: up to ``budget``, and up to and including the first EOS."""
    n = min(len(tokens), budget)
    if eos_token_id is not None and eos_token_id in tokens[:n]:
        n = tokens.index(eos_token_id) + 1
    return n


@dataclass
class PromptPrefill:
    """The target's forward over one prompt, shared by every decoding of that prompt (``prefill_prompt``):
    ``num_ids`` prompt tokens, ``first`` (the target's greedy token after them), ``aux_SA`` [S, A] (the prompt's aux
    features; A = 0 without aux layers) and ``seconds`` (its wall time, counted into every decoding that reuses it)."""

    num_ids: int
    first: int
    aux_SA: torch.Tensor
    seconds: float


@torch.no_grad()
def prefill_prompt(target: CachedTarget, prompt_ids: list[int]) -> PromptPrefill:
    """Reset ``target``'s cache and run the prompt through it once; the cache then holds the prompt, and a decoding
    given this ``PromptPrefill`` (``shared=``) crops the cache back to it instead of running the prompt again.
    Raises ValueError for an empty prompt."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    start = time.perf_counter()
    target.begin()
    out = target.forward(prompt_ids, logits_rows=1)  # only the last row is read: no [S, V] logits of the prompt
    return PromptPrefill(num_ids=len(prompt_ids), first=int(out.logits_SV[-1].argmax()), aux_SA=out.aux_SA,
                         seconds=time.perf_counter() - start)


def _start(target: CachedTarget, prompt_ids: list[int], shared: PromptPrefill | None) -> tuple[float, PromptPrefill]:
    """``(start time counting the prefill's seconds, the prefill)``: a new ``prefill_prompt``, or ``shared`` with
    ``target``'s cache cropped back to its prompt (ValueError when it holds another prompt)."""
    if shared is None:
        shared = prefill_prompt(target, prompt_ids)
    elif shared.num_ids != len(prompt_ids) or len(target) < shared.num_ids:
        raise ValueError(f"the shared prefill holds {shared.num_ids} prompt tokens, the prompt has {len(prompt_ids)} "
                         f"and the target cache {len(target)}")
    else:
        target.crop(shared.num_ids)
    return time.perf_counter() - shared.seconds, shared


@torch.no_grad()
def greedy_generate(target: CachedTarget, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None, shared: PromptPrefill | None = None) -> Generation:
    """Plain greedy decoding with the target's KV cache: one forward per token. Returns the new tokens.
    ``shared``: the prompt's ``PromptPrefill`` on this ``target`` (its cache is cropped back to the prompt)."""
    start, shared = _start(target, prompt_ids, shared)
    tokens: list[int] = [shared.first]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        tokens.append(int(target.forward([tokens[-1]]).logits_SV[-1].argmax()))
    return Generation(tokens=tokens, seconds=time.perf_counter() - start)


@torch.no_grad()
def greedy_generate_batched(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None,
                            pad_token_id: int = 0) -> list[list[int]]:
    """Greedy decoding of all ``prompts`` at once: one left-padded batch [P, S_max] through a ``transformers``
    causal LM ``model`` (one that takes ``logits_to_keep``, as transformers' causal LMs do) with one KV cache, each
    row's RoPE positions counted from its first real token (the attention mask hides the padding), one forward of P
    new tokens per decoding step. Returns each prompt's new tokens as ``greedy_generate`` does (up to
    ``max_new_tokens``, up to and including the first EOS).

    The same decoding as ``greedy_generate`` prompt by prompt, in one forward per token instead of one per token and
    prompt; the matmuls see P rows instead of 1, so logits can differ in the last float bits (a near-tie could then
    flip an argmax). Raises ValueError for no prompts, an empty prompt or ``max_new_tokens < 1``.
    """
    if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
        raise ValueError("greedy_generate_batched needs non-empty prompts and max_new_tokens >= 1")

    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids_PS = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask_PS = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids_PS[row, longest - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask_PS[row, longest - len(p):] = 1
    ids_PS, mask_PS = ids_PS.to(device), mask_PS.to(device)
    positions_PS = (mask_PS.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits_PV = model(input_ids=ids_PS, attention_mask=mask_PS, position_ids=positions_PS, past_key_values=cache,
                      use_cache=True, logits_to_keep=1).logits[:, -1]
    positions_P1 = positions_PS[:, -1:]
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while True:
        next_P = logits_PV.float().argmax(dim=-1)
        for row, token in enumerate(next_P.tolist()):
            if not done[row]:
                tokens[row].append(token)
                done[row] = len(tokens[row]) >= max_new_tokens or token == eos_token_id
        if all(done):
            return tokens
        mask_PS = torch.cat([mask_PS, mask_PS.new_ones(len(prompts), 1)], dim=1)
        positions_P1 = positions_P1 + 1
        logits_PV = model(input_ids=next_P.view(-1, 1), attention_mask=mask_PS, position_ids=positions_P1,
                          past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


@torch.no_grad()
def prefill(target: CachedTarget, drafter, prompt_ids: list[int], shared: PromptPrefill | None = None):
    """Start a speculative generation: reset the drafter's cache and run the prompt through the target (or, with
    ``shared``, crop the target's cache back to that prefill of the prompt and reuse it). Returns ``(start time,
    [the target's first token], aux features [S, A] of the anchors not yet given to the drafter, the token after
    each of those anchors [S])``. Raises ValueError for an empty prompt."""
    start, shared = _start(target, prompt_ids, shared)
    drafter.begin()
    tokens = [shared.first]
    return start, tokens, shared.aux_SA, torch.tensor(list(prompt_ids[1:]) + tokens)


def speculative_generate(target: CachedTarget, drafter: Drafter, prompt_ids: list[int], k: int,
                         max_new_tokens: int, eos_token_id: int | None = None,
                         shared: PromptPrefill | None = None) -> Generation:
    """Chain speculative decoding with greedy verification; ``k`` >= 1 draft tokens per round.

    The target's first token comes from the prompt's forward pass (no verification step); every later token is
    emitted by a verification step. ``shared``: the prompt's ``PromptPrefill`` on this ``target``, reused instead of
    a new forward over the prompt (its seconds are counted). Raises ValueError for ``k < 1`` or an empty prompt.
    """
    if k < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {k}")
    start, tokens, new_aux, new_next = prefill(target, drafter, prompt_ids, shared)
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        proposal = drafter.propose(new_aux, new_next, k)
        if len(proposal) != k:
            raise ValueError(f"drafter proposed {len(proposal)} tokens, expected k={k}")
        cached = len(target)
        step = target.forward([tokens[-1], *proposal])
        greedy = step.logits_SV.argmax(dim=-1).tolist()  # greedy[i]: target's token after input i
        a = 0
        while a < k and proposal[a] == greedy[a]:
            a += 1
        emitted = stop_index(proposal[:a] + [greedy[a]], max_new_tokens - len(tokens), eos_token_id)
        accepted.append(emitted - 1)
        # Positions cached..cached+a hold tokens[-1], d_1..d_a: they are now anchors with target features.
        target.crop(cached + a + 1)
        new_aux = step.aux_SA[: a + 1]
        tokens.extend(proposal[:a] + [greedy[a]])
        new_next = torch.tensor(tokens[-(a + 1):])
        tokens = tokens[: len(tokens) - (a + 1) + emitted]
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, accepted=accepted, k=k)


def check_lossless(name: str, reference: Generation, speculative: Generation) -> None:
    """Raise ``MismatchError`` naming the prompt and the first differing position when the token lists differ."""
    if reference.tokens == speculative.tokens:
        return
    ref, spec = reference.tokens, speculative.tokens
    i = next((j for j, (x, y) in enumerate(zip(ref, spec)) if x != y), min(len(ref), len(spec)))
    raise MismatchError(f"prompt {name!r}: speculative output differs from greedy decoding at new token {i} "
                        f"(greedy {ref[i:i + 5]}, speculative {spec[i:i + 5]}; lengths {len(ref)} vs {len(spec)})")

