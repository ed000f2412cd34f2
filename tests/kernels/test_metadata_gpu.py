"""GPU-only checks of the metadata kernels: benchmark sizes, CUDA graphs, compile counts, 64-bit
addressing.  Run with ``python3 -m pytest -m gpu`` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from benchmarks import cases_metadata as cm

import dsv4_kernels as dk
from dsv4_kernels import _triton_metadata as kernels
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import POISON, fresh_seed, generator
from dsv4_kernels.testing.metadata import combine_bench_inputs, make_batch

pytestmark = pytest.mark.gpu


def _compiled(kernel: object) -> int:
    """Number of compiled variants of a Triton kernel (across devices)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", cm.COMBINE_MATRIX, ids=lambda s: s.name)
def test_combine_benchmark_sizes_match_reference(shape: cm.CombineShape, gpu: torch.device) -> None:
    seed = fresh_seed()
    inp = combine_bench_inputs(
        shape.layer, shape.num_reqs, shape.query_len, shape.context, gpu, generator(seed)
    )
    name, T, args = f"{shape.name} seed {seed}", inp.num_tokens, inp.args
    want, want_lens = ref.combine_topk_swa_indices(*args, num_tokens=T)
    out = torch.full_like(want, POISON)
    lens = torch.full_like(want_lens, POISON)
    dk.combine_topk_swa_indices(*args, out=out, lens_out=lens)
    assert out.shape[0] == T
    assert torch.equal(out, want), name
    assert torch.equal(lens, want_lens), name


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa", "images"])
def test_combine_random_batches_on_gpu(layer: str, gpu: torch.device) -> None:
    ratio, topk = {"c4a": (4, 512), "c128a": (128, 96), "swa": (1, 0), "images": (4, 512)}[layer]
    seed = fresh_seed()  # one seed for the query lengths and the batch
    lens = torch.randint(0, 700, (37,), generator=generator(seed)).tolist()
    b = make_batch(
        seed,
        query_lens=lens,
        ratio=ratio,
        topk=topk,
        context=(0, 9000),
        slice_offset=3,
        images=layer == "images",
        max_image_tokens=256,
        negative_positions=True,
    )
    b = b.to(gpu)
    want = ref.combine_topk_swa_indices(*b.args(), **b.kwargs())
    out = torch.full_like(want[0], POISON)
    got = dk.combine_topk_swa_indices(*b.args(), out=out, **b.kwargs())
    bad = (got[0] != want[0]).nonzero()
    assert bad.numel() == 0, (
        f"seed {b.seed}: {bad.shape[0]} mismatches, first {bad[:4].tolist()}: "
        f"got {got[0][tuple(bad[0])]}, want {want[0][tuple(bad[0])]}"
    )
    assert torch.equal(got[1], want[1]), f"seed {b.seed}"


def test_combine_cuda_graph_capture_and_replay(gpu: torch.device) -> None:
    b = make_batch(
        fresh_seed(), query_lens=[300, 0, 77, 512], ratio=4, topk=512, context=(0, 5000)
    ).to(gpu)
    width = 640
    out = torch.full((b.num_tokens, width), POISON, dtype=torch.int32, device=gpu)
    lens = torch.full((b.num_tokens,), POISON, dtype=torch.int32, device=gpu)
    topk, seq = b.topk_indices.clone(), b.seq_lens.clone()  # type: ignore[union-attr]
    args = (topk, b.query_start_loc, seq, b.gather_lens, 128, 4, 512, b.M, b.N)
    dk.combine_topk_swa_indices(*args, out=out, lens_out=lens)  # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dk.combine_topk_swa_indices(*args, out=out, lens_out=lens)
    # New inputs in the captured buffers, poisoned outputs, replay.
    topk.copy_(torch.randint_like(topk, -1, b.N))
    seq.add_(torch.randint_like(seq, 0, 1000))
    out.fill_(POISON)
    lens.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.combine_topk_swa_indices(*args)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])


def test_global_cuda_graph_capture_and_replay(gpu: torch.device) -> None:
    T, K = 999, 512
    topk = torch.randint(-1, 32768, (T, K), dtype=torch.int32, device=gpu)
    req = torch.randint(0, 4, (T,), dtype=torch.int32, device=gpu)
    table = torch.randint(0, 10**6, (4, 512), dtype=torch.int32, device=gpu)
    valid = torch.rand(T, device=gpu) > 0.1
    out = torch.empty((T, K), dtype=torch.int32, device=gpu)
    lens = torch.empty((T,), dtype=torch.int32, device=gpu)
    args = (topk, req, table, 64, valid)
    dk.compute_global_topk_indices_and_lens(*args, out=out, lens_out=lens)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dk.compute_global_topk_indices_and_lens(*args, out=out, lens_out=lens)
    topk.copy_(torch.randint_like(topk, -1, 40000))
    out.fill_(POISON)
    lens.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.compute_global_topk_indices_and_lens(*args)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])


def test_no_recompilation_for_runtime_sizes(gpu: torch.device) -> None:
    """Tokens, requests, M, N, query_start_loc offsets and the C128A width are run-time values."""

    def run_all(seed: int, qlens: list[int], offset: int, c128a_topk: int) -> None:
        for ratio, topk, generate in ((4, 512, False), (128, c128a_topk, True), (1, 0, False)):
            b = make_batch(
                seed,
                query_lens=qlens,
                ratio=ratio,
                topk=topk,
                context=(0, 3000),
                slice_offset=offset,
                generate_topk=generate,
            ).to(gpu)
            got = dk.combine_topk_swa_indices(*b.args(), num_tokens=b.num_tokens)
            want = ref.combine_topk_swa_indices(*b.args(), num_tokens=b.num_tokens)
            assert torch.equal(got[0], want[0])
        T = sum(qlens)
        topk = torch.randint(-1, 4096, (T, 512), dtype=torch.int32, device=gpu)
        dk.compute_global_topk_indices_and_lens(
            topk,
            torch.zeros(T, dtype=torch.int32, device=gpu),
            torch.randint(0, 999, (1, 64 + offset), dtype=torch.int32, device=gpu),
            64,
            torch.ones(T, dtype=torch.bool, device=gpu),
        )

    def counts() -> tuple[int, int]:
        return (
            _compiled(kernels._combine_topk_swa_indices_kernel),
            _compiled(kernels._global_topk_indices_kernel),
        )

    run_all(fresh_seed(), [16, 32], 1, 16)  # compiles each variant once
    before = counts()
    for qlens, offset, width in (
        ([1], 2, 1),
        ([1000, 17, 0, 3], 5, 33),
        ([4096], 1, 128),
        ([7, 9, 11, 13, 15], 8, 7),
    ):
        run_all(fresh_seed(), qlens, offset, width)
    assert counts() == before, f"new compilations: {before} -> {counts()}"
    # Caller-provided C128A rows of varying width: the only new variant allowed is
    # the scalar-load one for rows that are not 16-byte aligned (a layout property).
    for width in (16, 33, 7, 1, 128):
        b = make_batch(fresh_seed(), query_lens=[50, 3], ratio=128, topk=width).to(gpu)
        got = dk.combine_topk_swa_indices(*b.args())
        assert torch.equal(got[0], ref.combine_topk_swa_indices(*b.args())[0])
    assert counts()[0] <= before[0] + 1, f"{before} -> {counts()}"


def test_combine_64bit_row_offsets(gpu: torch.device) -> None:
    """An output whose element offsets pass 2**31 (8.6 GB): the tail rows must be right."""
    width = 128  # SWA-only rows
    T = (2**31) // width + 4096
    context = T + 1000
    qsl = torch.tensor([5, 5 + T], dtype=torch.int32, device=gpu)
    seq = torch.tensor([context], dtype=torch.int32, device=gpu)
    gl = torch.tensor([T + 127], dtype=torch.int32, device=gpu)
    out, lens = dk.combine_topk_swa_indices(
        None,
        qsl,
        seq,
        gl,
        128,
        1,
        0,
        T + 127 + 8,
        8,
        out=torch.empty((T, width), dtype=torch.int32, device=gpu),
    )
    tail = 8192
    small_qsl = torch.tensor([0, tail], dtype=torch.int32, device=gpu)
    want, want_lens = ref.combine_topk_swa_indices(
        None, small_qsl, seq, gl, 128, 1, 0, T + 127 + 8, 8
    )
    assert torch.equal(out[-tail:], want) and torch.equal(lens[-tail:], want_lens)
    del out


def test_global_64bit_row_offsets(gpu: torch.device) -> None:
    K = 512
    T = (2**31) // K + 2048
    topk = torch.randint(-1, 32768, (T, K), dtype=torch.int32, device=gpu)
    req = torch.zeros(T, dtype=torch.int32, device=gpu)
    table = torch.randint(0, 10**6, (1, 512), dtype=torch.int32, device=gpu)
    valid = torch.ones(T, dtype=torch.bool, device=gpu)
    out, lens = dk.compute_global_topk_indices_and_lens(topk, req, table, 64, valid)
    tail = 4096
    want, want_lens = ref.compute_global_topk_indices_and_lens(
        topk[-tail:], req[-tail:], table, 64, valid[-tail:]
    )
    assert torch.equal(out[-tail:], want) and torch.equal(lens[-tail:], want_lens)
