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
base-2 log-sum-exp for its real heads; :func:`._triton_decode._decode_combine_kernel`
merges the chunks.  With ``PDL`` each program signals, once its partial is stored,
that the combine (launched as its programmatic dependent) may start launching, so
the combine's launch overlaps the split kernel's last programs.  CUDA sm_90 only; the
decode's launcher in :mod:`._paged_keys` chooses it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._gluon_sparse_mla import (
    BN,
    L_CODE_REG_A,
    _attend_source,
    _gather,
    _rows,
    _shared_buffers,
    _stage_q,
)
from ._jit_layout import HEAD_DIM
from ._triton_decode import SPLIT_RUNTIME_ARGS


@gluon.jit
def _clip(lo, hi, offset, end):
    """The source's own columns ``[c0, c1)`` of chunk ``[lo, hi)`` (see _triton_decode)."""
    c0 = gl.minimum(gl.maximum(lo - offset, 0), end)
    c1 = gl.minimum(gl.maximum(hi - offset, 0), end)
    return c0, c1


@gluon.jit(do_not_specialize=[*SPLIT_RUNTIME_ARGS, "head_blocks"])
def _decode_split_wgmma_kernel(
    q_ptr, po_ptr, plse_ptr,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads, num_splits, chunk,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h,
    qk_scale,
    head_blocks,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr,
    HT: gl.constexpr, ASYNC_PV: gl.constexpr, REG_A: gl.constexpr, IO_VEC: gl.constexpr,
    PDL: gl.constexpr, WG: gl.constexpr = 1,
):  # fmt: skip
    HP: gl.constexpr = HT
    W: gl.constexpr = 4 * WG  # warps
    L_CODE: gl.constexpr = (
        L_CODE_REG_A if REG_A else gl.BlockedLayout([1, 16], [8, 4], [W, 1], [1, 0])
    )
    L_ROPE: gl.constexpr = (
        L_CODE_REG_A if REG_A else gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    )
    L_QW: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [W, 1], [1, 0])
    L_OUT: gl.constexpr = gl.BlockedLayout([4 // WG, 1], [32, 1], [W, 1], [0, 1])
    # S^T [keys, heads]: each warpgroup its share of the heads; O^T [512, heads]: each
    # warpgroup its share of the 512 output columns (all of both with one warpgroup)
    L_MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, HP // WG, 16]
    )
    L_ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, HP, 16]
    )
    k_smem, q_smem, p_smem = _shared_buffers(HP)
    pid = gl.program_id(0)
    hb = pid % head_blocks
    row = pid // head_blocks  # t * num_splits + s
    t = (row // num_splits).to(gl.int64)
    s = row % num_splits
    h0 = hb * HT
    heads_here = gl.minimum(num_heads - h0, HT)
    lo = s * chunk
    hi = lo + chunk
    # The loads a chunk's first tile depends on are issued together, before q is
    # staged: the lengths, both sources' first index entries (bounded by the row widths
    # here, by the lengths once they arrive) and q.  A program then waits for one trip to
    # memory, not for q, the lengths and the index entries in turn.
    a0, a1 = _clip(lo, hi, 0, a_width)
    a_ok, a_data, a_scales = _gather(a_src_ptr, a_idx_ptr + t * a_idx_stride, a0, a1,
                                     a_row_stride, a_num_rows, A_SLOTS, BN, L_CODE)  # fmt: skip
    if A_HAS_LENS:
        a_len = gl.load(a_len_ptr + t)
    if HAS_B:
        b0, b1 = _clip(lo, hi, a_width, b_width)
        b_ok, b_data, b_scales = _gather(b_src_ptr, b_idx_ptr + t * b_idx_stride, b0, b1,
                                         b_row_stride, b_num_rows, B_SLOTS, BN, L_CODE)  # fmt: skip
        if B_HAS_LENS:
            b_len = gl.load(b_len_ptr + t)
    _stage_q(q_smem, q_ptr + h0.to(gl.int64) * q_stride_h, t, t + 1, heads_here, q_stride_t,
             q_stride_h, HP, HT, REG_A, IO_VEC, L_QW)  # fmt: skip

    m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_MMA))
    l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, L_MMA))
    acc = gl.zeros([HEAD_DIM, HP], gl.float32, layout=L_ACC)
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, L_CODE))
    if A_HAS_LENS:  # the columns past the token's length are not keys
        a0, a1 = _clip(lo, hi, 0, gl.maximum(gl.minimum(a_len, a_width), 0))
        a_ok = a_ok & (a0 + n < a1)
    acc, m_i, l_i = _attend_source(
        acc, m_i, l_i, q_smem, k_smem, p_smem, a_src_ptr, a_idx_ptr + t * a_idx_stride,
        a0, a1, a1, a1, a_row_stride, a_num_rows, qk_scale, a_ok, a_data, a_scales, A_SLOTS,
        BN, HP, L_CODE, L_ROPE, L_MMA, ASYNC_PV, REG_A, False, L_ACC,
    )  # fmt: skip
    if HAS_B:
        if B_HAS_LENS:
            b0, b1 = _clip(lo, hi, a_width, gl.maximum(gl.minimum(b_len, b_width), 0))
            b_ok = b_ok & (b0 + n < b1)
        acc, m_i, l_i = _attend_source(
            acc, m_i, l_i, q_smem, k_smem, p_smem, b_src_ptr, b_idx_ptr + t * b_idx_stride,
            b0, b1, b1, b1, b_row_stride, b_num_rows, qk_scale, b_ok, b_data, b_scales, B_SLOTS,
            BN, HP, L_CODE, L_ROPE, L_MMA, ASYNC_PV, REG_A, False, L_ACC,
        )  # fmt: skip

    _ts, hs, row_ok = _rows(t, t + 1, heads_here, HP, HT, gl.SliceLayout(0, L_MMA))
    has_key = l_i > 0.0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse2 = gl.where(has_key, m_i + gl.log2(l_safe), float("-inf"))
    factor = gl.where(has_key, 1.0 / l_safe, 0.0)
    prow = row.to(gl.int64) * num_heads + h0
    gl.store(plse_ptr + prow + hs, lse2, mask=row_ok)
    factor = gl.convert_layout(factor, gl.SliceLayout(0, L_ACC))
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


def compiled_variants() -> int:
    """How many variants of the kernel this process has compiled (0: never built)."""
    caches = getattr(_decode_split_wgmma_kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
