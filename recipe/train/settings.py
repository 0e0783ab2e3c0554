"""What the training loop reads of ``run.py``'s flags (:class:`TrainSettings`), apart from the flags themselves
(``recipe.train.flags``) and the loop (``recipe.train.loop``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipe.train.flags import TrainArgs


@dataclass(frozen=True)
class TrainSettings:
    """What the loop reads of the flags (``run.py --help`` explains each): the run folder, the TTT steps K, the
    sequence length cap and seed (recorded in the checkpoint's run state), the checkpoint cadence and count, the
    non-finite policy, whether to export, the progress cadence, whether a resume may re-plan the run length, and
    whether lm_head is frozen (recorded in the run state so a resume must match it), the MFU peak override."""

    output: Path
    ttt_steps: int
    max_length: int
    seed: int
    save_every: int = 0
    save_every_minutes: float = 0.0
    hang_timeout_minutes: float = 0.0
    keep_checkpoints: int = 2
    skip_nonfinite: bool = False
    no_export: bool = False
    log_every: int = 1
    extend: bool = False
    freeze_lm_head: bool = False
    peak_tflops: float | None = None

    @classmethod
    def from_args(cls, args: TrainArgs) -> "TrainSettings":
        return cls(output=args.output, ttt_steps=args.ttt_steps, max_length=args.max_length, seed=args.seed,
                   save_every=args.save_every, save_every_minutes=args.save_every_minutes,
                   hang_timeout_minutes=args.hang_timeout_minutes, keep_checkpoints=args.keep_checkpoints,
                   skip_nonfinite=args.skip_nonfinite, no_export=args.no_export, log_every=args.log_every,
                   extend=args.extend, freeze_lm_head=args.freeze_lm_head, peak_tflops=args.peak_tflops)
