"""GPU-only checks of build_prefill_indices: benchmark sizes, many requests, CUDA graphs,
compile counts.  The torch reference (itself checked against the per-token spec on CPU) is
the oracle.  Run with ``python3 -m pytest -m gpu`` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import _triton_prefill_indices as kernels
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import POISON, fresh_seed
from dsv4_kernels.testing.prefill_indices import PrefillIndexCase, make_prefill_index_case

from ._prefill_indices_cases import make_case

pytestmark = pytest.mark.gpu

# (name, query lens, context lens): the benchmark shapes.
BENCH_SHAPES = [
    ("1x16384@131072", [16384], [131072 - 16384]),
    ("16x1024-fresh", [1024] * 16, [0] * 16),
]
# (ratio, topk): SWA-only, V4-Flash and V4-Pro C4A, C128A at vLLM's width.
LAYERS = [(1, None), (4, 512), (4, 1024), (128, None)]


def _compiled(kernel: object) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())  # type: ignore[attr-defined]


def _check(case: PrefillIndexCase, what: str) -> None:
    T = case.num_tokens
    dev = case.query_start_loc.device
    outs = {
        "window_out": torch.full((T + 5, 128), POISON, dtype=torch.int32, device=dev),
        "window_lens_out": torch.full((T + 5,), POISON, dtype=torch.int32, device=dev),
    }
    if case.compress_ratio > 1:
        outs["comp_out"] = torch.full((T + 5, case.topk), POISON, dtype=torch.int32, device=dev)
        outs["comp_lens_out"] = torch.full((T + 5,), POISON, dtype=torch.int32, device=dev)
    got = case.build(**outs)
    want = ref.build_prefill_indices(
        case.query_start_loc,
        case.seq_lens,
        num_tokens=T,
        window_block_table=case.window_block_table,
        compress_ratio=case.compress_ratio,
        comp_block_table=case.comp_block_table if case.compress_ratio > 1 else None,
        comp_block_size=case.comp_block_size,
        topk_indices=case.topk_indices,
        topk=case.topk if case.compress_ratio > 1 else None,
    )
    for name, g, w in zip(("window", "window_lens", "comp", "comp_lens"), got, want, strict=True):
        assert (g is None) == (w is None), f"{what}: {name}"
        if g is None or w is None:
            continue
        bad = (g != w).nonzero()
        assert bad.numel() == 0, (
            f"{what}: {name}: {bad.shape[0]} mismatches, first {bad[:4].tolist()}"
        )
    for name, buf in outs.items():
        assert bool((buf[T:] == POISON).all()), f"{what}: {name} wrote past the chunk"


@pytest.mark.parametrize("ratio,topk", LAYERS, ids=["swa", "c4a-512", "c4a-1024", "c128a"])
@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=[s[0] for s in BENCH_SHAPES])
def test_benchmark_sizes_match_reference(
    shape: tuple[str, list[int], list[int]], ratio: int, topk: int | None, gpu: torch.device
) -> None:
    name, qlens, ctx = shape
    seed = fresh_seed()
    case = make_prefill_index_case(
        qlens, ctx, compress_ratio=ratio, topk=topk, device=gpu, seed=seed, hole_fraction=0.02
    )
    _check(case, f"{name} ratio {ratio} seed {seed}")


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_many_requests_match_reference(ratio: int, gpu: torch.device) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    qlens = torch.randint(0, 700, (37,), generator=g).tolist()
    case = make_case(
        fresh_seed(),
        query_lens=qlens,
        ratio=ratio,
        topk={1: 0, 4: 512, 128: 96}[ratio],
        context=(0, 12000),
        negative_pages=0.01,
    ).to(gpu)
    want = ref.build_prefill_indices(case.query_start_loc, case.seq_lens, **case.kwargs())
    got = dk.build_prefill_indices(case.query_start_loc, case.seq_lens, **case.kwargs())
    for g_, w_ in zip(got, want, strict=True):
        assert (g_ is None) == (w_ is None)
        if g_ is not None and w_ is not None:
            assert torch.equal(g_, w_), f"seed {case.seed}"


def test_cuda_graph_capture_and_replay(gpu: torch.device) -> None:
    case = make_prefill_index_case(
        [300, 0, 77, 512],
        [5000, 7, 0, 9000],
        compress_ratio=4,
        topk=512,
        device=gpu,
        seed=fresh_seed(),
    )
    T = case.num_tokens
    outs = dict(
        window_out=torch.empty((T, 128), dtype=torch.int32, device=gpu),
        window_lens_out=torch.empty((T,), dtype=torch.int32, device=gpu),
        comp_out=torch.empty((T, 512), dtype=torch.int32, device=gpu),
        comp_lens_out=torch.empty((T,), dtype=torch.int32, device=gpu),
    )
    case.build(**outs)  # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.build(**outs)
    # new values in the captured input buffers, poisoned outputs, replay
    assert case.topk_indices is not None
    case.topk_indices.copy_(torch.randint_like(case.topk_indices, -1, 500))
    case.window_block_table.copy_(torch.randint_like(case.window_block_table, 0, 10**5))
    for buf in outs.values():
        buf.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.build_prefill_indices(
        case.query_start_loc,
        case.seq_lens,
        num_tokens=T,
        window_block_table=case.window_block_table,
        compress_ratio=4,
        comp_block_table=case.comp_block_table,
        comp_block_size=64,
        topk_indices=case.topk_indices,
        topk=512,
    )
    assert torch.equal(outs["window_out"], want.window)
    assert torch.equal(outs["comp_out"], want.comp)
    assert torch.equal(outs["comp_lens_out"], want.comp_lens)


def test_no_recompilation_for_runtime_sizes(gpu: torch.device) -> None:
    """Tokens, requests, table widths and strides, top-k strides and the C128A width are
    run-time values: new batches of the same layer types compile nothing new."""

    def run_all(seed: int, qlens: list[int], ctx: list[int], c128a_topk: int) -> None:
        for ratio, topk in ((1, None), (4, 512), (128, c128a_topk)):
            case = make_prefill_index_case(
                qlens, ctx, compress_ratio=ratio, topk=topk, device=gpu, seed=seed
            )
            case.build()
            if ratio > 1:
                case.build(window=False)

    run_all(1, [5, 9], [100, 3000], 128)
    before = _compiled(kernels._prefill_indices_kernel)
    run_all(2, [700, 1, 0, 33], [9000, 0, 5, 20000], 256)
    run_all(3, [1], [77], 384)
    assert _compiled(kernels._prefill_indices_kernel) == before


@pytest.mark.parametrize("group", [1, 2, 4])
def test_window_floor_bounds_the_window_rows_gpu(group: int) -> None:
    """The window floor (vLLM's SWA bounded replay) compiled for the GPU: as on CPU."""
    from .test_prefill_indices import check_window_floor

    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    check_window_floor(group, torch.device("cuda"))
