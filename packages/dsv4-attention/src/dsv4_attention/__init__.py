"""DeepSeek-V4 sparse attention for vLLM, built on dsv4-kernels.

* :mod:`dsv4_attention.plugin`: the vLLM plugin (gated, lazy, visible in
  vLLM's log) that routes vLLM's DSV4 path to our kernels where they are
  measured faster, and to the head-exact prefill (:mod:`.vllm_backend`).
* :mod:`dsv4_attention.prefill`: the prefill forward of one DSV4 attention
  layer from the FP8 pages, with its torch reference.

``DSV4_KERNELS_DISABLE=1`` keeps vLLM exactly as it is.  Importing this
package imports neither vLLM nor torch.
"""

from __future__ import annotations

from .plugin import is_active, patched, register, unregister

__all__ = ["is_active", "patched", "register", "unregister"]
__version__ = "0.1.0"
