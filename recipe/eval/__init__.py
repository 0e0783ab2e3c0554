"""Speculative decoding with an exported EAGLE-3 draft: acceptance length τ, lossless check, speed.

``python -m recipe.eval --target DIR --draft EXPORT_DIR`` (see ``recipe/eval/__main__.py``). Modules:
``draft_runtime`` (export loader, draft KV cache, chain drafting), ``target_runtime`` (target with a KV cache and
aux-state hooks), ``speculative`` (greedy and speculative decoding, lossless check), ``prompts``, ``report``,
``harness`` (``evaluate``); τ by context length (``--context-lengths``): ``context`` (prompts at a context length),
``by_length`` (``evaluate_by_length``), ``length_report`` (entries, standard error, table, plot).
"""
