"""``python -m recipe.plan --ds_config F --target DIR|config.json|NAME --length N[,N...]
[--gpu h100|h200|a100-80g|<GiB>] [--world-size W] [--tp 1,2] [--cp 1,2,4] [--mlp-tile none,4096]
[--sparse-anchors MASKS] [--supervised-fraction F] [--data SOURCE.. [--limit N]] [--ttt-steps K]
[--draft-vocab-size Vd] [--offline] [--freeze-lm-head] [--json OUT]``:
the per-rank memory plan (``recipe.plan``) by component, whether it fits the GPU, and the longest length that fits
each layout. ``--tp`` / ``--cp`` lists override the JSON's parallelism section and ``--mlp-tile`` its
``memory.mlp_tile_size`` ("none" or 0: untiled), one table per (tp, cp, MLP tile). ``--sparse-anchors`` adds a table
with ``memory.sparse_anchors`` on per named supervision mask, ``--supervised-fraction F`` one for the mask whose last
F of the positions are supervised, and ``--data`` measures F from the run's data (``recipe.plan.supervision``) when
``--supervised-fraction`` is not given. ``--target NAME``: the public name of a shipped config
(``recipe.target.named``), so a layout is planned before any weight is downloaded. The JSON's ``"auto"`` memory
switches are resolved per table for ``--gpu`` at the longest ``--length``, as a run of that longest sample on that
GPU resolves them (``recipe.config_memory.MemoryOptions.resolve``): every row of the table plans that choice, and a
line under it says what was chosen, its predicted peak and the alternative rejected (the plan's JSON:
``"memory_auto"`` per layout). Bad input: one line naming it, exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe.arg_types import length_list
from recipe.config_keys import ConfigError
from recipe.config_memory import MemoryOptions, MemoryReport
from recipe.data.flags import add_data_arguments, check_data_arguments
from recipe.plan import (PlanError, PlanInputs, load_inputs, longest_fit, plan_rows, read_sections, resolve_inputs,
                         states)
from recipe.plan.spec import MASKS, check_fraction, fraction_mask, mask_fraction, spec_draft_config, spec_for_memory
from recipe.plan.states import GIB
from recipe.plan.supervision import measure_supervision

SHOWN = (("activations", ("draft_activations",)), ("ZeRO states", ("weights", "grads", "optimizer")),
         ("ZeRO buffers", ("zero_buffers",)), ("batch", ("batch",)), ("target w", ("target_weights",)),
         ("target fwd", ("target_forward",)), ("fixed", ("cuda_context", "nccl", "allocator_slack")))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: expected integers like 1,2") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: expected positive integers like 1,2")
    return values


def _tiles(text: str) -> list[int | None]:
    """``"none,4096"`` -> [None, 4096] (none or 0: untiled); ArgumentTypeError otherwise."""
    out = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        try:
            value = None if item in ("none", "null", "0") else int(item)
        except ValueError:
            value = -1
        if value is not None and value < 1:
            raise argparse.ArgumentTypeError(f"bad MLP tile {item!r}: expected a positive integer, or none / 0")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: expected MLP tile sizes like none,4096")
    return out


def _memory(text: str) -> dict:
    """``"loss_chunk_size=4096,checkpoint_ttt_steps=true"`` -> {"loss_chunk_size": 4096, "checkpoint_ttt_steps":
    True}: each value read as JSON (true, null, 4096), else kept as text (auto); the keys are checked against the
    memory section's (``recipe.config_memory.MemoryOptions.pop_from``) when applied."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"bad --memory item {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def _masks(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(m not in MASKS for m in out):
        raise argparse.ArgumentTypeError(f"unknown mask in {text!r}; choose from {', '.join(MASKS)}")
    return out


def _fraction(text: str) -> float:
    try:
        return check_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m recipe.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", type=Path, required=True,
                   help="the run's DeepSpeed JSON")
    p.add_argument("--target", type=Path, required=True,
                   help="target folder with config.json, a config.json, or the public name of a shipped config "
                        "(Llama-3.1-8B-Instruct, Qwen3-8B, Llama-3.3-70B-Instruct; an org/ prefix is fine)")
    p.add_argument("--length", type=length_list, required=True, help="tokens per sequence, e.g. 32k or 4k,8k,128k")
    p.add_argument("--gpu", default="h200", help=f"one of {sorted(states.GPUS_MIB)} or a size in GiB")
    p.add_argument("--world-size", type=int, help="ranks (default tp·cp, i.e. dp = 1)")
    p.add_argument("--tp", type=_ints, help="tensor-parallel degree(s), overriding the JSON, e.g. 1,2")
    p.add_argument("--cp", type=_ints, help="context-parallel degree(s), overriding the JSON, e.g. 1,2,4")
    p.add_argument("--mlp-tile", type=_tiles, help="memory.mlp_tile_size value(s), overriding the JSON, e.g. "
                   "none,4096 (none or 0: untiled)")
    p.add_argument("--memory", type=_memory, metavar="KEY=VALUE,...",
                   help="override keys of the JSON's memory section, e.g. loss_chunk_size=4096,"
                        "checkpoint_ttt_steps=true,mlp_tile_size=null (values as in the JSON; auto for \"auto\")")
    p.add_argument("--sparse-anchors", type=_masks,
                   help="also plan with memory.sparse_anchors on, for each supervision mask listed (full, sharegpt: "
                        "69%% supervised turns, long10: the last 10%% supervised), e.g. sharegpt,long10")
    p.add_argument("--supervised-fraction", type=_fraction, metavar="F",
                   help="also plan with memory.sparse_anchors on for a long prompt and a short answer: the last F "
                        "(0 < F <= 1) of the positions supervised, e.g. 0.1 (default: measured from --data, if given)")
    add_data_arguments(p)
    p.add_argument("--limit", type=int, metavar="N",
                   help="with --data: read only the first N records of each data file (default: all)")
    p.add_argument("--seed", type=int, default=0, help="with --data: run.py's --seed (weighted mixing, chaining)")
    p.add_argument("--cache-dir", help="with --data: datasets cache folder for the tokenised examples (default: the "
                   "datasets default)")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT steps K (run.py's default 7)")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="draft vocabulary (run.py's default 32000)")
    p.add_argument("--offline", action="store_true", help="hidden states from a store: no target on the GPU")
    p.add_argument("--freeze-lm-head", action="store_true", help="run.py's flag: lm_head is not trained")
    p.add_argument("--json", type=Path, help="write the plan as JSON here")
    return p


def make_plan(args, argv: list[str]) -> dict:
    """The JSON-ready plan of the parsed ``args`` (one table per (tp, cp, MLP tile, supervision): the dense one, one
    with sparse anchors per ``--sparse-anchors`` mask and one for ``args.supervision``'s fraction, ``supervision``'s
    result set by ``main``); PlanError for bad input."""
    layouts, masks, planned = [], list(args.sparse_anchors or []), getattr(args, "supervision", None)
    if planned is not None:
        masks.append(fraction_mask(planned["fraction"]))
    sections = read_sections(args.ds_config)  # the JSON read once, as run.py reads it
    for tp in args.tp or [None]:
        for cp in args.cp or [None]:
            loaded = load_inputs(sections, args.target, args.gpu, args.world_size, tp, cp, args.ttt_steps,
                                 args.draft_vocab_size, args.offline, args.freeze_lm_head)
            loaded = dataclasses.replace(loaded, memory=_override(loaded.memory, args.memory))
            for tile in args.mlp_tile or [loaded.memory.mlp_tile_size]:
                inputs = resolved_inputs(loaded, tile, max(args.length))
                supervision = [(inputs.spec.sparse_anchors, "full")] + [(True, m) for m in masks]
                for sparse, mask in supervision:
                    spec = dataclasses.replace(inputs.spec, sparse_anchors=sparse, mask=mask)
                    layouts.append({**plan_rows(dataclasses.replace(inputs, spec=spec), args.length),
                                    "memory_auto": inputs.memory_report.record(),
                                    "longest_fit_auto": _longest_auto(loaded, tile, spec),
                                    "trainable_params_per_rank": inputs.params.trainable})
    spec = inputs.spec
    whole = states.count_draft_params(spec_draft_config(spec), 1, args.freeze_lm_head)  # the draft, unsplit
    return {"command": "python -m recipe.plan " + " ".join(shlex.quote(a) for a in argv),
            "gpu": {"name": args.gpu, "bytes": inputs.gpu_bytes, "gib": inputs.gpu_bytes / GIB},
            "draft": {"hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads,
                      "intermediate": spec.intermediate, "draft_vocab": spec.draft_vocab, "vocab": spec.vocab,
                      "ttt_steps": spec.ttt_steps, "dtype": spec.dtype, "micro_batch": spec.batch,
                      "loss_chunk_size": spec.loss_chunk_size if "chunked" in spec.layout else None,
                      "attention_tile_size": spec.attention_tile,
                      "mlp_tile_sizes": sorted({t["mlp_tile"] for t in layouts}, key=lambda t: t or 0),
                      "trainable_params": whole.trainable, "frozen_params": whole.frozen},
            "zero_stage": inputs.zero_stage, "target_params": inputs.target.params, "offline": args.offline,
            "partitioned_target": inputs.partitioned_target,
            "constants": {"cuda_context_bytes": states.CUDA_CONTEXT_BYTES,
                          "nccl_bytes_per_communicator": states.NCCL_BYTES_PER_COMMUNICATOR,
                          "nccl_p2p_bytes_per_communicator": states.NCCL_P2P_BYTES_PER_COMMUNICATOR,
                          "allocator_slack": states.ALLOCATOR_SLACK, "gpus_mib": states.GPUS_MIB,
                          "note": "fixed overheads from public measurements (recipe/plan/states.py cites them) "
                                  "until a GPU calibrates them"},
            **({"supervision": planned} if planned else {}),
            "layouts": layouts,
            "longest_fit": {_layout_key(t): t["longest_fit"] for t in layouts}}


def _override(memory: MemoryOptions, changes: dict | None) -> MemoryOptions:
    """``memory`` with ``--memory``'s keys replaced, validated as the JSON's section is; PlanError naming them."""
    if not changes:
        return memory
    try:
        return MemoryOptions.pop_from({"memory": {**dataclasses.asdict(memory), **changes}}, "--memory")
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _longest_auto(loaded: PlanInputs, mlp_tile, spec) -> int | None:
    """With "auto" switches (``loaded.memory``, ``mlp_tile`` as ``--mlp-tile`` sets it), the longest length that
    fits with every saving "auto" may choose (``MemoryOptions.most_saving``), on ``spec``'s supervision; None
    without "auto" switches (the table's own ``longest_fit`` is then the answer)."""
    memory = dataclasses.replace(loaded.memory, mlp_tile_size=mlp_tile)
    if not memory.auto_switches:
        return None
    most = dataclasses.replace(memory.most_saving(), sparse_anchors=spec.sparse_anchors)
    inputs = dataclasses.replace(loaded, memory=most, spec=spec_for_memory(spec, most))
    return longest_fit(inputs)


def resolved_inputs(inputs: PlanInputs, mlp_tile, length: int) -> PlanInputs:
    """``inputs`` with ``memory.mlp_tile_size`` = ``mlp_tile`` (``--mlp-tile``; the JSON's value, perhaps "auto",
    without it) and the memory section's "auto" values resolved for the planned GPU at ``length`` tokens, the longest
    planned: what a run of that longest sample on that GPU chooses (``recipe.plan.resolve_inputs``)."""
    memory = dataclasses.replace(inputs.memory, mlp_tile_size=mlp_tile)
    resolved, _ = resolve_inputs(dataclasses.replace(inputs, memory=memory), length, inputs.gpu, inputs.gpu_bytes)
    return resolved


def supervision(args) -> dict | None:
    """The supervised fraction planned (``{"fraction": F, "source": "--supervised-fraction" | "--data"}``, with
    ``"data"``: ``recipe.plan.supervision.DataSupervision.as_json`` when ``--data`` was measured), or None; the
    measured figure is printed. PlanError for data that cannot be read."""
    if args.data is None:
        return None if args.supervised_fraction is None else {"fraction": args.supervised_fraction,
                                                              "source": "--supervised-fraction"}

    try:
        measured = measure_supervision(args.data, args.target, max(args.length), args.limit, args.data_column,
                                       args.data_weights, args.chain_conversations, args.seed, args.cache_dir)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    print(f"--data: {measured.supervised} of {measured.tokens} tokens supervised ({measured.fraction:.2%}) in "
          f"{measured.examples} samples cut at {measured.max_length} tokens ({measured.skipped} records skipped)")
    if args.supervised_fraction is not None:
        return {"fraction": args.supervised_fraction, "source": "--supervised-fraction", "data": measured.as_json()}
    return {"fraction": measured.fraction, "source": "--data", "data": measured.as_json()}


def _layout_key(layout: dict) -> str:
    """``tp1_cp2`` (``tp1_cp2_mlp4096`` with an MLP tile): a table's key in the plan's ``longest_fit``."""
    tile = layout.get("mlp_tile")
    sparse = f"_sparse_{layout.get('mask', 'full')}" if layout.get("sparse_anchors") else ""
    return f"tp{layout['tp']}_cp{layout['cp']}" + (f"_mlp{tile}" if tile else "") + sparse


def _mask_title(mask: str) -> str:
    """``"sharegpt mask"``, or ``"last 18.33% supervised"`` for a fraction mask."""
    fraction = mask_fraction(mask)
    return f"{mask} mask" if fraction is None else f"last {fraction:.2%} supervised"


def print_plan(plan: dict, console: Console) -> None:
    for lay in plan["layouts"]:
        table = Table(title=f"per-rank GiB, tp={lay['tp']} cp={lay['cp']} dp={lay['dp']}, {lay['layout']}, "
                            f"{lay['backend']} attention, "
                            f"{'MLP tile ' + str(lay['mlp_tile']) if lay.get('mlp_tile') else 'untiled MLP'}, "
                            f"{'' if lay.get('teacher_logits_once', True) else 'teacher logits per step, '}"
                            f"{'sparse anchors, ' + _mask_title(lay['mask']) + ', ' if lay.get('sparse_anchors') else ''}"
                            f"{plan['gpu']['name']} ({plan['gpu']['gib']:.1f} GiB)")
        for col in ("length", *(name for name, _ in SHOWN), "total", "fits"):
            table.add_column(col, justify="right", no_wrap=True)
        for row in lay["rows"]:
            cells = [f"{sum(row[k] for k in keys) / GIB:.2f}" for _, keys in SHOWN]
            table.add_row(f"{row['length'] // 1024}k" if row["length"] % 1024 == 0 else str(row["length"]), *cells,
                          f"{row['total'] / GIB:.2f}", "fits" if row["fits"] else "does not fit")
        console.print(table)
        if lay["memory_auto"]["rule"] == "planned":
            console.print(MemoryReport(**lay["memory_auto"]).line())
        best = lay["longest_fit"]
        console.print(f"longest length that fits: {best if best else 'none'} tokens "
                      f"(activation fit {lay['fit']['kind']}, traced at {lay['fit']['trace_lengths']})"
                      + (f"; {lay['longest_fit_auto'] or 'none'} with every saving \"auto\" may choose"
                         if lay["memory_auto"]["rule"] == "planned" else ""))


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 (with a one-line message) on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_data_arguments(parser, args)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: must be >= 1")
    if args.ttt_steps < 1 or args.draft_vocab_size < 1 or (args.world_size is not None and args.world_size < 1):
        print("python -m recipe.plan: error: --ttt-steps, --draft-vocab-size and --world-size must be >= 1",
              file=sys.stderr)
        return 2
    try:
        args.supervision = supervision(args)
        plan = make_plan(args, argv)
    except PlanError as exc:
        print(f"python -m recipe.plan: error: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, Console(width=None if sys.stdout.isatty() else 150))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plan, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
