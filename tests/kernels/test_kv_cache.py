"""FP8 (UE8M0) paged K cache: quantize_and_insert_k_cache, dequantize_and_gather_k_cache.

Both the Triton kernels (through the interpreter on CPU, compiled on CUDA) and
the vectorised torch reference are compared with the slow spec references in
``_kv_cache_spec.py`` on fresh random inputs, and with each other byte for
byte.  Caches and outputs are poisoned with fresh random bytes before every
call, and the whole buffer is compared, so a stray or missing write fails.

The kernels round to FP8 in integer arithmetic, so the bytes they produce
under the interpreter are the bytes they produce on the GPU (and torch's
``.to(torch.float8_e4m3fn)``): cache bytes are compared exactly everywhere.
``test_kv_cache_views.py`` covers vLLM's block-outer cache views and bad
input; ``test_kv_cache_gpu.py`` repeats the comparisons on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_kernels.kv_cache as kvc
from dsv4_kernels.reference import kv_cache as ref
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing import generator as gen

from . import _kv_cache_spec as spec
from ._kv_cache_common import (
    GATHERS,
    INSERTS,
    LAYERS,
    bits_equal,
    fill_requests,
    first_diff,
    make_keys,
    poisoned_cache,
    poisoned_out,
)

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
