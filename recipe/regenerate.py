"""Regenerate the assistant turns of conversation data with the target itself (EAGLE-3 and SpecForge train the draft on
the target's own answers).

    python -m recipe.regenerate --target DIR --data SOURCE [SOURCE ...] --output FILE.jsonl
        [--batch-size 8] [--max-new-tokens 512] [--temperature 0] [--top-p 1.0] [--seed 0] [--max-length 2048]
        [--limit N] [--max-turns N] [--data-column FIELD=COLUMN] [--device cuda|cpu] [--dtype bf16|fp32]
    torchrun --nproc_per_node N -m recipe.regenerate ...   # each rank takes every N-th conversation

Every conversation of ``--data`` (read like ``run.py --data``: ``recipe.data.sources``) keeps its system and user turns;
each assistant turn, in order, is replaced by what the target generates after the chat template's rendering of the
turns before it, the earlier assistant turns already regenerated (``apply_chat_template(add_generation_prompt=True)``).
Assistant turns that open a conversation (ShareGPT's split conversations often start so) have nothing before them to
generate from and are dropped (``dropped_leading_turns`` in the record). ``--max-turns N`` keeps each conversation up
to its N-th assistant turn and drops the rest (training at a short ``--max-length`` never sees later turns, so
generating them is wasted work). Conversations are generated in batches of like lengths (left padding, the KV cache
of ``transformers``' ``generate``), greedily with ``--temperature 0`` (the default) or sampled with ``--temperature T
--top-p P`` (``--seed`` + rank seeds the sampler).

Length budget (long prompts): ``--max-length`` bounds a whole conversation, prompts and regenerated answers together
(the length it will train at), and ``--max-new-tokens`` each answer. A turn is generated for at most
min(``--max-new-tokens``, ``--max-length`` − its prompt's tokens) tokens, so a long document is kept whole and its
answer fits after it. A conversation whose first prompt alone reaches ``--max-length`` is a counted ``too_long`` skip
(its context is never cut); once a conversation fills the budget its remaining assistant turns (and the user turns
before them) are cut, counted per record (``cut_turns``) and in the final line. An answer stopped by either limit
before its end-of-turn token counts in ``truncated_turns``.

Output: one JSON line per conversation, ``{"id": "<source>:<row>", "messages": [{"role", "content"}, ...],
"regenerated": {"target", "temperature", "top_p", "max_new_tokens", "max_turns", "seed", "source", "row",
"dropped_leading_turns", "truncated_turns", "cut_turns"}}``, readable as training data (OpenAI ``messages``); a local
source is named in the id by its absolute path. With ``WORLD_SIZE`` > 1 rank r writes ``FILE`` with ``.rank<r>`` before
its suffix (give all of them to ``--data``). Resumable: ids already in the output file(s) are skipped, so a killed run
continues where it stopped (a conversation is written once all its turns are done). Skips are counted by reason: the
source's bad rows (``recipe.data.conversations.SKIP_REASONS``), ``no_prompt`` (no assistant turn left once the opening
ones are dropped), ``too_long`` (a first prompt of ``--max-length`` tokens or more) and ``empty_generation`` (the target
ended a turn at once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from recipe.data.flags import add_data_arguments, check_data_arguments
from recipe.jsonl import read_jsonl
from recipe.lifecycle.distributed import launcher_ranks

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face format)")
    add_data_arguments(p, required=True, chain=False)
    p.add_argument("--output", type=Path, required=True, help="JSONL of regenerated conversations (appended to)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations generated together")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="new tokens per assistant turn at most (a long-answer set such as LongWriter needs more)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy decoding; > 0: sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (plus the rank)")
    p.add_argument("--max-length", type=int, default=2048,
                   help="token budget of a whole conversation, prompts and answers: a first prompt over it is a "
                   "counted too_long skip (never cut), later turns past it are cut and counted")
    p.add_argument("--limit", type=int, help="read the first N records of each data file")
    p.add_argument("--max-turns", type=int, help="keep each conversation up to its N-th assistant turn (default: all)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda:LOCAL_RANK when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="the target's dtype (default: bf16 on CUDA, else fp32)")
    p.add_argument("--cache-dir", type=Path, help="datasets cache for reading the sources")
    return p


def rank_output(output: Path, rank: int, world_size: int) -> Path:
    """The file rank ``rank`` writes: ``output`` itself for one rank, else ``<stem>.rank<r><suffix>``."""
    return output if world_size == 1 else output.with_name(f"{output.stem}.rank{rank}{output.suffix}")


def finished_ids(output: Path) -> set[str]:
    """Ids of the conversations in ``output`` and in its ``.rank<r>`` siblings (any world size); a last line cut
    by a kill is ignored."""
    ids = set()
    for file in [output, *sorted(output.parent.glob(f"{output.stem}.rank*{output.suffix}"))]:
        if not file.is_file():
            continue
        ids.update(row["id"] for _, row in read_jsonl(file, skip_bad=True) if isinstance(row, dict) and "id" in row)
    return ids


def drop_partial_line(path: Path) -> None:
    """Cut a last line left without its newline by a kill, so appended records start on a line of their own."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def first_turns(messages: list[dict], max_turns: int | None) -> list[dict]:
    """``messages`` up to and including the ``max_turns``-th assistant turn (all of them with None)."""
    if max_turns is None:
        return messages
    seen = 0
    for i, m in enumerate(messages):
        seen += m["role"] == "assistant"
        if seen == max_turns:
            return messages[: i + 1]
    return messages


def source_key(item) -> str:
    """How a record's id names its source (a ``recipe.data.sources.DataFile``): a local file by its absolute path,
    so a rerun from another folder or with another spelling of the path resumes; a hub dataset by its name."""
    return item.name if item.kind == "hub" else str(Path(item.name).resolve())


def read_conversations(args, skips: Counter) -> list[dict]:
    """``[{"id", "source", "row", "dropped_leading_turns", "messages"}]`` of every usable record of ``--data``:
    assistant turns that open a conversation are dropped (nothing to generate them from; ShareGPT's split
    conversations often start so), the rest is cut after ``--max-turns`` assistant turns. Bad rows, and rows left
    without an answer to generate (``no_prompt``), are counted in ``skips``."""
    from recipe.data.sources import load_rows, resolve_source  # import cost: pulls in datasets

    out = []
    for spec in args.data:
        for item in resolve_source(spec):
            rows = load_rows(item, limit=args.limit, columns=args.data_column,
                             cache_dir=str(args.cache_dir) if args.cache_dir else None)
            for r in rows:
                if r["reason"]:
                    skips[r["reason"]] += 1
                    continue
                messages = list(r["messages"])
                lead = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
                messages = messages[lead:]  # answers with nothing before them (a split conversation's tail)
                if not any(m["role"] == "assistant" for m in messages):
                    skips["no_prompt"] += 1
                    continue
                out.append({"id": f"{source_key(item)}:{r['row']}", "source": item.name, "row": r["row"],
                            "dropped_leading_turns": lead,
                            "messages": [dict(m) for m in first_turns(messages, args.max_turns)]})
    return out


class Regenerator:
    """Batched regeneration of assistant turns with a Hugging Face causal LM (``model``, eval mode) and its
    ``tokenizer`` (chat template; padded on the left, its EOS as pad token when it has none)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, top_p: float, max_length: int):
        if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1 or max_length < 1:
            raise ValueError(f"need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1, max_length >= 1; got "
                             f"{max_new_tokens}, {temperature}, {top_p}, {max_length}")
        self.model, self.tokenizer = model, tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        self.eos_ids.add(int(self.tokenizer.eos_token_id))
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
            {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        self.generate_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": self.tokenizer.pad_token_id,
                                **sampling}

    @torch.no_grad()
    def batch(self, conversations: list[dict]) -> tuple[list[dict], Counter, int]:
        """Regenerate every assistant turn of ``conversations`` (changed in place, ``truncated_turns`` and
        ``cut_turns`` counts added) within the length budget (module docstring); returns (the finished ones, skip
        counts by reason, new tokens generated)."""
        skips: Counter = Counter()
        tokens = 0
        live = list(conversations)
        for c in live:
            c["truncated_turns"] = c["cut_turns"] = 0
        turn = 0
        while True:
            todo = []  # (conversation, message index) of each conversation's assistant turn number `turn`
            for c in live:
                idx = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
                if turn < len(idx):
                    todo.append((c, idx[turn]))
            if not todo:
                break
            prompts = [self.tokenizer.apply_chat_template(c["messages"][:i], tokenize=False,
                                                          add_generation_prompt=True) for c, i in todo]
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            room = [self.max_length - n for n in enc["attention_mask"].sum(dim=1).tolist()]
            keep = [j for j, r in enumerate(room) if r >= 1]
            for j in set(range(len(todo))) - set(keep):
                c, i = todo[j]
                if turn == 0:  # the prompt alone is over the budget: skipped whole, never cut
                    skips["too_long"] += 1
                    live.remove(c)
                else:  # the conversation so far fills the budget: end it after the last regenerated answer
                    c["cut_turns"] = sum(m["role"] == "assistant" for m in c["messages"][i:])
                    c["messages"] = c["messages"][:i]
                    while c["messages"][-1]["role"] != "assistant":
                        c["messages"].pop()
            if keep:
                ids = enc["input_ids"][keep].to(self.model.device)
                mask = enc["attention_mask"][keep].to(self.model.device)
                width = int(mask.sum(dim=1).max())  # drop columns that are padding in every kept row
                ids, mask = ids[:, -width:], mask[:, -width:]
                cap = min(self.max_new_tokens, max(room[j] for j in keep))
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          **{**self.generate_kwargs, "max_new_tokens": cap})
                for row, j in enumerate(keep):
                    c, i = todo[j]
                    new = out[row, width:width + min(self.max_new_tokens, room[j])].tolist()
                    # up to the first end-of-turn id (generate pads a finished row after it); none: cut at the cap
                    n = next((k + 1 for k, t in enumerate(new) if t in self.eos_ids), None)
                    if n is None:
                        c["truncated_turns"] += 1
                        n = len(new)
                    tokens += n
                    text = self.tokenizer.decode(new[:n], skip_special_tokens=True).strip()
                    if not text:
                        skips["empty_generation"] += 1
                        live.remove(c)
                        continue
                    c["messages"][i] = {"role": "assistant", "content": text}
            turn += 1
        return live, skips, tokens


def _record(c: dict, provenance: dict) -> dict:
    return {"id": c["id"], "messages": c["messages"],
            "regenerated": {**provenance, "source": c["source"], "row": c["row"],
                            "dropped_leading_turns": c["dropped_leading_turns"],
                            "truncated_turns": c["truncated_turns"], "cut_turns": c["cut_turns"]}}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_data_arguments(parser, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rich.console import Console  # import cost: rich

    # import cost: rich
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from recipe.target.capture import TargetModel  # import cost: pulls in transformers

    console = Console(stderr=True)
    skips: Counter = Counter()
    try:
        _, rank, world, local_rank = launcher_ranks(os.environ)  # whichever launcher started it (or one process)
        if args.batch_size < 1 or (args.max_turns is not None and args.max_turns < 1):
            raise ValueError(f"--batch-size and --max-turns must be >= 1, got {args.batch_size}, {args.max_turns}")
        conversations = read_conversations(args, skips)
        done = finished_ids(args.output)
        mine = [c for k, c in enumerate(conversations) if k % world == rank and c["id"] not in done]
        mine.sort(key=lambda c: sum(len(m["content"]) for m in c["messages"]))  # batches of like lengths pad less
        device = args.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        target = TargetModel(args.target, dtype=DTYPES[args.dtype] if args.dtype else None, device=device)
        regen = Regenerator(target.model, target.load_tokenizer(), args.max_new_tokens, args.temperature,
                            args.top_p, args.max_length)
    except (ValueError, FileNotFoundError, OSError) as exc:
        console.print(f"[bold red]error[/bold red]: {exc}")
        return 2
    torch.manual_seed(args.seed + rank)
    provenance = {"target": str(args.target), "temperature": args.temperature,
                  "top_p": args.top_p if args.temperature > 0 else None, "max_new_tokens": args.max_new_tokens,
                  "max_turns": args.max_turns, "seed": args.seed}
    out_file = rank_output(args.output, rank, world)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    drop_partial_line(out_file)
    console.print(f"rank {rank}/{world}: {len(mine)} conversations to regenerate "
                  f"({len(done)} already in {args.output}) -> {out_file}")
    tokens, written, cut = 0, 0, 0
    columns = [TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[rate]}")]
    with Progress(*columns, console=console) as progress, out_file.open("a", encoding="utf-8") as f:
        task = progress.add_task("regenerate", total=len(mine), rate="")
        for start in range(0, len(mine), args.batch_size):
            batch = mine[start:start + args.batch_size]
            finished, batch_skips, new_tokens = regen.batch(batch)
            skips.update(batch_skips)
            tokens += new_tokens
            cut += sum(c["cut_turns"] for c in finished)
            for c in finished:
                f.write(json.dumps(_record(c, provenance), ensure_ascii=False) + "\n")
            f.flush()
            written += len(finished)
            elapsed = progress.tasks[task].elapsed or 1e-9
            progress.update(task, advance=len(batch), rate=f"{tokens / elapsed:,.1f} tok/s")
    console.print(f"rank {rank}: wrote {written} conversations, {tokens} new tokens; {cut} assistant turns cut "
                  f"at the --max-length budget; skipped {sum(skips.values())}: {dict(skips.most_common()) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
