# mypy: ignore-errors
"""Warp-specialised Gluon sparse MLA kernel for Hopper, 1 to 16 heads, one token's rows each.

The kernel of :mod:`._gluon_sparse_mla` runs gather, dequantisation, ``S``,
softmax and ``P V`` as one chain per warpgroup and token, and is bound by that
chain's latency (docs/attention.md, "What limits the kernel now").  This one
splits the chain between partitions of one persistent program per
multiprocessor, linked by mbarriers:

* ``NP`` producer warpgroups gather each tile's 64 keys by slot, dequantise
  them **once** and store the bf16 tile ``K [64, 512]`` to one of ``NBUF``
  shared buffers (producer ``j`` fills tiles ``j, j + NP, ...`` of the
  program's sequence), then signal the buffer full;
* the consumer warpgroup (the default partition) waits for each tile, runs
  ``S^T [64, HP] = K q^T`` (wgmma, keys on M as in the other kernel), the
  online softmax and ``O^T += K^T P^T`` from the same buffer, and signals it
  empty once ``P V`` is done;
* the program walks tokens ``pid, pid + grid, ...`` and, per token, its two
  sources' tiles; every partition derives the same sequence from the lengths.

CUDA sm_90 only; the launcher in :mod:`.sparse_mla` chooses it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ._gluon_sparse_mla import _block_to_smem, _gather, _load_tile, _rows
from ._triton_sparse_mla import RUNTIME_ARGS

BN = 64  # keys per tile
D = 512
QB = 64
NOPE = 448


@gluon.jit
def _source_end(len_ptr, t, width, HAS_LENS: gl.constexpr):
    """Token ``t``'s key count in one source (its row's length, at most the width)."""
    end = width
    if HAS_LENS:
        end = gl.minimum(gl.load(len_ptr + t), width)
    return end


@gluon.jit
def _produce_source(
    i, j, k_bufs, full, empty, src_ptr, idx_row_ptr, end, row_stride, num_rows,
    SLOTS: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr,
    NP: gl.constexpr, NBUF: gl.constexpr, L_CODE: gl.constexpr, L_ROPE: gl.constexpr,
):  # fmt: skip
    """Fill this producer's tiles of one source (sequence numbers from ``i`` on)."""
    for start in range(0, end, 64):
        if i % NP == j:
            buf = i % NBUF
            mbarrier.wait(empty.index(buf), ((i // NBUF) & 1) ^ 1)
            ok, data, scales = _gather(
                src_ptr, idx_row_ptr, start, end, row_stride, num_rows, SLOTS, DATA_BYTES,
                SCALE_BYTES, 64, L_CODE,
            )  # fmt: skip
            c0, c1, c2, c3, c4, c5, c6, sb, rope = _load_tile(
                ok, data, scales, 64, 448, L_CODE, L_ROPE
            )
            k = k_bufs.index(buf)
            codes = (c0, c1, c2, c3, c4, c5, c6)
            for b in gl.static_range(7):
                _block_to_smem(codes[b], sb, b, k, 64)
            k.slice(448, 64, dim=1).store(rope)
            fence_async_shared()  # the generic stores before the consumer's wgmma reads
            mbarrier.arrive(full.index(buf), count=1)
        i += 1
    return i


@gluon.jit
def _producer(
    j: gl.constexpr, k_bufs, full, empty,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr, num_tokens,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr,
    DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr, NP: gl.constexpr, NBUF: gl.constexpr,
):  # fmt: skip
    L_CODE: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    L_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    i = 0
    for t in range(gl.program_id(0), num_tokens, gl.num_programs(0)):
        t64 = t.to(gl.int64)
        a_end = _source_end(a_len_ptr, t64, a_width, A_HAS_LENS)
        i = _produce_source(
            i, j, k_bufs, full, empty, a_src_ptr, a_idx_ptr + t64 * a_idx_stride, a_end,
            a_row_stride, a_num_rows, A_SLOTS, DATA_BYTES, SCALE_BYTES, NP, NBUF, L_CODE, L_ROPE,
        )  # fmt: skip
        if HAS_B:
            b_end = _source_end(b_len_ptr, t64, b_width, B_HAS_LENS)
            i = _produce_source(
                i, j, k_bufs, full, empty, b_src_ptr, b_idx_ptr + t64 * b_idx_stride, b_end,
                b_row_stride, b_num_rows, B_SLOTS, DATA_BYTES, SCALE_BYTES, NP, NBUF, L_CODE,
                L_ROPE,
            )  # fmt: skip


@gluon.jit
def _producer0(k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
               b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
               b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS: gl.constexpr,
               A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr, B_SLOTS: gl.constexpr,
               B_HAS_LENS: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr,
               NP: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    _producer(0, k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
              b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
              b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
              B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF)  # fmt: skip


@gluon.jit
def _producer1(k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
               b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
               b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS: gl.constexpr,
               A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr, B_SLOTS: gl.constexpr,
               B_HAS_LENS: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr,
               NP: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    _producer(1, k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
              b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
              b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
              B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF)  # fmt: skip


@gluon.jit
def _producer2(k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
               b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
               b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS: gl.constexpr,
               A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr, B_SLOTS: gl.constexpr,
               B_HAS_LENS: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr,
               NP: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
    _producer(2, k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
              b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
              b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
              B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF)  # fmt: skip


@gluon.jit
def _qk(k, q_smem, c: gl.constexpr, W: gl.constexpr, HP: gl.constexpr, L_MMA: gl.constexpr):
    """Issue ``S^T`` over columns ``c .. c + W`` of the tile (asynchronous)."""
    return warpgroup_mma(
        k.slice(c, W, dim=1),
        q_smem.slice(c, W, dim=1).permute((1, 0)),
        gl.zeros([64, HP], gl.float32, layout=L_MMA),
        use_acc=False,
        is_async=True,
    )


@gluon.jit
def _consume_source(
    i, acc, m_i, l_i, k_bufs, full, empty, q_smem, p_smem, idx_row_ptr, end, num_rows,
    qk_scale, HP: gl.constexpr, NBUF: gl.constexpr, L_MMA: gl.constexpr,
    SPLIT: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    """Online softmax over one source's tiles (sequence numbers from ``i`` on)."""
    if OVERLAP:
        acc = warpgroup_mma_init(acc)  # the loop carries an accumulator in flight
    for start in range(0, end, 64):
        n = start + gl.arange(0, 64, layout=gl.SliceLayout(1, L_MMA))
        idx = gl.load(idx_row_ptr + n, mask=n < end, other=-1)
        live = gl.expand_dims((idx >= 0) & (idx < num_rows), 1)
        buf = i % NBUF
        mbarrier.wait(full.index(buf), (i // NBUF) & 1)
        k = k_bufs.index(buf)
        if SPLIT == 2:
            s0 = _qk(k, q_smem, 0, 256, HP, L_MMA)
            s1 = _qk(k, q_smem, 256, 256, HP, L_MMA)
        else:
            s0 = _qk(k, q_smem, 0, 512, HP, L_MMA)
        if OVERLAP:  # the tile before (if any): its P V is done once SPLIT groups are left
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((i - 1) % NBUF), count=1, pred=start > 0)
        if SPLIT == 2:
            s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1))
            s = s0 + s1
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s0,))
        s = gl.where(live, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        acc = acc * gl.expand_dims(alpha, 0)
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(k.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        if not OVERLAP:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(buf), count=1)
        m_i = m_new
        i += 1
    if OVERLAP:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # the last tile's P V
        mbarrier.arrive(empty.index((i - 1) % NBUF), count=1, pred=end > 0)
    return i, acc, m_i, l_i


@gluon.jit
def _consumer(
    k_bufs, full, empty, q_smem, p_smem,
    q_ptr, out_ptr, lse_ptr, sink_ptr, a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads, a_idx_stride, a_width, a_num_rows,
    b_idx_stride, b_width, b_num_rows,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
    A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr, B_HAS_LENS: gl.constexpr,
    HAS_SINK: gl.constexpr, HP: gl.constexpr, NBUF: gl.constexpr, SPLIT: gl.constexpr,
    OVERLAP: gl.constexpr,
):  # fmt: skip
    L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    L_OUT: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [4, 1], [0, 1])
    L_MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16]
    )
    LN2: gl.constexpr = 0.6931471805599453
    LOG2E: gl.constexpr = 1.4426950408889634
    i = 0
    for t in range(gl.program_id(0), num_tokens, gl.num_programs(0)):
        t64 = t.to(gl.int64)
        tq, hq, q_ok = _rows(t64, t64 + 1, num_heads, HP, HP, gl.SliceLayout(1, L_Q))
        q_row = gl.multiple_of(tq * q_stride_t + hq.to(gl.int64) * q_stride_h, 8)
        dq = gl.arange(0, 512, layout=gl.SliceLayout(0, L_Q))
        q = gl.load(
            q_ptr + gl.expand_dims(q_row, 1) + gl.expand_dims(dq, 0),
            mask=gl.expand_dims(q_ok, 1),
            other=0.0,
        )
        gl.thread_barrier()  # every warp's S of the token before is done with q_smem
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_MMA))
        l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, L_MMA))
        acc = gl.zeros([512, HP], gl.float32, layout=L_MMA)
        a_end = _source_end(a_len_ptr, t64, a_width, A_HAS_LENS)
        i, acc, m_i, l_i = _consume_source(
            i, acc, m_i, l_i, k_bufs, full, empty, q_smem, p_smem,
            a_idx_ptr + t64 * a_idx_stride, a_end, a_num_rows, qk_scale, HP, NBUF, L_MMA,
            SPLIT, OVERLAP,
        )  # fmt: skip
        if HAS_B:
            b_end = _source_end(b_len_ptr, t64, b_width, B_HAS_LENS)
            i, acc, m_i, l_i = _consume_source(
                i, acc, m_i, l_i, k_bufs, full, empty, q_smem, p_smem,
                b_idx_ptr + t64 * b_idx_stride, b_end, b_num_rows, qk_scale, HP, NBUF, L_MMA,
                SPLIT, OVERLAP,
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
        o = gl.convert_layout((acc * gl.expand_dims(factor, 0)).to(gl.bfloat16), L_OUT)
        do = gl.arange(0, 512, layout=gl.SliceLayout(1, L_OUT))
        to, ho, o_ok = _rows(t64, t64 + 1, num_heads, HP, HP, gl.SliceLayout(0, L_OUT))
        o_row = gl.multiple_of(to * out_stride_t + ho.to(gl.int64) * out_stride_h, 8)
        gl.store(
            out_ptr + gl.expand_dims(o_row, 0) + gl.expand_dims(do, 1),
            o,
            mask=gl.expand_dims(o_ok, 0),
        )


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_mla_ws_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t,
    qk_scale,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr, HAS_SINK: gl.constexpr,
    DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr,
    HT: gl.constexpr, NP: gl.constexpr, NBUF: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    SPLIT: gl.constexpr = 1, OVERLAP: gl.constexpr = False,
):  # fmt: skip
    """Persistent: program ``pid`` attends tokens ``pid, pid + grid, ...`` (q and out
    strides whole 16-byte vectors: the launcher checks)."""
    HP: gl.constexpr = HT
    k_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [NBUF, 64, 512], gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    )
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [HP, 512], gl.NVMMASharedLayout.get_default_for([HP, 512], gl.bfloat16)
    )
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [HP, 64], gl.NVMMASharedLayout.get_default_for([HP, 64], gl.bfloat16)
    )
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NBUF):
        mbarrier.init(full.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
    # fmt: off
    # (the argument tuples are written out in each call: a tuple held in a variable
    # turns its constexprs into tensors)
    if NP == 1:
        gl.warp_specialize(
            [(_consumer, (
                k_bufs, full, empty, q_smem, p_smem, q_ptr, out_ptr, lse_ptr, sink_ptr,
                a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
                a_idx_stride, a_width, a_num_rows, b_idx_stride, b_width, b_num_rows,
                q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
                A_HAS_LENS, HAS_B, B_HAS_LENS, HAS_SINK, HP, NBUF, SPLIT, OVERLAP,
            )), (_producer0, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            ))],
            [4],
            [PRODUCER_REGS],
        )
    elif NP == 3:
        gl.warp_specialize(
            [(_consumer, (
                k_bufs, full, empty, q_smem, p_smem, q_ptr, out_ptr, lse_ptr, sink_ptr,
                a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
                a_idx_stride, a_width, a_num_rows, b_idx_stride, b_width, b_num_rows,
                q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
                A_HAS_LENS, HAS_B, B_HAS_LENS, HAS_SINK, HP, NBUF, SPLIT, OVERLAP,
            )), (_producer0, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            )), (_producer1, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            )), (_producer2, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            ))],
            [4, 4, 4],
            [PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS],
        )
    else:
        gl.static_assert(NP == 2, "one to three producer warpgroups")
        gl.warp_specialize(
            [(_consumer, (
                k_bufs, full, empty, q_smem, p_smem, q_ptr, out_ptr, lse_ptr, sink_ptr,
                a_idx_ptr, a_len_ptr, b_idx_ptr, b_len_ptr, num_tokens, num_heads,
                a_idx_stride, a_width, a_num_rows, b_idx_stride, b_width, b_num_rows,
                q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t, qk_scale,
                A_HAS_LENS, HAS_B, B_HAS_LENS, HAS_SINK, HP, NBUF, SPLIT, OVERLAP,
            )), (_producer0, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            )), (_producer1, (
                k_bufs, full, empty, a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr,
                b_len_ptr, num_tokens, a_idx_stride, a_width, a_row_stride, a_num_rows,
                b_idx_stride, b_width, b_row_stride, b_num_rows, A_SLOTS, A_HAS_LENS, HAS_B,
                B_SLOTS, B_HAS_LENS, DATA_BYTES, SCALE_BYTES, NP, NBUF,
            ))],
            [4, 4],
            [PRODUCER_REGS, PRODUCER_REGS],
        )

    # fmt: on


def compiled_variants() -> int:
    """How many variants of the kernel this process has compiled (0: never built)."""
    caches = getattr(_sparse_mla_ws_kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
