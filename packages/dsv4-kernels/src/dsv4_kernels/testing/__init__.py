"""Input factories, poison values and seeds shared by tests, benchmarks, sweeps and probes.

One home for what every check needs, beside the references (as FlashInfer
ships ``flashinfer.testing``):

- :mod:`.common`: :data:`POISON`, :func:`fresh_seed`, :func:`generator`;
- :mod:`.k_cache`: keys, poisoned caches and outputs, and the block-outer
  per-layer cache views vLLM 0.32 allocates;
- :mod:`.metadata`: prefill batches for ``combine_topk_swa_indices`` and
  top-k rows for ``compute_global_topk_indices_and_lens``;
- :mod:`.sparse_mla`: queries, FP8 pages and index rows for sparse MLA;
- :mod:`.decode`: decode steps (requests, MTP tokens, page pools) for the decode.

Import the submodule you need; this package imports only :mod:`.common`.
"""

from __future__ import annotations

from .common import POISON, fresh_seed, generator

__all__ = ["POISON", "fresh_seed", "generator"]
