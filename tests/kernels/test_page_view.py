"""``dsv4_kernels.PageView``: a cache view checked once, then passed to the sparse MLA
kernels in place of a cache tensor and its block size (the plugin's layer binding holds
one per cache for the run).  The kernels' outputs are the same as with the tensors, the
view is not checked again, and a view that does not fit the call is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import _paged_keys
from dsv4_kernels.geometry import page_stride_bytes
from dsv4_kernels.testing import decode as td
from dsv4_kernels.testing.common import fresh_seed

from ._decode_oracle import check, oracle

SCALE = 512**-0.5


def _poisoned(T: int, H: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    return out, lse


def _views(case: td.DecodeCase) -> tuple[dk.PageView, dk.PageView | None]:
    swa = dk.PageView.check(case.pools.swa.cache, 64, "swa_cache")
    comp = case.pools.comp
    return swa, None if comp is None else dk.PageView.check(comp.cache, comp.block_size)


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the cache views the kernels' argument check looks at from now on."""
    seen: list[str] = []
    real = _paged_keys.check_page_cache

    def counted(name: str, *args: Any) -> Any:
        seen.append(name)
        return real(name, *args)

    monkeypatch.setattr(_paged_keys, "check_page_cache", counted)
    return seen


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa"])
@pytest.mark.parametrize("kernel", ["decode", "paged"])
def test_page_views_equal_the_tensors_and_are_not_checked_again(
    layer: str, kernel: str, kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator(device=kernel_device).manual_seed(fresh_seed())
    case = td.make_decode_case(
        layer, 3, 2, 8, context=700, generator=g, device=kernel_device, topk=48
    )
    swa, comp = _views(case)
    assert swa.page_size == 64 and swa.page_stride == case.pools.swa.cache.stride(0)
    assert swa.num_slots == case.pools.swa.num_slots
    T, H, _ = case.q.shape
    r = case.rows
    scratch = dk.make_decode_scratch(dk.DecodeScratchSizes(64, 16, 16), kernel_device)

    def run(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _poisoned(T, H, kernel_device)
        if kernel == "decode":
            kw["scratch"] = scratch
        fn = dk.sparse_mla_decode if kernel == "decode" else dk.sparse_mla_paged
        return fn(case.q, swa_indices=r.swa_indices, swa_lens=r.swa_lens, scale=SCALE,
                  attn_sink=case.sink, out=out, lse=lse, **kw)  # fmt: skip

    tensors = case.kwargs()
    tensors.pop("attn_sink")
    want = run(swa_cache=case.pools.swa.cache, **tensors)
    checked = _count_checks(monkeypatch)
    by_view: dict[str, Any] = {"swa_cache": swa}
    if comp is not None:
        by_view.update(comp_cache=comp, comp_indices=r.comp_indices, comp_lens=r.comp_lens)
    got = run(**by_view)
    assert checked == [], "a PageView was checked again"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    want_out, want_lse = oracle(case.q, case.sources(), SCALE, case.sink)
    check(got[0].cpu(), got[1].cpu(), (want_out.cpu(), want_lse.cpu()))
    # the block sizes may still be given, if they are the views' own
    sizes = {"swa_block_size": 64}
    if comp is not None:
        sizes["comp_block_size"] = comp.page_size
    again = run(**by_view, **sizes)
    assert torch.equal(again[0], want[0])


def test_page_view_checks_once_and_names_what_is_wrong() -> None:
    """The check is the kernels' one rule for a cache view; its errors name the argument
    (and the page size by its own name where the caller gives one)."""
    cache = dk.empty_k_cache(3, 64, "cpu")
    view = dk.PageView.check(cache, 64, "swa_cache")
    assert (view.page_size, view.page_stride, view.num_slots) == (64, page_stride_bytes(64), 192)
    assert view.cache is cache
    with pytest.raises(ValueError, match="swa_cache"):
        dk.PageView.check(cache.view(torch.int8), 64, "swa_cache")
    with pytest.raises(ValueError, match="comp_block_size"):
        dk.PageView.check(cache, 0, "comp_cache", page_size_name="comp_block_size")
    with pytest.raises(ValueError, match=r"swa_cache must be \[num_pages, >= 74880\]"):
        dk.PageView.check(cache, 128, "swa_cache")  # pages of 128 slots do not fit


def test_a_page_view_that_does_not_fit_the_call_is_refused() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    case = td.make_decode_case("c4a", 2, 1, 4, context=300, generator=g, device="cpu", topk=32)
    swa, comp = _views(case)
    assert comp is not None
    r = case.rows
    base: dict[str, Any] = dict(q=case.q, swa_cache=swa, swa_indices=r.swa_indices,
                                swa_lens=r.swa_lens, scale=SCALE, comp_cache=comp,
                                comp_indices=r.comp_indices, comp_lens=r.comp_lens)  # fmt: skip
    bad: list[tuple[dict[str, Any], str]] = [
        ({"swa_block_size": 32}, "swa_block_size must be None or the PageView's page size 64"),
        ({"comp_block_size": 8}, "comp_block_size must be None or the PageView's page size"),
        ({"comp_indices": None}, "must be given together"),
        ({"swa_cache": dk.PageView(torch.empty(3, 64, 584, dtype=torch.uint8, device="meta"),
                                   64, page_stride_bytes(64), 192)}, "swa_cache must be on cpu"),
    ]  # fmt: skip
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            dk.sparse_mla_paged(**{**base, **change})
