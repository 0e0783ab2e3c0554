"""Shared test helpers (``tests/`` is on ``sys.path``, see ``tests/conftest.py``; import as ``helpers.<module>``).

- ``ranks``: ``run_ranks`` runs a function on N CPU gloo ranks and collects each rank's return value.
- ``tiny_target``: a tiny random Llama target folder and an fp32 offline hidden-state store of random chats (the
  session fixtures ``tiny_target``, ``other_tiny_target`` and ``tiny_target_and_store`` build them once).
- ``cases``: random TTT problems (draft, target head, padded batch) of a given geometry, and the forward+backward /
  comparison helpers of the memory-switch tests.
- ``parity``: the whole-draft TP / CP parity harness (single-process reference vs a (tp, cp) layout).
- ``training``: DeepSpeed configs derived from the shipped ones, ``run.py`` argv, a ``run.main`` rank worker, curve
  comparison.
- ``faults``: a ``run.main`` rank worker with injected faults (SIGTERM, NaN inputs, ENOSPC, write failures of
  DeepSpeed's ``torch.save`` / safetensors / metrics.jsonl (``WriteFault``), environment, a function run before
  a job).
"""
