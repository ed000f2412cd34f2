"""``LayerBinding``: a layer's caches, rows, heads and window held for the run.

The binding refuses caches that do not match the layer's rows, names what is wrong,
and reads vLLM's decode step only where vLLM's ``swa_only`` agrees with the rows; the
plain-tensor forwards that build one per call keep the bad-input errors of their
arguments.  (Its use inside vLLM's step, with vLLM's own metadata and allocator:
``test_vllm_decode``, ``test_vllm_prefill``.)"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import dsv4_kernels as dk
import dsv4_kernels.testing.decode
from dsv4_attention import vllm_calls
from dsv4_attention.binding import DecodeRows, LayerBinding, check_sink
from dsv4_kernels.geometry import RowKind


def _q(heads: int = 64) -> torch.Tensor:
    return torch.zeros(2, heads, 512, dtype=torch.bfloat16)


def _bind(rows: RowKind, comp: bool, **kw: object) -> LayerBinding:
    args: dict[str, object] = dict(
        name="layers.7.attn",
        rows=rows,
        ratio={RowKind.WINDOW: 1, RowKind.TOPK: 4, RowKind.ALL: 128}[rows],
        heads=8,
        window_size=128,
        swa_cache=dk.empty_k_cache(4, 64, "cpu"),
        swa_block_size=64,
        comp_cache=dk.empty_k_cache(3, 64, "cpu") if comp else None,
        comp_block_size=64 if comp else None,
        scale=512**-0.5,
        q=_q(),
    )
    args.update(kw)
    return LayerBinding.bind(**args)  # type: ignore[arg-type]


def test_the_binding_holds_what_is_fixed_for_the_run() -> None:
    """The page layouts, rows, ratio, heads, window and grouping; no tensor (a KV cache
    vLLM frees is not kept alive by a binding)."""
    b = _bind(RowKind.TOPK, comp=True)
    held = [getattr(b, f.name) for f in dataclasses.fields(b)]
    assert not any(isinstance(x, torch.Tensor) for x in held)
    assert b.window.page_size == 64 and b.window.num_slots == 256
    assert b.comp is not None and b.comp.page_size == 64 and b.comp.num_slots == 192
    assert (b.heads, b.window_size, b.ratio, b.group_size) == (8, 128, 4, 1)
    # window-only and C128A rows take the kernels' grouping for 8 heads on this device
    # (on a CPU: none)
    assert _bind(RowKind.ALL, comp=True).group_size == dk.sparse_mla.prefill_group_size(_q(8))
    assert _bind(RowKind.WINDOW, comp=False, group_size=4).group_size == 4


@pytest.mark.parametrize(
    ("rows", "comp", "change", "message"),
    [
        (RowKind.WINDOW, True, {}, "comp_cache must be given for compressed rows and None"),
        (RowKind.TOPK, False, {}, "TOPK rows and comp_cache None"),
        (RowKind.ALL, True, {"comp_block_size": None}, "comp_block_size is needed"),
        (RowKind.TOPK, True, {"comp_block_size": 128}, r"comp_cache must be \[num_pages, >= "),
        (RowKind.WINDOW, False, {"swa_block_size": 0}, "swa_block_size"),
        (RowKind.WINDOW, False, {"heads": 0}, "heads must be 1 to 128"),
        (
            RowKind.WINDOW,
            False,
            {"swa_cache": torch.zeros(4, 64, 584, dtype=torch.int8)},
            "swa_cache must have dtype torch.uint8",
        ),
    ],
)
def test_a_binding_that_does_not_fit_is_refused_by_name(
    rows: RowKind, comp: bool, change: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _bind(rows, comp, **change)


@pytest.mark.parametrize(("rows", "swa_only"), [(RowKind.WINDOW, False), (RowKind.TOPK, True)])
def test_decode_rows_refuse_a_step_whose_swa_only_disagrees(rows: RowKind, swa_only: bool) -> None:
    """vLLM's ``swa_only`` and the layer's rows must agree (else the plugin's decode would
    read the wrong caches); the error sends the step to vLLM's own decode."""
    b = _bind(rows, comp=rows.compressed)
    meta = types.SimpleNamespace(num_decode_tokens=1)
    with pytest.raises(ValueError, match="swa_only"):
        vllm_calls.decode_rows(types.SimpleNamespace(), b, meta, None, swa_only, None)


def test_decode_refuses_rows_that_do_not_match_the_caches() -> None:
    b = _bind(RowKind.TOPK, comp=True)
    rows = DecodeRows(torch.zeros(2, 128, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    scratch = dk.make_decode_scratch(dk.DecodeScratchSizes(64, 8, 4), "cpu")
    out = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="TOPK rows need compressed rows"):
        b.decode(_q(), out, rows, scratch, None, dk.empty_k_cache(4, 64, "cpu"), None)


def test_decode_writes_only_the_real_heads_of_vllms_padded_buffers() -> None:
    """``q`` and ``out`` as vLLM passes them (64 padded heads, more rows than the step):
    the real heads of the step's tokens are written, nothing else."""
    g = torch.Generator().manual_seed(3)
    case = dk.testing.decode.make_decode_case(
        "c4a", 2, 1, 8, context=400, generator=g, device="cpu", topk=32
    )
    b = _bind(
        RowKind.TOPK,
        comp=True,
        swa_cache=case.pools.swa.cache,
        comp_cache=case.pools.comp.cache,
        comp_block_size=case.pools.comp.block_size,
    )
    q = torch.randn(5, 64, 512, generator=g).to(torch.bfloat16)
    q[:2, :8] = case.q
    out = torch.full((5, 64, 512), float("nan"), dtype=torch.bfloat16)
    r = case.rows
    rows = DecodeRows(r.swa_indices, r.swa_lens, r.comp_indices, r.comp_lens)
    scratch = dk.make_decode_scratch(dk.DecodeScratchSizes(64, 8, 4), "cpu")
    got = b.decode(q, out, rows, scratch, case.sink, case.pools.swa.cache, case.pools.comp.cache)
    want, _ = dk.reference.sparse_mla_paged(
        case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, 512**-0.5, **case.kwargs()
    )
    assert got.shape == (2, 8, 512)
    torch.testing.assert_close(out[:2, :8].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert bool(out[:2, 8:].isnan().all()) and bool(out[2:].isnan().all())


def test_check_sink_names_the_heads() -> None:
    check_sink(None, 8)
    check_sink(torch.zeros(8), 8)
    with pytest.raises(ValueError, match="attn_sink must have 8 entries"):
        check_sink(torch.zeros(64), 8)
