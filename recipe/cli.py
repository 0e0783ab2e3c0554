"""The command line of ``run.py`` (``TrainArgs``, :func:`parse_args`) and the flag types and data flags shared by
``recipe.dump``, ``recipe.eval``, ``recipe.demo`` and the benchmarks, and the environment of the recipe's subprocesses
(``subprocess_env``). The ``--ds_config`` JSON is ``recipe.config``.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class TrainArgs:
    ds_config: Path
    target: Path
    output: Path
    data: list[str] | None = None
    data_column: dict[str, str] | None = None
    data_weights: list[float] | None = None
    chain_conversations: int | None = None
    hidden_states: Path | None = None
    max_length: int = 2048
    ttt_steps: int = 7
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB  # None only with --init-draft: the draft's
    draft_config: Path | None = None
    init_draft: Path | None = None
    position_offset_max: int = 0
    epochs: float = 1.0
    max_steps: int | None = None
    seed: int = 0
    limit: int | None = None
    num_proc: int = 1
    save_every: int = 0
    save_every_minutes: float = 30.0
    hang_timeout_minutes: float = 10.0
    keep_checkpoints: int = 2
    resume: str | None = None
    extend: bool = False
    overwrite: bool = False
    tp_size: int | None = None
    cp_size: int | None = None
    aux_layer_ids: list[int] | None = None
    lm_head_init: str = "target"
    freeze_lm_head: bool = False
    cache_dir: Path | None = None
    log_every: int = 1
    no_export: bool = False
    skip_nonfinite: bool = False
    eval_data: list[str] | None = None
    eval_fraction: float | None = None
    eval_every: int = 0
    peak_tflops: float | None = None
    memory_budget: float | None = None
    packing: bool | None = None


def int_list(text: str, minimum: int | None = None) -> list[int]:
    """argparse type: ``"1,2,4"`` -> [1, 2, 4]. ArgumentTypeError naming the text when a part is not an integer,
    or (with ``minimum``) when the list is empty or a value is below it."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if minimum is not None and (not values or min(values) < minimum):
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """argparse type: a non-empty ``int_list`` of values >= 1 (parallel sizes, draft-token counts)."""
    return int_list(text, minimum=1)


def parse_length(text: str, minimum: int = 1) -> int:
    """``"4k"`` -> 4096, ``"1.5k"`` -> 1536, ``"512"`` -> 512 (tokens; k = 1024), the length syntax of
    ``recipe.plan``, ``recipe.bench`` and ``recipe.eval --context-lengths``; ValueError naming the text for anything
    else or a value below ``minimum``."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * 1024 if t.endswith("k") else float(t)
    except ValueError:
        raise ValueError(f"bad length {text!r}: expected an integer or a number followed by k (e.g. 4k)") from None
    if value < minimum or value != int(value):
        what = "positive whole number of tokens" if minimum == 1 else f"whole number of tokens >= {minimum}"
        raise ValueError(f"bad length {text!r}: must be a {what}")
    return int(value)


def length_list(text: str, minimum: int = 1) -> list[int]:
    """argparse type: ``"2k,4k,512"`` -> sorted distinct lengths in tokens (k = 1024), each >= ``minimum``;
    ArgumentTypeError otherwise (also for an empty list)."""
    try:
        values = sorted({parse_length(x, minimum) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths, got {text!r}")
    return values


def context_length_list(text: str) -> list[int]:
    """argparse type of ``recipe.eval --context-lengths``: ``length_list`` that also accepts 0 (no context)."""
    return length_list(text, minimum=0)


def length(text: str) -> int:
    """argparse type: :func:`parse_length` (``"32k"`` -> 32768); ArgumentTypeError naming the text otherwise."""
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default, except where there is none (None, False) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" not in text and "default" not in text and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS and action.option_strings):
            text += " (default: %(default)s)"
        return text


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


CONVERSATION_FIELDS = ("conversations", "messages", "document", "question", "answer")


def column_mapping(text: str) -> tuple[str, str]:
    """argparse type: ``"messages=dialog"`` -> ("messages", "dialog"): the conversation field (``conversations``:
    ShareGPT turns {from, value}; ``messages``: OpenAI turns {role, content}; ``document``, ``question``,
    ``answer``: the fields of a long-document record, ``recipe.data.conversations``) and the column that holds it.
    ArgumentTypeError for another form or field."""
    field_name, sep, column = text.partition("=")
    if not sep or field_name not in CONVERSATION_FIELDS or not column:
        raise argparse.ArgumentTypeError(f"expected FIELD=COLUMN with FIELD one of {list(CONVERSATION_FIELDS)}, "
                                         f"e.g. messages=dialog; got {text!r}")
    return field_name, column


def _weights(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"weights must be positive finite numbers, got {text!r}")
    return values


def add_data_arguments(p: argparse.ArgumentParser, required: bool = False, chain: bool = True) -> None:
    """The conversation-data flags shared by ``run.py`` and ``python -m recipe.dump`` (``recipe.data.sources``):
    ``--data`` (one or more sources), ``--data-column FIELD=COLUMN`` (repeatable), ``--data-weights W1,W2,..``
    and, with ``chain``, ``--chain-conversations TOKENS`` (``recipe.data.chain``)."""
    p.add_argument("--data", nargs="+", required=required, metavar="SOURCE",
                   help="conversations: files (.json/.jsonl/.parquet/.csv), folders of them, or Hugging Face hub "
                   "dataset names (split 'train'; needs a reachable hub); ShareGPT or OpenAI form")
    p.add_argument("--data-column", type=column_mapping, action="append", metavar="FIELD=COLUMN",
                   help="read the conversation FIELD ('conversations': ShareGPT turns, 'messages': OpenAI turns; "
                   "'document', 'question', 'answer': a long-document record) from COLUMN, e.g. messages=dialog; "
                   "applies to every source that has COLUMN; repeatable")
    p.add_argument("--data-weights", type=_weights, metavar="W1,W2,...",
                   help="mixing weights, one per --data source: the sources are interleaved with probabilities "
                   "W_i/sum(W) until the first one runs out (no sample repeats); default: all rows, in order")
    if chain:
        p.add_argument("--chain-conversations", type=length, metavar="TOKENS",
                       help="chain whole conversations of each data file (shuffled by --seed) into multi-turn "
                       "samples of up to TOKENS tokens as the chat template renders them (k = 1024, e.g. 32k); "
                       "every assistant turn supervised")


def check_data_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """parser.error for --data-weights not matching --data and for --chain-conversations without --data; turns
    --data-column pairs into a dict."""
    if ns.data_weights is not None and (ns.data is None or len(ns.data_weights) != len(ns.data)):
        parser.error(f"--data-weights has {len(ns.data_weights)} value(s) for {len(ns.data or [])} --data "
                     "source(s); give one weight per source")
    if getattr(ns, "chain_conversations", None) is not None and ns.data is None:
        parser.error("--chain-conversations chains the --data conversations; a store (--hidden-states) holds the "
                     "samples it was dumped with: chain when dumping (python -m recipe.dump --chain-conversations)")
    ns.data_column = dict(ns.data_column) if ns.data_column else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Train an EAGLE-3 draft model with DeepSpeed (ZeRO 0-3), tensor and context parallelism.",
        formatter_class=_DefaultsFormatter,
        epilog="Launch: `deepspeed --num_gpus N run.py --ds_config ds_configs/zero3.json ...`, `torchrun "
        "--nproc_per_node N run.py ...`, or `python run.py ...` for one process. See README.md.",
    )
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", type=Path, required=True,
                   help="DeepSpeed JSON (optimizer, scheduler, ZeRO stage, batch sizes) with our 'parallelism' section")
    p.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face format)")
    p.add_argument("--output", type=Path, required=True,
                   help="run folder: metrics.jsonl, checkpoints/, export/; one that holds a previous run needs "
                   "--resume or --overwrite")
    add_data_arguments(p)
    p.add_argument("--hidden-states", type=Path, help="offline store written by `python -m recipe.dump`")
    p.add_argument("--max-length", type=length, default=2048,
                   help="tokens per sample after the chat template; k = 1024, e.g. 32k")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                   help="pack each micro-batch's samples into rows (data.packing_tokens tokens each; default one "
                   "row a micro-batch), documents isolated (docs/algorithm.md, 'Packing'); --no-packing: one sample "
                   "per padded row; default: the JSON's data.packing, \"auto\" unless set (packed where that "
                   "computes fewer positions)")
    _add_draft_and_schedule_arguments(p)
    _add_checkpoint_arguments(p)
    _add_layout_and_report_arguments(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def _add_draft_and_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """run.py's flags for the draft (K, vocabulary, geometry, warm start, position offsets) and how long it trains."""
    p.add_argument("--ttt-steps", type=_positive, default=7, help="training-time-test unroll steps K")
    p.add_argument("--draft-vocab-size", type=_positive, default=None,
                   help=f"draft vocabulary size V_d (capped at the target vocabulary; default {DEFAULT_DRAFT_VOCAB}, "
                   "with --init-draft the draft's own)")
    p.add_argument("--draft-config", type=Path, help="JSON of draft config overrides, e.g. head counts")
    p.add_argument("--init-draft", type=Path, metavar="PATH",
                   help="start a new run (fresh optimizer, step 0) from an existing EAGLE-3 draft: an export folder, "
                   "a SpecForge or EAGLE checkpoint folder, or one .safetensors/.bin file; its vocabulary map and "
                   "aux layers are kept, its geometry checked against the target (docs/training.md, 'Warm start')")
    p.add_argument("--position-offset-max", type=_non_negative, default=0, metavar="N",
                   help="anchor-offset positions (LongSpec): the draft's position ids of each training sample after "
                   "the first 4 are shifted by a random offset in [0, N] (per sample, from --seed), so short samples "
                   "teach long relative distances; 0 (default): positions as they are")
    p.add_argument("--epochs", type=_positive_float, default=1.0, help="passes over the data (fractions allowed)")
    p.add_argument("--max-steps", type=_positive, help="stop after this many optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data order and dropout-free RNG")
    p.add_argument("--limit", type=_positive,
                   help="use only the first N conversations of each data file / the first N stored samples")
    p.add_argument("--num-proc", type=_positive, default=1, help="processes for tokenisation (datasets.map)")


def _add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """run.py's flags for checkpoints, resume, the hang watchdog and reusing an --output folder."""
    p.add_argument("--save-every", type=_non_negative, default=0,
                   help="checkpoint every N optimizer steps (0: not by steps; see --save-every-minutes)")
    p.add_argument("--save-every-minutes", type=_non_negative_float, default=30.0, metavar="M",
                   help="also checkpoint after the first step that ends M minutes or more after the last checkpoint "
                   "(or the start), agreed by every rank (0: not by time; docs/training.md, 'Periodic checkpoints')")
    p.add_argument("--hang-timeout-minutes", type=_non_negative_float, default=10.0, metavar="M",
                   help="when no step (or checkpoint, or validation) finishes within M minutes, every rank writes "
                   "its Python stacks to OUTPUT/hang-rank-R.txt and the run exits with 76; the process group's "
                   "timeout is set above it (0: no watchdog; docs/training.md, 'Hangs')")
    p.add_argument("--keep-checkpoints", type=_positive, default=2, help="how many checkpoints to keep")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="auto|DIR",
                   help="resume from OUTPUT/checkpoints/latest (no value), from the given checkpoint folder, or "
                   "'auto': resume when --output holds a run with a checkpoint, start afresh when it holds none "
                   "(for job scripts that are requeued)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --output folder that holds a previous run: its checkpoints/, "
                   "metrics.jsonl, run_config.json, export/ and curves.png are deleted once the run is built "
                   "(without it, or --resume, such a run is refused)")
    p.add_argument("--extend", action="store_true",
                   help="with --resume and another --max-steps/--epochs: re-plan the LR schedule for the new length "
                   "from the saved step (docs/training.md, 'Extending a run'); without it such a resume is refused")


def _add_layout_and_report_arguments(p: argparse.ArgumentParser) -> None:
    """run.py's flags for the layout overrides, lm_head, caches, logging, export, validation, MFU and memory."""
    p.add_argument("--tp-size", type=_positive, help="override parallelism.tp_size of the JSON")
    p.add_argument("--cp-size", type=_positive, help="override parallelism.cp_size of the JSON")
    p.add_argument("--aux-layer-ids", type=int_list, help="target layers for aux hidden states, e.g. 1,14,26")
    p.add_argument("--lm-head-init", choices=["target", "random"], default="target",
                   help="initialise the draft lm_head from the target's rows of the draft vocabulary")
    p.add_argument("--freeze-lm-head", action="store_true",
                   help="keep the draft lm_head at the target's rows (needs --lm-head-init target): the draft then "
                        "learns to produce hidden states in the target's output space")
    p.add_argument("--cache-dir", type=Path, help="cache for tokenised data and vocab maps (default OUTPUT/cache)")
    p.add_argument("--log-every", type=_positive, default=1,
                   help="refresh the progress statistics every N steps; when stderr is not a terminal (a log file), "
                   "print them as one line every N steps")
    p.add_argument("--no-export", action="store_true", help="skip writing OUTPUT/export at the end")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip (and count) optimizer steps whose loss is NaN/inf instead of stopping with an error "
                   "naming the step and samples; needs gradient_accumulation_steps = 1")
    p.add_argument("--eval-data", nargs="+", metavar="SOURCE",
                   help="held-out data for validation: conversation sources like --data (online) or a store folder "
                   "of the same target (offline)")
    p.add_argument("--eval-fraction", type=_positive_float, metavar="F",
                   help="hold out this fraction (0 < F < 1) of the training samples for validation")
    p.add_argument("--eval-every", type=_non_negative, default=0,
                   help="with --eval-data/--eval-fraction: validate every N optimizer steps (0: only at the end)")
    p.add_argument("--peak-tflops", type=_positive_float, metavar="TFLOPS",
                   help="the GPU's dense peak TFLOP/s for the run's dtype, which MFU divides by (default: the "
                        "bf16 peak of a known device, recipe.model.flops.PEAK_TFLOPS; otherwise TFLOP/s only)")
    p.add_argument("--memory-budget", type=_positive_float, metavar="GIB",
                   help='plan the memory section\'s "auto" switches against this many GiB a rank instead of the '
                        "device's free memory (also on the CPU, where they otherwise take the defaults)")


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """Parse ``run.py`` flags; errors exit with argparse's message naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if (ns.data is None) == (ns.hidden_states is None):
        parser.error("give exactly one of --data (online: the target runs each step) or --hidden-states (offline)")
    if ns.overwrite and ns.resume is not None:
        parser.error("--overwrite starts the run afresh and --resume continues it: give one of them")
    if ns.extend and ns.resume is None:
        parser.error("--extend re-plans a resumed run: give it together with --resume")
    check_data_arguments(parser, ns)
    if ns.draft_vocab_size is None and ns.init_draft is None:
        ns.draft_vocab_size = DEFAULT_DRAFT_VOCAB
    if ns.eval_every and ns.eval_data is None and ns.eval_fraction is None:
        parser.error("--eval-every needs a held-out split: --eval-data or --eval-fraction")
    if ns.freeze_lm_head and ns.lm_head_init != "target":
        parser.error("--freeze-lm-head keeps lm_head at its initial rows: it needs --lm-head-init target "
                     "(a frozen random lm_head cannot learn)")
    values = {k: v for k, v in vars(ns).items() if k != "local_rank"}
    return TrainArgs(**values)


def subprocess_env(threads: int) -> dict:
    """The environment for the recipe's command lines run as subprocesses: this one, offline Hugging Face, ``threads``
    OpenMP threads, the repository on ``PYTHONPATH`` (used by ``recipe.demo`` and ``scripts/gpu_check.py``; this
    module imports nothing heavy, so a launcher can build it before torch or transformers are known to import)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
