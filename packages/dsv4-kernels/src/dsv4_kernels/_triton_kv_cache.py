# mypy: allow-untyped-defs
"""Triton kernels for the FP8 (UE8M0) paged K cache (launched from :mod:`.kv_cache`).

Layout of one page (``SLOTS`` tokens or compressed entries, see docs/design.md)::

    [slot * 576, slot * 576 + 448)          448 E4M3 codes, 7 blocks of 64
    [slot * 576 + 448, slot * 576 + 576)    64 rope values, bf16
    [SLOTS * 576 + slot * 8, ... + 8)       7 UE8M0 exponents (e + 127) and a zero byte

Pages are ``page_stride`` bytes apart, a run-time argument: at least
``round_up(SLOTS * 584, 576)`` (pages of one layer side by side), or a whole
block of several layers' pages when vLLM allocates a cache group block-outer
(one layer's view is then ``[num_blocks, SLOTS, 584]`` with ``stride(0)`` =
the block).  Every layer of every group runs the same compiled kernel.

Design (both kernels):

* token-parallel: a program owns ``BLOCK_T`` tokens (insert: rows of ``k``;
  gather: output rows of one request), so one long request and many short
  ones give the same amount of independent work, in one launch;
* a token is handled as an ``[8, 64]`` tile (row 7 of the nope tile is
  masked; the rope values travel as their own 64-wide bf16 row), so every
  global access is a contiguous 64- or 128-byte run at a 16-byte-aligned
  offset: 16-byte vector loads and stores;
* byte offsets are 64-bit (page id * page stride passes 2**31 near 57K
  pages of 64 slots);
* only geometry (slots per page, tile sizes) is ``tl.constexpr``; token,
  request and page counts, the page stride and the output offset are run-time
  values excluded from specialisation, so they never compile a new kernel
  (``PAGE_ALIGNED``, the page stride being a multiple of 16, is the one
  switch, and vLLM's strides always are);
* no host synchronisation: gather lengths, sequence lengths and page ids are
  read on the device; programs past a request's gather length exit at once.

Rounding to FP8: with ``EXACT_ROUNDING`` the kernel rounds in integer
arithmetic (nearest, ties to even), so its bytes equal torch's
``.to(torch.float8_e4m3fn)`` everywhere, the interpreter included (whose own
float->fp8 cast rounds half-up and can lose the mantissa carry).  Without it
the kernel uses the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32`` on
sm_89+), which gives the same bytes and is cheaper (measured on an H200, about
1.5-2 us of 14 at 16K tokens).  The wrapper rounds in integers under the
interpreter and on GPUs older than sm_89, and uses the hardware elsewhere; the
GPU tests check both against torch byte for byte.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit_layout import DATA_BYTES, NOPE, NQ, NQ_PAD, QBLOCK, ROPE, SCALE_BYTES

# Run-time sizes that must not be specialised on value (== 1, % 16): changing
# them must not compile a new kernel.
INSERT_RUNTIME_ARGS = ["page_stride", "num_tokens", "num_slots"]
GATHER_RUNTIME_ARGS = ["page_stride", "out_rows", "offset", "table_width", "num_pages"]


@triton.jit
def _e4m3_rne_codes(v):
    """float32 ``v`` with ``|v| <= 448`` -> E4M3 (fn) code bits as int32, ties to even.

    Normal range (``|v| >= 2**-6``): rebias the float32 exponent (127 -> 7)
    and round the 23-bit mantissa to 3 bits with ties to even; a mantissa
    that rounds over carries into the exponent by plain integer addition.
    Subnormal range: ``|v| + 2**14`` rounds ``|v|`` to a multiple of 2**-9
    (the ulp of 2**14 in float32; IEEE addition rounds to nearest even
    everywhere), and the low mantissa bits are the code (8 is 2**-6, which is
    also the first normal code).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    t = mag - 0x3C000000  # exponent 127 -> 7
    normal = (t + 0x7FFFF + ((t >> 20) & 1)) >> 20
    shifted = mag.to(tl.float32, bitcast=True) + 16384.0
    subnormal = shifted.to(tl.int32, bitcast=True) - 0x46800000  # bits of 2**14
    code = tl.where(mag >= 0x3C800000, normal, subnormal)  # 0x3C800000 = 2**-6
    return code | sign


@triton.jit
def _slot_offsets(
    page,
    in_page,
    page_stride,
    SLOTS: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
):
    """Byte offsets (int64) of a slot's data and of its scale bytes, pages ``page_stride`` apart.

    ``page`` must be int64.  With ``PAGE_ALIGNED`` the offsets are declared
    multiples of 16 and 8, so the accesses can be 16-byte vectors.
    """
    page_base = page * page_stride
    data_off = page_base + in_page * DATA_BYTES
    scale_off = page_base + SLOTS * DATA_BYTES + in_page * SCALE_BYTES
    if PAGE_ALIGNED:
        data_off = tl.multiple_of(data_off, 16)
        scale_off = tl.multiple_of(scale_off, SCALE_BYTES)
    return data_off, scale_off


@triton.jit(do_not_specialize=INSERT_RUNTIME_ARGS)
def _quantize_and_insert_k_cache_kernel(
    # pointers
    k_ptr,  # [>= num_tokens, 512] bf16, rows k_stride apart
    k_cache_ptr,  # page p at byte p * page_stride, uint8
    slot_ptr,  # [num_tokens] int64 or int32, negative = skip
    # sizes and strides
    k_stride,
    page_stride,  # bytes between pages (>= round_up(SLOTS * 584, 576))
    num_tokens,
    num_slots,  # num_pages * SLOTS: slots at or past this are skipped
    # meta-parameters
    SLOTS: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,  # page_stride % 16 == 0: 16-byte vector accesses
    FP8_MAX: tl.constexpr,  # 448.0
    FP8_MAX_EXP: tl.constexpr,  # 8: 448 = 1.75 * 2**8
    FP8_MAX_MANTISSA: tl.constexpr,  # 0x600000: float32 mantissa field of 1.75
    AMAX_FLOOR: tl.constexpr,  # 1e-4
    BIAS: tl.constexpr,  # 127
    BLOCK_T: tl.constexpr,
    EXACT_ROUNDING: tl.constexpr,
    EVICT_FIRST: tl.constexpr,  # stream the cache writes past L2
):
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    data_off, scale_off = _slot_offsets(
        slot // SLOTS, slot % SLOTS, page_stride, SLOTS, PAGE_ALIGNED
    )

    qb = tl.arange(0, NQ_PAD)  # quantisation block (row 7 is padding)
    col = tl.arange(0, QBLOCK)
    elem = qb[:, None] * QBLOCK + col[None, :]  # [8, 64] index into the 448 nope values
    nope_ok = ok[:, None, None] & (qb < NQ)[None, :, None]  # [T, 8, 1]
    k_row = k_ptr + tok * k_stride
    x = tl.load(k_row[:, None, None] + elem[None, :, :], mask=nope_ok, other=0.0)
    x = x.to(tl.float32)
    rope_col = tl.arange(0, ROPE)
    rope = tl.load(k_row[:, None] + NOPE + rope_col[None, :], mask=ok[:, None])

    # e = ceil(log2(max(amax, 1e-4) / 448)), exactly: the smallest e with
    # amax <= 1.75 * 2**(e + 8), read off amax's float32 exponent and mantissa.
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), AMAX_FLOOR)  # [T, 8]
    abits = amax.to(tl.int32, bitcast=True)
    e = (abits >> 23) - (BIAS + FP8_MAX_EXP) + ((abits & 0x7FFFFF) > FP8_MAX_MANTISSA).to(tl.int32)
    inv_scale = ((BIAS - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    v = x * inv_scale[:, :, None]
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if EXACT_ROUNDING:
        codes = _e4m3_rne_codes(v).to(tl.uint8)
    else:
        codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    cache_data = k_cache_ptr + data_off
    code_dst = cache_data[:, None, None] + elem[None, :, :]
    rope_dst = (cache_data + NOPE).to(tl.pointer_type(tl.bfloat16))[:, None] + rope_col[None, :]
    scale_dst = k_cache_ptr + scale_off[:, None] + qb[None, :]
    scale_bytes = tl.where(qb[None, :] < NQ, e + BIAS, 0).to(tl.uint8)
    if EVICT_FIRST:
        tl.store(code_dst, codes, mask=nope_ok, eviction_policy="evict_first")
        tl.store(rope_dst, rope, mask=ok[:, None], eviction_policy="evict_first")
        tl.store(scale_dst, scale_bytes, mask=ok[:, None], eviction_policy="evict_first")
    else:
        tl.store(code_dst, codes, mask=nope_ok)
        tl.store(rope_dst, rope, mask=ok[:, None])
        tl.store(scale_dst, scale_bytes, mask=ok[:, None])


@triton.jit(do_not_specialize=GATHER_RUNTIME_ARGS)
def _dequantize_and_gather_k_cache_kernel(
    # pointers
    out_ptr,  # [num_reqs, out_rows, 512] bf16
    k_cache_ptr,  # page p at byte p * page_stride, uint8
    seq_lens_ptr,  # [num_reqs] int32 / int64
    gather_lens_ptr,  # [num_reqs] int32 / int64 (unused unless HAS_GATHER_LENS)
    block_table_ptr,  # [num_reqs, table_width] int32 / int64
    # sizes and strides
    page_stride,  # bytes between pages (>= round_up(SLOTS * 584, 576))
    out_stride_b,
    out_stride_t,
    table_stride,
    out_rows,
    offset,
    table_width,
    num_pages,
    # meta-parameters
    SLOTS: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,  # page_stride % 16 == 0: 16-byte vector accesses
    BIAS: tl.constexpr,
    HAS_GATHER_LENS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EVICT_FIRST: tl.constexpr,  # stream the output writes past L2
):
    pid_t = tl.program_id(0)
    req = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int64)
    if HAS_GATHER_LENS:
        gather_len = tl.load(gather_lens_ptr + req).to(tl.int64)
        gather_len = tl.maximum(tl.minimum(gather_len, seq_len), 0)
    else:
        gather_len = tl.maximum(seq_len, 0)
    # Rows past the output are never written (the host checks this on CPU
    # tensors, or with check_values=True).
    limit = tl.minimum(gather_len, out_rows - offset)
    first = pid_t.to(tl.int64) * BLOCK_T
    if first < limit:
        i = first + tl.arange(0, BLOCK_T)
        ok = i < limit
        pos = seq_len - gather_len + i
        page_idx = pos // SLOTS
        in_page = pos % SLOTS
        ok = ok & (page_idx < table_width)
        page = tl.load(
            block_table_ptr + req.to(tl.int64) * table_stride + page_idx, mask=ok, other=0
        ).to(tl.int64)
        ok = ok & (page >= 0) & (page < num_pages)
        data_off, scale_off = _slot_offsets(page, in_page, page_stride, SLOTS, PAGE_ALIGNED)

        qb = tl.arange(0, NQ_PAD)
        col = tl.arange(0, QBLOCK)
        elem = qb[:, None] * QBLOCK + col[None, :]
        nope_ok = ok[:, None, None] & (qb < NQ)[None, :, None]
        cache_data = k_cache_ptr + data_off
        codes = tl.load(cache_data[:, None, None] + elem[None, :, :], mask=nope_ok, other=0)
        sbytes = tl.load(k_cache_ptr + scale_off[:, None] + qb[None, :], mask=ok[:, None], other=0)
        rope_col = tl.arange(0, ROPE)
        rope_src = (cache_data + NOPE).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_src[:, None] + rope_col[None, :], mask=ok[:, None])

        scale = (sbytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2**(byte - 127)
        vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        out_row = out_ptr + req.to(tl.int64) * out_stride_b + (offset + i) * out_stride_t
        nope_dst = out_row[:, None, None] + elem[None, :, :]
        rope_dst = out_row[:, None] + NOPE + rope_col[None, :]
        if EVICT_FIRST:
            tl.store(nope_dst, vals.to(tl.bfloat16), mask=nope_ok, eviction_policy="evict_first")
            tl.store(rope_dst, rope, mask=ok[:, None], eviction_policy="evict_first")
        else:
            tl.store(nope_dst, vals.to(tl.bfloat16), mask=nope_ok)
            tl.store(rope_dst, rope, mask=ok[:, None])
