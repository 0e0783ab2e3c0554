"""Speculative decoding with an EAGLE-3 draft: acceptance length τ, lossless check, speed.

``python -m recipe.eval --target DIR --draft PATH`` (see ``recipe/eval/__main__.py``). One engine, ``by_length``
(``evaluate_by_length``; plain evaluation, ``evaluate``, is its one-length case). Modules: ``draft_runtime`` (draft
reader for every ``--init-draft`` layout, draft KV cache, chain drafting), ``speculative`` (greedy and speculative
decoding, lossless check), ``tree`` / ``tree_draft`` (draft trees), ``prompts``, ``report``; τ by context length
(``--context-lengths``): ``context`` (prompts at a context length), ``length_report`` (entries, standard error,
table, plot).
"""
