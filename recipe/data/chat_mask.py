"""Tokenise a conversation with the target's own chat template and mark the assistant tokens (the loss mask).

Convention (docs/architecture.md): ``loss_mask[j] = 1`` iff token j belongs to an assistant turn's content or its
end-of-turn token(s) (ChatML ``<|im_end|>``, Llama-3 ``<|eot_id|>``). The turn header (``<|im_start|>assistant\\n``)
and the separator after the end-of-turn token (ChatML's ``\\n``) are not supervised: the model never generates them.

Method (template-agnostic, no per-model patterns). Let ``render(msgs, gen)`` be
``tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)`` and ``full = render(messages)``.
For each assistant message i:

1. **Start** (after the header). ``render(messages[:i], gen=True)`` ends exactly where the template starts the
   assistant's content, because the generation prompt *is* the assistant header. When that text is a prefix of
   ``full`` its length is the start. Default system prompts need no special care: the same prefix of messages
   renders the same injected system turn in both texts.
2. **End** (after the turn). ``render(messages[:i+1])`` ends after turn i; when it is a prefix of ``full`` its
   length is the end of the turn.
3. **Fallback**, used when a template renders a message differently once it is no longer the last one (so the
   prefixes above are not prefixes of ``full``): the turn's content is searched in ``full`` after the previous
   turn's end (with surrounding whitespace stripped, as templates often ``trim`` it); the turn then extends over
   the special tokens that follow it directly. Reasoning templates (Qwen3: a ``<think>...</think>`` block at the
   start of an assistant content) render the reasoning of assistant turns before the last user turn not at all:
   when the content is not found and holds ``</think>``, the text after the last ``</think>`` is searched instead,
   so an earlier turn is supervised as the template renders it (the answer only) and a turn after the last user
   turn with its reasoning (found by the prefixes, as at inference, where the model writes the ``<think>`` block).
   A content that cannot be found raises ``BadRow("template_error")``.
4. The character span [start, end) is mapped to tokens with the fast tokenizer's ``offset_mapping`` of ``full``
   (tokenised with ``add_special_tokens=False``, exactly as ``apply_chat_template(tokenize=True)`` does); a token is
   in the span iff its first character is. Trailing tokens of the span that are whitespace and not special tokens
   (the separator between turns) are dropped.

``transformers``' ``return_assistant_tokens_mask`` needs ``{% generation %}`` markers in the template, which most
templates (SmolLM2's included) lack; this method works from any template's rendering alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipe.data.conversations import BadRow


@dataclass
class ChatTokens:
    """``input_ids`` [S] token ids of the rendered conversation; ``loss_mask`` [S] 0/1, 1 on assistant tokens."""

    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_ids(tokenizer) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return special


def _consistent_prefix(tokenizer, messages: list[dict], full: str, add_generation_prompt: bool) -> int | None:
    """Length of ``render(messages)`` if it is a prefix of ``full``, else None (also when rendering fails)."""
    try:
        text = _render(tokenizer, messages, add_generation_prompt)
    except Exception:  # noqa: BLE001 - any template failure (e.g. empty message list) means "use the fallback"
        return None
    return len(text) if full.startswith(text) else None


REASONING_END = "</think>"


def _fallback_span(content: str, full: str, cursor: int, offsets, ids, special: set[int]) -> tuple[int, int]:
    needle = content.strip()
    start = full.find(needle, cursor)
    if start < 0 and REASONING_END in content:  # the template dropped this turn's reasoning (Qwen3 style)
        needle = content.rsplit(REASONING_END, 1)[1].strip()
        start = full.find(needle, cursor) if needle else -1
    if start < 0:
        raise BadRow("template_error", "assistant content not found verbatim in the rendered conversation")
    end = start + len(needle)
    # Extend over the special tokens (end-of-turn) that directly follow the content.
    for tok_id, (tok_start, tok_end) in zip(ids, offsets):
        if tok_start < end:
            continue
        if tok_start == end and tok_id in special and tok_end > tok_start:
            end = tok_end
            continue
        break
    return start, end


def assistant_char_spans(messages: list[dict], tokenizer, full: str, offsets, ids) -> list[tuple[int, int]]:
    """Character spans [start, end) of ``full`` covering each assistant turn's content and end-of-turn text.

    Raises:
        BadRow: ``template_error`` when a turn cannot be located (see module docstring, step 3).
    """
    special = _special_ids(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _consistent_prefix(tokenizer, messages[:i], full, add_generation_prompt=True)
        end = _consistent_prefix(tokenizer, messages[: i + 1], full, add_generation_prompt=False)
        if start is None or end is None or not cursor <= start < end:
            start, end = _fallback_span(message["content"], full, cursor, offsets, ids, special)
        spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(messages: list[dict], tokenizer) -> ChatTokens:
    """Render ``messages`` with ``tokenizer``'s chat template; return ids and the assistant loss mask (untruncated).

    ``tokenizer`` must be a fast tokenizer (offset mapping) with a ``chat_template``.

    Raises:
        ValueError: the tokenizer is not fast or has no chat template.
        BadRow: ``template_error`` when the template fails or an assistant turn cannot be located.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; offset mapping is required")
    if not tokenizer.chat_template:
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'tokenizer')} has no chat_template")
    try:
        full = _render(tokenizer, messages, add_generation_prompt=False)
    except Exception as err:  # noqa: BLE001 - templates raise their own errors (e.g. role alternation)
        raise BadRow("template_error", str(err)[:80]) from None
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    for start, end in assistant_char_spans(messages, tokenizer, full, offsets, ids):
        in_span = [j for j, (a, b) in enumerate(offsets) if start <= a < end and b > a]
        while in_span and ids[in_span[-1]] not in special and not full[slice(*offsets[in_span[-1]])].strip():
            in_span.pop()  # separator whitespace after the end-of-turn token
        for j in in_span:
            mask[j] = 1
    return ChatTokens(input_ids=list(ids), loss_mask=mask)
