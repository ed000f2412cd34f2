"""Grouped index rows (SWA-only and C128A layers) and sparse MLA on them, on CPU.

``build_grouped_prefill_indices`` (the Triton kernel through the interpreter,
and the torch reference) must give every token exactly the keys of its
per-token rows (``build_prefill_indices``, checked against the spec in
``test_prefill_indices``): its leader's row, from its start, for its length.
``sparse_mla_paged`` with ``leads`` must then give the per-token result.  The
wgmma kernel that consumes grouped rows without expanding them runs on the
H200 (``test_sparse_mla_gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import reference as ref
from dsv4_kernels import sparse_mla as sm
from dsv4_kernels.reference.prefill_indices import expand_grouped_rows
from dsv4_kernels.testing import fresh_seed, generator
from dsv4_kernels.testing import sparse_mla as ts
from dsv4_kernels.testing.prefill_indices import make_prefill_index_case

from ._prefill_indices_cases import QUERY_LENS, WINDOW, WINDOW_BS, Case, make_case

# the row builders' cases, and requests shorter than a group
GROUPED_QUERY_LENS = {**QUERY_LENS, "short-requests": [1, 2, 1, 3, 1, 1, 2]}


def _grouped(case: Case, group: int, device: torch.device, impl: str, **outs: Any) -> Any:
    """The case's grouped rows, from the kernel (``impl`` "triton") or the reference, into
    the ``*_out`` buffers given."""
    c = case.to(device)
    comp = case.ratio == 128
    fn = dk.build_grouped_prefill_indices if impl == "triton" else ref.build_grouped_prefill_indices
    return fn(
        c.query_start_loc,
        c.seq_lens,
        num_tokens=case.num_tokens,
        group_size=group,
        window_block_table=c.window_table,
        window_block_size=WINDOW_BS,
        window_size=WINDOW,
        comp_block_table=c.comp_table if comp else None,
        comp_block_size=case.comp_bs if comp else None,
        topk=case.topk if comp else None,
        **outs,
    )


def _leads_spec(case: Case, group: int) -> torch.Tensor:
    qsl = case.query_start_loc.long() - int(case.query_start_loc[0])
    leads = []
    for b in range(qsl.shape[0] - 1):
        for t in range(int(qsl[b]), int(qsl[b + 1])):
            leads.append(max(group * (t // group), int(qsl[b])))
    return torch.tensor(leads, dtype=torch.int32)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("group", [2, 3, 4, 8])
@pytest.mark.parametrize("layer", ["swa", "c128a"])
@pytest.mark.parametrize("lens", list(GROUPED_QUERY_LENS))
def test_grouped_rows_hold_each_tokens_keys(
    impl: str, group: int, layer: str, lens: str, kernel_device: torch.device
) -> None:
    ratio = 128 if layer == "c128a" else 1
    case = make_case(
        fresh_seed(),
        query_lens=GROUPED_QUERY_LENS[lens],
        ratio=ratio,
        topk=6 if ratio == 128 else 0,
        context=(0, 900),
        negative_pages=0.05,
    )
    device = kernel_device if impl == "triton" else torch.device("cpu")
    c = case.to(device)
    per = dk.build_prefill_indices(c.query_start_loc, c.seq_lens, **c.kwargs())
    got = _grouped(case, group, device, impl)
    T = case.num_tokens
    what = f"seed {case.seed}"
    assert got.group_size == group
    assert torch.equal(got.leads.cpu(), _leads_spec(case, group)), what
    assert got.window.shape == (T, WINDOW + group - 1)
    starts, lens_w = got.window_starts.long(), got.window_lens.long()
    assert bool((starts >= 0).all()) and bool((starts + lens_w <= WINDOW + group - 1).all())
    rows, n = expand_grouped_rows(got.leads, got.window, got.window_lens, got.window_starts, T)
    assert torch.equal(n, per.window_lens), what
    assert torch.equal(rows[:, :WINDOW], per.window), what
    assert bool((rows[:, WINDOW:] == -1).all()), what
    if ratio == 128:
        rows, n = expand_grouped_rows(got.leads, got.comp, got.comp_lens, None, T)
        assert torch.equal(n, per.comp_lens) and torch.equal(rows, per.comp), what
    else:
        assert got.comp is None and got.comp_lens is None
    # the kernel and the reference build the same rows, past the lengths too
    other = _grouped(case, group, device, "reference" if impl == "triton" else "triton")
    for name, a, b in zip(got._fields, got, other, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), f"{what}: {name}"


def test_groups_of_one_are_the_per_token_rows(kernel_device: torch.device) -> None:
    case = make_case(fresh_seed(), query_lens=[5, 0, 17, 1], ratio=128, topk=6)
    c = case.to(kernel_device)
    per = dk.build_prefill_indices(c.query_start_loc, c.seq_lens, **c.kwargs())
    got = _grouped(case, 1, kernel_device, "triton")
    assert torch.equal(got.leads.cpu(), torch.arange(case.num_tokens, dtype=torch.int32))
    assert torch.equal(got.window, per.window) and torch.equal(got.comp, per.comp)
    assert not bool(got.window_starts.any())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda kw: kw.update(group_size=0), "group_size must be > 0"),
        (lambda kw: kw.update(group_size=2.0), "group_size must be an int"),
        (lambda kw: kw.update(comp_block_table=None), "topk must be None without"),
        (lambda kw: kw.update(topk=None), "topk .* is needed"),
        (lambda kw: kw.update(window_block_table=None, comp_block_table=None, topk=None),
         "nothing to build"),
        (lambda kw: kw.update(num_tokens=3), "num_tokens"),
    ],
)  # fmt: skip
def test_grouped_bad_input(change: Any, match: str) -> None:
    case = make_case(fresh_seed(), query_lens=[5, 2], ratio=128, topk=6)
    kw: dict[str, Any] = dict(
        num_tokens=case.num_tokens,
        group_size=2,
        window_block_table=case.window_table,
        comp_block_table=case.comp_table,
        topk=6,
    )
    change(kw)
    with pytest.raises(ValueError, match=match):
        dk.build_grouped_prefill_indices(case.query_start_loc, case.seq_lens, **kw)


def _attention_case(layer: str, device: torch.device, seed: int, heads: int = 3) -> Any:
    """A small chunk of requests (some shorter than a group, one empty) and its caches."""
    ratio = 128 if layer == "c128a" else 1
    case = make_prefill_index_case(
        [5, 1, 0, 11, 2], [0, 900, 40, 300, 127], compress_ratio=ratio, device=device, seed=seed
    )
    g = generator(seed)
    swa = ts.paged_cache(case.window_num_pages, WINDOW_BS, generator=g, device="cpu").cache
    comp = None
    if ratio == 128:
        comp = ts.paged_cache(case.comp_num_pages, case.comp_block_size, generator=g, device="cpu")
        comp = comp.cache.to(device)
    q = ts.random_q(case.num_tokens, heads, generator=g, device="cpu").to(device)
    sink = ts.random_sink(heads, generator=g, device="cpu").to(device)
    return case, swa.to(device), comp, q, sink


def _grouped_of(case: Any, group: int) -> Any:
    comp = case.compress_ratio == 128
    return dk.build_grouped_prefill_indices(
        case.query_start_loc, case.seq_lens, num_tokens=case.num_tokens, group_size=group,
        window_block_table=case.window_block_table,
        comp_block_table=case.comp_block_table if comp else None,
        comp_block_size=case.comp_block_size if comp else None,
        topk=case.topk if comp else None,
    )  # fmt: skip


@pytest.mark.parametrize("layer", ["swa", "c128a"])
@pytest.mark.parametrize("group", [2, 4])
def test_attention_on_grouped_rows_equals_per_token(
    layer: str, group: int, kernel_device: torch.device
) -> None:
    seed = fresh_seed()
    case, swa, comp, q, sink = _attention_case(layer, kernel_device, seed)
    per = case.build()
    grp = _grouped_of(case, group)
    kw: dict[str, Any] = dict(swa_block_size=WINDOW_BS, attn_sink=sink)
    if comp is not None:
        kw.update(comp_cache=comp, comp_block_size=case.comp_block_size)
    want = dk.sparse_mla_paged(
        q, swa, per.window, per.window_lens, 0.05, comp_indices=per.comp,
        comp_lens=per.comp_lens, **kw,
    )  # fmt: skip
    out = torch.full_like(want[0], float("nan"))
    lse = torch.full_like(want[1], float("nan"))
    got = dk.sparse_mla_paged(
        q, swa, grp.window, grp.window_lens, 0.05, comp_indices=grp.comp,
        comp_lens=grp.comp_lens, leads=grp.leads, group_size=group,
        swa_starts=grp.window_starts, out=out, lse=lse, **kw,
    )  # fmt: skip
    assert got[0] is out
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"seed {seed}"


def test_grouped_attention_bad_input() -> None:
    case, swa, _, q, _ = _attention_case("swa", torch.device("cpu"), fresh_seed())
    grp = _grouped_of(case, 2)
    T = case.num_tokens
    args = (q, swa, grp.window, grp.window_lens, 0.05)
    kw: dict[str, Any] = dict(swa_block_size=WINDOW_BS)
    with pytest.raises(ValueError, match="swa_starts is only meaningful with leads"):
        dk.sparse_mla_paged(*args, swa_starts=grp.window_starts, **kw)
    with pytest.raises(ValueError, match=f"leads must have {T} entries"):
        dk.sparse_mla_paged(*args, leads=grp.leads[1:], group_size=2, **kw)
    with pytest.raises(ValueError, match=r"leads must have dtype torch\.int32"):
        dk.sparse_mla_paged(*args, leads=grp.leads.long(), group_size=2, **kw)
    with pytest.raises(ValueError, match="group_size must be > 0"):
        dk.sparse_mla_paged(*args, leads=grp.leads, group_size=0, **kw)
    with pytest.raises(ValueError, match="comp_starts given without comp_cache"):
        dk.sparse_mla_paged(*args, leads=grp.leads, group_size=2, comp_starts=grp.leads, **kw)
    with pytest.raises(ValueError, match=f"swa_starts must have {T} entries"):
        dk.sparse_mla_paged(
            *args, leads=grp.leads, group_size=2, swa_starts=grp.window_starts[:-1], **kw
        )


def test_group_size_is_one_where_the_wgmma_kernel_does_not_run() -> None:
    q = torch.zeros(4, 8, 512, dtype=torch.bfloat16)
    assert sm.prefill_group_size(q) == 1
    assert sm.group_rows(8, 4) == 32 and sm.group_rows(16, 2) == 32 and sm.group_rows(3, 1) == 8


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["triton-interpreted", "torch-reference"])
@pytest.mark.parametrize("ratio", [1, 128])
def test_grouped_rows_into_given_outputs(
    ratio: int, interpret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every output given, the rows land in the caller's buffers (views of them are
    returned; the poison is overwritten) and equal the allocating call's; on a CPU
    without the interpreter the reference computes and copies in."""
    case = make_case(fresh_seed(), query_lens=QUERY_LENS["mixed-with-empty"], ratio=ratio)
    group = 4
    want = _grouped(case, group, torch.device("cpu"), "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    T, extra = case.num_tokens, 3
    outs = {
        "window_out": torch.full((T + extra, WINDOW + group - 1), -77, dtype=torch.int32),
        "window_lens_out": torch.full((T + extra,), -77, dtype=torch.int32),
        "leads_out": torch.full((T + extra,), -77, dtype=torch.int32),
        "starts_out": torch.full((T + extra,), -77, dtype=torch.int32),
    }
    comp = ratio == 128
    if comp:
        outs["comp_out"] = torch.full((T + extra, case.topk), -77, dtype=torch.int32)
        outs["comp_lens_out"] = torch.full((T + extra,), -77, dtype=torch.int32)
    got = _grouped(case, group, torch.device("cpu"), "triton", **outs)
    pairs = [
        ("leads_out", got.leads, want.leads),
        ("window_lens_out", got.window_lens, want.window_lens),
        ("starts_out", got.window_starts, want.window_starts),
    ]
    if comp:
        pairs += [("comp_lens_out", got.comp_lens, want.comp_lens)]
    for name, g, w in pairs:
        assert g.data_ptr() == outs[name].data_ptr(), name
        assert torch.equal(g, w), name
        assert bool((outs[name][T:] == -77).all()), f"{name}: rows past T written"
    assert got.window.data_ptr() == outs["window_out"].data_ptr()
    # a leader's row is what tokens read; compare what each token sees
    for t in range(T):
        lead = int(want.leads[t])
        s, n = int(want.window_starts[t]), int(want.window_lens[t])
        assert torch.equal(got.window[lead, s : s + n], want.window[lead, s : s + n])


def test_leads_out_is_only_for_grouped_rows() -> None:
    case = make_case(fresh_seed(), query_lens=[5], ratio=1)
    with pytest.raises(ValueError, match="leads_out"):
        dk.prefill_indices._build(
            case.query_start_loc,
            case.seq_lens,
            num_tokens=case.num_tokens,
            window_block_table=case.window_table,
            window_block_size=WINDOW_BS,
            window_size=WINDOW,
            compress_ratio=None,
            comp_block_table=None,
            comp_block_size=None,
            topk_indices=None,
            topk=None,
            window_out=None,
            window_lens_out=None,
            comp_out=None,
            comp_lens_out=None,
            check_values=False,
            group=1,
            leads_out=torch.zeros(case.num_tokens, dtype=torch.int32),
        )
