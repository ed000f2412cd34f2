# mypy: ignore-errors
"""Gluon (Hopper wgmma) split-key kernel of the sparse MLA decode, in blocks of up to
16 heads.

The same partial results as :func:`._triton_decode._decode_split_kernel`, from the
prefill's wgmma tile loop (:func:`._gluon_sparse_mla._attend_source`: per tile of
64 keys the FP8 codes, scale bytes and rope are gathered by slot, dequantised once
into a shared bf16 tile, ``S^T = K q^T`` and ``O^T += K^T P^T`` by wgmma with the
keys on M and the heads padded to 8 or 16 inside the kernel only).

One program (one warpgroup) per (token, chunk, head block): the chunk is columns
``[s * chunk, (s + 1) * chunk)`` of the token's window-then-compressed column list,
the head block heads ``[hb * HT, hb * HT + HT)`` (one block at up to 16 heads; more
heads, DP attention's 64 or 128, run in blocks of 16 that read the same keys, the
later blocks mostly from L2).  It writes the chunk's normalised float32 output and
base-2 log-sum-exp for its real heads.  Then either
:func:`._triton_decode._decode_combine_kernel` merges the chunks (a second launch),
or, with ``FUSED``, the program that finishes a (token, head block) last merges them
itself: each program, once its partial is stored, adds one to the (token, head
block)'s arrival counter (after a barrier of its warps, with release-acquire order at
GPU scope); the one that reads ``num_splits - 1`` reads every chunk's partial back
(from L2), writes ``out`` and ``lse`` and sets the counter back to zero for the next
call (so a CUDA graph replays with the counters as it found them).  CUDA sm_90 only;
the decode's launcher in :mod:`._paged_keys` chooses it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._gluon_sparse_mla import (
    BN,
    L_CODE_REG_A,
    L_CODE_ROWS,
    L_ROPE_ROWS,
    _attend_source,
    _cta_barrier,
    _rows,
    _shared_buffers,
    _stage_q,
)
from ._jit_layout import HEAD_DIM
from ._triton_decode import SPLIT_RUNTIME_ARGS

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _clip(lo, hi, offset, end):
    """The source's own columns ``[c0, c1)`` of chunk ``[lo, hi)`` (see _triton_decode)."""
    c0 = gl.minimum(gl.maximum(lo - offset, 0), end)
    c1 = gl.minimum(gl.maximum(hi - offset, 0), end)
    return c0, c1


@gluon.jit
def _partial(po_ptr, plse_ptr, r, ok, d):
    """One chunk's partial of a head block: base-2 lse ``[HP]`` and output ``[512, HP]``
    (rows ``r``; read through L2, where the other programs' stores are)."""
    lse = gl.load(plse_ptr + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = gl.load(
        po_ptr + gl.expand_dims(r * HEAD_DIM, 0) + gl.expand_dims(d, 1),
        mask=gl.expand_dims(ok, 0),
        other=0.0,
        cache_modifier=".cg",
    )
    return lse, o


@gluon.jit
def _merge_partials(
    po_ptr, plse_ptr, out_ptr, lse_ptr, sink_ptr, t, h0, heads_here, num_heads, num_splits,
    out_stride_t, out_stride_h, lse_stride_t,
    HAS_SINK: gl.constexpr, HP: gl.constexpr, L_OUT: gl.constexpr,
):  # fmt: skip
    """Merge the ``num_splits`` partials of token ``t``'s heads ``h0 + [0, heads_here)``
    (two chunks per step, their loads in flight together), apply the sink and write
    ``out`` (bf16) and ``lse`` (natural log, without the sink), as the combine kernel."""
    L_H: gl.constexpr = gl.SliceLayout(0, L_OUT)
    hs = gl.arange(0, HP, layout=L_H)
    h_ok = hs < heads_here
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, L_OUT))
    first = t * num_splits
    m = gl.full([HP], float("-inf"), gl.float32, layout=L_H)
    l_sum = gl.zeros([HP], gl.float32, layout=L_H)
    acc = gl.zeros([HEAD_DIM, HP], gl.float32, layout=L_OUT)
    for s0 in range(0, num_splits, 2):
        r0 = (first + s0) * num_heads + h0 + hs
        lse0, o0 = _partial(po_ptr, plse_ptr, r0, h_ok, d)
        lse1, o1 = _partial(po_ptr, plse_ptr, r0 + num_heads, h_ok & (s0 + 1 < num_splits), d)
        m_new = gl.maximum(m, gl.maximum(lse0, lse1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_use)
        w0 = gl.exp2(lse0 - m_use)
        w1 = gl.exp2(lse1 - m_use)
        acc = (
            acc * gl.expand_dims(alpha, 0)
            + o0 * gl.expand_dims(w0, 0)
            + o1 * gl.expand_dims(w1, 0)
        )
        l_sum = l_sum * alpha + w0 + w1
        m = m_new
    has_key = l_sum > 0.0
    l_safe = gl.where(has_key, l_sum, 1.0)
    lse2 = gl.where(has_key, m, 0.0) + gl.log2(l_safe)
    factor = gl.where(has_key, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        sink = gl.load(sink_ptr + h0 + hs, mask=h_ok, other=float("-inf"))
        factor = factor / (1.0 + gl.exp2(sink * LOG2E - lse2))
    heads = (h0 + hs).to(gl.int64)
    o_ptr = out_ptr + t * out_stride_t + gl.expand_dims(heads * out_stride_h, 0)
    o = acc * gl.expand_dims(factor, 0)
    gl.store(o_ptr + gl.expand_dims(d, 1), o.to(gl.bfloat16), mask=gl.expand_dims(h_ok, 0))
    gl.store(lse_ptr + t * lse_stride_t + heads, gl.where(has_key, lse2 * LN2, float("-inf")),
             mask=h_ok)  # fmt: skip


@gluon.jit(do_not_specialize=[*SPLIT_RUNTIME_ARGS, "head_blocks", "out_stride_t",
                              "out_stride_h", "lse_stride_t"])  # fmt: skip
def _decode_split_wgmma_kernel(
    q_ptr, po_ptr, plse_ptr,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads, num_splits, chunk,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h,
    qk_scale,
    head_blocks, cnt_ptr, out_ptr, lse_ptr, sink_ptr, out_stride_t, out_stride_h, lse_stride_t,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr,
    HT: gl.constexpr, ASYNC_PV: gl.constexpr, REG_A: gl.constexpr, IO_VEC: gl.constexpr,
    FUSED: gl.constexpr, HAS_SINK: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    HP: gl.constexpr = HT
    L_CODE: gl.constexpr = L_CODE_REG_A if REG_A else L_CODE_ROWS
    L_ROPE: gl.constexpr = L_CODE_REG_A if REG_A else L_ROPE_ROWS
    L_OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [4, 1], [0, 1])
    L_MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16]
    )
    k_smem, q_smem, p_smem = _shared_buffers(HP)
    pid = gl.program_id(0)
    hb = pid % head_blocks
    row = pid // head_blocks  # t * num_splits + s
    t = (row // num_splits).to(gl.int64)
    s = row % num_splits
    h0 = hb * HT
    heads_here = gl.minimum(num_heads - h0, HT)
    _stage_q(q_smem, q_ptr + h0.to(gl.int64) * q_stride_h, t, t + 1, heads_here, q_stride_t,
             q_stride_h, HP, HT, REG_A, IO_VEC)  # fmt: skip

    m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_MMA))
    l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, L_MMA))
    acc = gl.zeros([HEAD_DIM, HP], gl.float32, layout=L_MMA)

    lo = s * chunk
    hi = lo + chunk
    a_end = a_width
    if A_HAS_LENS:
        a_end = gl.maximum(gl.minimum(gl.load(a_len_ptr + t), a_width), 0)
    a0, a1 = _clip(lo, hi, 0, a_end)
    acc, m_i, l_i = _attend_source(
        acc, m_i, l_i, q_smem, k_smem, p_smem, a_src_ptr, a_idx_ptr + t * a_idx_stride,
        a0, a1, a1, a1, a_row_stride, a_num_rows, qk_scale, A_SLOTS, BN, HP, L_CODE, L_ROPE, L_MMA,
        ASYNC_PV, REG_A, False,
    )  # fmt: skip
    if HAS_B:
        b_end = b_width
        if B_HAS_LENS:
            b_end = gl.maximum(gl.minimum(gl.load(b_len_ptr + t), b_width), 0)
        b0, b1 = _clip(lo, hi, a_width, b_end)
        acc, m_i, l_i = _attend_source(
            acc, m_i, l_i, q_smem, k_smem, p_smem, b_src_ptr, b_idx_ptr + t * b_idx_stride,
            b0, b1, b1, b1, b_row_stride, b_num_rows, qk_scale, B_SLOTS, BN, HP, L_CODE, L_ROPE,
            L_MMA, ASYNC_PV, REG_A, False,
        )  # fmt: skip

    _ts, hs, row_ok = _rows(t, t + 1, heads_here, HP, HT, gl.SliceLayout(0, L_MMA))
    has_key = l_i > 0.0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse2 = gl.where(has_key, m_i + gl.log2(l_safe), float("-inf"))
    factor = gl.where(has_key, 1.0 / l_safe, 0.0)
    prow = row.to(gl.int64) * num_heads + h0
    gl.store(plse_ptr + prow + hs, lse2, mask=row_ok)
    o = gl.convert_layout(acc * gl.expand_dims(factor, 0), L_OUT)
    do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, L_OUT))
    _to, ho, o_ok = _rows(t, t + 1, heads_here, HP, HT, gl.SliceLayout(0, L_OUT))
    o_row = (prow + ho.to(gl.int64)) * HEAD_DIM
    gl.store(
        po_ptr + gl.expand_dims(o_row, 0) + gl.expand_dims(do, 1),
        o,
        mask=gl.expand_dims(o_ok, 0),
    )
    if PDL:  # this program's partial is stored: the combine may start launching
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, 0;", "=r,r",
                                  [s], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    if FUSED:
        _cta_barrier()  # every warp's partial is stored before the arrival is counted
        counter = cnt_ptr + t * head_blocks + hb
        arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last chunk of this (token, head block)
            _merge_partials(
                po_ptr, plse_ptr, out_ptr, lse_ptr, sink_ptr, t, h0, heads_here, num_heads,
                num_splits, out_stride_t, out_stride_h, lse_stride_t, HAS_SINK, HP, L_OUT,
            )  # fmt: skip
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def compiled_variants() -> int:
    """How many variants of the kernel this process has compiled (0: never built)."""
    caches = getattr(_decode_split_wgmma_kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
