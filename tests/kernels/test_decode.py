"""Sparse MLA decode (split over keys + combine): the Triton kernels through Triton's
interpreter on small decode steps against a float64 oracle over exactly the indexed keys;
the split policy, the scratch sizes and the bad-input table."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import decode as dec
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import decode as td
from dsv4_kernels.testing.common import fresh_seed

from ._decode_oracle import check, oracle

SCALE = 512**-0.5


def _run(case: td.DecodeCase, scratch: dk.DecodeScratch, num_splits: int | None,
         sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    T, H, _ = case.q.shape
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=case.q.device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=case.q.device)
    kw = case.kwargs()
    kw["attn_sink"] = case.sink if sink is None else sink
    r = case.rows
    return dk.sparse_mla_decode(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE,
                                scratch=scratch, out=out, lse=lse, num_splits=num_splits,
                                **kw)  # fmt: skip


def _scratch(device: torch.device) -> dk.DecodeScratch:
    """Room for forced splits too (up to 4 per token)."""
    return dk.make_decode_scratch(dk.DecodeScratchSizes(64, 16, 16), device)


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa", "c1a", "c2a"])  # c1a, c2a: V4.1
@pytest.mark.parametrize("per_request", [1, 2, 3, 4])
def test_decode_matches_oracle(layer: str, per_request: int, kernel_device: torch.device) -> None:
    """Splits off (1), forced (2, 3 chunks) and chosen from the sizes; holes, junk past
    the lengths, one token without keys, one head without a sink."""
    seed = fresh_seed()
    g = torch.Generator(device=kernel_device).manual_seed(seed)
    heads = {1: 3, 2: 8, 3: 16, 4: 1}[per_request]
    case = td.make_decode_case(
        layer, 2, per_request, heads, context=[per_request + 200, 600], generator=g,
        device=kernel_device, topk=64, comp_width=8, hole_fraction=0.15, empty_tokens=1,
        junk_tail=True,
    )  # fmt: skip
    want = oracle(case.q, case.sources(), SCALE, case.sink)
    scratch = _scratch(kernel_device)
    for splits in (None, 1, 2, 3):
        out, lse = _run(case, scratch, splits)
        check(out.cpu(), lse.cpu(), (want[0].cpu(), want[1].cpu()))


def test_decode_sink_all_minus_inf_and_empty_rows(kernel_device: torch.device) -> None:
    """A sink of -inf on every head is no sink; rows whose keys are all holes give 0."""
    g = torch.Generator(device=kernel_device).manual_seed(fresh_seed())
    case = td.make_decode_case("c4a", 3, 1, 4, context=400, generator=g, device=kernel_device,
                               topk=64, empty_tokens=1)  # fmt: skip
    case.rows.swa_indices[1] = -1
    case.rows.comp_indices[1] = -1  # type: ignore[index]
    sink = torch.full((4,), float("-inf"), device=kernel_device)
    want = oracle(case.q, case.sources(), SCALE, sink)
    assert torch.isneginf(want[1][:2]).all() and torch.isfinite(want[1][2]).all()
    for splits in (1, 3):
        out, lse = _run(case, _scratch(kernel_device), splits, sink)
        check(out.cpu(), lse.cpu(), (want[0].cpu(), want[1].cpu()))


def test_decode_block_outer_views(kernel_device: torch.device) -> None:
    """vLLM's per-layer views (several layers' pages per block, nonzero offset)."""
    g = torch.Generator(device=kernel_device).manual_seed(fresh_seed())
    pools = td.make_pools("c128a", swa_pages=8, comp_pages=8, generator=g, device=kernel_device,
                          layers_per_block=3)  # fmt: skip
    assert pools.swa.cache.stride(0) > pools.swa.cache.shape[1] * 584
    case = td.make_decode_case("c128a", 2, 2, 5, context=[300, 500], generator=g,
                               device=kernel_device, pools=pools)  # fmt: skip
    want = oracle(case.q, case.sources(), SCALE, case.sink)
    out, lse = _run(case, _scratch(kernel_device), 2)
    check(out.cpu(), lse.cpu(), (want[0].cpu(), want[1].cpu()))


def test_reference_is_the_paged_reference() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    case = td.make_decode_case("c4a", 2, 2, 4, context=300, generator=g, device="cpu", topk=32)
    r = case.rows
    a = ref.sparse_mla_decode(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE,
                              **case.kwargs())  # fmt: skip
    b = ref.sparse_mla_paged(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE,
                             **case.kwargs())  # fmt: skip
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check(a[0], a[1], oracle(case.q, case.sources(), SCALE, case.sink))


@pytest.mark.parametrize("sms", [4, 132])
def test_split_policy_covers_every_column(sms: int) -> None:
    """Chunks are whole 64-key tiles that cover the concatenated list, splits only while
    the tokens alone do not fill the GPU, and every split fits the scratch's rows."""
    for heads in (1, 8, 16, 64):
        sizes = dk.decode_scratch_sizes(600, heads, 128 + 1024, sms=sms)
        for tokens in (1, 2, 3, 7, 16, 33, 100, 197, 198, 264, 600):
            for b in (0, 8, 64, 512, 1000, 1024):
                splits, chunk = dec.decode_splits(tokens, heads, 128, b, sms)
                assert splits * chunk >= 128 + b
                if splits > 1:
                    assert chunk % 64 == 0 and (splits - 1) * chunk < 128 + b
                    exact = dec.decode_scratch_sizes(tokens, heads, 128 + b, sms=sms)
                    assert tokens * splits <= min(exact.partial_rows, sizes.partial_rows)
                per_sm = 3 if heads <= 8 else 2
                if dec.DECODE_TILES["NOSPLIT_DIV"] * tokens >= sms * per_sm:
                    assert splits == 1
    assert dec.decode_splits(1, 8, 128, 512, 132) == (10, 64)


def test_split_policy_by_argument_leaves_the_defaults_alone(kernel_device: torch.device) -> None:
    """A sweep passes its variant as ``policy=`` (no module global is rebound): it changes
    the splits, the scratch it needs and nothing of the result; bad entries are refused
    by name."""
    before = dict(dec.DECODE_TILES)
    # at least two tiles per chunk: half the chunks, twice as long
    assert dec.decode_splits(1, 8, 128, 512, 132, policy={"MIN_TILES_PER_SPLIT": 2}) == (5, 128)
    assert dec.decode_splits(1, 8, 128, 512, 132) == (10, 64)
    # every token unsplit once NOSPLIT_DIV * tokens reaches the target
    assert dec.decode_splits(2, 8, 128, 512, 132, policy={"NOSPLIT_DIV": 400})[0] == 1
    small = dk.decode_scratch_sizes(64, 8, 640, sms=132, policy={"MIN_TILES_PER_SPLIT": 2})
    assert small.partial_rows < dk.decode_scratch_sizes(64, 8, 640, sms=132).partial_rows
    seed = fresh_seed()
    g = torch.Generator(device=kernel_device).manual_seed(seed)
    case = td.make_decode_case("c4a", 2, 1, 8, context=700, generator=g, device=kernel_device,
                               swa_pages=8, comp_pages=64, topk=256)  # fmt: skip
    r = case.rows
    scratch = dk.make_decode_scratch(
        dk.decode_scratch_sizes(2, 8, 384, kernel_device), kernel_device
    )
    args = (case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE)
    a = dk.sparse_mla_decode(*args, scratch=scratch, **case.kwargs(r))
    a = (a[0].clone(), a[1].clone())
    b = dk.sparse_mla_decode(*args, scratch=scratch, policy={"MIN_TILES_PER_SPLIT": 3},
                             **case.kwargs(r))  # fmt: skip
    check(a[0], a[1], oracle(case.q, case.sources(), SCALE, case.sink))
    check(b[0], b[1], oracle(case.q, case.sources(), SCALE, case.sink))
    # decode v2's launch switches (PDL and the head-block wgmma kernel act on Hopper only:
    # never under the interpreter or on a CPU)
    assert not dec._pdl_runs(torch.device("cpu"))
    c = dk.sparse_mla_decode(*args, scratch=scratch, policy={"PDL": 0, "HEAD_BLOCKS": 0},
                             **case.kwargs(r))  # fmt: skip
    check(c[0], c[1], oracle(case.q, case.sources(), SCALE, case.sink))
    assert before == dec.DECODE_TILES
    for bad, match in (({"SPLITS": 2}, "unknown entries"), ({"NOSPLIT_DIV": -1}, "NOSPLIT_DIV"),
                       ({"NOSPLIT_DIV": 1.5}, "NOSPLIT_DIV"), ([1], "mapping"),
                       ({"WIDE_HT": 48}, r"WIDE_HT.*\(0, 32, 64\).*48")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            dk.sparse_mla_decode(*args, scratch=scratch, policy=bad, **case.kwargs(r))  # type: ignore[arg-type]


def test_decode_scratch_sizes_and_buffer() -> None:
    sizes = dk.decode_scratch_sizes(8, 16, 640, "cpu")
    assert sizes.partial_out == sizes.partial_rows * 16 * 512
    assert sizes.total == sizes.partial_out + sizes.partial_lse + 8 * 16
    buf = torch.zeros(sizes.total + 5)
    s = dk.make_decode_scratch(sizes, "cpu", buffer=buf)
    assert s.partial_out.data_ptr() == buf.data_ptr() and s.lse.numel() == 8 * 16
    with pytest.raises(ValueError, match="buffer"):
        dk.make_decode_scratch(sizes, "cpu", buffer=torch.zeros(sizes.total - 1))
    with pytest.raises(ValueError, match="max_tokens"):
        dk.decode_scratch_sizes(0, 8, 640)


def _bad_calls(case: td.DecodeCase, scratch: dk.DecodeScratch) -> list[tuple[dict, str]]:
    r = case.rows
    return [
        ({"scratch": object()}, "scratch must be a DecodeScratch"),
        ({"scratch": dk.make_decode_scratch(dk.decode_scratch_sizes(1, 1, 640, "cpu"), "cpu")},
         "scratch holds"),
        ({"num_splits": 0}, "num_splits"),
        ({"num_splits": 1000}, "scratch holds"),
        ({"q": case.q.float()}, "q must have dtype"),
        ({"swa_indices": r.swa_indices.long()}, "swa_indices must have dtype"),
        ({"swa_lens": r.swa_lens[:1]}, "swa_lens must have"),
        ({"comp_block_size": None}, "must be given together"),
        ({"attn_sink": case.sink[:1]}, "attn_sink must have"),
        ({"out": torch.empty(1, 1, 512, dtype=torch.bfloat16)}, "out must have shape"),
        ({"lse": torch.empty(1, dtype=torch.float32)}, "lse must have shape"),
        ({"scale": -1.0}, "scale"),
        ({"swa_block_size": 0}, "swa_block_size"),
    ]  # fmt: skip


def test_bad_inputs_raise_value_errors_naming_the_argument() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    case = td.make_decode_case("c4a", 2, 1, 4, context=300, generator=g, device="cpu", topk=32)
    scratch = _scratch(torch.device("cpu"))
    r = case.rows
    base = dict(q=case.q, swa_cache=case.pools.swa.cache, swa_indices=r.swa_indices,
                swa_lens=r.swa_lens, scale=SCALE, scratch=scratch, **case.kwargs())  # fmt: skip
    for change, message in _bad_calls(case, scratch):
        with pytest.raises(ValueError, match=message):
            dk.sparse_mla_decode(**{**base, **change})
