"""The decode indexer kernels (``dsv4_kernels.indexer_decode_topk``; Triton's interpreter
on CPU) against the reference on fresh random inputs: the selected set of every row
equals the reference's (rows longer and shorter than k, empty rows, MTP rows of
different lengths, holes in the block table, a strided page layout, ties at the k-th
place taken lowest position first as the reference does), -1 after a row's entries,
a poisoned output written in its first ``topk`` columns of its first ``T`` rows only;
bad input named."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator
from dsv4_kernels.testing.indexer import make_indexer_step

from .test_indexer_reference import _copy_entry, _oracle_scores, _tie_pick


def _run(step, topk: int, max_entries: int, extra_rows: int = 2):  # type: ignore[no-untyped-def]
    T = step.q.shape[0]
    out = torch.full((T + extra_rows, topk + 3), -7, dtype=torch.int32)
    got = dk.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk,
        out, max_entries=max_entries,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert bool((out[:, topk:] == -7).all()) and bool((out[T:] == -7).all()), "wrote outside"
    return out[:T, :topk]


def _same_sets(got: torch.Tensor, want: torch.Tensor, lens: torch.Tensor, where: str) -> None:
    for t in range(got.shape[0]):
        n = min(int(lens[t]), got.shape[1])
        g, w = got[t].tolist(), want[t].tolist()
        assert g[n:] == [-1] * (len(g) - n) and w[n:] == g[n:], f"{where}, row {t}: the -1 fill"
        assert sorted(g[:n]) == sorted(w[:n]), f"{where}, row {t}"


@pytest.mark.parametrize("heads", [8, 32, 64])
@pytest.mark.parametrize("topk", [16, 64])
def test_selected_sets_equal_the_reference(heads: int, topk: int) -> None:
    seed = fresh_seed()
    g = generator(seed)
    row_lens = [[299, 300], [0, 0], [9, 10], [63, 64], [65, 64]]
    step = make_indexer_step([300, 0, 10, 64, 65], g, heads=heads, topk=topk, rows_per_request=2,
                             row_lens=row_lens, entries_per_page=64)  # fmt: skip
    got = _run(step, topk, 320)
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
    )
    _same_sets(got, want, step.lens, f"seed {seed}")


def test_ties_at_the_kth_place_lowest_position_first() -> None:
    seed = fresh_seed()
    g = generator(seed)
    topk = 16
    step = make_indexer_step([200, 150], g, heads=16, topk=topk, entries_per_page=32, ties=6)
    scores = _oracle_scores(step)[0]
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    kth = ranked[topk - 1]
    for below in ranked[topk + 2 : topk + 5]:  # three more entries tied with the k-th
        _copy_entry(step, 0, kth, below)
    got = _run(step, topk, 256)
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk
    )
    _same_sets(got, want, step.lens, f"seed {seed}")
    tied, kept = _tie_pick(step, 0, scores[kth], topk)
    assert len(tied) >= 4 and 1 <= len(kept) < len(tied), (seed, tied, kept)
    assert sorted(set(got[0].tolist()) & set(tied)) == kept, "lowest position first"


def test_a_strided_cache_and_a_scores_scratch() -> None:
    """vLLM's block-outer page stride (pages further apart than their 64 x 132 bytes) and
    a caller's scores scratch wider than needed (what a CUDA graph reuses)."""
    seed = fresh_seed()
    g = generator(seed)
    step = make_indexer_step([130, 70], g, heads=32, topk=32, entries_per_page=64)
    pages, entries = step.cache.shape[:2]
    stride = entries * 132 + 1152
    flat = torch.zeros(pages * stride, dtype=torch.uint8)
    strided = flat.as_strided((pages, entries, 132), (stride, 132, 1))
    strided.copy_(step.cache)
    scores = torch.full((5, 400), float("nan"))
    out = torch.full((2, 32), -7, dtype=torch.int32)
    dk.indexer_decode_topk(step.q, step.weights, strided, step.lens, step.row_req,
                           step.block_table, 32, out, max_entries=130, scores=scores)  # fmt: skip
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, 32
    )
    _same_sets(out, want, step.lens, f"seed {seed}")


def test_bad_input_is_named() -> None:
    g = generator(fresh_seed())
    s = make_indexer_step([40], g, heads=16, topk=8)
    out = torch.zeros((1, 8), dtype=torch.int32)
    args = (s.q, s.weights, s.cache, s.lens, s.row_req, s.block_table, 8, out)
    with pytest.raises(ValueError, match="q must have dtype"):
        dk.indexer_decode_topk(s.q.float(), *args[1:], max_entries=64)
    with pytest.raises(ValueError, match="weights must be"):
        dk.indexer_decode_topk(s.q, s.weights[:, :4], *args[2:], max_entries=64)
    with pytest.raises(ValueError, match="cache must be"):
        dk.indexer_decode_topk(*args[:2], s.cache[:, :, :128], *args[3:], max_entries=64)
    with pytest.raises(ValueError, match="out must be"):
        dk.indexer_decode_topk(*args[:7], out[:, :4], max_entries=64)
    with pytest.raises(ValueError, match="scores must be"):
        dk.indexer_decode_topk(*args, max_entries=64, scores=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="lens must have dtype"):
        dk.indexer_decode_topk(*args[:3], s.lens.long(), *args[4:], max_entries=64)


def test_the_benchmark_case_checks_what_it_times() -> None:
    """``benchmarks.cases_indexer``'s smoke case: ours and the two split parts (TP2 on a
    CPU) run and pass their checks, and each check fails on the poisoned output alone
    (a provider that wrote nothing)."""
    from benchmarks.cases_indexer import build_cases

    (case,) = build_cases(torch.device("cpu"), smoke=True)
    labels = [p.name for p in case.providers]
    assert labels == ["dsv4-kernels", "split-keys/TP2", "split-rows/TP2"], labels
    for prov in case.providers:
        prov.poison()
        prov.run()
        prov.check()
        prov.poison()
        with pytest.raises(AssertionError, match="not the reference"):
            prov.check()
    assert case.floor_bytes >= case.params["entries"] * 132 * case.params["requests"]


@pytest.mark.parametrize("rows_per_request", [1, 2, 3])
def test_rows_by_request_without_row_req_and_cleared_padding_rows(rows_per_request: int) -> None:
    """vLLM's uniform decode batches (``row_req`` None: row ``t`` is request
    ``t // rows_per_request``, one block-table row per request) and its padded tokens:
    rows ``T .. clear_rows - 1`` become -1, every other column and row untouched."""
    seed = fresh_seed()
    g = generator(seed)
    per = rows_per_request
    seq = [150, 40, 0, 97]
    row_lens = [[max(s - per + 1 + j, 0) for j in range(per)] for s in seq]
    step = make_indexer_step(seq, g, heads=16, topk=32, rows_per_request=per,
                             row_lens=row_lens, entries_per_page=64)  # fmt: skip
    T = step.q.shape[0]
    assert torch.equal(step.row_req, torch.arange(T, dtype=torch.int32) // per)
    out = torch.full((T + 4, 35), -7, dtype=torch.int32)
    dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, None, step.block_table,
                           32, out, max_entries=160, rows_per_request=per,
                           clear_rows=T + 3)  # fmt: skip
    want = ref.indexer_decode_topk(
        step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, 32
    )
    _same_sets(out[:T, :32], want, step.lens, f"seed {seed}")
    assert bool((out[T : T + 3, :32] == -1).all()), "padding rows cleared"
    assert bool((out[T + 3 :] == -7).all()) and bool((out[:, 32:] == -7).all()), "wrote outside"
    with pytest.raises(ValueError, match="rows_per_request"):
        dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, None,
                               step.block_table, 32, out, max_entries=160,
                               rows_per_request=0)  # fmt: skip
    with pytest.raises(ValueError, match="out must be"):
        dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, None,
                               step.block_table, 32, out, max_entries=160,
                               clear_rows=T + 5)  # fmt: skip


def test_the_table_section_takes_the_smallest_ratio_per_row_count() -> None:
    """``cases_indexer.indexer_section``: vLLM's time over ours per heads, top-k and rows,
    the smallest over contexts; cases where vLLM's pair did not run are left out (the
    plugin's parser of that shape: ``tests/attention/test_indexer_policy.py``)."""
    from benchmarks.cases_indexer import KERNEL, VLLM_PROVIDER, indexer_section
    from benchmarks.harness import Result

    def result(case: str, provider: str, us: float, reqs: int, per: int) -> Result:
        p = {"requests": reqs, "tokens_per_request": per, "heads": 64, "topk": 512}
        return Result(KERNEL, provider, case, reqs * per, us, us, us, 0.0, 0, p)

    rs = [
        result("a", "dsv4-kernels", 10.0, 4, 2), result("a", VLLM_PROVIDER, 30.0, 4, 2),
        result("b", "dsv4-kernels", 10.0, 8, 1), result("b", VLLM_PROVIDER, 15.0, 8, 1),
        result("c", "dsv4-kernels", 10.0, 1, 1),  # vLLM's pair did not run
    ]  # fmt: skip
    section = indexer_section(rs, "test")
    assert section is not None
    assert section["ratios"] == {"64": {"512": {"8": 1.5}}}
    assert indexer_section(rs[-1:]) is None


def test_the_fetch_stages_vllms_deep_gemm_and_topk_only() -> None:
    from benchmarks.support.fetch_vllm_indexer import TOPK_FILE, TOPK_MEMBER, members

    names = [
        "vllm/third_party/deep_gemm/_C.py",
        "vllm/third_party/deep_gemm/include/deep_gemm/x.cuh",
        "vllm/third_party/deep_gemm/__pycache__/_C.cpython-311.pyc",
        "vllm/third_party/flashmla/flash_mla_interface.py",
        TOPK_MEMBER,
        "vllm/_flashmla_C.abi3.so",
    ]
    assert members(names) == {
        names[0]: "deep_gemm/_C.py",
        names[1]: "deep_gemm/include/deep_gemm/x.cuh",
        TOPK_MEMBER: TOPK_FILE,
    }
