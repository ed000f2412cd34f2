"""DeepSeek-V4 sparse attention for vLLM, built on dsv4-kernels.

Today this package holds the vLLM plugin (:mod:`dsv4_attention.plugin`) that
routes vLLM's DSV4 sparse-attention metadata and FP8 K-cache functions to
``dsv4_kernels``.  Set ``DSV4_KERNELS_DISABLE=1`` to keep vLLM's own kernels.
"""

from __future__ import annotations

from .plugin import patched, register, unregister

__all__ = ["patched", "register", "unregister"]
__version__ = "0.1.0"
