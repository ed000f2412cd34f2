"""Sparse MLA with sink: the Triton kernel (through Triton's interpreter on CPU) and the
torch reference, against a slow per-token float64 spec oracle over exactly the indexed rows.

One file (about 530 lines) for the whole CPU contract: the oracle, the semantic
cases, the cache-view cases and the bad-input table; the GPU cases and the
second kernel's cases have files of their own."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import reference as ref
from dsv4_kernels.geometry import page_stride_bytes
from dsv4_kernels.testing import sparse_mla as ts
from dsv4_kernels.testing.common import fresh_seed

SCALE = 512**-0.5
# bf16 output: one rounding of values up to ~10 (plus fp32 sums); lse is float32 math.
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=1e-4, rtol=1e-5)


def spec(
    q: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
    sink: torch.Tensor | None,
    abs_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token oracle; sources are (values [slots, 512] float32, indices [T, K], lens or None).
    Computed on the CPU in float64 whatever device the inputs are on.  ``abs_values``
    returns ``sum_k p_k |V_k|`` (the same weights) instead of the output: the scale of
    the rounding error of attention in 16-bit arithmetic."""
    q = q.cpu()
    sources = [(v.cpu(), i.cpu(), None if n is None else n.cpu()) for v, i, n in sources]
    sink = None if sink is None else sink.cpu()
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        rows = []
        for values, indices, lens in sources:
            n = indices.shape[1] if lens is None else int(lens[t])
            for j in range(min(n, indices.shape[1])):
                i = int(indices[t, j])
                if 0 <= i < values.shape[0]:
                    rows.append(values[i])
        if not rows:
            continue
        k = torch.stack(rows).double()
        s = scale * (q[t].double() @ k.T)  # [H, n]
        lse[t] = torch.logsumexp(s, dim=1)
        o = torch.softmax(s, dim=1) @ (k.abs() if abs_values else k)
        if sink is not None:
            o = o / (1.0 + torch.exp(sink.double() - lse[t])).unsqueeze(1)
        out[t] = o
    return out, lse


def _check(out: torch.Tensor, lse: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten or bad arithmetic)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or bad arithmetic)"
    want_out, want_lse = want
    torch.testing.assert_close(out.double(), want_out, **OUT_TOL)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse -inf exactly where a row has no key"
    torch.testing.assert_close(lse.double()[~empty], want_lse[~empty], **LSE_TOL)


def _outputs(T: int, H: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    ts.poison_outputs(out, lse)
    return out, lse


def _paged(
    fn: Any,
    q: torch.Tensor,
    swa: Any,
    comp: Any,
    a_idx: torch.Tensor,
    a_len: torch.Tensor,
    b_idx: torch.Tensor,
    b_len: torch.Tensor,
    sink: torch.Tensor | None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` (the kernel or its reference) over a :func:`_case`'s window and compressed
    sources (64-slot window pages, 2-entry compressed pages)."""
    return fn(q, swa.cache, a_idx, a_len, SCALE, swa_block_size=64, attn_sink=sink,
              comp_cache=comp.cache, comp_indices=b_idx, comp_lens=b_len, comp_block_size=2,
              **kw)  # fmt: skip


def _case(device: torch.device, seed: int, *, layers: int = 1, three_d: bool = True, T: int = 5):
    g = torch.Generator(device=device).manual_seed(seed)
    swa = ts.paged_cache(
        3,
        64,
        generator=g,
        device=device,
        layers_per_block=layers,
        layer=layers - 1,
        three_d=three_d,
    )
    comp = ts.paged_cache(
        5, 2, generator=g, device=device, layers_per_block=layers, layer=0, three_d=not three_d
    )
    a_idx, a_len = ts.index_rows(
        T, 40, swa.num_slots, generator=g, device=device, out_of_range_fraction=0.1, empty_rows=1
    )
    b_idx, b_len = ts.index_rows(
        T, 7, comp.num_slots, generator=g, device=device, hole_fraction=0.2, empty_rows=2
    )
    return g, swa, comp, a_idx, a_len, b_idx, b_len


@pytest.mark.parametrize("H", [1, 3, 8, 16])
@pytest.mark.parametrize("with_comp", [True, False])
@pytest.mark.parametrize("with_sink", [True, False])
def test_paged_matches_spec(
    H: int, with_comp: bool, with_sink: bool, kernel_device: torch.device
) -> None:
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed, layers=3)
    T = a_idx.shape[0]
    q = ts.random_q(T, H, generator=g, device=kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device) if with_sink else None
    out, lse = _outputs(T, H, kernel_device)
    comp_args = {}
    if with_comp:
        comp_args = dict(
            comp_cache=comp.cache, comp_indices=b_idx, comp_lens=b_len, comp_block_size=2
        )
    got = dk.sparse_mla_paged(
        q,
        swa.cache,
        a_idx,
        a_len,
        SCALE,
        swa_block_size=64,
        attn_sink=sink,
        out=out,
        lse=lse,
        **comp_args,
    )
    assert got[0] is out and got[1] is lse
    sources = [(swa.values, a_idx, a_len)] + ([(comp.values, b_idx, b_len)] if with_comp else [])
    _check(out, lse, spec(q, sources, SCALE, sink))


@pytest.mark.parametrize("three_d", [True, False])
def test_block_outer_views_equal_page_contiguous(
    three_d: bool, kernel_device: torch.device
) -> None:
    """stride(0) = 3 x the page stride and a nonzero storage offset read the same keys."""
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed, layers=3, three_d=three_d)
    assert swa.cache.stride(0) == 3 * page_stride_bytes(64)
    assert swa.cache.storage_offset() == 2 * page_stride_bytes(64)
    assert comp.cache.stride(0) == 3 * page_stride_bytes(2)
    q = ts.random_q(a_idx.shape[0], 8, generator=g, device=kernel_device)
    sink = ts.random_sink(8, generator=g, device=kernel_device)

    def run(sc: torch.Tensor, cc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dk.sparse_mla_paged(
            q,
            sc,
            a_idx,
            a_len,
            SCALE,
            swa_block_size=64,
            attn_sink=sink,
            comp_cache=cc,
            comp_indices=b_idx,
            comp_lens=b_len,
            comp_block_size=2,
        )

    def contiguous(c: torch.Tensor, bs: int) -> torch.Tensor:
        flat = torch.stack([c[p].reshape(-1)[: bs * 584] for p in range(c.shape[0])])
        return torch.nn.functional.pad(flat, (0, page_stride_bytes(bs) - bs * 584))

    got = run(swa.cache, comp.cache)
    want = run(contiguous(swa.cache, 64), contiguous(comp.cache, 2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    sources = [(swa.values, a_idx, a_len), (comp.values, b_idx, b_len)]
    _check(*got, spec(q, sources, SCALE, sink))


def test_holes_lengths_and_out_of_range(kernel_device: torch.device) -> None:
    """Entries past the length, -1 (and other negatives) and slots past the cache are skipped."""
    seed = fresh_seed()
    g, swa, _, a_idx, a_len, _, _ = _case(kernel_device, seed)
    q = ts.random_q(a_idx.shape[0], 4, generator=g, device=kernel_device)
    base = dk.sparse_mla_paged(q, swa.cache, a_idx, a_len, SCALE, swa_block_size=64)
    # Same valid keys, different junk: holes as other negatives, far slots and junk past lens.
    col = torch.arange(a_idx.shape[1], device=kernel_device)
    past = col.unsqueeze(0) >= a_len.unsqueeze(1)
    junk = torch.where(past, torch.randint_like(a_idx, -5, 10_000, generator=g), a_idx)
    junk = torch.where(junk == -1, -7, junk)
    junk = torch.where((junk >= swa.num_slots) & ~past, swa.num_slots, junk)
    got = dk.sparse_mla_paged(q, swa.cache, junk.to(torch.int32), a_len, SCALE, swa_block_size=64)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    # Without lens every column counts: same as lens = width.
    full = torch.full_like(a_len, a_idx.shape[1])
    no_lens = dk.sparse_mla_paged(q, swa.cache, a_idx, None, SCALE, swa_block_size=64)
    with_full = dk.sparse_mla_paged(q, swa.cache, a_idx, full, SCALE, swa_block_size=64)
    assert torch.equal(no_lens[0], with_full[0]) and torch.equal(no_lens[1], with_full[1])
    _check(*no_lens, spec(q, [(swa.values, a_idx, None)], SCALE, None))


@pytest.mark.parametrize("kind", ["zero-length", "all-holes", "all-out-of-range", "zero-width"])
def test_row_without_keys_gives_zero_and_neg_inf(kind: str, kernel_device: torch.device) -> None:
    g = torch.Generator(device=kernel_device).manual_seed(fresh_seed())
    swa = ts.paged_cache(2, 64, generator=g, device=kernel_device)
    T, H, K = 3, 5, 0 if kind == "zero-width" else 33
    idx, lens = ts.index_rows(T, K, swa.num_slots, generator=g, device=kernel_device)
    lens[:] = K
    if kind == "zero-length":
        lens[:] = 0
    elif kind == "all-holes":
        idx[:] = -1
    elif kind == "all-out-of-range":
        idx[:] = swa.num_slots + torch.arange(K, dtype=torch.int32, device=kernel_device)
    q = ts.random_q(T, H, generator=g, device=kernel_device)
    out, lse = _outputs(T, H, kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    dk.sparse_mla_paged(
        q, swa.cache, idx, lens, SCALE, swa_block_size=64, attn_sink=sink, out=out, lse=lse
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.isneginf(lse).all())


def test_sink_semantics(kernel_device: torch.device) -> None:
    """lse excludes the sink; out scales by exp(lse)/(exp(lse)+exp(sink)); -inf sink = none."""
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed)
    H = 6
    q = ts.random_q(a_idx.shape[0], H, generator=g, device=kernel_device)
    args = (q, swa.cache, a_idx, a_len, SCALE)
    kw = dict(
        swa_block_size=64,
        comp_cache=comp.cache,
        comp_indices=b_idx,
        comp_lens=b_len,
        comp_block_size=2,
    )
    plain = dk.sparse_mla_paged(*args, **kw)
    no_sink = dk.sparse_mla_paged(
        *args, attn_sink=torch.full((H,), -math.inf, device=kernel_device), **kw
    )
    assert torch.equal(plain[0], no_sink[0]) and torch.equal(plain[1], no_sink[1])
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    with_sink = dk.sparse_mla_paged(*args, attn_sink=sink, **kw)
    assert torch.equal(with_sink[1], plain[1]), "the sink must not change lse"
    has = ~torch.isneginf(plain[1])
    factor = torch.sigmoid(plain[1] - sink).unsqueeze(-1)
    want = torch.where(has.unsqueeze(-1), plain[0].float() * factor, 0.0)
    torch.testing.assert_close(with_sink[0].float(), want, **OUT_TOL)
    # A +inf sink takes all the weight: zero output.
    inf = dk.sparse_mla_paged(
        *args, attn_sink=torch.full((H,), math.inf, device=kernel_device), **kw
    )
    assert torch.equal(inf[0], torch.zeros_like(inf[0]))


@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("three_d_kv", [False, True])
def test_workspace_matches_spec_and_paged(
    H: int, three_d_kv: bool, kernel_device: torch.device
) -> None:
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed)
    T = a_idx.shape[0]
    q = ts.random_q(T, H, generator=g, device=kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    # Workspace: the window slots' values then the compressed slots' values (exact in bf16).
    kv = torch.cat([swa.values, comp.values]).to(torch.bfloat16)
    off = swa.num_slots
    col_a = torch.arange(a_idx.shape[1], device=kernel_device).unsqueeze(0) < a_len.unsqueeze(1)
    col_b = torch.arange(b_idx.shape[1], device=kernel_device).unsqueeze(0) < b_len.unsqueeze(1)
    ok_a = col_a & (a_idx >= 0) & (a_idx < swa.num_slots)
    ok_b = col_b & (b_idx >= 0) & (b_idx < comp.num_slots)
    idx = torch.cat([torch.where(ok_a, a_idx, -1), torch.where(ok_b, b_idx + off, -1)], dim=1)
    idx = idx.to(torch.int32)
    out, lse = _outputs(T, H, kernel_device)
    dk.sparse_mla_workspace(
        q, kv.unsqueeze(1) if three_d_kv else kv, idx, None, SCALE, attn_sink=sink, out=out, lse=lse
    )
    _check(out, lse, spec(q, [(kv.float(), idx, None)], SCALE, sink))
    paged = _paged(dk.sparse_mla_paged, q, swa, comp, a_idx, a_len, b_idx, b_len, sink)
    torch.testing.assert_close(paged[0].float(), out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(paged[1], lse, **LSE_TOL)


@pytest.mark.parametrize("H", [1, 8, 16])
def test_reference_matches_spec(H: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorised torch reference (the CPU path without the interpreter)."""
    device = torch.device("cpu")
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(device, seed, layers=3, T=9)
    T = a_idx.shape[0]
    q = ts.random_q(T, H, generator=g, device=device)
    sink = ts.random_sink(H, generator=g, device=device)
    out, lse = _outputs(T, H, device)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the public CPU path now runs the reference
    _paged(dk.sparse_mla_paged, q, swa, comp, a_idx, a_len, b_idx, b_len, sink, out=out, lse=lse)
    sources = [(swa.values, a_idx, a_len), (comp.values, b_idx, b_len)]
    want = spec(q, sources, SCALE, sink)
    _check(out, lse, want)
    direct = _paged(ref.sparse_mla_paged, q, swa, comp, a_idx, a_len, b_idx, b_len, sink)
    assert torch.equal(direct[0], out) and torch.equal(direct[1], lse)
    kv = swa.values.to(torch.bfloat16)
    w_out, w_lse = _outputs(T, H, device)
    dk.sparse_mla_workspace(q, kv, a_idx, a_len, SCALE, attn_sink=sink, out=w_out, lse=w_lse)
    _check(w_out, w_lse, spec(q, [(kv.float(), a_idx, a_len)], SCALE, sink))


# --- bad input -------------------------------------------------------------------------------


def _good() -> dict:
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(7)
    swa = ts.paged_cache(2, 64, generator=g, device=device)
    comp = ts.paged_cache(2, 2, generator=g, device=device)
    idx, lens = ts.index_rows(3, 8, 128, generator=g, device=device)
    return dict(
        q=ts.random_q(3, 8, generator=g, device=device),
        swa_cache=swa.cache,
        swa_indices=idx,
        swa_lens=lens,
        scale=SCALE,
        swa_block_size=64,
        attn_sink=torch.zeros(8),
        comp_cache=comp.cache,
        comp_indices=idx[:, :4].contiguous(),
        comp_lens=lens,
        comp_block_size=2,
    )


def _bad_stride_cache(stride: int) -> torch.Tensor:
    buf = torch.zeros(4 * 40000, dtype=torch.uint8)
    return torch.as_strided(buf, (2, 64, 584), (stride, 584, 1))


BAD_PAGED = {
    "head size 576": (
        dict(q=torch.zeros(3, 8, 576, dtype=torch.bfloat16)),
        r"q must be .*head size 512",
    ),
    "zero heads": (
        dict(q=torch.zeros(3, 0, 512, dtype=torch.bfloat16)),
        r"q must have 1 to 128 heads",
    ),
    "129 heads": (
        dict(q=torch.zeros(3, 129, 512, dtype=torch.bfloat16)),
        r"q must have 1 to 128 heads",
    ),
    "q fp16": (
        dict(q=torch.zeros(3, 8, 512, dtype=torch.float16)),
        r"q must have dtype torch.bfloat16",
    ),
    "q 2-D": (dict(q=torch.zeros(3, 512, dtype=torch.bfloat16)), r"q must be 3-dimensional"),
    "int64 indices": (
        dict(swa_indices=torch.zeros(3, 8, dtype=torch.int64)),
        r"swa_indices must have dtype torch.int32",
    ),
    "indices rows": (
        dict(swa_indices=torch.zeros(4, 8, dtype=torch.int32)),
        r"swa_indices must have 3 rows",
    ),
    "lens length": (
        dict(swa_lens=torch.zeros(2, dtype=torch.int32)),
        r"swa_lens must have 3 entries",
    ),
    "lens int64": (
        dict(comp_lens=torch.zeros(3, dtype=torch.int64)),
        r"comp_lens must have dtype torch.int32",
    ),
    "cache dtype": (
        dict(swa_cache=torch.zeros(2, 37440, dtype=torch.int8)),
        r"swa_cache must have dtype torch.uint8",
    ),
    "page stride too small": (
        dict(swa_cache=_bad_stride_cache(64 * 584)),
        r"swa_cache page stride .* >= 37440",
    ),
    "2-D page too small": (
        dict(comp_cache=torch.zeros(2, 1000, dtype=torch.uint8)),
        r"comp_cache must be \[num_pages, >= 1728\]",
    ),
    "bad inner strides": (
        dict(
            swa_cache=torch.as_strided(
                torch.zeros(200000, dtype=torch.uint8), (2, 64, 584), (40000, 600, 1)
            )
        ),
        r"inner strides \(584, 1\)",
    ),
    "block size mismatch": (dict(swa_block_size=32), r"swa_cache must be a \[num_pages, 32, 584\]"),
    "comp partly": (
        dict(comp_cache=None),
        r"comp_cache, comp_indices and comp_block_size must be given together",
    ),
    "sink length": (dict(attn_sink=torch.zeros(7)), r"attn_sink must have 8 entries"),
    "sink dtype": (
        dict(attn_sink=torch.zeros(8, dtype=torch.bfloat16)),
        r"attn_sink must have dtype torch.float32",
    ),
    "scale": (dict(scale=-1.0), r"scale must be a finite positive float"),
    "device": (
        dict(swa_indices=torch.zeros(3, 8, dtype=torch.int32, device="meta")),
        r"swa_indices must be on cpu",
    ),
    "out shape": (
        dict(out=torch.zeros(3, 8, 448, dtype=torch.bfloat16)),
        r"out must have shape \(3, 8, 512\)",
    ),
    "lse dtype": (
        dict(lse=torch.zeros(3, 8, dtype=torch.bfloat16)),
        r"lse must have dtype torch.float32",
    ),
}


@pytest.mark.parametrize("name", list(BAD_PAGED))
def test_paged_bad_input_raises(name: str) -> None:
    change, match = BAD_PAGED[name]
    kw = _good() | change
    args = [kw.pop(k) for k in ("q", "swa_cache", "swa_indices", "swa_lens", "scale")]
    with pytest.raises(ValueError, match=match):
        dk.sparse_mla_paged(*args, **kw)


BAD_WORKSPACE = {
    "kv dtype": (
        dict(kv=torch.zeros(10, 512, dtype=torch.float32)),
        r"kv must have dtype torch.bfloat16",
    ),
    "kv width": (dict(kv=torch.zeros(10, 576, dtype=torch.bfloat16)), r"kv must be \[N, 512\]"),
    "kv heads": (
        dict(kv=torch.zeros(10, 2, 512, dtype=torch.bfloat16)),
        r"a 3-D kv must be \[N, 1, 512\]",
    ),
    "indices 1-D": (
        dict(indices=torch.zeros(3, dtype=torch.int32)),
        r"indices must be 2-dimensional",
    ),
    "lens rows": (dict(lens=torch.zeros(4, dtype=torch.int32)), r"lens must have 3 entries"),
    "q heads": (
        dict(q=torch.zeros(3, 200, 512, dtype=torch.bfloat16)),
        r"q must have 1 to 128 heads",
    ),
}


@pytest.mark.parametrize("name", list(BAD_WORKSPACE))
def test_workspace_bad_input_raises(name: str) -> None:
    kw = dict(
        q=torch.zeros(3, 8, 512, dtype=torch.bfloat16),
        kv=torch.zeros(10, 512, dtype=torch.bfloat16),
        indices=torch.zeros(3, 4, dtype=torch.int32),
        lens=None,
        scale=SCALE,
    )
    change, match = BAD_WORKSPACE[name]
    kw |= change
    with pytest.raises(ValueError, match=match):
        dk.sparse_mla_workspace(**kw)


# --- tile variants ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tiles",
    [
        dict(MAX_BLOCK_H=16, BLOCK_N=16, NUM_WARPS=4, NUM_STAGES=1, PREFETCH=0, BF16_DEQUANT=0),
        dict(MAX_BLOCK_H=16, BLOCK_N=32, NUM_WARPS=4, NUM_STAGES=1, PREFETCH=1, BF16_DEQUANT=0),
        dict(MAX_BLOCK_H=32, BLOCK_N=16, NUM_WARPS=4, NUM_STAGES=1, PREFETCH=1, BF16_DEQUANT=0),
    ],
    ids=["16-heads-no-prefetch", "16-heads-prefetch", "32-heads-prefetch"],
)
@pytest.mark.parametrize("H", [5, 40])
def test_tile_variants_and_head_blocks(tiles: dict, H: int, kernel_device: torch.device) -> None:
    """Several head blocks per token (H = 40 in blocks of 16 or 32), with and without the
    prefetch of the next key tile, give the spec's result (tiles passed as the argument)."""
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed, layers=2, T=3)
    q = ts.random_q(a_idx.shape[0], H, generator=g, device=kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    out, lse = _outputs(a_idx.shape[0], H, kernel_device)
    _paged(
        dk.sparse_mla_paged,
        q,
        swa,
        comp,
        a_idx,
        a_len,
        b_idx,
        b_len,
        sink,
        out=out,
        lse=lse,
        tiles={"small": tiles, "large": tiles},
    )
    sources = [(swa.values, a_idx, a_len), (comp.values, b_idx, b_len)]
    _check(out, lse, spec(q, sources, SCALE, sink))
