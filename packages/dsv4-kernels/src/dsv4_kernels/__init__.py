"""Triton kernels for DeepSeek-V4 sparse attention metadata and the FP8 paged K cache.

CUDA tensors run the Triton kernels.  CPU tensors run the pure-torch
references in :mod:`dsv4_kernels.reference`, unless the Triton interpreter was
switched on (``TRITON_INTERPRET=1`` before import), in which case CPU tensors
run the real Triton kernels through it.
"""

from __future__ import annotations

from . import geometry, reference
from .metadata import combine_topk_swa_indices, compute_global_topk_indices_and_lens

__all__ = [
    "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens",
    "geometry",
    "reference",
]
__version__ = "0.1.0"
