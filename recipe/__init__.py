"""EAGLE-3 draft training recipe on DeepSpeed with tensor and context parallelism."""

__version__ = "0.1.0"
