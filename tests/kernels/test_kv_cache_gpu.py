"""GPU-only checks of the FP8 K cache: benchmark sizes, a page past 2**31 bytes,
CUDA graph capture and replay, block-outer views, and no recompilation for run-time
sizes or page strides.  Run with the README's ``python3 -m pytest -m gpu`` command."""

from __future__ import annotations

import math

import pytest
import torch

import dsv4_kernels.kv_cache as kvc
from dsv4_kernels.reference import kv_cache as ref
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing import generator as gen
from dsv4_kernels.testing.k_cache import (
    WIDE_SPREAD,
    assert_same_bytes,
    block_outer_k_cache_group,
    block_outer_k_cache_views,
    fill_every_slot,
    poisoned_bf16,
    random_keys,
)

from ._kv_cache_common import (
    bits_equal,
    first_diff,
    make_keys,
    poisoned_out,
)

# --------------------------------------------------------------------------- GPU

GPU_GATHER_CASES = {
    # name: (block_size, seq_lens, gather_len or None)
    "1x1024": (64, [1024], None),
    "16x1024": (64, [1024] * 16, None),
    "1x16384": (64, [16384], None),
    "swa-131072-w128": (64, [131072], 128),
    "swa-4x131072-w128": (64, [131072, 5000, 129, 70], 128),
    "c4a-131072": (64, [131072 // 4], None),
    "c128a-131072": (2, [131072 // 128], None),
}


def _gpu_requests(
    block_size: int, seq_lens: list[int], gather_len: int | None, dev: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Cache with every page of every request filled (only the window's pages for SWA)."""
    g = gen(seed, dev)
    widths = [math.ceil(s / block_size) for s in seq_lens]
    num_pages = sum(widths) + 7
    table = torch.full((len(seq_lens), max(widths) + 1), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(num_pages, generator=g, device=dev).to(torch.int32)
    used = 0
    for b, w in enumerate(widths):
        table[b, :w] = perm[used : used + w]
        used += w
    cache = kvc.empty_k_cache(num_pages, block_size, dev)
    cache.random_(0, 256, generator=g)
    k = fill_every_slot(cache, block_size, generator=g)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    gl = None
    if gather_len is not None:
        gl = torch.clamp(seq, max=gather_len)
    return cache, table, seq, gl, k


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_GATHER_CASES))
def test_gpu_gather_benchmark_sizes(name: str, gpu: torch.device) -> None:
    seed = fresh_seed()
    block_size, seq_lens, gather_len = GPU_GATHER_CASES[name]
    cache, table, seq, gl, _ = _gpu_requests(block_size, seq_lens, gather_len, gpu, seed)
    rows = gather_len if gather_len is not None else max(seq_lens)
    offset = 3
    out = poisoned_out((len(seq_lens), rows + offset, 512), seed).to(gpu)
    want = out.clone()
    kvc.dequantize_and_gather_k_cache(out, cache, seq, gl, table, block_size, offset)
    ref.dequantize_and_gather_k_cache(want, cache, seq, gl, table, block_size, offset)
    assert bits_equal(out, want), f"seed {seed}"


GPU_INSERT_CASES = {
    # name: (block_size, num_tokens)
    "1x1024": (64, 1024),
    "16x1024": (64, 16 * 1024),
    "1x16384-c128a": (2, 16384),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_INSERT_CASES))
def test_gpu_insert_benchmark_sizes(name: str, gpu: torch.device) -> None:
    """Kernel (default, hardware rounding on sm_89+; and integer rounding) == torch, bytewise."""
    seed = fresh_seed()
    block_size, n = GPU_INSERT_CASES[name]
    g = gen(seed, gpu)
    num_pages = math.ceil(n / block_size) * 2
    slots = torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n]
    slots[torch.rand(n, generator=g, device=gpu) < 0.05] = -1
    k = make_keys(n, seed).to(gpu)
    a = kvc.empty_k_cache(num_pages, block_size, gpu)
    a.random_(0, 256, generator=g)
    b, c = a.clone(), a.clone()
    kvc.quantize_and_insert_k_cache(k, a, slots, block_size)
    ref.quantize_and_insert_k_cache(k, b, slots, block_size)
    stride = kvc.k_cache_page_stride(block_size)
    kvc._launch_insert(k, c, slots, block_size, stride, num_pages, exact_rounding=True)
    assert torch.equal(a, b), f"seed {seed}: kernel != reference: {first_diff(a, b)}"
    assert torch.equal(c, b), f"seed {seed}: integer rounding != reference: {first_diff(c, b)}"


@pytest.mark.gpu
def test_gpu_page_offset_beyond_2_31(gpu: torch.device) -> None:
    """Pages whose byte offsets pass 2**31 are written and read at the right place."""
    seed = fresh_seed()
    block_size = 64
    stride = kvc.k_cache_page_stride(block_size)
    high = (2**31) // stride + 3  # first page id past 2**31 bytes, plus a little
    assert high * stride > 2**31
    num_pages = high + 8
    cache = kvc.empty_k_cache(num_pages, block_size, gpu)
    g = gen(seed, gpu)
    cache[high - 8 :].random_(0, 256, generator=g)
    # Every slot of the 16 pages is written (the gather below reads them all).
    pages = torch.arange(high - 8, num_pages, device=gpu)
    n = 16 * block_size
    slots = (high - 8) * block_size + torch.randperm(n, generator=g, device=gpu)
    k = make_keys(slots.numel(), seed).to(gpu)
    small = cache[high - 8 :].cpu()
    kvc.quantize_and_insert_k_cache(k, cache, slots, block_size)
    ref.quantize_and_insert_k_cache(
        k.cpu(), small, (slots - (high - 8) * block_size).cpu(), block_size
    )
    assert torch.equal(cache[high - 8 :].cpu(), small), f"seed {seed}"
    # Gather back through a table that points at those pages.
    table = pages[torch.randperm(16, generator=g, device=gpu)].to(torch.int32).reshape(1, 16)
    seq = torch.tensor([16 * block_size - 5], dtype=torch.int32, device=gpu)
    out = poisoned_out((1, 16 * block_size, 512), seed).to(gpu)
    want = out.cpu()
    kvc.dequantize_and_gather_k_cache(out, cache, seq, None, table, block_size, 0)
    ref.dequantize_and_gather_k_cache(
        want, small, seq.cpu(), None, (table - (high - 8)).cpu(), block_size, 0
    )
    assert bits_equal(out, want), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay(gpu: torch.device) -> None:
    """Insert then gather, captured once; replays see new keys, slots and lengths in place."""
    seed = fresh_seed()
    block_size, num_pages, n = 64, 40, 700
    g = gen(seed, gpu)
    cache = kvc.empty_k_cache(num_pages, block_size, gpu)
    cache.random_(0, 256, generator=g)
    k = make_keys(n, seed).to(gpu)
    slots = torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n]
    table = torch.randperm(num_pages, generator=g, device=gpu).to(torch.int32).reshape(2, 20)
    seq = torch.tensor([900, 1280], dtype=torch.int32, device=gpu)
    gl = torch.tensor([300, 1000], dtype=torch.int32, device=gpu)
    out = torch.zeros((2, 1100, 512), dtype=torch.bfloat16, device=gpu)

    def step() -> None:
        kvc.quantize_and_insert_k_cache(k, cache, slots, block_size)
        kvc.dequantize_and_gather_k_cache(out, cache, seq, gl, table, block_size, 7)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rep in range(3):
        k.copy_(make_keys(n, seed + rep + 1).to(gpu))
        slots.copy_(torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n])
        seq.copy_(torch.randint(500, 1281, (2,), generator=g, device=gpu, dtype=torch.int32))
        gl.copy_(
            torch.minimum(
                seq, torch.randint(0, 1090, (2,), generator=g, device=gpu, dtype=torch.int32)
            )
        )
        cache.random_(0, 256, generator=g)
        out.copy_(poisoned_out(tuple(out.shape), seed + rep).to(gpu))
        want_cache, want_out = cache.clone(), out.clone()
        graph.replay()
        ref.quantize_and_insert_k_cache(k, want_cache, slots, block_size)
        ref.dequantize_and_gather_k_cache(want_out, want_cache, seq, gl, table, block_size, 7)
        torch.cuda.synchronize()
        assert torch.equal(cache, want_cache), f"seed {seed} replay {rep}"
        assert bits_equal(out, want_out), f"seed {seed} replay {rep}"


@pytest.mark.gpu
def test_gpu_sizes_do_not_recompile(gpu: torch.device) -> None:
    """Token, request and page counts, the offset and the page stride are run-time values.

    One kernel each, whatever the page stride of a layer's block-outer view.
    """
    from dsv4_kernels import _triton_kv_cache as tk

    seed = fresh_seed()
    caches = {}
    for fn in (tk._quantize_and_insert_k_cache_kernel, tk._dequantize_and_gather_k_cache_kernel):
        if not hasattr(fn, "device_caches"):
            pytest.skip("this Triton keeps no per-device kernel cache to count")
        caches[fn] = fn.device_caches[torch.cuda.current_device()][0]
    counts = []
    for i, (n, reqs, pages, offset, layers) in enumerate(
        [(1, 1, 1, 0, 0), (16, 2, 33, 16, 0), (17, 5, 64, 1, 3), (1000, 3, 17, 5, 5)]
    ):
        cache = kvc.empty_k_cache(pages, 64, gpu)
        if layers:  # a block-outer layer view: another page stride and storage offset
            cache = block_outer_k_cache_views(pages, 64, layers, gpu)[layers // 2]
        k = make_keys(n, seed + i).to(gpu)
        slots = torch.randint(0, pages * 64, (n,), device=gpu).unique()
        kvc.quantize_and_insert_k_cache(k, cache, slots, 64)
        out = torch.empty((reqs, offset + 64, 512), dtype=torch.bfloat16, device=gpu)
        seq = torch.full((reqs,), 64, dtype=torch.int32, device=gpu)
        table = torch.randint(0, pages, (reqs, 2), dtype=torch.int32, device=gpu)
        kvc.dequantize_and_gather_k_cache(out, cache, seq, seq, table, 64, offset)
        counts.append(tuple(len(c) for c in caches.values()))
    assert counts[1:] == counts[:1] * 3, counts


GPU_BLOCK_OUTER_CASES = {
    # name: (pages of the group, run, layer, seq_lens, gather_len)
    "window-3-layers-1x16384": ([(64, 3)], 0, 1, [16384], None),
    "window-3-layers-16x1024": ([(64, 3)], 0, 2, [1024] * 16, None),
    "c4a-of-c4a-c128a-1x32768": ([(64, 3), (2, 3)], 0, 1, [32768], None),
    "c128a-of-c4a-c128a-1x1024": ([(64, 3), (2, 3)], 1, 2, [1024], None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_BLOCK_OUTER_CASES))
def test_gpu_block_outer_views_benchmark_sizes(name: str, gpu: torch.device) -> None:
    """Insert into and gather from one layer of vLLM's block-outer group at benchmark sizes.

    The kernel's bytes equal the reference's on the same view (both address pages
    through ``stride(0)``, the reference by plain indexing), the other layers'
    bytes in the same blocks are untouched, and the gather equals the gather of
    a page-contiguous copy of the layer's pages.
    """
    seed = fresh_seed()
    pages, run, layer, seq_lens, gather_len = GPU_BLOCK_OUTER_CASES[name]
    g = gen(seed, gpu)
    block_size = pages[run][0]
    per_req = math.ceil(max(seq_lens) / block_size)
    num_blocks = per_req * len(seq_lens) + 5
    group = block_outer_k_cache_group(num_blocks, pages, gpu, generator=g)
    view = group.views[run][layer]
    n = num_blocks * block_size
    slots = torch.randperm(n, generator=g, device=gpu)
    slots[torch.rand(n, generator=g, device=gpu) < 0.02] = -1
    k = random_keys(n, generator=g, device=gpu, spread=WIDE_SPREAD)
    before = group.raw.clone()
    want_raw = group.raw.clone()
    want_view = torch.as_strided(want_raw, view.shape, view.stride(), view.storage_offset())
    kvc.quantize_and_insert_k_cache(k, view, slots, block_size)
    ref.quantize_and_insert_k_cache(k, want_view, slots, block_size)
    assert_same_bytes(group.raw, want_raw, f"seed {seed}: allocation after insert")
    mask = group.layer_bytes(run, layer)
    assert torch.equal(group.raw[~mask], before[~mask]), f"seed {seed}: other layers changed"

    page = kvc.k_cache_page_stride(block_size)
    start = view.storage_offset()
    contiguous = group.raw.reshape(num_blocks, -1)[:, start : start + page].contiguous()
    perm = torch.randperm(num_blocks, generator=g, device=gpu).to(torch.int32)
    table = perm[: per_req * len(seq_lens)].reshape(len(seq_lens), per_req).contiguous()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=gpu)
    gl = None if gather_len is None else torch.clamp(seq, max=gather_len)
    out = poisoned_bf16((len(seq_lens), max(seq_lens) + 3, 512), generator=g, device=gpu)
    want = out.clone()
    kvc.dequantize_and_gather_k_cache(out, view, seq, gl, table, block_size, 3)
    kvc.dequantize_and_gather_k_cache(want, contiguous, seq, gl, table, block_size, 3)
    assert_same_bytes(out, want, f"seed {seed}: gather from the view")
