"""The command line of ``run.py``: its flags (``build_parser``; ``--help`` shows defaults), their checks
(``parse_args``) and the parsed values (``TrainArgs``). The ``--ds_config`` JSON is ``recipe.config``."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from recipe.arg_types import (DefaultsFormatter, int_list, length, non_negative, non_negative_float, positive,
                              positive_float)
from recipe.data.flags import add_data_arguments, check_data_arguments


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Train an EAGLE-3 draft model with DeepSpeed (ZeRO 0-3), tensor and context parallelism.",
        formatter_class=DefaultsFormatter,
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
    p.add_argument("--ttt-steps", type=positive, default=7, help="training-time-test unroll steps K")
    p.add_argument("--draft-vocab-size", type=positive, default=None,
                   help=f"draft vocabulary size V_d (capped at the target vocabulary; default {DEFAULT_DRAFT_VOCAB}, "
                   "with --init-draft the draft's own)")
    p.add_argument("--draft-config", type=Path, help="JSON of draft config overrides, e.g. head counts")
    p.add_argument("--init-draft", type=Path, metavar="PATH",
                   help="start a new run (fresh optimizer, step 0) from an existing EAGLE-3 draft: an export folder, "
                   "a SpecForge or EAGLE checkpoint folder, or one .safetensors/.bin file; its vocabulary map and "
                   "aux layers are kept, its geometry checked against the target (docs/training.md, 'Warm start')")
    p.add_argument("--position-offset-max", type=non_negative, default=0, metavar="N",
                   help="anchor-offset positions (LongSpec): the draft's position ids of each training sample after "
                   "the first 4 are shifted by a random offset in [0, N] (per sample, from --seed), so short samples "
                   "teach long relative distances; 0 (default): positions as they are")
    p.add_argument("--epochs", type=positive_float, default=1.0, help="passes over the data (fractions allowed)")
    p.add_argument("--max-steps", type=positive, help="stop after this many optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data order and dropout-free RNG")
    p.add_argument("--limit", type=positive,
                   help="use only the first N conversations of each data file / the first N stored samples")
    p.add_argument("--num-proc", type=positive, default=1, help="processes for tokenisation (datasets.map)")


def _add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """run.py's flags for checkpoints, resume, the hang watchdog and reusing an --output folder."""
    p.add_argument("--save-every", type=non_negative, default=0,
                   help="checkpoint every N optimizer steps (0: not by steps; see --save-every-minutes)")
    p.add_argument("--save-every-minutes", type=non_negative_float, default=30.0, metavar="M",
                   help="also checkpoint after the first step that ends M minutes or more after the last checkpoint "
                   "(or the start), agreed by every rank (0: not by time; docs/training.md, 'Periodic checkpoints')")
    p.add_argument("--hang-timeout-minutes", type=non_negative_float, default=10.0, metavar="M",
                   help="when no step (or checkpoint, or validation) finishes within M minutes, every rank writes "
                   "its Python stacks to OUTPUT/hang-rank-R.txt and the run exits with 76; the process group's "
                   "timeout is set above it (0: no watchdog; docs/training.md, 'Hangs')")
    p.add_argument("--keep-checkpoints", type=positive, default=2, help="how many checkpoints to keep")
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
    p.add_argument("--tp-size", type=positive, help="override parallelism.tp_size of the JSON")
    p.add_argument("--cp-size", type=positive, help="override parallelism.cp_size of the JSON")
    p.add_argument("--aux-layer-ids", type=int_list, help="target layers for aux hidden states, e.g. 1,14,26")
    p.add_argument("--lm-head-init", choices=["target", "random"], default="target",
                   help="initialise the draft lm_head from the target's rows of the draft vocabulary")
    p.add_argument("--freeze-lm-head", action="store_true",
                   help="keep the draft lm_head at the target's rows (needs --lm-head-init target): the draft then "
                        "learns to produce hidden states in the target's output space")
    p.add_argument("--cache-dir", type=Path, help="cache for tokenised data and vocab maps (default OUTPUT/cache)")
    p.add_argument("--log-every", type=positive, default=1,
                   help="refresh the progress statistics every N steps; when stderr is not a terminal (a log file), "
                   "print them as one line every N steps")
    p.add_argument("--no-export", action="store_true", help="skip writing OUTPUT/export at the end")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip (and count) optimizer steps whose loss is NaN/inf instead of stopping with an error "
                   "naming the step and samples; needs gradient_accumulation_steps = 1")
    p.add_argument("--eval-data", nargs="+", metavar="SOURCE",
                   help="held-out data for validation: conversation sources like --data (online) or a store folder "
                   "of the same target (offline)")
    p.add_argument("--eval-fraction", type=positive_float, metavar="F",
                   help="hold out this fraction (0 < F < 1) of the training samples for validation")
    p.add_argument("--eval-every", type=non_negative, default=0,
                   help="with --eval-data/--eval-fraction: validate every N optimizer steps (0: only at the end)")
    p.add_argument("--peak-tflops", type=positive_float, metavar="TFLOPS",
                   help="the GPU's dense peak TFLOP/s for the run's dtype, which MFU divides by (default: the "
                        "bf16 peak of a known device, recipe.model.flops.PEAK_TFLOPS; otherwise TFLOP/s only)")
    p.add_argument("--memory-budget", type=positive_float, metavar="GIB",
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
