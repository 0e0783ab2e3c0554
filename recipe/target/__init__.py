"""The frozen target LLM: everything the recipe does with it, and the per-architecture facts in one registry.

``registry`` (what differs between architectures: routable attention, final logit soft-cap, RoPE fields, default
aux layers; the draft config derived from the target's), ``capture`` (``TargetModel``: load, aux hidden states,
argmax, tokenizer, the weight fingerprint), ``files`` (a target's weight files and the file of each tensor),
``split`` (``SplitTarget``: the target forward split over the cp·tp ranks, its attention through the ring),
``partition`` (ZeRO-3 partitioned target, ``build_target``), ``head`` (embedding and lm_head without the decoder,
chunked argmax), ``options`` (the JSON's ``target`` section), ``aux_layers`` (EAGLE-3's default aux ids and their
checks), ``runtime`` (``CachedTarget``: the evaluation's target with a KV cache and aux hooks).
"""
