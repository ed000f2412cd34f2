"""The lightning indexer's reference (``dsv4_kernels.reference.indexer``) against slow
oracles spelled from the layout and the formula in ``docs/design.md`` ("The lightning
indexer"), on fresh random inputs: the page layout byte by byte (codes of every entry,
then every entry's float32 scale, at any page stride), the power-of-two quantisation,
the scores entry by entry, and the top-k (rows shorter than k, empty rows, MTP rows of
different lengths, holes in the block table, ties at the k-th place, a poisoned output
written exactly where it should be)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator
from dsv4_kernels.testing.indexer import make_index_cache, make_indexer_step

ENTRY, CODES, SCALE = 132, 128, 4  # the spec, restated (docs/design.md)


def test_insert_writes_codes_then_scales_per_page_at_any_stride() -> None:
    seed = fresh_seed()
    g = generator(seed)
    entries, pages, stride = 8, 5, 8 * ENTRY + 576  # a block-outer page stride
    cache = make_index_cache(pages, entries, page_stride=stride)
    slots = torch.randperm(pages * entries, generator=g)[:17]
    k = torch.randn(18, CODES, generator=g) * 3
    ref.insert_index_k(k, cache, torch.cat([slots, torch.tensor([-1])]))  # -1: nothing
    raw = torch.as_strided(cache, ((pages - 1) * stride + entries * ENTRY,), (1,))
    for i, s in enumerate(slots.tolist()):
        page, e = divmod(s, entries)
        codes = raw[page * stride + e * CODES : page * stride + (e + 1) * CODES]
        at = page * stride + entries * CODES + e * SCALE
        scale = raw[at : at + SCALE].clone().view(torch.float32).item()
        x = k[i].to(torch.bfloat16).to(torch.float32)
        amax = max(float(x.abs().max()), 1e-4)
        assert scale == 2.0 ** math.ceil(math.log2(amax / 448)), (seed, s)
        want = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(codes, want), (seed, s)
    # nothing else was written (the -1 slot, the padding between pages)
    written = torch.zeros_like(raw, dtype=torch.bool)
    for s in slots.tolist():
        page, e = divmod(s, entries)
        written[page * stride + e * CODES : page * stride + (e + 1) * CODES] = True
        at = page * stride + entries * CODES + e * SCALE
        written[at : at + SCALE] = True
    assert not bool(raw[~written].any())


def _oracle_scores(step) -> list[list[float]]:  # type: ignore[no-untyped-def]
    """Entry by entry, head by head, in float64, from the bytes."""
    cache, entries = step.cache, step.cache.shape[1]
    stride = cache.stride(0)
    raw = torch.as_strided(cache, ((cache.shape[0] - 1) * stride + entries * ENTRY,), (1,))
    q = step.q.to(torch.float64)
    out = []
    for t in range(q.shape[0]):
        b = int(step.row_req[t])
        row = []
        for j in range(int(step.lens[t])):
            page = int(step.block_table[b, j // entries])
            e = j % entries
            k = raw[page * stride + e * CODES : page * stride + (e + 1) * CODES]
            k = k.view(torch.float8_e4m3fn).to(torch.float64)
            at = page * stride + entries * CODES + e * SCALE
            scale = raw[at : at + SCALE].clone().view(torch.float32).to(torch.float64).item()
            dots = (q[t] @ k).clamp_min(0)
            row.append(scale * float((step.weights[t].to(torch.float64) * dots).sum()))
        out.append(row)
    return out


def _copy_entry(step, req: int, src: int, dst: int) -> None:  # type: ignore[no-untyped-def]
    """Copy request ``req``'s entry ``src`` (codes and scale) onto its entry ``dst``."""
    cache, entries = step.cache, step.cache.shape[1]
    stride = cache.stride(0)
    raw = torch.as_strided(cache, ((cache.shape[0] - 1) * stride + entries * ENTRY,), (1,))

    def at(j: int) -> tuple[int, int]:
        page = int(step.block_table[req, j // entries])
        return page * stride + (j % entries) * CODES, page * stride + entries * CODES + (
            j % entries
        ) * SCALE

    (c_src, s_src), (c_dst, s_dst) = at(src), at(dst)
    raw[c_dst : c_dst + CODES] = raw[c_src : c_src + CODES].clone()
    raw[s_dst : s_dst + SCALE] = raw[s_src : s_src + SCALE].clone()


def _tie_pick(step, req_row: int, score: float, topk: int) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    """Row ``req_row``'s entries tied at ``score`` (ascending) and the ones a top-k that
    takes ties lowest position first keeps of them: the random keys may already tie
    with the k-th (fp8 codes, ``ties=``), so the count is read, not assumed."""
    row = _oracle_scores(step)[req_row]
    above = sum(1 for s in row if s > score)
    tied = sorted(j for j, s in enumerate(row) if s == score)
    return tied, tied[: max(0, topk - above)]


def test_scores_equal_the_formula_entry_by_entry() -> None:
    seed = fresh_seed()
    g = generator(seed)
    step = make_indexer_step([70, 3, 130], g, heads=4, topk=8, rows_per_request=2,
                             entries_per_page=16)  # fmt: skip
    got = ref.index_scores(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table
    )
    for t, row in enumerate(_oracle_scores(step)):
        n = len(row)
        assert torch.allclose(got[t, :n], torch.tensor(row, dtype=torch.float64), rtol=1e-12)
        assert bool((got[t, n:] == float("-inf")).all()), (seed, t)


@pytest.mark.parametrize("topk", [8, 64])
@pytest.mark.parametrize("ties", [0, 5])
def test_topk_is_the_highest_scores_lowest_position_first(topk: int, ties: int) -> None:
    """Rows shorter than k (all their entries, then -1), an empty request's rows (all
    -1), MTP rows of one request with different lengths, ties at the k-th place (lowest
    position first), a poisoned output written in its first ``topk`` columns only."""
    seed = fresh_seed()
    g = generator(seed)
    row_lens = [[95, 96], [0, 0], [5, 6], [40, 38]]
    step = make_indexer_step([96, 0, 6, 40], g, heads=8, topk=topk, rows_per_request=2,
                             row_lens=row_lens, entries_per_page=16, ties=ties)  # fmt: skip
    if ties:  # a tie straddling the k-th place of row 0: its k-th entry's bytes copied
        scores = _oracle_scores(step)[0]  # onto an entry ranked below k, both directions
        ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
        kth, below = ranked[topk - 1], ranked[topk + 5]
        _copy_entry(step, 0, kth, below)
        assert _oracle_scores(step)[0][below] == scores[kth]
    out = torch.full((step.q.shape[0], topk + 3), -7, dtype=torch.int32)
    got = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk,
        out=out,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert bool((out[:, topk:] == -7).all()), "written past topk"
    for t, row in enumerate(_oracle_scores(step)):
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:topk]
        want = order + [-1] * (topk - len(order))
        assert out[t, :topk].tolist() == want, (seed, t)


def test_fill_index_cache_is_random_finite_and_in_the_layout() -> None:
    """The benchmarks' fast filler: every code finite (no E4M3 NaN pattern), every scale
    a power of two in [2^-8, 1], at a block-outer page stride, the padding untouched."""
    from dsv4_kernels.testing.indexer import fill_index_cache

    g = generator(fresh_seed())
    entries, pages, stride = 16, 6, 16 * ENTRY + 64
    cache = make_index_cache(pages, entries, page_stride=stride)
    fill_index_cache(cache, g)
    codes, scales = ref.dequantize_index_k(cache, torch.arange(pages * entries))
    assert bool(torch.isfinite(codes).all()) and codes.abs().max() > 0
    e = torch.log2(scales)
    assert bool((e == e.round()).all()) and e.min() >= -8 and e.max() <= 0
    raw = torch.as_strided(cache, (pages * stride - 64,), (1,))
    for p in range(pages - 1):
        assert not bool(raw[p * stride + entries * ENTRY : (p + 1) * stride].any())
