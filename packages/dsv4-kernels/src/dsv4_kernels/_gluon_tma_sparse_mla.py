# mypy: ignore-errors
"""Experiment (run 19): the wgmma sparse MLA kernel fed by tensor-map copies.

Run 16 and 18 showed the default kernel (:mod:`._gluon_sparse_mla`) bound by the L1
data pipe, about 1,070 of its 2,090 wavefronts per 64-key tile going to the gathers
(their data and the load path's writes into the L1 array, which no cache hint
removes).  Here the gathers bypass the load/store unit: one copier warp issues one
tensor-map copy (TMA) per key of its 576 code and rope bytes into a shared FP8
stage; the consumer warpgroup reads the stage (16-byte shared loads in the layout
the default kernel gathers with), dequantises, stores the bf16 tile and runs the
same products as the default kernel (``REG_A`` at 8 heads).

* The copies see the cache as 64-byte rows (two 2-D tensor maps over the whole cache:
  a slot's 576 code and rope bytes are a box of 8 rows and one of 1).  A hole or a slot
  beyond the cache is copied from past the map, which the copy fills with zeros (the
  full box still counts towards the barrier's bytes).  Shared destinations of tensor
  copies must be 128-byte aligned, so the 1-row boxes land on every other 64-byte row.
* The scale words are gathered by the consumer (8 bytes a key, below a copy's
  16-byte minimum).
* Persistent: ``grid`` programs of two streams, stream ``c`` of program ``p`` attends
  tokens ``2 p + c``, stepping ``2 grid``; one 40,960-byte stage per stream (``NST`` 1:
  two streams fill an SM's shared memory at 8 heads; at 16 heads they do not fit).
  384 threads (Gluon pads the workers to whole warpgroups) launch at 168 registers.

Measured on the H200 (run 19, docs/attention.md): correct on the sweep's checks and
4.5-9x slower than the default kernel (C4A Flash TP8 574 against 126 ns per token).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ._gluon_sparse_mla import _block_bf16, _qk_block, _rows
from ._triton_sparse_mla import RUNTIME_ARGS

BN = 64
ROWS64 = 9  # a slot's 576 code and rope bytes as 64-byte rows (8 + 1: box sides are powers of 2)


@gluon.jit
def _source_end(len_ptr, t, width, HAS_LENS: gl.constexpr):
    end = width
    if HAS_LENS:
        end = gl.minimum(gl.load(len_ptr + t), width)
    return end


@gluon.jit
def _copy_source(
    i, desc8, desc1, plane_a, plane_b, full, empty, idx_row_ptr, end, rs64, num_rows, oob_row,
    SLOTS: gl.constexpr, NST: gl.constexpr, PART: gl.constexpr, NCOPY: gl.constexpr,
):  # fmt: skip
    """Copier ``PART`` of ``NCOPY``: one tensor-map copy pair per key of its share of each
    64-key tile of one source (rows of 64 bytes: ``rs64`` per page, 9 per slot)."""
    K: gl.constexpr = 64 // NCOPY
    for start in range(0, end, 64):
        # every row of the tile first (independent loads in flight), then the copies
        rows = ()
        for j in gl.static_range(PART * K, PART * K + K):
            col = start + j
            idx = gl.load(idx_row_ptr + col, mask=col < end, other=-1)
            ok = (idx >= 0) & (idx < num_rows)
            row = gl.where(ok, (idx // SLOTS) * rs64 + (idx % SLOTS) * 9, oob_row)
            rows = rows + (row,)  # noqa: RUF005 (the Triton frontend has no unpacking)
        buf = i % NST
        mbarrier.wait(empty.index(buf), ((i // NST) & 1) ^ 1)
        mbarrier.expect(full.index(buf), K * 576)
        for j in gl.static_range(K):
            row = rows[j]
            tma.async_copy_global_to_shared(
                desc8,
                [row, 0],
                full.index(buf),
                plane_a.index(buf).slice((PART * K + j) * 8, 8, dim=0),
            )
            tma.async_copy_global_to_shared(
                desc1,
                [row + 8, 0],
                full.index(buf),
                plane_b.index(buf).slice((PART * K + j) * 2, 1, dim=0),
            )
        i += 1
    return i


@gluon.jit
def _copier(
    plane_a, plane_b, full, empty, a_desc8, a_desc1, b_desc8, b_desc1, a_idx_ptr, a_len_ptr,
    b_idx_ptr, b_len_ptr, num_tokens, a_idx_stride, a_width, a_rs64, a_num_rows, a_oob,
    b_idx_stride, b_width, b_rs64, b_num_rows, b_oob,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr, NST: gl.constexpr,
    C: gl.constexpr,
):  # fmt: skip
    i = 0
    for t in range(gl.program_id(0) * 2 + C, num_tokens, gl.num_programs(0) * 2):
        t64 = t.to(gl.int64)
        a_end = _source_end(a_len_ptr, t64, a_width, A_HAS_LENS)
        i = _copy_source(
            i, a_desc8, a_desc1, plane_a, plane_b, full, empty, a_idx_ptr + t64 * a_idx_stride,
            a_end, a_rs64, a_num_rows, a_oob, A_SLOTS, NST, 0, 1,
        )  # fmt: skip
        if HAS_B:
            b_end = _source_end(b_len_ptr, t64, b_width, B_HAS_LENS)
            i = _copy_source(
                i, b_desc8, b_desc1, plane_a, plane_b, full, empty,
                b_idx_ptr + t64 * b_idx_stride, b_end, b_rs64, b_num_rows, b_oob, B_SLOTS, NST,
                0, 1,
            )  # fmt: skip


@gluon.jit
def _consume_source(
    i, acc, m_i, l_i, plane_a, plane_b, full, empty, k_smem, q_smem, p_smem,
    src_ptr, idx_row_ptr, end, row_stride, num_rows, qk_scale,
    SLOTS: gl.constexpr, HP: gl.constexpr, NST: gl.constexpr,
    L_CODE: gl.constexpr, L_MMA: gl.constexpr, REG_A: gl.constexpr,
):  # fmt: skip
    """Online softmax over one source's tiles, their bytes from the copier's stages."""
    L_ST: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    L_R: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    acc = warpgroup_mma_init(acc)
    for start in range(0, end, 64):
        n = start + gl.arange(0, 64, layout=gl.SliceLayout(1, L_CODE))
        idx = gl.load(idx_row_ptr + n, mask=n < end, other=-1)
        ok = (idx >= 0) & (idx < num_rows)
        page = (idx // SLOTS).to(gl.int64)
        scales = src_ptr + page * row_stride + SLOTS * 576 + (idx % SLOTS) * 8
        sb = gl.load(scales.to(gl.pointer_type(gl.int64)), mask=ok, other=0)
        ok_s = gl.convert_layout(ok, gl.SliceLayout(1, L_MMA))
        buf = i % NST
        mbarrier.wait(full.index(buf), (i // NST) & 1)
        pa = plane_a.index(buf)._reinterpret(gl.uint8, [64, 512], L_ST)
        c0 = pa.slice(0, 64, dim=1).load(L_CODE)
        c1 = pa.slice(64, 64, dim=1).load(L_CODE)
        c2 = pa.slice(128, 64, dim=1).load(L_CODE)
        c3 = pa.slice(192, 64, dim=1).load(L_CODE)
        c4 = pa.slice(256, 64, dim=1).load(L_CODE)
        c5 = pa.slice(320, 64, dim=1).load(L_CODE)
        c6 = pa.slice(384, 64, dim=1).load(L_CODE)
        # the rope: its first 32 values end plane A's row, the other 32 are plane B's
        r0 = plane_a.index(buf)._reinterpret(gl.bfloat16, [64, 256], L_ST)
        r0 = r0.slice(224, 32, dim=1).load(L_R)
        r1 = plane_b.index(buf)._reinterpret(gl.bfloat16, [64, 64], L_ST)
        r1 = r1.slice(0, 32, dim=1).load(L_R)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # the tile before's P V
        gl.thread_barrier()  # every warp has read the stage and is done with the tile
        mbarrier.arrive(empty.index(buf), count=1)
        rope = gl.reshape(gl.permute(gl.join(r0, r1), (0, 2, 1)), [64, 64])
        k_smem.slice(448, 64, dim=1).store(rope)
        codes = (c0, c1, c2, c3, c4, c5, c6)
        if REG_A:  # blocks 0-6 from registers, the rope block from shared memory
            L_A: gl.constexpr = gl.DotOperandLayout(0, L_MMA, 2)
            s = gl.zeros([64, HP], gl.float32, layout=L_MMA)
            v = _block_bf16(c0, sb, 0)
            k_smem.slice(0, 64, dim=1).store(v)
            s, a = _qk_block(v, q_smem, 0, s, v, True, L_A)
            for b in gl.static_range(1, 7):
                v = _block_bf16(codes[b], sb, b)
                k_smem.slice(b * 64, 64, dim=1).store(v)
                s, a = _qk_block(v, q_smem, b, s, a, False, L_A)
            fence_async_shared()
            gl.thread_barrier()
            qr = q_smem.slice(448, 64, dim=1).permute((1, 0))
            s = warpgroup_mma(k_smem.slice(448, 64, dim=1), qr, s, is_async=True)
            s, a = warpgroup_mma_wait(num_outstanding=0, deps=(s, a))
        else:
            for b in gl.static_range(7):
                k_smem.slice(b * 64, 64, dim=1).store(_block_bf16(codes[b], sb, b))
            fence_async_shared()
            gl.thread_barrier()
            s = gl.zeros([64, HP], gl.float32, layout=L_MMA)
            s = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s, use_acc=False)
        s = gl.where(gl.expand_dims(ok_s, 1), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        acc = acc * gl.expand_dims(alpha, 0)
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        m_i = m_new
        i += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return i, acc, m_i, l_i


@gluon.jit
def _consumer(
    plane_a, plane_b, full, empty, k_smem, q_smem, p_smem,
    q_ptr, out_ptr, lse_ptr, sink_ptr, a_src_ptr, a_idx_ptr, a_len_ptr,
    b_src_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr, HAS_SINK: gl.constexpr,
    HP: gl.constexpr, NST: gl.constexpr, REG_A: gl.constexpr, C: gl.constexpr,
):  # fmt: skip
    L_CODE: gl.constexpr = (
        gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 64],
        )
        if REG_A
        else gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    )
    L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    L_Q7: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    L_MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16]
    )
    LN2: gl.constexpr = 0.6931471805599453
    LOG2E: gl.constexpr = 1.4426950408889634
    i = 0
    for t in range(gl.program_id(0) * 2 + C, num_tokens, gl.num_programs(0) * 2):
        t64 = t.to(gl.int64)
        tq, hq, q_ok = _rows(t64, t64 + 1, num_heads, HP, HP, gl.SliceLayout(1, L_Q))
        q_row = gl.multiple_of(tq * q_stride_t + hq.to(gl.int64) * q_stride_h, 8)
        dq = gl.arange(0, 512, layout=gl.SliceLayout(0, L_Q))
        q = gl.load(
            q_ptr + gl.expand_dims(q_row, 1) + gl.expand_dims(dq, 0),
            mask=gl.expand_dims(q_ok, 1),
            other=0.0,
        )
        if REG_A:  # blocks 0-6 of q in the relabelled order (as the default kernel)
            q = gl.reshape(q, [HP, 8, 2, 2, 2, 2, 2, 2])
            q = gl.reshape(gl.permute(q, (0, 1, 4, 5, 6, 2, 3, 7)), [HP, 512])
        gl.thread_barrier()  # the token before's products are done with q_smem
        q_smem.store(q)
        if REG_A:  # block 7 (the rope, read from shared memory by S) in its own order
            d7 = 448 + gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q7))
            tq7, hq7, q7_ok = _rows(t64, t64 + 1, num_heads, HP, HP, gl.SliceLayout(1, L_Q7))
            q7_row = tq7 * q_stride_t + hq7.to(gl.int64) * q_stride_h
            q7 = gl.load(
                q_ptr + gl.expand_dims(q7_row, 1) + gl.expand_dims(d7, 0),
                mask=gl.expand_dims(q7_ok, 1),
                other=0.0,
            )
            q_smem.slice(448, 64, dim=1).store(q7)
        fence_async_shared()
        gl.thread_barrier()
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_MMA))
        l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, L_MMA))
        acc = gl.zeros([512, HP], gl.float32, layout=L_MMA)
        a_end = _source_end(a_len_ptr, t64, a_width, A_HAS_LENS)
        i, acc, m_i, l_i = _consume_source(
            i, acc, m_i, l_i, plane_a, plane_b, full, empty, k_smem, q_smem, p_smem, a_src_ptr,
            a_idx_ptr + t64 * a_idx_stride, a_end, a_row_stride, a_num_rows, qk_scale,
            A_SLOTS, HP, NST, L_CODE, L_MMA, REG_A,
        )  # fmt: skip
        if HAS_B:
            b_end = _source_end(b_len_ptr, t64, b_width, B_HAS_LENS)
            i, acc, m_i, l_i = _consume_source(
                i, acc, m_i, l_i, plane_a, plane_b, full, empty, k_smem, q_smem, p_smem, b_src_ptr,
                b_idx_ptr + t64 * b_idx_stride, b_end, b_row_stride, b_num_rows, qk_scale,
                B_SLOTS, HP, NST, L_CODE, L_MMA, REG_A,
            )  # fmt: skip
        ts, hs, row_ok = _rows(t64, t64 + 1, num_heads, HP, HP, gl.SliceLayout(0, L_MMA))
        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        lse2 = gl.where(has_key, m_i, 0.0) + gl.log2(l_safe)
        factor = gl.where(has_key, 1.0 / l_safe, 0.0)
        if HAS_SINK:
            sink = gl.load(sink_ptr + hs, mask=row_ok, other=float("-inf"))
            factor = factor / (1.0 + gl.exp2(sink * LOG2E - lse2))
        lse = gl.where(has_key, lse2 * LN2, float("-inf"))
        gl.store(lse_ptr + ts * lse_stride_t + hs, lse, mask=row_ok)
        o = (acc * gl.expand_dims(factor, 0)).to(gl.bfloat16)  # stored from the MMA layout
        do = gl.arange(0, 512, layout=gl.SliceLayout(1, L_MMA))
        o_row = ts * out_stride_t + hs.to(gl.int64) * out_stride_h
        gl.store(
            out_ptr + gl.expand_dims(o_row, 0) + gl.expand_dims(do, 1),
            o,
            mask=gl.expand_dims(row_ok, 0),
        )


@gluon.jit(do_not_specialize=[*RUNTIME_ARGS, "a_rs64", "b_rs64", "a_oob", "b_oob"])
def _sparse_mla_tma_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t,
    qk_scale,
    a_desc8, a_desc1, b_desc8, b_desc1, a_rs64, b_rs64, a_oob, b_oob,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr, HAS_SINK: gl.constexpr,
    HT: gl.constexpr, NST: gl.constexpr, REG_A: gl.constexpr, COPIER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr = 168,
):  # fmt: skip
    HP: gl.constexpr = HT
    # two streams (tokens 2 p + c, stride 2 x grid), each with a copier warp, a consumer
    # warpgroup and its own buffers; per key: its first 512 bytes (codes, 32 rope values)
    # in plane A, the last 64 in plane B
    pa0 = gl.allocate_shared_memory(gl.uint8, [NST, 512, 64], gl.NVMMASharedLayout(0, 8))
    pb0 = gl.allocate_shared_memory(gl.uint8, [NST, 128, 64], gl.NVMMASharedLayout(0, 8))
    pa1 = gl.allocate_shared_memory(gl.uint8, [NST, 512, 64], gl.NVMMASharedLayout(0, 8))
    pb1 = gl.allocate_shared_memory(gl.uint8, [NST, 128, 64], gl.NVMMASharedLayout(0, 8))
    L_K: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    L_QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 512], gl.bfloat16)
    L_PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 64], gl.bfloat16)
    k0 = gl.allocate_shared_memory(gl.bfloat16, [64, 512], L_K)
    k1 = gl.allocate_shared_memory(gl.bfloat16, [64, 512], L_K)
    q0 = gl.allocate_shared_memory(gl.bfloat16, [HP, 512], L_QS)
    q1 = gl.allocate_shared_memory(gl.bfloat16, [HP, 512], L_QS)
    p0 = gl.allocate_shared_memory(gl.bfloat16, [HP, 64], L_PS)
    p1 = gl.allocate_shared_memory(gl.bfloat16, [HP, 64], L_PS)
    f0 = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    e0 = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    f1 = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    e1 = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NST):
        mbarrier.init(f0.index(b), count=1)
        mbarrier.init(e0.index(b), count=1)
        mbarrier.init(f1.index(b), count=1)
        mbarrier.init(e1.index(b), count=1)
    # fmt: off
    gl.warp_specialize(
        [(_consumer, (pa0, pb0, f0, e0, k0, q0, p0,
            q_ptr, out_ptr, lse_ptr, sink_ptr, a_src_ptr, a_idx_ptr, a_len_ptr,
            b_src_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
            a_idx_stride, a_width, a_row_stride, a_num_rows,
            b_idx_stride, b_width, b_row_stride, b_num_rows,
            q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
            A_SLOTS, A_HAS_LENS, HAS_B, B_SLOTS, B_HAS_LENS, HAS_SINK, HP, NST, REG_A, 0,
        )), (_consumer, (pa1, pb1, f1, e1, k1, q1, p1,
            q_ptr, out_ptr, lse_ptr, sink_ptr, a_src_ptr, a_idx_ptr, a_len_ptr,
            b_src_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
            a_idx_stride, a_width, a_row_stride, a_num_rows,
            b_idx_stride, b_width, b_row_stride, b_num_rows,
            q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
            A_SLOTS, A_HAS_LENS, HAS_B, B_SLOTS, B_HAS_LENS, HAS_SINK, HP, NST, REG_A, 1,
        )), (_copier, (pa0, pb0, f0, e0,
            a_desc8, a_desc1, b_desc8, b_desc1,
            a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr, num_tokens, a_idx_stride, a_width,
            a_rs64, a_num_rows, a_oob, b_idx_stride, b_width, b_rs64, b_num_rows, b_oob,
            A_SLOTS, A_HAS_LENS, HAS_B, B_SLOTS, B_HAS_LENS, NST, 0,
        )), (_copier, (pa1, pb1, f1, e1,
            a_desc8, a_desc1, b_desc8, b_desc1,
            a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr, num_tokens, a_idx_stride, a_width,
            a_rs64, a_num_rows, a_oob, b_idx_stride, b_width, b_rs64, b_num_rows, b_oob,
            A_SLOTS, A_HAS_LENS, HAS_B, B_SLOTS, B_HAS_LENS, NST, 1,
        ))],
        [4, 1, 1],
        [CONSUMER_REGS, COPIER_REGS, COPIER_REGS],
    )
    # fmt: on


def compiled_variants() -> int:
    caches = getattr(_sparse_mla_tma_kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
