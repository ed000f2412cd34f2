"""The decode indexer on the GPU (not yet run on one: issues 39 and 40 wait for a GPU
session): V4's 64 index heads and V4.1-Flash's 32, top-k 512 and 1,024, contexts of 8K to 1M tokens
(2K to 256K index entries), MTP rows; the selected sets equal the reference's, the
output written exactly in its first ``topk`` columns; CUDA-graph capture and replay with
new lengths and new keys give the reference's sets again; issue 40's key shards merged,
eager and captured."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator
from dsv4_kernels.testing.indexer import make_indexer_step

from .test_indexer import _same_sets

pytestmark = pytest.mark.gpu


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need CUDA")
    return torch.device("cuda")


@pytest.mark.parametrize(("heads", "topk"), [(64, 512), (64, 1024), (32, 512)])
@pytest.mark.parametrize("entries", [2048, 32768, 262144])
def test_sets_equal_the_reference(heads: int, topk: int, entries: int) -> None:
    gpu = _gpu()
    seed = fresh_seed()
    g = generator(seed)
    sizes = [entries, entries // 3, topk - 5, 0]
    step = make_indexer_step(sizes, g, heads=heads, topk=topk, rows_per_request=2,
                             entries_per_page=64, device=gpu)  # fmt: skip
    T = step.q.shape[0]
    out = torch.full((T + 1, topk + 1), -7, dtype=torch.int32, device=gpu)
    dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, step.row_req,
                           step.block_table, topk, out, max_entries=entries)  # fmt: skip
    assert bool((out[:, topk:] == -7).all()) and bool((out[T:] == -7).all())
    # the reference in float64, on the GPU too (it is plain torch)
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
    )
    _same_sets(out[:T, :topk].cpu(), want.cpu(), step.lens.cpu(), f"seed {seed}")


def test_capture_and_replay_with_new_lengths() -> None:
    gpu = _gpu()
    seed = fresh_seed()
    g = generator(seed)
    topk, entries = 512, 16384
    step = make_indexer_step([entries, 9000], g, heads=64, topk=topk, device=gpu)
    out = torch.full((2, topk), -7, dtype=torch.int32, device=gpu)
    scores = torch.empty((2, entries), dtype=torch.float32, device=gpu)

    def call() -> None:
        dk.indexer_decode_topk(
            step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table,
            topk, out, max_entries=entries, scores=scores,
        )  # fmt: skip

    call()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([entries, 9000], [300, 16000], [0, 600]):
        step.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        step.weights.copy_(torch.randn(step.weights.shape, generator=g).to(gpu))
        out.fill_(-7)
        graph.replay()
        want = ref.indexer_decode_topk(
            step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
        )
        _same_sets(out.cpu(), want.cpu(), step.lens.cpu(), f"seed {seed}, lens {lens}")


@pytest.mark.parametrize("shards", [2, 8])
def test_key_shards_merged_equal_the_whole_and_replay_in_a_graph(shards: int) -> None:
    """Issue 40's split on one GPU: every shard's candidates stacked as the all-gather
    returns them, merged, equal the whole step's sets; the shard and the merge captured
    in one CUDA graph and replayed with new lengths give them again."""
    gpu = _gpu()
    seed = fresh_seed()
    g = generator(seed)
    topk, entries = 512, 65536
    step = make_indexer_step([entries, 20000, topk - 3], g, heads=64, topk=topk,
                             rows_per_request=2, device=gpu)  # fmt: skip
    T = step.q.shape[0]
    width = -(-entries // shards)
    scores = torch.empty((T, width), dtype=torch.float32, device=gpu)
    parts = torch.full((shards * T, 2 * topk), -7, dtype=torch.int32, device=gpu)
    out = torch.full((T + 2, topk), -7, dtype=torch.int32, device=gpu)

    def call() -> None:
        for r in range(shards):
            dk.indexer_shard_topk(
                step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table,
                topk, parts[r * T : (r + 1) * T], shard=r, shards=shards, max_entries=entries,
                scores=scores,
            )  # fmt: skip
        dk.indexer_merge_topk(parts, topk, out, shards=shards, clear_rows=T + 1)

    call()
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
    )
    _same_sets(out[:T].cpu(), want.cpu(), step.lens.cpu(), f"seed {seed}")
    assert bool((out[T] == -1).all()) and bool((out[T + 1] == -7).all())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([300, 65536, 9, 10, 500, 509], [0, 1, 40000, 40001, 0, 0]):
        step.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(-7)
        graph.replay()
        want = ref.indexer_decode_topk(
            step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
        )
        _same_sets(out[:T].cpu(), want.cpu(), step.lens.cpu(), f"seed {seed}, lens {lens}")
