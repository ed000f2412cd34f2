"""Pure-torch references with the same signatures as the kernels.

One reference per op, used by the CPU path, the tests and the benchmarks.
"""

from __future__ import annotations

from .decode import sparse_mla_decode
from .indexer import indexer_decode_topk
from .kv_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache
from .metadata import combine_topk_swa_indices, compute_global_topk_indices_and_lens
from .prefill_indices import build_grouped_prefill_indices, build_prefill_indices
from .sparse_mla import sparse_mla_paged, sparse_mla_workspace

__all__ = [
    "build_grouped_prefill_indices",
    "build_prefill_indices",
    "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens",
    "dequantize_and_gather_k_cache",
    "indexer_decode_topk",
    "quantize_and_insert_k_cache",
    "sparse_mla_decode",
    "sparse_mla_paged",
    "sparse_mla_workspace",
]
