# mypy: allow-untyped-defs
"""Triton kernel for sparse MLA with sink (launched from :mod:`._paged_keys`).

One program owns one query token and ``BLOCK_H`` of its heads (``BLOCK_H`` is
the head count rounded up to 16, the smallest MMA M, and at most 64): heads
are padded inside the kernel only, never in memory.  It walks the token's
key list (source A: window-cache slots or workspace rows; source B:
compressed-cache slots) ``BLOCK_N`` keys at a time:

* gather the keys' bytes by slot: 7 x 64 FP8 codes, 7 UE8M0 scale bytes and
  64 bf16 rope values per key, at page ``slot // SLOTS`` (``page *
  page_stride``, 64-bit, ``page_stride`` a run-time value so per-layer views
  with any block-outer stride share one compiled kernel);
* dequantise once into a ``[BLOCK_N, 512]`` bf16 tile (exact: an E4M3 code
  times a power of two fits bf16), used as K for ``S = q K^T`` and as V for
  ``O += P V``;
* online softmax in base 2 (``scale * log2(e)`` folded into the scores),
  masked keys (past the length, ``-1``, or slots past the cache) at ``-inf``;
* with ``PREFETCH``, the next tile's index entries and bytes are requested
  before this tile's math, so the gather overlaps the compute (Triton's own
  loop pipelining does not reach these dependent gathers).

At the end ``lse = ln 2 * (m + log2 l)`` (without the sink) and ``o =
acc / l / (1 + exp(sink - lse))``; a row with no valid key writes 0 and
``-inf``.  Program ids are flattened with the head block fastest, so the
programs of one token run together and neighbouring tokens (which share
window keys) run close in time.

``A_WORDS``/``B_WORDS`` (off by default; CUDA and 16-byte aligned pages only)
load the FP8 codes as int32 words and dequantise four at a time in inline PTX
(:mod:`._triton_sparse_mla_asm`): measured 1.4-1.5x slower than the default at
8/16 heads and 1.12x faster at 64 heads on the H200 (one run, docs/attention.md).

``DOT_FP32`` up-casts the dot operands to fp32: Triton's interpreter
computes ``tl.dot`` on bf16 operands wrongly (docs/design.md, "Where code runs"),
and its bf16 multiplies too, so ``BF16_DEQUANT`` is off there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit_layout import DATA_BYTES, HEAD_DIM, NOPE, NQ, NQ_PAD, QBLOCK, SCALE_BYTES
from ._triton_sparse_mla_asm import E4M3_ASM

# Run-time sizes that must not be specialised on value: a new layer, batch or
# cache size must not compile a new kernel.
# ``SOURCE_RUNTIME_ARGS``: those of the two key sources and q, which the decode's split
# kernels share.
SOURCE_RUNTIME_ARGS = [
    "num_tokens",
    "num_heads",
    "a_idx_stride",
    "a_width",
    "a_row_stride",
    "a_num_rows",
    "b_idx_stride",
    "b_width",
    "b_row_stride",
    "b_num_rows",
    "q_stride_t",
    "q_stride_h",
]
RUNTIME_ARGS = [*SOURCE_RUNTIME_ARGS, "out_stride_t", "out_stride_h", "lse_stride_t"]


@triton.jit
def _load_raw(
    src_ptr,
    idx_row_ptr,
    start,
    length,
    row_stride,  # page stride in bytes (paged) or row stride in elements (workspace)
    num_rows,  # slots (rows) in the source: larger indices are holes
    SLOTS: tl.constexpr,
    PAGED: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr = False,
    BLOCKS: tl.constexpr = False,
):
    """The bytes of keys ``start .. start + BLOCK_N`` of an index row: (ok, a, b, sbytes).
    ``BLOCKS``: the row is a block table's row (key ``c``: slot ``row[c // SLOTS] * SLOTS +
    c % SLOTS``; a negative page id is a hole), as :class:`~dsv4_kernels.BlockRows`.

    Paged: ``a`` the FP8 codes ``[BLOCK_N, 8, 64]`` uint8 (block 7 zero),
    ``b`` the rope in block 7 of a ``[BLOCK_N, 8, 64]`` bf16 tile, ``sbytes``
    ``[BLOCK_N, 8]`` uint8 scale bytes.  Workspace: ``a`` the ``[BLOCK_N,
    512]`` bf16 rows (``b``, ``sbytes`` unused).
    """
    n = tl.arange(0, BLOCK_N)
    col = start + n
    if BLOCKS:
        page_id = tl.load(idx_row_ptr + col // SLOTS, mask=col < length, other=-1).to(tl.int64)
        idx = tl.where(page_id >= 0, page_id * SLOTS + col % SLOTS, -1)
    else:
        idx = tl.load(idx_row_ptr + col, mask=col < length, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < num_rows)
    if PAGED:
        page = idx // SLOTS
        in_page = idx % SLOTS
        base = page * row_stride
        data_off = base + in_page * DATA_BYTES
        scale_off = base + SLOTS * DATA_BYTES + in_page * SCALE_BYTES
        if ALIGNED:
            data_off = tl.multiple_of(data_off, 16)
            scale_off = tl.multiple_of(scale_off, 8)
        qb = tl.arange(0, NQ_PAD)  # 8 blocks of 64: 7 FP8 blocks, then the rope
        e = tl.arange(0, QBLOCK)
        elem = qb[:, None] * QBLOCK + e[None, :]  # [8, 64]
        is_nope = (qb < NQ)[None, :, None]
        data = src_ptr + data_off
        if WORDS:  # the codes as int32 words of four, [BLOCK_N, 8, 16] (aligned pages)
            word_idx = qb[:, None] * (QBLOCK // 4) + tl.arange(0, QBLOCK // 4)[None, :]
            codes = tl.load(
                data.to(tl.pointer_type(tl.int32))[:, None, None] + word_idx[None, :, :],
                mask=ok[:, None, None] & is_nope,
                other=0,
            )
        else:
            codes = tl.load(
                data[:, None, None] + elem[None, :, :], mask=ok[:, None, None] & is_nope, other=0
            )
        rope_src = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(
            rope_src[:, None, None] + (elem - NOPE)[None, :, :],
            mask=ok[:, None, None] & (qb == NQ)[None, :, None],
            other=0.0,
        )
        sbytes = tl.load(
            (src_ptr + scale_off)[:, None] + qb[None, :],
            mask=ok[:, None] & (qb < NQ)[None, :],
            other=0,
        )
        return ok, codes, rope, sbytes
    else:
        d = tl.arange(0, HEAD_DIM)
        rows = tl.load(
            src_ptr + idx[:, None] * row_stride + d[None, :], mask=ok[:, None], other=0.0
        )
        return ok, rows, rows, ok


@triton.jit
def _dequant_words(words, sbytes, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, 8, 64]`` bf16 from ``[BLOCK_N, 8, 16]`` int32 words of E4M3 codes and
    their ``[BLOCK_N, 8]`` scale bytes (``NQ_PAD`` blocks), four codes per inline-PTX call
    (CUDA only; the conversion is :data:`._triton_sparse_mla_asm.E4M3_ASM`)."""
    sb = sbytes.to(tl.int32)
    pair = (sb << 7) | (sb << 23)  # bf16 2**(byte - 127), twice
    pw = tl.broadcast_to(pair[:, :, None], (BLOCK_N, NQ_PAD, 16))
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        E4M3_ASM,
        "=h,=h,=h,=h,r,r",
        [words, pw],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=1,
    )
    v = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [.., j, i] = code 2j + i of the word
    return tl.reshape(v, (BLOCK_N, NQ_PAD, QBLOCK))


@triton.jit
def _keys_from_raw(
    a,
    b,
    sbytes,
    PAGED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16_DEQUANT: tl.constexpr,
    WORDS: tl.constexpr = False,
):
    """``[BLOCK_N, 512]`` bf16 keys from :func:`_load_raw`'s bytes (zero for masked rows).

    ``code * 2**(byte - 127)`` is exact in bf16 (4 significant bits), so with
    ``BF16_DEQUANT`` the dequantisation multiplies in bf16 (Triton's interpreter
    multiplies bf16 wrongly: there it goes through float32, same result).
    """
    if PAGED and WORDS:
        nope = _dequant_words(a, sbytes, BLOCK_N)
        is_nope = (tl.arange(0, NQ_PAD) < NQ)[None, :, None]
        k = tl.where(is_nope, nope, b)
        return tl.reshape(k, (BLOCK_N, HEAD_DIM))
    elif PAGED:
        scale = (sbytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2**(byte - 127)
        if BF16_DEQUANT:
            nope = (
                a.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
                * scale.to(tl.bfloat16)[:, :, None]
            )
        else:
            nope = a.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
            nope = nope.to(tl.bfloat16)
        is_nope = (tl.arange(0, NQ_PAD) < NQ)[None, :, None]
        k = tl.where(is_nope, nope, b)
        return tl.reshape(k, (BLOCK_N, HEAD_DIM))
    else:
        return a


@triton.jit
def _attend_source(
    acc,
    m_i,
    l_i,
    q,
    src_ptr,
    idx_row_ptr,  # this token's index row
    length,  # keys counted in this row
    row_stride,
    num_rows,
    qk_scale,  # scale * log2(e)
    SLOTS: tl.constexpr,
    PAGED: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    BF16_DEQUANT: tl.constexpr,
    WORDS: tl.constexpr = False,
    BLOCKS: tl.constexpr = False,
):
    """Online softmax over one key source; with ``PREFETCH`` the next tile's bytes are
    requested before this tile's math, so loads overlap compute within a program."""
    if PREFETCH:
        ok, a, b, sb = _load_raw(
            src_ptr, idx_row_ptr, 0, length, row_stride, num_rows, SLOTS, PAGED, ALIGNED, BLOCK_N,
            WORDS, BLOCKS,
        )  # fmt: skip
    for start in range(0, length, BLOCK_N):
        # with PREFETCH the next tile's bytes (this tile's came one step earlier)
        n_ok, n_a, n_b, n_sb = _load_raw(
            src_ptr, idx_row_ptr, start + BLOCK_N if PREFETCH else start, length, row_stride,
            num_rows, SLOTS, PAGED, ALIGNED, BLOCK_N, WORDS, BLOCKS,
        )  # fmt: skip
        if not PREFETCH:
            ok, a, b, sb = n_ok, n_a, n_b, n_sb
        k = _keys_from_raw(a, b, sb, PAGED, BLOCK_N, BF16_DEQUANT, WORDS)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOT_FP32:
            acc += tl.dot(p, k.to(tl.float32))
        else:
            acc = tl.dot(p.to(tl.bfloat16), k, acc)
        m_i = m_new
        if PREFETCH:
            ok, a, b, sb = n_ok, n_a, n_b, n_sb
    return acc, m_i, l_i


@triton.jit
def _start_heads(q_ptr, t, hb, num_heads, q_stride_t, q_stride_h, BLOCK_H: tl.constexpr):
    """A program's heads ``hb * BLOCK_H + [0, BLOCK_H)`` of token ``t`` (which of them are
    real), their q rows ``[BLOCK_H, 512]`` (0 on padded heads) and a fresh online-softmax
    state (running max, sum, accumulator).  Shared by this kernel and the decode's split
    kernel."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + t * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h + d[None, :],
        mask=h_ok[:, None],
        other=0.0,
    )
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    return heads, h_ok, q, m_i, l_i, acc


@triton.jit
def _finish(m, l_sum, sink_ptr, heads, h_ok, HAS_SINK: tl.constexpr):
    """From a base-2 softmax state (max ``m``, sum ``l_sum``) of heads ``heads``: the
    factor the accumulated output is multiplied by (``1 / l``, then the sink's ``1 / (1 +
    exp(sink - lse))``; 0 without a valid key) and the natural-log lse without the sink
    (``-inf`` without a valid key).  Shared by this kernel and the decode's combine."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    has_key = l_sum > 0.0
    l_safe = tl.where(has_key, l_sum, 1.0)
    lse2 = tl.where(has_key, m, 0.0) + tl.log2(l_safe)  # base-2 lse of the scaled scores
    factor = tl.where(has_key, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=float("-inf"))
        factor = factor / (1.0 + tl.exp2(sink * LOG2E - lse2))
    return factor, tl.where(has_key, lse2 * LN2, float("-inf"))


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_mla_kernel(
    # pointers
    q_ptr,  # [T, H, 512] bf16
    out_ptr,  # [T, H, 512] bf16
    lse_ptr,  # [T, H] float32
    sink_ptr,  # [H] float32 (unused unless HAS_SINK)
    a_src_ptr,  # source A: uint8 pages (PAGED) or bf16 workspace rows
    a_idx_ptr,  # [T, a_width] int32
    a_len_ptr,  # [T] int32 (unused unless A_HAS_LENS)
    b_src_ptr,  # source B: uint8 pages (unused unless HAS_B)
    b_idx_ptr,
    b_len_ptr,
    # sizes and strides
    num_tokens,
    num_heads,
    a_idx_stride,
    a_width,
    a_row_stride,
    a_num_rows,
    b_idx_stride,
    b_width,
    b_row_stride,
    b_num_rows,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    lse_stride_t,
    qk_scale,  # scale * log2(e)
    # meta-parameters
    A_SLOTS: tl.constexpr,
    A_PAGED: tl.constexpr,
    A_HAS_LENS: tl.constexpr,
    HAS_B: tl.constexpr,
    B_SLOTS: tl.constexpr,
    B_HAS_LENS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,  # cdiv(H, BLOCK_H)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    BF16_DEQUANT: tl.constexpr,
    A_WORDS: tl.constexpr = False,  # FP8 codes of source A as int32 words through inline PTX
    B_WORDS: tl.constexpr = False,  # the same for source B (aligned pages, CUDA only)
    b_req_ptr=None,  # [T] int32 (B_BLOCKS): each token's row of source B's block table
    B_BLOCKS: tl.constexpr = False,  # source B's rows are a block table (BlockRows)
):
    pid = tl.program_id(0)
    t = (pid // HEAD_BLOCKS).to(tl.int64)
    hb = pid % HEAD_BLOCKS
    heads, h_ok, q, m_i, l_i, acc = _start_heads(
        q_ptr, t, hb, num_heads, q_stride_t, q_stride_h, BLOCK_H
    )

    a_len = a_width
    if A_HAS_LENS:
        a_len = tl.minimum(tl.load(a_len_ptr + t), a_width)
    acc, m_i, l_i = _attend_source(
        acc, m_i, l_i, q, a_src_ptr, a_idx_ptr + t * a_idx_stride, a_len, a_row_stride,
        a_num_rows, qk_scale, A_SLOTS, A_PAGED, ALIGNED, BLOCK_N, DOT_FP32, PREFETCH, BF16_DEQUANT,
        A_WORDS,
    )  # fmt: skip
    if HAS_B:
        b_len = b_width
        if B_HAS_LENS:
            b_len = tl.minimum(tl.load(b_len_ptr + t), b_width)
        b_row = t
        if B_BLOCKS:
            b_row = tl.load(b_req_ptr + t).to(tl.int64)
        acc, m_i, l_i = _attend_source(  # the compressed source is always paged
            acc, m_i, l_i, q, b_src_ptr, b_idx_ptr + b_row * b_idx_stride, b_len, b_row_stride,
            b_num_rows, qk_scale, B_SLOTS, True, ALIGNED, BLOCK_N, DOT_FP32, PREFETCH, BF16_DEQUANT,
            B_WORDS, B_BLOCKS,
        )  # fmt: skip

    factor, lse = _finish(m_i, l_i, sink_ptr, heads, h_ok, HAS_SINK)
    o = acc * factor[:, None]
    d = tl.arange(0, HEAD_DIM)
    tl.store(
        out_ptr + t * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h + d[None, :],
        o.to(tl.bfloat16),
        mask=h_ok[:, None],
    )
    tl.store(lse_ptr + t * lse_stride_t + heads, lse, mask=h_ok)
