"""Evaluation prompts: JSONL with ``{"prompt": str}`` or ``{"turns": [str, ...]}`` (the first turn is used, as in
MT-Bench first-turn evaluation) and an optional ``"category"``; rendered with the target's chat template."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipe.jsonl import read_jsonl


@dataclass(frozen=True)
class Prompt:
    """``name`` (``question_id``/``id`` or ``FILE:LINE``), ``category`` ("all" when absent), ``text`` (first user
    turn)."""

    name: str
    category: str
    text: str


def read_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read a prompts JSONL file; blank lines are skipped. Raises ValueError naming the file and line for invalid
    JSON, a non-object, or a row without a non-empty string ``prompt`` / ``turns[0]``; FileNotFoundError if
    missing. ``limit`` keeps the first N prompts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts: list[Prompt] = []
    for lineno, row in read_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        text = row.get("prompt")
        if text is None and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: needs a non-empty string 'prompt' or 'turns' list")
        name = str(row.get("question_id", row.get("id", where)))
        prompts.append(Prompt(name=name, category=str(row.get("category") or "all"), text=text))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` as one user turn rendered by the target's chat template with the generation prompt
    (``add_generation_prompt=True``), tokenised without extra special tokens (as ``apply_chat_template`` does)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
