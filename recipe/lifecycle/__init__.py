"""A training run's life apart from its steps: process start under every launcher (``distributed``), the output
folder (``output_dir``), atomic checkpoints with their manifest, layout-free training state and RNG state
(``checkpoint``, ``manifest``, ``reshard``, ``rng_state``), what a resume must match (``resume_checks``), stop
requests and the watchdogs (``signals``, ``watch``) and the out-of-memory report (``oom``)."""
