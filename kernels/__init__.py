"""Attention kernels for EAGLE-3 training-time test: block attention with log-sum-exp, the LSE merge, the tiled
(flash-style) block attention and the ring-attention autograd functions (pure PyTorch, any device), the fused
backends (PyTorch's fused CPU SDPA kernel, flex attention on CUDA), and ``attention_backends``, which picks one.

Note on the name: a PyPI package is also called ``kernels`` and transformers probes for it. transformers reads the
version from our distribution (``eagle3-recipe``, 0.x), far below the range it accepts, so it never treats this
package as the hub-kernels library (tests/test_packaging.py checks this).
"""
