"""Triton kernels for DeepSeek-V4 sparse attention metadata and the FP8 paged K cache.

CUDA tensors run the Triton kernels.  CPU tensors run the pure-torch
references in :mod:`dsv4_kernels.reference`, unless the Triton interpreter was
switched on (``TRITON_INTERPRET=1`` before import), in which case CPU tensors
run the real Triton kernels through it.
"""

from __future__ import annotations

from . import geometry, reference
from ._paged_keys import PageView
from .decode import (
    DecodeScratch,
    DecodeScratchSizes,
    decode_scratch_sizes,
    make_decode_scratch,
    sparse_mla_decode,
)
from .indexer import indexer_decode_topk, indexer_merge_topk, indexer_shard_topk
from .kv_cache import (
    dequantize_and_gather_k_cache,
    empty_k_cache,
    k_cache_page_stride,
    quantize_and_insert_k_cache,
)
from .metadata import combine_topk_swa_indices, compute_global_topk_indices_and_lens
from .prefill_indices import (
    BlockRows,
    GroupedPrefillIndices,
    PrefillIndices,
    build_grouped_prefill_indices,
    build_prefill_indices,
)
from .sparse_mla import sparse_mla_paged, sparse_mla_workspace

__all__ = [
    "BlockRows",
    "DecodeScratch",
    "DecodeScratchSizes",
    "GroupedPrefillIndices",
    "PageView",
    "PrefillIndices",
    "build_grouped_prefill_indices",
    "build_prefill_indices",
    "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens",
    "decode_scratch_sizes",
    "dequantize_and_gather_k_cache",
    "empty_k_cache",
    "geometry",
    "indexer_decode_topk",
    "indexer_merge_topk",
    "indexer_shard_topk",
    "k_cache_page_stride",
    "make_decode_scratch",
    "quantize_and_insert_k_cache",
    "reference",
    "sparse_mla_decode",
    "sparse_mla_paged",
    "sparse_mla_workspace",
]
__version__ = "0.1.0"
