"""The indexer reference's page layout on the index-key cache vLLM allocates (``vllm``).

vLLM's own allocator and grouping (``vllm_layout``: its ``DeepseekV4IndexerCache`` specs
beside the attention caches, block-outer) hand each C4A layer's indexer a
``[pages, 64, 132]`` view; vLLM's ``kv_cache_as_quant_view`` (what it passes DeepGEMM)
views it as ``[pages, 64, 1, 132]``.  Writing every slot of one layer's view with the
reference (codes of every entry, then every scale, per page) reads back the keys
within FP8 precision, and leaves every byte of every other layer's cache in the same
buffer untouched: the layout fits vLLM's pages exactly.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator

from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm


def test_reference_layout_fills_vllms_index_pages_exactly() -> None:
    from vllm.model_executor.layers.sparse_attn_indexer import kv_cache_as_quant_view

    seed = fresh_seed()
    g = generator(seed)
    views, storage = vllm_dsv4_caches("BLHNC", available_bytes=16 << 20, ratios=(1, 4, 128, 4))
    storage.random_(0, 256, generator=g)
    before = storage.clone()
    index = [v for v in views if v.kind == "indexer"]
    assert len(index) == 2
    view = index[0].view
    assert view.dtype == torch.uint8 and tuple(view.shape[1:]) == (64, 132), view.shape
    assert view.stride(0) >= 64 * 132  # vLLM's block-outer page stride
    assert tuple(kv_cache_as_quant_view(view, 128, False).shape) == (view.shape[0], 64, 1, 132)
    n = view.shape[0] * 64
    keys = torch.randn(n, 128, generator=g) * torch.rand(n, 1, generator=g) * 5
    slots = torch.arange(n)
    ref.insert_index_k(keys, view, slots)
    codes, scales = ref.dequantize_index_k(view, slots)
    x = keys.to(torch.bfloat16).to(torch.float32)
    err = (codes * scales[:, None] - x).abs()
    # E4M3: 3 mantissa bits, so within 2^-4 of each value's magnitude, or the scale's
    # smallest step where the value is tiny
    bound = x.abs() * 2.0**-4 + scales[:, None] * 2.0**-9
    assert bool((err <= bound).all()), f"seed {seed}: {float((err - bound).max())}"
    # bytes outside this view's pages' data are exactly as before
    start = view.storage_offset()
    stride = view.stride(0)
    touched = torch.zeros_like(storage, dtype=torch.bool)
    for p in range(view.shape[0]):
        touched[start + p * stride : start + p * stride + 64 * 132] = True
    assert torch.equal(storage[~touched], before[~touched]), f"seed {seed}"
    assert not torch.equal(storage[touched], before[touched])
