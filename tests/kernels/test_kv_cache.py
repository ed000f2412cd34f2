"""FP8 (UE8M0) paged K cache: quantize_and_insert_k_cache, dequantize_and_gather_k_cache.

Both the Triton kernels (through the interpreter on CPU, compiled on CUDA) and
the vectorised torch reference are compared with the slow spec references in
``_kv_cache_spec.py`` on fresh random inputs, and with each other byte for
byte.  Caches and outputs are poisoned with fresh random bytes before every
call, and the whole buffer is compared, so a stray or missing write fails.

The kernels round to FP8 in integer arithmetic, so the bytes they produce
under the interpreter are the bytes they produce on the GPU (and torch's
``.to(torch.float8_e4m3fn)``): cache bytes are compared exactly everywhere.
GPU tests (``-m gpu``) repeat the comparisons at benchmark sizes, with a page
whose byte offset passes 2**31, under CUDA graph capture and replay, and check
that sizes do not compile new kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_kernels.kv_cache as kvc
from dsv4_kernels import geometry
from dsv4_kernels.reference import kv_cache as ref
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing import generator as gen
from dsv4_kernels.testing.k_cache import (
    assert_same_bytes,
    block_outer_k_cache_group,
    block_outer_k_cache_views,
    edge_case_keys,
    poisoned_bf16,
    poisoned_k_cache,
    spread_keys,
)

from . import _kv_cache_spec as spec

Insert = Callable[..., None]
Gather = Callable[..., None]
INSERTS = {"triton": kvc.quantize_and_insert_k_cache, "reference": ref.quantize_and_insert_k_cache}
GATHERS = {
    "triton": kvc.dequantize_and_gather_k_cache,
    "reference": ref.dequantize_and_gather_k_cache,
}
# Page sizes of the three caches: sliding window, C4A (256/4), C128A (256/128).
LAYERS = {
    "swa": geometry.SWA_BLOCK_SIZE,
    "c4a": geometry.slots_per_page(4),
    "c128a": geometry.slots_per_page(128),
}


# --------------------------------------------------------------------------- inputs


make_keys = edge_case_keys


def poisoned_cache(num_pages: int, block_size: int, seed: int) -> torch.Tensor:
    return poisoned_k_cache(num_pages, block_size, generator=gen(seed), device="cpu")


def poisoned_out(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bf16 filled with random bit patterns (NaNs and infinities included)."""
    return poisoned_bf16(shape, generator=gen(seed), device="cpu")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = a.cpu().contiguous().view(torch.uint8) != b.cpu().contiguous().view(torch.uint8)
    idx = d.nonzero()
    return f"{idx.shape[0]} bytes differ, first at {idx[0].tolist()}" if idx.numel() else "equal"


def fill_requests(
    seq_lens: list[int], block_size: int, spare_pages: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A poisoned cache holding every position of every request, its block table, and keys.

    Pages are shuffled; block-table columns past a request's need hold junk
    (page ids that would be wrong to read).  Returns (cache, block_table
    [B, width] int32, keys [B, max_seq, 512] bf16).
    """
    g = gen(seed)
    pages_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    width = max([*pages_needed, 1]) + 2
    table = torch.randint(0, num_pages, (len(seq_lens), width), generator=g, dtype=torch.int32)
    cache = poisoned_cache(num_pages, block_size, seed + 1)
    max_seq = max([*seq_lens, 1])
    keys = make_keys(len(seq_lens) * max_seq, seed + 2).reshape(len(seq_lens), max_seq, 512)
    used = 0
    slots = []
    for b, (s, npg) in enumerate(zip(seq_lens, pages_needed, strict=True)):
        table[b, :npg] = perm[used : used + npg].to(torch.int32)
        used += npg
        pos = torch.arange(s)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
        slots.append(torch.full((max_seq - s,), -1, dtype=torch.long))
    ref.quantize_and_insert_k_cache(keys.reshape(-1, 512), cache, torch.cat(slots), block_size)
    return cache, table, keys


# --------------------------------------------------------------------------- the spec itself


def test_spec_e4m3_encoder_matches_torch() -> None:
    """The spec's encoder (from the format definition) agrees with torch on random floats."""
    seed = fresh_seed()
    v = (torch.randn(4000, generator=gen(seed)) * 100).clamp(-448, 448)
    v[:8] = torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 15.5])
    want = v.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    got = [spec.e4m3_encode(float(x)) for x in v]
    assert got == want, f"seed {seed}"


def test_page_stride_helpers() -> None:
    assert kvc.k_cache_page_stride(64) == 37440 == spec.page_stride(64)
    assert kvc.k_cache_page_stride(2) == 1728 == spec.page_stride(2)
    for slots in (1, 3, 16, 256):
        stride = kvc.k_cache_page_stride(slots)
        assert stride == spec.page_stride(slots) and stride % 576 == 0
        assert stride >= slots * 584
    cache = kvc.empty_k_cache(3, 64)
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (3, 37440)
    with pytest.raises(ValueError, match="slots_per_page"):
        kvc.k_cache_page_stride(0)
    with pytest.raises(ValueError, match="num_pages"):
        kvc.empty_k_cache(-1, 64)


# --------------------------------------------------------------------------- insert


@pytest.mark.parametrize("impl", list(INSERTS))
def test_insert_rounds_every_bf16_like_torch(impl: str) -> None:
    """Every finite bf16 in [-448, 448], in blocks whose amax is 448 (or 448 * 32).

    The codes must equal torch's round-to-nearest-even conversion: this covers
    every tie and every mantissa carry (the interpreter trap), and subnormals.
    """
    seed = fresh_seed()
    pos = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = torch.cat([pos, -pos])[torch.randperm(2 * pos.numel(), generator=gen(seed))]
    per_block = 63
    nblk = math.ceil(vals.numel() / per_block)
    blocks = torch.full((nblk * per_block,), 1.0, dtype=torch.bfloat16)
    blocks[: vals.numel()] = vals
    blocks = torch.cat(
        [blocks.reshape(nblk, per_block), torch.full((nblk, 1), 448.0, dtype=torch.bfloat16)],
        dim=1,
    )
    ntok = math.ceil(nblk / 7)
    nope = torch.full((ntok * 7, 64), 448.0, dtype=torch.bfloat16)
    nope[:nblk] = blocks
    for scale in (1.0, 32.0):
        k = torch.cat([(nope * scale).reshape(ntok, 448), make_keys(ntok, seed)[:, 448:]], dim=1)
        block_size = 64
        cache = poisoned_cache(math.ceil(ntok / block_size), block_size, seed)
        INSERTS[impl](k, cache, torch.arange(ntok), block_size)
        data = cache[:, : block_size * 576].reshape(-1, 576)[:ntok]
        want = nope.float().to(torch.float8_e4m3fn).view(torch.uint8).reshape(ntok, 448)
        assert torch.equal(data[:, :448], want), (
            f"seed {seed} scale {scale}: {first_diff(data[:, :448], want)}"
        )
        scales = cache[:, block_size * 576 : block_size * 584].reshape(-1, 8)[:ntok]
        assert (scales[:, :7] == 127 + int(math.log2(scale))).all()
        assert (scales[:, 7] == 0).all()


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("impl", list(INSERTS))
def test_insert_matches_spec(impl: str, layer: str) -> None:
    """Byte-exact against the spec; slot -1 and out-of-range slots write nothing."""
    seed = fresh_seed()
    block_size = LAYERS[layer]
    n = 20
    num_pages = math.ceil(n / block_size) + 2
    slots = torch.randperm(num_pages * block_size, generator=gen(seed))[:n]
    slots[3] = -1
    slots[11] = -1
    slots[7] = num_pages * block_size + 5  # past the cache: skipped
    k = make_keys(n + 3, seed)  # extra rows are ignored (vLLM pads k under DP)
    cache = poisoned_cache(num_pages, block_size, seed)
    want = spec.spec_insert(cache, k[:n], slots.tolist(), block_size)
    INSERTS[impl](k, cache, slots, block_size)
    assert torch.equal(cache, want), f"seed {seed}: {first_diff(cache, want)}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_insert_triton_matches_reference(layer: str) -> None:
    """Many tokens, shuffled slots, a strided ``k``, int32 slots: kernel == reference."""
    seed = fresh_seed()
    block_size = LAYERS[layer]
    n = 150
    num_pages = math.ceil(n / block_size) + 3
    g = gen(seed)
    slots = torch.randperm(num_pages * block_size, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.1] = -1
    wide = torch.cat([make_keys(n, seed), make_keys(n, seed + 1)[:, :100]], dim=1)
    k = wide[:, :512]  # row stride 612
    for slot_dtype in (torch.int64, torch.int32):
        a = poisoned_cache(num_pages, block_size, seed)
        b = a.clone()
        kvc.quantize_and_insert_k_cache(k, a, slots.to(slot_dtype), block_size)
        ref.quantize_and_insert_k_cache(k, b, slots.to(slot_dtype), block_size)
        assert torch.equal(a, b), f"seed {seed}: {first_diff(a, b)}"


def test_insert_nothing_to_do() -> None:
    seed = fresh_seed()
    cache = poisoned_cache(2, 64, seed)
    before = cache.clone()
    kvc.quantize_and_insert_k_cache(make_keys(4, seed), cache, torch.full((4,), -1), 64)
    kvc.quantize_and_insert_k_cache(make_keys(1, seed)[:0], cache, torch.zeros(0).long(), 64)
    assert torch.equal(cache, before)


@settings(max_examples=25, deadline=None)
@given(raw=st.binary(min_size=1024, max_size=1024), slot=st.integers(0, 2 * 64 - 1))
def test_insert_property_any_finite_bf16(raw: bytes, slot: int) -> None:
    """Any finite bf16 token, at any slot: kernel bytes == spec bytes, one token written."""
    bits = torch.frombuffer(bytearray(raw), dtype=torch.int16).clone()
    non_finite = (bits & 0x7F80) == 0x7F80
    bits = torch.where(non_finite, bits & ~0x4000, bits)  # clear an exponent bit: finite
    k = bits.view(torch.bfloat16).reshape(1, 512)
    cache = poisoned_cache(2, 64, slot)
    want = spec.spec_insert(cache, k, [slot], 64)
    kvc.quantize_and_insert_k_cache(k, cache, torch.tensor([slot]), 64)
    assert torch.equal(cache, want), first_diff(cache, want)


# --------------------------------------------------------------------------- gather


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("impl", list(GATHERS))
def test_round_trip(impl: str, layer: str) -> None:
    """Insert, then gather everything: each value within its quantisation step, rope exact."""
    seed = fresh_seed()
    block_size = LAYERS[layer]
    seq_lens = [37, 5]
    cache, table, keys = fill_requests(seq_lens, block_size, 2, seed)
    out = poisoned_out((2, 40, 512), seed)
    want = spec.spec_gather(out, cache, seq_lens, None, table.tolist(), block_size, 0)
    GATHERS[impl](out, cache, torch.tensor(seq_lens, dtype=torch.int32), None, table, block_size, 0)
    assert bits_equal(out, want), f"seed {seed}"
    for b, s in enumerate(seq_lens):
        x = keys[b, :s].double()
        y = out[b, :s].double()
        assert torch.equal(y[:, 448:], x[:, 448:]), f"seed {seed}: rope not exact"
        for t in range(s):
            for q in range(7):
                xs = x[t, q * 64 : (q + 1) * 64].tolist()
                bound = torch.tensor(spec.roundtrip_bound(xs), dtype=torch.float64)
                err = (y[t, q * 64 : (q + 1) * 64] - x[t, q * 64 : (q + 1) * 64]).abs()
                assert (err <= bound).all(), f"seed {seed}: request {b} token {t} block {q}"
                amax_exp = math.floor(math.log2(max(max(map(abs, xs)), 1e-30)))
                assert (err <= 2.0 ** (amax_exp - 4) + 2.0 ** (spec.block_exponent(xs) - 10)).all()


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("impl", list(GATHERS))
def test_gather_lengths_and_offsets(impl: str, layer: str) -> None:
    """Mixed requests (empty, short, several pages), gather lengths 0..all, an offset.

    The whole of ``out`` is compared: rows outside ``[offset, offset + g)`` of
    each request stay poisoned.
    """
    seed = fresh_seed()
    block_size = LAYERS[layer]
    g = gen(seed)
    seq_lens = [0, 1, 70, 130, 64, 9]
    gather_lens = [0, 1, 0, 130, int(torch.randint(1, 64, (1,), generator=g)), 8]
    cache, table, _ = fill_requests(seq_lens, block_size, 3, seed)
    offset = int(torch.randint(0, 5, (1,), generator=g))
    out = poisoned_out((len(seq_lens) + 1, offset + 131, 512), seed)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    for gl in (gather_lens, None):
        gl_t = None if gl is None else torch.tensor(gl, dtype=torch.int32)
        want = spec.spec_gather(out, cache, seq_lens, gl, table.tolist(), block_size, offset)
        got = out.clone()
        GATHERS[impl](got, cache, seq_t, gl_t, table, block_size, offset)
        assert bits_equal(got, want), f"seed {seed} gather_lens {gl}"


@pytest.mark.parametrize("layer", ["swa", "c128a"])
def test_gather_every_length_of_one_request(layer: str) -> None:
    """One request; every gather length 0..seq_len; kernel == reference == spec."""
    seed = fresh_seed()
    block_size = LAYERS[layer]
    seq = 66 if block_size == 64 else 7
    cache, table, _ = fill_requests([seq], block_size, 1, seed)
    out = poisoned_out((1, seq + 2, 512), seed)
    lengths = range(seq + 1) if seq < 10 else [0, 1, 2, 63, 64, 65, 66]
    seq_t = torch.tensor([seq], dtype=torch.int64)
    for gl in lengths:
        a, b = out.clone(), out.clone()
        gl_t = torch.tensor([gl], dtype=torch.int64)
        kvc.dequantize_and_gather_k_cache(a, cache, seq_t, gl_t, table.long(), block_size, 1)
        ref.dequantize_and_gather_k_cache(b, cache, seq_t, gl_t, table.long(), block_size, 1)
        want = spec.spec_gather(out, cache, [seq], [gl], table.tolist(), block_size, 1)
        assert bits_equal(a, want) and bits_equal(b, want), f"seed {seed} gather_len {gl}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_gather_any_valid_bytes(layer: str) -> None:
    """A cache of random bytes (every non-NaN code, subnormals, -0; exponents 2**-27..2**23).

    The gather must not depend on the insert: kernel == reference == spec.
    """
    seed = fresh_seed()
    block_size = LAYERS[layer]
    g = gen(seed)
    num_pages = math.ceil(40 / block_size) + 1
    cache = poisoned_cache(num_pages, block_size, seed)
    flat = cache[:, : block_size * 584]
    data = flat[:, : block_size * 576].reshape(num_pages, block_size, 576)
    codes = torch.randint(0, 254, data[..., :448].shape, generator=g, dtype=torch.int32)
    data[..., :448] = (codes + (codes >= 0x7F).int()).to(torch.uint8)  # skip NaN codes 0x7F, 0xFF
    rope = (torch.randn(num_pages, block_size, 64, generator=g) * 10).to(torch.bfloat16)
    data[..., 448:] = rope.view(torch.uint8)
    sc = flat[:, block_size * 576 :].reshape(num_pages, block_size, 8)
    sc[...] = torch.randint(100, 150, sc.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    seq = num_pages * block_size - 3
    table = torch.randperm(num_pages, generator=g).to(torch.int32).reshape(1, -1)
    out = poisoned_out((1, seq + 1, 512), seed)
    a, b = out.clone(), out.clone()
    seq_t = torch.tensor([seq], dtype=torch.int32)
    kvc.dequantize_and_gather_k_cache(a, cache, seq_t, None, table, block_size, 1)
    ref.dequantize_and_gather_k_cache(b, cache, seq_t, None, table, block_size, 1)
    want = spec.spec_gather(out, cache, [seq], None, table.tolist(), block_size, 1)
    assert bits_equal(b, want), f"seed {seed}: reference differs from spec"
    assert bits_equal(a, want), f"seed {seed}: kernel differs from spec"


# ------------------------------------------------------------------------ vLLM block-outer views

# (slots per page, layers) runs of one cache group, as vLLM packs DSV4's groups
# (dsv4_kernels.testing.k_cache): three window caches, or the compressed group
# with its C4A pages then its C128A pages, in a block sized by a wider group.
BLOCK_OUTER_GROUPS = {
    "window-3-layers": ([(64, 3)], None),
    "c4a-c128a-group": ([(64, 2), (2, 3)], 4 * 37440),
}


def _block_outer_case(
    group_name: str, run: int, layer: int, seed: int, rank: int
) -> tuple[torch.Tensor, object, torch.Tensor, int]:
    """A random-filled block-outer group; returns (raw, group, the layer's view, block_size)."""
    pages, block_bytes = BLOCK_OUTER_GROUPS[group_name]
    group = block_outer_k_cache_group(5, pages, block_bytes=block_bytes, generator=gen(seed))
    view = group.views[run][layer]
    block_size = view.shape[1]
    if rank == 2:  # the same pages as [num_blocks, page] rows, still a block apart
        page = kvc.k_cache_page_stride(block_size)
        view = torch.as_strided(group.raw, (5, page), (group.block_bytes, 1), view.storage_offset())
    return group.raw, group, view, block_size


def _pages_of(raw: torch.Tensor, group: object, run: int, layer: int) -> torch.Tensor:
    """A page-contiguous copy ``[num_blocks, page]`` of one layer's pages."""
    view = group.views[run][layer]  # type: ignore[attr-defined]
    page = kvc.k_cache_page_stride(view.shape[1])
    start = view.storage_offset()
    return raw.reshape(-1, group.block_bytes)[:, start : start + page].clone()  # type: ignore[attr-defined]


@pytest.mark.parametrize("rank", [3, 2])
@pytest.mark.parametrize(("group_name", "run", "layer"), [
    ("window-3-layers", 0, 1), ("window-3-layers", 0, 2),
    ("c4a-c128a-group", 0, 1), ("c4a-c128a-group", 1, 0), ("c4a-c128a-group", 1, 2),
])  # fmt: skip
@pytest.mark.parametrize("impl", list(INSERTS))
def test_block_outer_views_round_trip(
    impl: str, group_name: str, run: int, layer: int, rank: int
) -> None:
    """Insert into, then gather from, one layer of a block-outer group (vLLM's allocation).

    The layer's pages must hold exactly the spec's bytes, every other byte of
    the allocation (the other layers' pages in the same blocks, the block's
    padding) must be untouched, and the gather must read the spec's values
    (within the FP8 bound of the keys, rope exact) from pages a block apart.
    """
    seed = fresh_seed()
    raw, group, view, block_size = _block_outer_case(group_name, run, layer, seed, rank)
    before = raw.clone()
    mask = group.layer_bytes(run, layer)  # type: ignore[attr-defined]
    n = 5 * block_size  # every slot of the layer's pages, in random order
    slots = torch.randperm(n, generator=gen(seed + 1))
    k = make_keys(n, seed + 2)
    want_pages = spec.spec_insert(_pages_of(raw, group, run, layer), k, slots.tolist(), block_size)
    INSERTS[impl](k, view, slots, block_size)
    got_pages = _pages_of(raw, group, run, layer)
    assert torch.equal(got_pages, want_pages), f"seed {seed}: {first_diff(got_pages, want_pages)}"
    assert torch.equal(raw[~mask], before[~mask]), f"seed {seed}: other layers' bytes changed"

    # gather every slot back, in slot order, through a block table of all pages
    after_insert = raw.clone()
    seq = [5 * block_size]
    table = torch.randperm(5, generator=gen(seed + 3)).to(torch.int32).reshape(1, 5)
    out = poisoned_out((1, seq[0] + 2, 512), seed)
    want = spec.spec_gather(out, want_pages, seq, None, table.tolist(), block_size, 2)
    GATHERS[impl](out, view, torch.tensor(seq, dtype=torch.int32), None, table, block_size, 2)
    assert bits_equal(out, want), f"seed {seed}: gather differs from the spec"
    assert torch.equal(raw, after_insert), f"seed {seed}: the gather wrote to the cache"
    pos_of_slot = {}  # slot -> row of out: the table maps position p to page table[p // bs]
    for p in range(seq[0]):
        pos_of_slot[int(table[0, p // block_size]) * block_size + p % block_size] = p
    rows = torch.tensor([pos_of_slot[int(s)] for s in slots]) + 2
    y, x = out[0, rows].double(), k.double()
    assert torch.equal(y[:, 448:], x[:, 448:]), f"seed {seed}: rope not exact"
    amax = x[:, :448].reshape(n, 7, 64).abs().amax(-1)
    # half an E4M3 unit at the amax's binade, plus the subnormal unit 2**(e - 10)
    e = ref.ue8m0_exponents(amax.float()).double()
    bound = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 4) + torch.exp2(e - 10)
    err = (y[:, :448] - x[:, :448]).reshape(n, 7, 64).abs()
    assert (err <= bound.unsqueeze(-1)).all(), f"seed {seed}: round trip outside the FP8 bound"


def test_block_outer_views_match_the_documented_layout() -> None:
    """The issue's example and the compressed group's offsets (see testing.k_cache)."""
    views = block_outer_k_cache_views(569, 64, 3)
    assert [(tuple(v.shape), v.stride(), v.storage_offset()) for v in views] == [
        ((569, 64, 584), (112320, 584, 1), layer * 37440) for layer in range(3)
    ]
    group = block_outer_k_cache_group(2, [(64, 3), (2, 3)], block_bytes=149760)
    assert group.offsets == ((0, 37440, 74880), (112320, 114048, 115776))
    assert all(v.stride() == (149760, 584, 1) for run in group.views for v in run)


def test_page_stride_is_taken_from_the_view() -> None:
    """Pages any stride >= the page size apart, at any storage offset, like the 2-D cache."""
    seed = fresh_seed()
    block_size = 2
    page = kvc.k_cache_page_stride(block_size)
    k = make_keys(7, seed)
    slots = torch.tensor([0, 5, 3, -1, 8, 9, 1])
    base = poisoned_cache(5, block_size, seed)
    want = spec.spec_insert(base, k, slots.tolist(), block_size)
    for stride, offset in ((page, 0), (page + 576, 0), (3 * page + 16, 40)):
        raw = torch.zeros(offset + 4 * stride + page, dtype=torch.uint8)
        view = torch.as_strided(raw, (5, block_size, 584), (stride, 584, 1), offset)
        for p in range(5):
            raw[offset + p * stride : offset + p * stride + page] = base[p]
        kvc.quantize_and_insert_k_cache(k, view, slots, block_size)
        got = torch.stack([raw[offset + p * stride : offset + p * stride + page] for p in range(5)])
        assert torch.equal(got, want), f"seed {seed} stride {stride} offset {offset}"


# --------------------------------------------------------------------------- bad input


def _insert_args() -> dict[str, object]:
    return {
        "k": make_keys(4, 1),
        "k_cache": kvc.empty_k_cache(2, 64),
        "slot_mapping": torch.arange(4),
        "block_size": 64,
    }


INSERT_ERRORS = [
    ({"k": make_keys(4, 1).float()}, "k must have dtype"),
    ({"k": make_keys(4, 1)[:, :448]}, r"k must be \[num_tokens, 512\]"),
    ({"k": make_keys(4, 1)[:, None]}, "k must be 2-dimensional"),
    ({"k": make_keys(2, 1)}, "k must have at least 4 rows"),
    ({"k_cache": kvc.empty_k_cache(2, 64).view(torch.int8)}, "k_cache must have dtype"),
    ({"k_cache": kvc.empty_k_cache(2, 2)}, r"k_cache must be \[num_pages, >= 37440\]"),
    ({"k_cache": torch.empty(37440, 2, dtype=torch.uint8).t()}, "contiguous in its last dim"),
    ({"k_cache": torch.empty(2, 64, 584, dtype=torch.uint8)}, "at least 37440 bytes apart"),
    (
        {
            "k_cache": torch.as_strided(
                torch.empty(80000, dtype=torch.uint8), (2, 37440), (36864, 1)
            )
        },
        r"at least 37440 bytes apart .*stride\(0\) = 36864",
    ),
    ({"k_cache": torch.empty(2, 64, 600, dtype=torch.uint8)[:, :, :584]}, "3-D k_cache"),
    ({"k_cache": torch.empty(2, 584, 64, dtype=torch.uint8).transpose(1, 2)}, "3-D k_cache"),
    ({"k_cache": torch.empty(2, 32, 584, dtype=torch.uint8)}, r"\[num_pages, 64, 584\] view"),
    ({"slot_mapping": torch.arange(4.0)}, "slot_mapping must have dtype"),
    ({"slot_mapping": torch.arange(8)[::2]}, "slot_mapping must be contiguous"),
    ({"block_size": 0}, "block_size must be > 0"),
    ({"block_size": 64.0}, "block_size must be an int"),
]


@pytest.mark.parametrize(("change", "match"), INSERT_ERRORS)
def test_insert_rejects_bad_input(change: dict[str, object], match: str) -> None:
    args = _insert_args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        kvc.quantize_and_insert_k_cache(**args)  # type: ignore[arg-type]


def _gather_args() -> dict[str, object]:
    return {
        "out": torch.empty(2, 20, 512, dtype=torch.bfloat16),
        "k_cache": kvc.empty_k_cache(3, 2),
        "seq_lens": torch.tensor([6, 3], dtype=torch.int32),
        "gather_lens": torch.tensor([4, 3], dtype=torch.int32),
        "block_table": torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32),
        "block_size": 2,
        "offset": 16,
    }


GATHER_ERRORS = [
    ({"out": torch.empty(2, 20, 512)}, "out must have dtype"),
    ({"out": torch.empty(2, 20, 448, dtype=torch.bfloat16)}, r"out must be \[num_reqs"),
    ({"out": torch.empty(1, 20, 512, dtype=torch.bfloat16)}, r"out must be \[num_reqs"),
    ({"out": torch.empty(2, 512, 20, dtype=torch.bfloat16).transpose(1, 2)}, "out must be contig"),
    ({"out": torch.empty(2, 19, 512, dtype=torch.bfloat16)}, "out has 19 rows.*too short"),
    ({"offset": 17}, "out has 20 rows.*too short"),
    ({"offset": -1}, "offset must be >= 0"),
    ({"k_cache": kvc.empty_k_cache(3, 64)[:, :1000]}, r"k_cache must be \[num_pages, >= 1728\]"),
    (
        {"k_cache": torch.as_strided(torch.empty(5000, dtype=torch.uint8), (3, 1728), (1152, 1))},
        r"at least 1728 bytes apart",
    ),
    ({"k_cache": torch.empty(3, 1728, dtype=torch.int32)}, "k_cache must have dtype"),
    ({"seq_lens": torch.tensor([6.0, 3.0])}, "seq_lens must have dtype"),
    ({"seq_lens": torch.tensor([-1, 3], dtype=torch.int32)}, "seq_lens must be >= 0"),
    ({"gather_lens": torch.tensor([4], dtype=torch.int32)}, "gather_lens must have 2 entries"),
    ({"gather_lens": torch.tensor([7, 3], dtype=torch.int32)}, "gather_lens must be <= seq_lens"),
    ({"gather_lens": torch.tensor([4, -1], dtype=torch.int32)}, "gather_lens must be >= 0"),
    ({"gather_lens": torch.tensor([4.0, 3.0])}, "gather_lens must have dtype"),
    ({"block_table": torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)}, "block_table has 2 col"),
    ({"block_table": torch.tensor([[0, 1, 2]], dtype=torch.int32)}, "block_table must have a row"),
    ({"block_table": torch.zeros(2, 3)}, "block_table must have dtype"),
    ({"block_size": 3}, r"k_cache must be \[num_pages, >= 2304\]"),
]


@pytest.mark.parametrize(("change", "match"), GATHER_ERRORS)
def test_gather_rejects_bad_input(change: dict[str, object], match: str) -> None:
    args = _gather_args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        kvc.dequantize_and_gather_k_cache(**args)  # type: ignore[arg-type]


def test_gather_accepts_the_good_arguments() -> None:
    """The base arguments of the error table are valid (so each error comes from its change)."""
    args = _gather_args()
    kvc.dequantize_and_gather_k_cache(**args)  # type: ignore[arg-type]
    kvc.quantize_and_insert_k_cache(**_insert_args())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GPU

GPU_GATHER_CASES = {
    # name: (block_size, seq_lens, gather_len or None)
    "1x1024": (64, [1024], None),
    "16x1024": (64, [1024] * 16, None),
    "1x16384": (64, [16384], None),
    "swa-131072-w128": (64, [131072], 128),
    "swa-4x131072-w128": (64, [131072, 5000, 129, 70], 128),
    "c4a-131072": (64, [131072 // 4], None),
    "c128a-131072": (2, [131072 // 128], None),
}


def _gpu_requests(
    block_size: int, seq_lens: list[int], gather_len: int | None, dev: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Cache with every page of every request filled (only the window's pages for SWA)."""
    g = gen(seed, dev)
    widths = [math.ceil(s / block_size) for s in seq_lens]
    num_pages = sum(widths) + 7
    table = torch.full((len(seq_lens), max(widths) + 1), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(num_pages, generator=g, device=dev).to(torch.int32)
    used = 0
    for b, w in enumerate(widths):
        table[b, :w] = perm[used : used + w]
        used += w
    cache = kvc.empty_k_cache(num_pages, block_size, dev)
    cache.random_(0, 256, generator=g)
    n = num_pages * block_size
    k = spread_keys(n, generator=g, device=dev)
    kvc.quantize_and_insert_k_cache(
        k, cache, torch.arange(num_pages * block_size, device=dev), block_size
    )
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    gl = None
    if gather_len is not None:
        gl = torch.clamp(seq, max=gather_len)
    return cache, table, seq, gl, k


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_GATHER_CASES))
def test_gpu_gather_benchmark_sizes(name: str, gpu: torch.device) -> None:
    seed = fresh_seed()
    block_size, seq_lens, gather_len = GPU_GATHER_CASES[name]
    cache, table, seq, gl, _ = _gpu_requests(block_size, seq_lens, gather_len, gpu, seed)
    rows = gather_len if gather_len is not None else max(seq_lens)
    offset = 3
    out = poisoned_out((len(seq_lens), rows + offset, 512), seed).to(gpu)
    want = out.clone()
    kvc.dequantize_and_gather_k_cache(out, cache, seq, gl, table, block_size, offset)
    ref.dequantize_and_gather_k_cache(want, cache, seq, gl, table, block_size, offset)
    assert bits_equal(out, want), f"seed {seed}"


GPU_INSERT_CASES = {
    # name: (block_size, num_tokens)
    "1x1024": (64, 1024),
    "16x1024": (64, 16 * 1024),
    "1x16384-c128a": (2, 16384),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_INSERT_CASES))
def test_gpu_insert_benchmark_sizes(name: str, gpu: torch.device) -> None:
    """Kernel (default, hardware rounding on sm_89+; and integer rounding) == torch, bytewise."""
    seed = fresh_seed()
    block_size, n = GPU_INSERT_CASES[name]
    g = gen(seed, gpu)
    num_pages = math.ceil(n / block_size) * 2
    slots = torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n]
    slots[torch.rand(n, generator=g, device=gpu) < 0.05] = -1
    k = make_keys(n, seed).to(gpu)
    a = kvc.empty_k_cache(num_pages, block_size, gpu)
    a.random_(0, 256, generator=g)
    b, c = a.clone(), a.clone()
    kvc.quantize_and_insert_k_cache(k, a, slots, block_size)
    ref.quantize_and_insert_k_cache(k, b, slots, block_size)
    stride = kvc.k_cache_page_stride(block_size)
    kvc._launch_insert(k, c, slots, block_size, stride, num_pages, exact_rounding=True)
    assert torch.equal(a, b), f"seed {seed}: kernel != reference: {first_diff(a, b)}"
    assert torch.equal(c, b), f"seed {seed}: integer rounding != reference: {first_diff(c, b)}"


@pytest.mark.gpu
def test_gpu_page_offset_beyond_2_31(gpu: torch.device) -> None:
    """Pages whose byte offsets pass 2**31 are written and read at the right place."""
    seed = fresh_seed()
    block_size = 64
    stride = kvc.k_cache_page_stride(block_size)
    high = (2**31) // stride + 3  # first page id past 2**31 bytes, plus a little
    assert high * stride > 2**31
    num_pages = high + 8
    cache = kvc.empty_k_cache(num_pages, block_size, gpu)
    g = gen(seed, gpu)
    cache[high - 8 :].random_(0, 256, generator=g)
    # Every slot of the 16 pages is written (the gather below reads them all).
    pages = torch.arange(high - 8, num_pages, device=gpu)
    n = 16 * block_size
    slots = (high - 8) * block_size + torch.randperm(n, generator=g, device=gpu)
    k = make_keys(slots.numel(), seed).to(gpu)
    small = cache[high - 8 :].cpu()
    kvc.quantize_and_insert_k_cache(k, cache, slots, block_size)
    ref.quantize_and_insert_k_cache(
        k.cpu(), small, (slots - (high - 8) * block_size).cpu(), block_size
    )
    assert torch.equal(cache[high - 8 :].cpu(), small), f"seed {seed}"
    # Gather back through a table that points at those pages.
    table = pages[torch.randperm(16, generator=g, device=gpu)].to(torch.int32).reshape(1, 16)
    seq = torch.tensor([16 * block_size - 5], dtype=torch.int32, device=gpu)
    out = poisoned_out((1, 16 * block_size, 512), seed).to(gpu)
    want = out.cpu()
    kvc.dequantize_and_gather_k_cache(out, cache, seq, None, table, block_size, 0)
    ref.dequantize_and_gather_k_cache(
        want, small, seq.cpu(), None, (table - (high - 8)).cpu(), block_size, 0
    )
    assert bits_equal(out, want), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay(gpu: torch.device) -> None:
    """Insert then gather, captured once; replays see new keys, slots and lengths in place."""
    seed = fresh_seed()
    block_size, num_pages, n = 64, 40, 700
    g = gen(seed, gpu)
    cache = kvc.empty_k_cache(num_pages, block_size, gpu)
    cache.random_(0, 256, generator=g)
    k = make_keys(n, seed).to(gpu)
    slots = torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n]
    table = torch.randperm(num_pages, generator=g, device=gpu).to(torch.int32).reshape(2, 20)
    seq = torch.tensor([900, 1280], dtype=torch.int32, device=gpu)
    gl = torch.tensor([300, 1000], dtype=torch.int32, device=gpu)
    out = torch.zeros((2, 1100, 512), dtype=torch.bfloat16, device=gpu)

    def step() -> None:
        kvc.quantize_and_insert_k_cache(k, cache, slots, block_size)
        kvc.dequantize_and_gather_k_cache(out, cache, seq, gl, table, block_size, 7)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rep in range(3):
        k.copy_(make_keys(n, seed + rep + 1).to(gpu))
        slots.copy_(torch.randperm(num_pages * block_size, generator=g, device=gpu)[:n])
        seq.copy_(torch.randint(500, 1281, (2,), generator=g, device=gpu, dtype=torch.int32))
        gl.copy_(
            torch.minimum(
                seq, torch.randint(0, 1090, (2,), generator=g, device=gpu, dtype=torch.int32)
            )
        )
        cache.random_(0, 256, generator=g)
        out.copy_(poisoned_out(tuple(out.shape), seed + rep).to(gpu))
        want_cache, want_out = cache.clone(), out.clone()
        graph.replay()
        ref.quantize_and_insert_k_cache(k, want_cache, slots, block_size)
        ref.dequantize_and_gather_k_cache(want_out, want_cache, seq, gl, table, block_size, 7)
        torch.cuda.synchronize()
        assert torch.equal(cache, want_cache), f"seed {seed} replay {rep}"
        assert bits_equal(out, want_out), f"seed {seed} replay {rep}"


@pytest.mark.gpu
def test_gpu_sizes_do_not_recompile(gpu: torch.device) -> None:
    """Token, request and page counts, the offset and the page stride are run-time values.

    One kernel each, whatever the page stride of a layer's block-outer view.
    """
    from dsv4_kernels import _triton_kv_cache as tk

    seed = fresh_seed()
    caches = {}
    for fn in (tk._quantize_and_insert_k_cache_kernel, tk._dequantize_and_gather_k_cache_kernel):
        if not hasattr(fn, "device_caches"):
            pytest.skip("this Triton keeps no per-device kernel cache to count")
        caches[fn] = fn.device_caches[torch.cuda.current_device()][0]
    counts = []
    for i, (n, reqs, pages, offset, layers) in enumerate(
        [(1, 1, 1, 0, 0), (16, 2, 33, 16, 0), (17, 5, 64, 1, 3), (1000, 3, 17, 5, 5)]
    ):
        cache = kvc.empty_k_cache(pages, 64, gpu)
        if layers:  # a block-outer layer view: another page stride and storage offset
            cache = block_outer_k_cache_views(pages, 64, layers, gpu)[layers // 2]
        k = make_keys(n, seed + i).to(gpu)
        slots = torch.randint(0, pages * 64, (n,), device=gpu).unique()
        kvc.quantize_and_insert_k_cache(k, cache, slots, 64)
        out = torch.empty((reqs, offset + 64, 512), dtype=torch.bfloat16, device=gpu)
        seq = torch.full((reqs,), 64, dtype=torch.int32, device=gpu)
        table = torch.randint(0, pages, (reqs, 2), dtype=torch.int32, device=gpu)
        kvc.dequantize_and_gather_k_cache(out, cache, seq, seq, table, 64, offset)
        counts.append(tuple(len(c) for c in caches.values()))
    assert counts[1:] == counts[:1] * 3, counts


GPU_BLOCK_OUTER_CASES = {
    # name: (pages of the group, run, layer, seq_lens, gather_len)
    "window-3-layers-1x16384": ([(64, 3)], 0, 1, [16384], None),
    "window-3-layers-16x1024": ([(64, 3)], 0, 2, [1024] * 16, None),
    "c4a-of-c4a-c128a-1x32768": ([(64, 3), (2, 3)], 0, 1, [32768], None),
    "c128a-of-c4a-c128a-1x1024": ([(64, 3), (2, 3)], 1, 2, [1024], None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_BLOCK_OUTER_CASES))
def test_gpu_block_outer_views_benchmark_sizes(name: str, gpu: torch.device) -> None:
    """Insert into and gather from one layer of vLLM's block-outer group at benchmark sizes.

    The kernel's bytes equal the reference's on the same view (both address pages
    through ``stride(0)``, the reference by plain indexing), the other layers'
    bytes in the same blocks are untouched, and the gather equals the gather of
    a page-contiguous copy of the layer's pages.
    """
    seed = fresh_seed()
    pages, run, layer, seq_lens, gather_len = GPU_BLOCK_OUTER_CASES[name]
    g = gen(seed, gpu)
    block_size = pages[run][0]
    per_req = math.ceil(max(seq_lens) / block_size)
    num_blocks = per_req * len(seq_lens) + 5
    group = block_outer_k_cache_group(num_blocks, pages, gpu, generator=g)
    view = group.views[run][layer]
    n = num_blocks * block_size
    slots = torch.randperm(n, generator=g, device=gpu)
    slots[torch.rand(n, generator=g, device=gpu) < 0.02] = -1
    k = spread_keys(n, generator=g, device=gpu)
    before = group.raw.clone()
    want_raw = group.raw.clone()
    want_view = torch.as_strided(want_raw, view.shape, view.stride(), view.storage_offset())
    kvc.quantize_and_insert_k_cache(k, view, slots, block_size)
    ref.quantize_and_insert_k_cache(k, want_view, slots, block_size)
    assert_same_bytes(group.raw, want_raw, f"seed {seed}: allocation after insert")
    mask = group.layer_bytes(run, layer)
    assert torch.equal(group.raw[~mask], before[~mask]), f"seed {seed}: other layers changed"

    page = kvc.k_cache_page_stride(block_size)
    start = view.storage_offset()
    contiguous = group.raw.reshape(num_blocks, -1)[:, start : start + page].contiguous()
    perm = torch.randperm(num_blocks, generator=g, device=gpu).to(torch.int32)
    table = perm[: per_req * len(seq_lens)].reshape(len(seq_lens), per_req).contiguous()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=gpu)
    gl = None if gather_len is None else torch.clamp(seq, max=gather_len)
    out = poisoned_bf16((len(seq_lens), max(seq_lens) + 3, 512), generator=g, device=gpu)
    want = out.clone()
    kvc.dequantize_and_gather_k_cache(out, view, seq, gl, table, block_size, 3)
    kvc.dequantize_and_gather_k_cache(want, contiguous, seq, gl, table, block_size, 3)
    assert_same_bytes(out, want, f"seed {seed}: gather from the view")
