# mypy: allow-untyped-defs
"""Sparse MLA with sink, second kernel (NOT the default): a key's 512 values in four pieces.

Measured SLOWER than :mod:`._triton_sparse_mla` on the H200 in every TP8 case
(docs/attention.md, "Column-piece kernel"; best variant 354.6 against 259.9
ns per token on C4A Flash TP8), so ``sparse_mla.TILES`` does not select it; a
tile with ``KERNEL=1`` does (the sweep in ``benchmarks/sweep_sparse_mla.py``).
Same arguments, grid and semantics as the first kernel (about 510 lines: the
four pieces each need their own load, dequantisation and two dots).  What differs:

* a key's values are four pieces of power-of-two width, gathered and
  dequantised separately: FP8 columns 0-255 (scale bytes 0-3), 256-383 (4-5),
  384-447 (6) and the 64 bf16 rope values, and every dot runs per piece (``S``
  sums four partial products, ``O`` has four accumulators).  The first kernel
  instead loads the rope as a masked ``[BLOCK_N, 8, 64]`` bf16 tile, seven
  eighths zeros, to build one ``[BLOCK_N, 512]`` tile;
* ``ONE_DEQUANT`` dequantises each piece once, in the load's layout, behind an
  identity that Triton does not look through (:func:`_pin`).  Without it
  Triton hoists each dot's operand conversion above the dequantisation, so the
  codes are dequantised twice (once per dot layout);
* ``A_WORDS``/``B_WORDS`` (with ``ONE_DEQUANT``, 16-byte aligned pages, CUDA
  only) load the codes as int32 words and dequantise four at a time in inline
  PTX (:data:`._triton_sparse_mla_asm.E4M3_ASM`); on the H200 this made the piece kernel 1.7x faster
  (602.0 to 354.6 ns per token, C4A Flash TP8) but not faster than the first
  kernel;
* ``KEYS_M`` puts the keys on the MMA's M dimension (``S^T = K q^T``, ``O^T
  += K^T P^T``, accumulators ``[piece, BLOCK_H]``), so Triton emits wgmma at
  8 or 16 heads (``BLOCK_N = 64``); measured slower than heads on M (471.4
  against 426.9 ns without the prefetch).

``PREFETCH`` requests the next tile's index entries and bytes before this
tile's math.  ``DOT_FP32`` (Triton's interpreter) up-casts the dot operands
to float32; the interpreter runs neither the PTX nor the pin.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_sparse_mla import RUNTIME_ARGS
from ._triton_sparse_mla_asm import E4M3_ASM

__all__ = ["RUNTIME_ARGS", "_sparse_mla_split_kernel"]


@triton.jit
def _gather(
    src_ptr,
    idx_row_ptr,
    start,
    length,
    row_stride,  # page stride in bytes (paged) or row stride in elements (workspace)
    num_rows,
    SLOTS: tl.constexpr,
    PAGED: tl.constexpr,
    ALIGNED: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr = False,
):
    """Raw bytes of keys ``start .. start + BLOCK_N``: (ok, a, b, c, rope, sa, sb, sc).

    Paged: ``a``/``b``/``c`` FP8 codes ``[BLOCK_N, 256/128/64]`` uint8, ``rope``
    ``[BLOCK_N, 64]`` bf16, ``sa``/``sb``/``sc`` the scale bytes ``[BLOCK_N,
    4/2/1]``.  Workspace: ``a``/``b``/``c``/``rope`` bf16 columns, scales unused.
    Masked keys read as zeros.
    """
    n = tl.arange(0, BLOCK_N)
    col = start + n
    idx = tl.load(idx_row_ptr + col, mask=col < length, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < num_rows)
    okc = ok[:, None]
    ea = tl.arange(0, 256)[None, :]
    eb = tl.arange(0, 128)[None, :]
    ec = tl.arange(0, 64)[None, :]
    if PAGED:
        page = idx // SLOTS
        in_page = idx % SLOTS
        base = page * row_stride
        data_off = base + in_page * DATA_BYTES
        scale_off = base + SLOTS * DATA_BYTES + in_page * SCALE_BYTES
        if ALIGNED:
            data_off = tl.multiple_of(data_off, 16)
        data = (src_ptr + data_off)[:, None]
        if WORDS:  # the codes as int32 words of four (16-byte aligned rows)
            w = data.to(tl.pointer_type(tl.int32))
            a = tl.load(w + tl.arange(0, 64)[None, :], mask=okc, other=0)
            b = tl.load(w + 64 + tl.arange(0, 32)[None, :], mask=okc, other=0)
            c = tl.load(w + 96 + tl.arange(0, 16)[None, :], mask=okc, other=0)
        else:
            a = tl.load(data + ea, mask=okc, other=0)
            b = tl.load(data + 256 + eb, mask=okc, other=0)
            c = tl.load(data + 384 + ec, mask=okc, other=0)
        rope = tl.load((data + 448).to(tl.pointer_type(tl.bfloat16)) + ec, mask=okc, other=0.0)
        sptr = (src_ptr + scale_off)[:, None]
        sa = tl.load(sptr + tl.arange(0, 4)[None, :], mask=okc, other=0)
        sb = tl.load(sptr + 4 + tl.arange(0, 2)[None, :], mask=okc, other=0)
        sc = tl.load(sptr + 6 + tl.arange(0, 1)[None, :], mask=okc, other=0)
        return ok, a, b, c, rope, sa, sb, sc
    else:
        row = (src_ptr + idx * row_stride)[:, None]
        a = tl.load(row + ea, mask=okc, other=0.0)
        b = tl.load(row + 256 + eb, mask=okc, other=0.0)
        c = tl.load(row + 384 + ec, mask=okc, other=0.0)
        rope = tl.load(row + 448 + ec, mask=okc, other=0.0)
        return ok, a, b, c, rope, ok, ok, ok


@triton.jit
def _dequant(codes, sbytes, PAGED: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, NB * 64]`` bf16 from FP8 codes and their ``[BLOCK_N, NB]`` UE8M0 scale
    bytes (exact in bf16: an E4M3 code times a power of two); workspace pieces pass through."""
    if PAGED:
        scale = (sbytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2**(byte - 127)
        v = tl.reshape(codes, (BLOCK_N, NB, 64)).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = v * scale[:, :, None]
        return tl.reshape(v, (BLOCK_N, NB * 64)).to(tl.bfloat16)
    else:
        return codes


@triton.jit
def _dequant_words(words, sbytes, NB: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_dequant` from ``[BLOCK_N, NB * 16]`` int32 words of codes, through
    :data:`._triton_sparse_mla_asm.E4M3_ASM` (CUDA only: not in the interpreter)."""
    sb = sbytes.to(tl.int32)
    pair = (sb << 7) | (sb << 23)  # bf16 2**(byte - 127), twice
    pw = tl.reshape(tl.broadcast_to(pair[:, :, None], (BLOCK_N, NB, 16)), (BLOCK_N, NB * 16))
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        E4M3_ASM,
        "=h,=h,=h,=h,r,r",
        [words, pw],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=1,
    )
    v = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [.., j, i] = code 2j + i of the word
    return tl.reshape(v, (BLOCK_N, NB * 64))


@triton.jit
def _pin(x, PIN: tl.constexpr):
    """An identity (``mov``) that Triton does not look through: the dequantisation stays
    in the load's vectorised layout and happens once, and the bf16 tile (not the FP8
    codes) is what is converted to each dot's operand layout."""
    if PIN:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    else:
        return x


@triton.jit
def _dequant_t(codes, sbytes, PAGED: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_dequant` of the transposed codes, ``[NB * 64, BLOCK_N]``: its own chain of
    operations, so Triton does not hoist one dequantisation into two register layouts
    that are both live at once (the second is only needed after the softmax)."""
    if PAGED:
        scale = (tl.trans(sbytes).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        v = tl.reshape(tl.trans(codes), (NB, 64, BLOCK_N))
        v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None, :]
        return tl.reshape(v, (NB * 64, BLOCK_N)).to(tl.bfloat16)
    else:
        return tl.trans(codes)


@triton.jit
def _k(
    pre,
    raw,
    sbytes,
    ONE: tl.constexpr,
    PAGED: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A piece as ``[BLOCK_N, w]``: the tile dequantised once (``ONE``) or its own chain."""
    if ONE:
        return pre
    else:
        return _dequant(raw, sbytes, PAGED, NB, BLOCK_N)


@triton.jit
def _kt(
    pre,
    raw,
    sbytes,
    ONE: tl.constexpr,
    PAGED: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A piece as ``[w, BLOCK_N]``: the transposed tile (``ONE``) or its own chain."""
    if ONE:
        return tl.trans(pre)
    else:
        return _dequant_t(raw, sbytes, PAGED, NB, BLOCK_N)


@triton.jit
def _mm(x, y, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc)
    else:
        return tl.dot(x, y, acc)


@triton.jit
def _attend(
    accs,
    m_i,
    l_i,
    qs,
    src_ptr,
    idx_row_ptr,
    length,
    row_stride,
    num_rows,
    qk_scale,
    SLOTS: tl.constexpr,
    PAGED: tl.constexpr,
    ALIGNED: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    ONE_DEQUANT: tl.constexpr,
    PIN: tl.constexpr,
    WORDS: tl.constexpr,  # FP8 codes as int32 words through inline PTX (one dequantisation)
):
    """Online softmax over one key source (base 2, masked keys at ``-inf``).

    ``qs`` are the four query pieces (``[BLOCK_H, w]``, or transposed ``[w,
    BLOCK_H]`` with ``KEYS_M``); ``accs`` the four output accumulators in the
    same orientation; ``m_i``/``l_i`` per head.
    """
    acc_a, acc_b, acc_c, acc_r = accs
    q_a, q_b, q_c, q_r = qs
    if PREFETCH:
        ok, ra, rb, rc, rr, sa, sb, sc = _gather(
            src_ptr, idx_row_ptr, 0, length, row_stride, num_rows,
            SLOTS, PAGED, ALIGNED, DATA_BYTES, SCALE_BYTES, BLOCK_N, WORDS,
        )  # fmt: skip
    for start in range(0, length, BLOCK_N):
        if PREFETCH:
            n_ok, n_ra, n_rb, n_rc, n_rr, n_sa, n_sb, n_sc = _gather(
                src_ptr, idx_row_ptr, start + BLOCK_N, length, row_stride, num_rows,
                SLOTS, PAGED, ALIGNED, DATA_BYTES, SCALE_BYTES, BLOCK_N, WORDS,
            )  # fmt: skip
        else:
            ok, ra, rb, rc, rr, sa, sb, sc = _gather(
                src_ptr, idx_row_ptr, start, length, row_stride, num_rows,
                SLOTS, PAGED, ALIGNED, DATA_BYTES, SCALE_BYTES, BLOCK_N, WORDS,
            )  # fmt: skip
        if WORDS:
            k_a = _pin(_dequant_words(ra, sa, 4, BLOCK_N), PIN)
            k_b = _pin(_dequant_words(rb, sb, 2, BLOCK_N), PIN)
            k_c = _pin(_dequant_words(rc, sc, 1, BLOCK_N), PIN)
        elif ONE_DEQUANT:
            k_a = _pin(_dequant(ra, sa, PAGED, 4, BLOCK_N), PIN)
            k_b = _pin(_dequant(rb, sb, PAGED, 2, BLOCK_N), PIN)
            k_c = _pin(_dequant(rc, sc, PAGED, 1, BLOCK_N), PIN)
        else:
            k_a = ra
            k_b = rb
            k_c = rc
        if KEYS_M:
            # S^T [BLOCK_N, BLOCK_H] = K q^T; softmax along the keys (axis 0).
            s = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
            s = _mm(_k(k_a, ra, sa, ONE_DEQUANT, PAGED, 4, BLOCK_N), q_a, s, DOT_FP32)
            s = _mm(_k(k_b, rb, sb, ONE_DEQUANT, PAGED, 2, BLOCK_N), q_b, s, DOT_FP32)
            s = _mm(_k(k_c, rc, sc, ONE_DEQUANT, PAGED, 1, BLOCK_N), q_c, s, DOT_FP32)
            s = _mm(rr, q_r, s, DOT_FP32)
            s = tl.where(ok[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if DOT_FP32:
                pd = p
            else:
                pd = p.to(tl.bfloat16)
            acc_a = _mm(
                _kt(k_a, ra, sa, ONE_DEQUANT, PAGED, 4, BLOCK_N),
                pd,
                acc_a * alpha[None, :],
                DOT_FP32,
            )
            acc_b = _mm(
                _kt(k_b, rb, sb, ONE_DEQUANT, PAGED, 2, BLOCK_N),
                pd,
                acc_b * alpha[None, :],
                DOT_FP32,
            )
            acc_c = _mm(
                _kt(k_c, rc, sc, ONE_DEQUANT, PAGED, 1, BLOCK_N),
                pd,
                acc_c * alpha[None, :],
                DOT_FP32,
            )
            acc_r = _mm(tl.trans(rr), pd, acc_r * alpha[None, :], DOT_FP32)
        else:
            # S [BLOCK_H, BLOCK_N] = q K^T; softmax along the keys (axis 1).
            s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
            s = _mm(q_a, _kt(k_a, ra, sa, ONE_DEQUANT, PAGED, 4, BLOCK_N), s, DOT_FP32)
            s = _mm(q_b, _kt(k_b, rb, sb, ONE_DEQUANT, PAGED, 2, BLOCK_N), s, DOT_FP32)
            s = _mm(q_c, _kt(k_c, rc, sc, ONE_DEQUANT, PAGED, 1, BLOCK_N), s, DOT_FP32)
            s = _mm(q_r, tl.trans(rr), s, DOT_FP32)
            s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_FP32:
                pd = p
            else:
                pd = p.to(tl.bfloat16)
            acc_a = _mm(
                pd,
                _k(k_a, ra, sa, ONE_DEQUANT, PAGED, 4, BLOCK_N),
                acc_a * alpha[:, None],
                DOT_FP32,
            )
            acc_b = _mm(
                pd,
                _k(k_b, rb, sb, ONE_DEQUANT, PAGED, 2, BLOCK_N),
                acc_b * alpha[:, None],
                DOT_FP32,
            )
            acc_c = _mm(
                pd,
                _k(k_c, rc, sc, ONE_DEQUANT, PAGED, 1, BLOCK_N),
                acc_c * alpha[:, None],
                DOT_FP32,
            )
            acc_r = _mm(pd, rr, acc_r * alpha[:, None], DOT_FP32)
        m_i = m_new
        if PREFETCH:
            ok, ra, rb, rc, rr, sa, sb, sc = n_ok, n_ra, n_rb, n_rc, n_rr, n_sa, n_sb, n_sc
    return (acc_a, acc_b, acc_c, acc_r), m_i, l_i


@triton.jit
def _q_piece(
    q_row, heads, h_ok, q_stride_h, OFF: tl.constexpr, W: tl.constexpr, KEYS_M: tl.constexpr
):
    d = OFF + tl.arange(0, W)
    if KEYS_M:
        return tl.load(
            q_row + heads[None, :].to(tl.int64) * q_stride_h + d[:, None],
            mask=h_ok[None, :],
            other=0.0,
        )
    else:
        return tl.load(
            q_row + heads[:, None].to(tl.int64) * q_stride_h + d[None, :],
            mask=h_ok[:, None],
            other=0.0,
        )


@triton.jit
def _store_piece(
    o_row,
    acc,
    factor,
    heads,
    h_ok,
    out_stride_h,
    OFF: tl.constexpr,
    W: tl.constexpr,
    KEYS_M: tl.constexpr,
):
    d = OFF + tl.arange(0, W)
    if KEYS_M:
        tl.store(
            o_row + heads[None, :].to(tl.int64) * out_stride_h + d[:, None],
            (acc * factor[None, :]).to(tl.bfloat16),
            mask=h_ok[None, :],
        )
    else:
        tl.store(
            o_row + heads[:, None].to(tl.int64) * out_stride_h + d[None, :],
            (acc * factor[:, None]).to(tl.bfloat16),
            mask=h_ok[:, None],
        )


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_mla_split_kernel(
    q_ptr,
    out_ptr,
    lse_ptr,
    sink_ptr,
    a_src_ptr,
    a_idx_ptr,
    a_len_ptr,
    b_src_ptr,
    b_idx_ptr,
    b_len_ptr,
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
    qk_scale,
    A_SLOTS: tl.constexpr,
    A_PAGED: tl.constexpr,
    A_HAS_LENS: tl.constexpr,
    HAS_B: tl.constexpr,
    B_SLOTS: tl.constexpr,
    B_HAS_LENS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    ALIGNED: tl.constexpr,
    DATA_BYTES: tl.constexpr,  # 576
    SCALE_BYTES: tl.constexpr,  # 8
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    ONE_DEQUANT: tl.constexpr,  # dequantise each piece once, in the load's layout
    PIN: tl.constexpr,  # with ONE_DEQUANT: keep Triton from re-hoisting (off in the interpreter)
    A_WORDS: tl.constexpr,  # source A read as words, dequantised through inline PTX (CUDA)
    B_WORDS: tl.constexpr,  # the same for source B (needs ONE_DEQUANT, aligned pages)
):
    pid = tl.program_id(0)
    t = (pid // HEAD_BLOCKS).to(tl.int64)
    hb = pid % HEAD_BLOCKS
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    q_row = q_ptr + t * q_stride_t
    qs = (
        _q_piece(q_row, heads, h_ok, q_stride_h, 0, 256, KEYS_M),
        _q_piece(q_row, heads, h_ok, q_stride_h, 256, 128, KEYS_M),
        _q_piece(q_row, heads, h_ok, q_stride_h, 384, 64, KEYS_M),
        _q_piece(q_row, heads, h_ok, q_stride_h, 448, 64, KEYS_M),
    )
    if KEYS_M:
        accs = (
            tl.zeros((256, BLOCK_H), tl.float32),
            tl.zeros((128, BLOCK_H), tl.float32),
            tl.zeros((64, BLOCK_H), tl.float32),
            tl.zeros((64, BLOCK_H), tl.float32),
        )
    else:
        accs = (
            tl.zeros((BLOCK_H, 256), tl.float32),
            tl.zeros((BLOCK_H, 128), tl.float32),
            tl.zeros((BLOCK_H, 64), tl.float32),
            tl.zeros((BLOCK_H, 64), tl.float32),
        )
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    a_len = a_width
    if A_HAS_LENS:
        a_len = tl.minimum(tl.load(a_len_ptr + t), a_width)
    accs, m_i, l_i = _attend(
        accs, m_i, l_i, qs, a_src_ptr, a_idx_ptr + t * a_idx_stride, a_len, a_row_stride,
        a_num_rows, qk_scale, A_SLOTS, A_PAGED, ALIGNED, DATA_BYTES, SCALE_BYTES, BLOCK_H,
        BLOCK_N, KEYS_M, DOT_FP32, PREFETCH, ONE_DEQUANT, PIN, A_WORDS,
    )  # fmt: skip
    if HAS_B:
        b_len = b_width
        if B_HAS_LENS:
            b_len = tl.minimum(tl.load(b_len_ptr + t), b_width)
        accs, m_i, l_i = _attend(
            accs, m_i, l_i, qs, b_src_ptr, b_idx_ptr + t * b_idx_stride, b_len, b_row_stride,
            b_num_rows, qk_scale, B_SLOTS, True, ALIGNED, DATA_BYTES, SCALE_BYTES, BLOCK_H,
            BLOCK_N, KEYS_M, DOT_FP32, PREFETCH, ONE_DEQUANT, PIN, B_WORDS,
        )  # fmt: skip

    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse2 = tl.where(has_key, m_i, 0.0) + tl.log2(l_safe)
    factor = tl.where(has_key, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=float("-inf"))
        factor = factor / (1.0 + tl.exp2(sink * LOG2E - lse2))
    o_row = out_ptr + t * out_stride_t
    acc_a, acc_b, acc_c, acc_r = accs
    _store_piece(o_row, acc_a, factor, heads, h_ok, out_stride_h, 0, 256, KEYS_M)
    _store_piece(o_row, acc_b, factor, heads, h_ok, out_stride_h, 256, 128, KEYS_M)
    _store_piece(o_row, acc_c, factor, heads, h_ok, out_stride_h, 384, 64, KEYS_M)
    _store_piece(o_row, acc_r, factor, heads, h_ok, out_stride_h, 448, 64, KEYS_M)
    lse = tl.where(has_key, lse2 * LN2, float("-inf"))
    tl.store(lse_ptr + t * lse_stride_t + heads, lse, mask=h_ok)
