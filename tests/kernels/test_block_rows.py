"""C128A rows named by the compressed block table (``BlockRows``), on CPU.

A C128A token reads every compressed entry of its request so far, in order: its row of
slots is ``0 .. n-1`` through the block table, so the attention can read the block table
itself and no ``[T, entries]`` row (512 MiB at 1M context and 16K tokens) is built.
``build_prefill_indices(..., comp_blocks=True)`` (and the grouped builder) then write only
each token's length and request; ``sparse_mla_paged`` with those ``BlockRows`` must give
exactly what it gives with the rows of slots (same keys, same order: bit-equal), per token
and grouped, with holes in the table, through the Triton kernel (interpreter) and the
reference.  The wgmma kernel's build is checked offline (``test_codegen_sparse_mla``) and
its result on the H200 (``test_sparse_mla_gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import sparse_mla as sm
from dsv4_kernels.reference.prefill_indices import expand_grouped_rows
from dsv4_kernels.testing import POISON, fresh_seed, generator
from dsv4_kernels.testing import sparse_mla as ts
from dsv4_kernels.testing.prefill_indices import make_prefill_index_case

WINDOW_BS = 64
QUERY_LENS = [5, 1, 0, 11, 2, 7]
CONTEXT = [0, 900, 40, 300, 127, 1500]


def _case(seed: int, device: torch.device, holes: bool = True, topk: int | None = None) -> Any:
    case = make_prefill_index_case(
        QUERY_LENS, CONTEXT, compress_ratio=128, device=device, seed=seed, topk=topk
    )
    if holes:  # a negative page id inside some request's entries: a hole in its row
        table = case.comp_block_table
        g = generator(seed + 1)
        pick = torch.rand(table.shape, generator=g) < 0.15
        table.masked_fill_(pick.to(table.device), -1)
    return case


def _build(case: Any, group: int, blocks: bool, **outs: Any) -> Any:
    kw: dict[str, Any] = dict(
        num_tokens=case.num_tokens,
        window_block_table=case.window_block_table,
        comp_block_table=case.comp_block_table,
        comp_block_size=case.comp_block_size,
        topk=case.topk,
        comp_blocks=blocks,
        **outs,
    )
    if group == 1:
        return dk.build_prefill_indices(
            case.query_start_loc, case.seq_lens, compress_ratio=128, **kw
        )
    return dk.build_grouped_prefill_indices(
        case.query_start_loc, case.seq_lens, group_size=group, **kw
    )


def _requests(case: Any) -> torch.Tensor:
    qsl = case.query_start_loc.cpu().long()
    qlen = qsl[1:] - qsl[:-1]
    return torch.repeat_interleave(torch.arange(qlen.shape[0]), qlen).to(torch.int32)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_block_rows_name_the_same_keys_as_the_rows_of_slots(
    group: int, impl: str, kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = fresh_seed()
    device = kernel_device if impl == "triton" else torch.device("cpu")
    if impl == "reference":
        monkeypatch.setattr("dsv4_kernels._prefill_indices_build.use_triton", lambda d: False)
    case = _case(seed, device)
    slots = _build(case, group, blocks=False)
    T = case.num_tokens
    req_out = torch.full((T + 3,), POISON, dtype=torch.int32, device=device)
    lens_out = torch.full((T + 3,), POISON, dtype=torch.int32, device=device)
    got = _build(case, group, blocks=True, req_out=req_out, comp_lens_out=lens_out)
    what = f"seed {seed}"
    assert isinstance(got.comp, dk.BlockRows)
    assert got.comp.block_table is case.comp_block_table
    assert got.comp.req.data_ptr() == req_out.data_ptr() and got.comp_lens is not None
    assert torch.equal(got.comp.req.cpu(), _requests(case)), what
    assert torch.equal(got.comp_lens.cpu(), slots.comp_lens.cpu()), what
    assert bool((req_out[T:] == POISON).all()) and bool((lens_out[T:] == POISON).all())
    # the window rows are those of the call without blocks
    assert torch.equal(got.window.cpu(), slots.window.cpu()), what
    # every token's keys: its (leader's) row of slots within its length
    leads = getattr(got, "leads", None)
    rows = got.comp.slots(case.comp_block_size, T)
    want = slots.comp
    if leads is not None:
        rows, _ = expand_grouped_rows(leads, rows, got.comp_lens, None, T)
        want, _ = expand_grouped_rows(leads, want, slots.comp_lens, None, T)
    n = got.comp_lens.long().cpu()
    for t in range(T):
        k = int(n[t])
        assert torch.equal(rows[t, :k].cpu(), want[t, :k].cpu()), f"{what}: token {t}"


def _attention_inputs(seed: int, device: torch.device, heads: int) -> Any:
    case = _case(seed, device)
    g = generator(seed)
    swa = ts.paged_cache(case.window_num_pages, WINDOW_BS, generator=g, device="cpu").cache
    comp = ts.paged_cache(case.comp_num_pages, case.comp_block_size, generator=g, device="cpu")
    q = ts.random_q(case.num_tokens, heads, generator=g, device="cpu").to(device)
    sink = ts.random_sink(heads, generator=g, device="cpu").to(device)
    return case, swa.to(device), comp.cache.to(device), q, sink


def _attend(q: Any, swa: Any, comp: Any, sink: Any, rows: Any, case: Any, **kw: Any) -> Any:
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=torch.bfloat16,
                     device=q.device)  # fmt: skip
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"), device=q.device)
    grouping = rows.grouping() if isinstance(rows, dk.GroupedPrefillIndices) else {}
    dk.sparse_mla_paged(
        q, swa, rows.window, rows.window_lens, 0.05, swa_block_size=WINDOW_BS, attn_sink=sink,
        comp_cache=comp, comp_block_size=case.comp_block_size, comp_indices=rows.comp,
        comp_lens=rows.comp_lens, out=out, lse=lse, **grouping, **kw,
    )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("group, heads", [(1, 3), (2, 3), (4, 3), (1, 20)])
def test_attention_on_block_rows_equals_the_rows_of_slots(
    group: int, heads: int, kernel_device: torch.device
) -> None:
    seed = fresh_seed()
    case, swa, comp, q, sink = _attention_inputs(seed, kernel_device, heads)
    want = _attend(q, swa, comp, sink, _build(case, group, blocks=False), case)
    got = _attend(q, swa, comp, sink, _build(case, group, blocks=True), case)
    assert not bool(got[0].isnan().any()) and not bool(got[1].isnan().any()), f"seed {seed}"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed}"


def test_the_reference_reads_block_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter CPU tensors take the torch reference: block rows give the
    reference's result on the rows of slots (the expanded rows are wider, past every
    length, so the float64 sums may round differently in the last place)."""
    seed = fresh_seed()
    case, swa, comp, q, sink = _attention_inputs(seed, torch.device("cpu"), 4)
    slots = _build(case, 1, blocks=False)
    blocks = _build(case, 1, blocks=True)
    monkeypatch.setattr(sm, "use_triton", lambda d: False)
    want = _attend(q, swa, comp, sink, slots, case)
    got = _attend(q, swa, comp, sink, blocks, case)
    assert not bool(got[0].isnan().any()) and not bool(got[1].isnan().any()), f"seed {seed}"
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2, msg=f"seed {seed}")
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6, msg=f"seed {seed}")


def test_rows_past_the_block_table_are_not_read(kernel_device: torch.device) -> None:
    """A length past the table's pages reads only the table's entries (the kernel caps it
    at pages x page size), as the rows of slots' -1 past the table."""
    seed = fresh_seed()
    case, swa, comp, q, sink = _attention_inputs(seed, kernel_device, 3)
    blocks = _build(case, 1, blocks=True)
    pages = max(1, case.comp_block_table.shape[1] - 4)  # fewer pages than the longest needs
    short = dk.BlockRows(case.comp_block_table[:, :pages].contiguous(), blocks.comp.req)
    slots = short.slots(case.comp_block_size, case.num_tokens)
    T = case.num_tokens
    slot_rows = dk.PrefillIndices(blocks.window, blocks.window_lens, slots, blocks.comp_lens)
    block_rows = dk.PrefillIndices(blocks.window, blocks.window_lens, short, blocks.comp_lens)
    want = _attend(q, swa, comp, sink, slot_rows, case)
    got = _attend(q, swa, comp, sink, block_rows, case)
    assert slots.shape == (T, pages * case.comp_block_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed}"


def _refused(**change: Any) -> Any:
    case, swa, comp, q, _sink = _attention_inputs(fresh_seed(), torch.device("cpu"), 3)
    rows = _build(case, 1, blocks=True)
    kw: dict[str, Any] = dict(
        swa_block_size=WINDOW_BS, comp_cache=comp, comp_block_size=case.comp_block_size,
        comp_indices=rows.comp, comp_lens=rows.comp_lens,
    )  # fmt: skip
    kw.update(change)
    return lambda: dk.sparse_mla_paged(q, swa, rows.window, rows.window_lens, 0.05, **kw)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(comp_lens=None), "comp_lens is needed with BlockRows"),
        (dict(comp_indices=dk.BlockRows(torch.zeros(2, 3), torch.zeros(30, dtype=torch.int32))),
         "comp_indices.block_table must have dtype torch.int32"),
        (dict(comp_indices=dk.BlockRows(torch.zeros(2, 3, dtype=torch.int32),
                                        torch.zeros(1, dtype=torch.int32))),
         r"comp_indices.req must have >= \d+ entries"),
        (dict(comp_indices=dk.BlockRows(torch.zeros(3, 2, dtype=torch.int32).t(),
                                        torch.zeros(30, dtype=torch.int32))),
         "comp_indices.block_table must be contiguous"),
    ],
)  # fmt: skip
def test_block_rows_bad_input(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _refused(**change)()


def test_the_decode_refuses_block_rows() -> None:
    case, swa, comp, q, _ = _attention_inputs(fresh_seed(), torch.device("cpu"), 3)
    rows = _build(case, 1, blocks=True)
    scratch = dk.make_decode_scratch(dk.DecodeScratchSizes(64, 16, 16), "cpu")
    with pytest.raises(ValueError, match=r"comp_indices must be a .* tensor of global slots"):
        dk.sparse_mla_decode(
            q, swa, rows.window, rows.window_lens, 0.05, swa_block_size=WINDOW_BS,
            comp_cache=comp, comp_block_size=case.comp_block_size, comp_indices=rows.comp,
            comp_lens=rows.comp_lens, scratch=scratch,
        )  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(compress_ratio=4, topk_indices=torch.zeros(26, 8, dtype=torch.int32), topk=None),
         "comp_blocks is only for C128A rows"),
        (dict(comp_out=torch.zeros(26, 6, dtype=torch.int32)), "comp_out must be None with"),
        (dict(comp_blocks=False, req_out=torch.zeros(26, dtype=torch.int32)),
         "req_out is only meaningful with comp_blocks"),
        (dict(req_out=torch.zeros(2, dtype=torch.int32)), "req_out"),
    ],
)  # fmt: skip
def test_builder_refuses_block_rows_where_they_do_not_apply(
    change: dict[str, Any], match: str
) -> None:
    case = _case(fresh_seed(), torch.device("cpu"), holes=False)
    kw: dict[str, Any] = dict(
        num_tokens=case.num_tokens, window_block_table=case.window_block_table,
        compress_ratio=128, comp_block_table=case.comp_block_table, topk=case.topk,
        comp_blocks=True,
    )  # fmt: skip
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        dk.build_prefill_indices(case.query_start_loc, case.seq_lens, **kw)
