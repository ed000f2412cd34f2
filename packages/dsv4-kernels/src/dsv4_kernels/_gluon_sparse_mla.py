# mypy: ignore-errors
"""Gluon (Triton's explicit-layout dialect) sparse MLA kernel for Hopper, 1 to 16 heads.

The Triton kernel of :mod:`._triton_sparse_mla` spends two thirds of its
instructions dequantising FP8 (twice: once per dot operand layout) and runs at
12.5% occupancy (docs/attention.md, run 6).  This kernel keeps the same contract
(FP8 pages, two sources, sink, lse without the sink) and reorganises the work
around Hopper's warpgroup MMA with the keys on the M dimension:

* one program (one warpgroup, 4 warps) per query token; heads padded to
  ``HP`` (8 or 16: wgmma's N) inside the kernel only;
* per tile of 64 keys (wgmma's M): gather each key's 7 x 64 FP8 codes, its 7
  scale bytes (one 8-byte word) and 64 bf16 rope values by slot, dequantise
  **once** and store the bf16 tile to one shared-memory buffer ``K [64, 512]``;
* ``S^T [64, HP] = K q^T`` (wgmma, B = q^T), online softmax down the key axis,
  ``P^T`` to shared memory, then ``O^T [512, HP] += K^T P^T`` (wgmma, A = the
  tile read transposed from shared memory): neither product pads the heads to 64;
* ``REG_A`` (the default at up to 8 heads): ``S`` takes each dequantised 64-column
  block straight from the registers that also store it, as wgmma's register A
  operand (the block's columns relabelled to that operand's layout, q's columns
  stored in the same order), so the tile is read from shared memory once, by
  ``P V``, not twice (run 11b: 1.04x at Flash TP8 C4A, 1.05x at C128A, 1.22x on
  SWA layers; without it ``S`` reads the tile from shared memory, faster at 16
  heads);
* ``IO_VEC``: q and out in 16-byte accesses where their strides allow;
* ``G`` > 1 (grouped rows: SWA-only and C128A layers): one program per ``G``
  consecutive tokens whose keys are one row (their leader's), ``G x HT`` MMA
  rows, each masked to its own token's columns: each key is loaded and
  dequantised once per group (docs/attention.md, "Grouped rows");
* the next tile's index entries are loaded before this tile's products; its
  bytes at the top of the next step, while ``ASYNC_PV`` lets this tile's
  ``P V`` product run (holding the bytes across the products was 10x slower,
  run 9), and two or three programs per multiprocessor overlap one program's
  gather with another's math.

CUDA sm_90 only (wgmma); the launcher in :mod:`._paged_keys` chooses it.  Gluon
has no interpreter: the CPU suite runs the Triton kernel, and the GPU tests run
both against the same references.

One module past 500 lines: the tile loop and its helpers, which the decode's split
kernel (:mod:`._gluon_decode`) imports, live beside the per-token kernel that is their
first user, so a change to the loop is read with the kernel it was measured in.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ._jit_layout import DATA_BYTES, HEAD_DIM, NOPE, QBLOCK, SCALE_BYTES
from ._triton_sparse_mla import RUNTIME_ARGS

# Every thread of the program waits here (``bar.sync``): ``thread_barrier`` up to
# Triton 3.6, renamed ``barrier`` by 3.9 (which dropped the old name).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# Keys per tile: wgmma's M.
BN = gl.constexpr(64)
# The gathered tile's registers: 16-byte rows of FP8 codes and bf16 values, 4 threads
# per 64-column block (the kernels' ``L_CODE`` and ``L_ROPE``, made for their warp
# count, as q's ``L_QW``); with REG_A rows as wgmma's accumulator rows, so the codes'
# registers relabel as its A operand (the rope takes the same layout).
L_CODE_REG_A = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 64],
    )
)


@gluon.jit
def _gather(
    src_ptr,
    idx_row_ptr,
    start,
    length,
    row_stride,
    num_rows,
    SLOTS: gl.constexpr,
    BN: gl.constexpr,
    L_CODE: gl.constexpr,
    BLOCKS: gl.constexpr = False,
):
    """Pointers and validity of keys ``start .. start + BN`` of an index row (``BLOCKS``:
    of a block table's row, key ``c`` at slot ``row[c // SLOTS] * SLOTS + c % SLOTS``, a
    negative page id a hole; :class:`~dsv4_kernels.BlockRows`)."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, L_CODE))
    col = start + n
    if BLOCKS:
        page_id = gl.load(idx_row_ptr + col // SLOTS, mask=col < length, other=-1).to(gl.int64)
        idx = gl.where(page_id >= 0, page_id * SLOTS + col % SLOTS, -1)
    else:
        idx = gl.load(idx_row_ptr + col, mask=col < length, other=-1).to(gl.int64)
    ok = (idx >= 0) & (idx < num_rows)
    page = idx // SLOTS
    in_page = idx % SLOTS
    base = page * row_stride
    data = src_ptr + gl.multiple_of(base + in_page * DATA_BYTES, 16)
    scales = src_ptr + gl.multiple_of(base + SLOTS * DATA_BYTES + in_page * SCALE_BYTES, 8)
    return ok, data, scales


@gluon.jit
def _load_tile(
    ok,
    data,
    scales,
    L_CODE: gl.constexpr,
    L_ROPE: gl.constexpr,
):
    """The tile's raw bytes: seven ``[BN, 64]`` uint8 code blocks, the ``[BN]`` int64
    words of scale bytes and the ``[BN, 64]`` bf16 rope values."""
    e = gl.arange(0, QBLOCK, layout=gl.SliceLayout(0, L_CODE))
    m2 = gl.expand_dims(ok, 1)
    p2 = gl.expand_dims(data, 1) + gl.expand_dims(e, 0)
    c0 = gl.load(p2, mask=m2, other=0)
    c1 = gl.load(p2 + QBLOCK, mask=m2, other=0)
    c2 = gl.load(p2 + 2 * QBLOCK, mask=m2, other=0)
    c3 = gl.load(p2 + 3 * QBLOCK, mask=m2, other=0)
    c4 = gl.load(p2 + 4 * QBLOCK, mask=m2, other=0)
    c5 = gl.load(p2 + 5 * QBLOCK, mask=m2, other=0)
    c6 = gl.load(p2 + 6 * QBLOCK, mask=m2, other=0)
    # the seven scale bytes as one 8-byte word (byte 7 is padding)
    sb = gl.load(scales.to(gl.pointer_type(gl.int64)), mask=ok, other=0)
    ok_r = gl.convert_layout(ok, gl.SliceLayout(1, L_ROPE))
    data_r = gl.convert_layout(data, gl.SliceLayout(1, L_ROPE))
    er = gl.arange(0, QBLOCK, layout=gl.SliceLayout(0, L_ROPE))
    rope_ptr = (data_r + NOPE).to(gl.pointer_type(gl.bfloat16))
    rope = gl.load(
        gl.expand_dims(rope_ptr, 1) + gl.expand_dims(er, 0), mask=gl.expand_dims(ok_r, 1), other=0.0
    )
    return c0, c1, c2, c3, c4, c5, c6, sb, rope


@gluon.jit
def _block_bf16(codes, sb, b: gl.constexpr):
    """Code block ``b`` dequantised (``code * 2**(byte - 127)``, exact in bf16); ``sb``
    holds the key's scale bytes as one int64 (byte ``b`` = bits ``8 b .. 8 b + 8``)."""
    byte = ((sb >> (8 * b)) & 0xFF).to(gl.int32)
    scale = (byte << 23).to(gl.float32, bitcast=True)
    v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 1)
    return v.to(gl.bfloat16)


@gluon.jit
def _block_to_smem(codes, sb, b: gl.constexpr, k_smem):
    """Code block ``b`` dequantised into columns ``64 b .. 64 b + 64`` of the shared tile."""
    k_smem.slice(b * QBLOCK, QBLOCK, dim=1).store(_block_bf16(codes, sb, b))


@gluon.jit
def _as_a_operand(v, L_A: gl.constexpr):
    """A ``[BN, 64]`` block in the codes' register layout relabelled as wgmma's register
    A operand, without moving data: column ``c`` of the result is column
    ``c0 + 2 c3 + 4 c4 + 8 c5 + 16 c1 + 32 c2`` of ``v`` (``ci`` the bits of ``c``), the
    column each thread already holds in that register.  The contraction over the
    block's columns does not care about their order, so q's columns are stored in the
    same order (the same reshapes, in the kernel's prologue)."""
    x = gl.reshape(v, [v.shape[0], 2, 2, 2, 2, 2, 2])  # [BN, p5, p4, p3, p2, p1, p0]
    x = gl.permute(x, (0, 3, 4, 5, 1, 2, 6))  # [BN, p3, p2, p1, p5, p4, p0]
    return gl.convert_layout(gl.reshape(x, [v.shape[0], 64]), L_A)


@gluon.jit
def _qk_block(v, q_smem, b: gl.constexpr, s, prev, first: gl.constexpr, L_A: gl.constexpr):
    """Issue ``S += K_b q_b^T`` for block ``b`` with ``K_b`` from registers (async), after
    waiting for the block before (whose registers ``prev`` it keeps alive until then)."""
    a = _as_a_operand(v, L_A)
    qb = q_smem.slice(b * 64, 64, dim=1).permute((1, 0))
    s = warpgroup_mma(a, qb, s, use_acc=not first, is_async=True)
    if not first:
        prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
    return s, a


@gluon.jit
def _attend_source(
    acc,
    m_i,
    l_i,
    q_all,
    k_all,
    p_all,
    src_ptr,
    idx_row_ptr,
    lo,
    length,
    row_lo,
    row_hi,
    row_stride,
    num_rows,
    qk_scale,
    ok,
    data,
    scales,
    SLOTS: gl.constexpr,
    BN: gl.constexpr,
    HP: gl.constexpr,
    L_CODE: gl.constexpr,
    L_ROPE: gl.constexpr,
    L_MMA: gl.constexpr,
    ASYNC_PV: gl.constexpr,
    REG_A: gl.constexpr,
    PER_ROW: gl.constexpr,
    L_ACC: gl.constexpr,
    BLOCKS: gl.constexpr = False,
):
    """Online softmax over columns ``lo .. length`` of one key source (tiles of ``BN``
    keys), from the first tile's index entries as :func:`_gather` returns them (``ok``,
    ``data``, ``scales`` of columns ``lo .. lo + BN``: the caller issues that load, as
    early as it can).  With ``PER_ROW`` column ``j`` counts for row ``r`` (a token's head)
    only where ``row_lo[r] <= j < row_hi[r]``.  With ``ASYNC_PV`` the ``P V`` product of a
    tile runs while the next tile's bytes are loaded.  ``L_MMA`` is the layout of ``S^T``
    and ``L_ACC`` that of the accumulator ``O^T`` (the same with one warpgroup; with two,
    :mod:`._gluon_decode`'s wide head blocks, ``S^T`` splits the heads between them and
    ``O^T`` the 512 output columns)."""
    if ASYNC_PV:  # the loop carries the accumulator of an MMA in flight
        acc = warpgroup_mma_init(acc)
    for start in range(lo, length, BN):
        # The buffers are indexed by a zero the compiler cannot see through: the wgmma
        # descriptors then depend on the iteration and are not hoisted out of the loop
        # (64 of them, live across it, took every register and spilled).
        z = gl.inline_asm_elementwise(
            "mov.b32 $0, 0;", "=r,r", [start], dtype=gl.int32, is_pure=True, pack=1
        )
        k_smem = k_all.index(z)
        q_smem = q_all.index(z)
        p_smem = p_all.index(z)
        c0, c1, c2, c3, c4, c5, c6, sb, rope = _load_tile(ok, data, scales, L_CODE, L_ROPE)
        ok_s = gl.convert_layout(ok, gl.SliceLayout(1, L_MMA))
        # the next tile's index entries, the first of its two dependent loads, before this
        # tile's math (measured the same as after it: run 7)
        ok, data, scales = _gather(
            src_ptr, idx_row_ptr, start + BN, length, row_stride, num_rows, SLOTS, BN, L_CODE,
            BLOCKS,
        )  # fmt: skip
        if ASYNC_PV:  # the previous tile's P V must be done before its tile is overwritten
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()  # every warp is done reading the previous tile
        if REG_A:
            # each block to shared memory (for P V) and, from the same registers, into
            # S = K q^T as wgmma's register operand: S reads no shared memory
            L_A: gl.constexpr = gl.DotOperandLayout(0, L_MMA, 2)
            s = gl.zeros([BN, HP], gl.float32, layout=L_MMA)
            codes = (c0, c1, c2, c3, c4, c5, c6)
            v = _block_bf16(c0, sb, 0)
            k_smem.slice(0, QBLOCK, dim=1).store(v)
            s, a = _qk_block(v, q_smem, 0, s, v, True, L_A)
            for b in gl.static_range(1, 7):
                v = _block_bf16(codes[b], sb, b)
                k_smem.slice(b * QBLOCK, QBLOCK, dim=1).store(v)
                s, a = _qk_block(v, q_smem, b, s, a, False, L_A)
            k_smem.slice(NOPE, QBLOCK, dim=1).store(rope)
            s, a = _qk_block(rope, q_smem, 7, s, a, False, L_A)
            s, a = warpgroup_mma_wait(num_outstanding=0, deps=(s, a))
        else:
            codes = (c0, c1, c2, c3, c4, c5, c6)
            for b in gl.static_range(7):
                _block_to_smem(codes[b], sb, b, k_smem)
            k_smem.slice(NOPE, QBLOCK, dim=1).store(rope)
            fence_async_shared()
            _cta_barrier()
            s = gl.zeros([BN, HP], gl.float32, layout=L_MMA)
            s = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s, use_acc=False)
        live = gl.expand_dims(ok_s, 1)
        if PER_ROW:
            col = gl.expand_dims(start + gl.arange(0, BN, layout=gl.SliceLayout(1, L_MMA)), 1)
            live = live & (col >= gl.expand_dims(row_lo, 0)) & (col < gl.expand_dims(row_hi, 0))
        s = gl.where(live, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, L_ACC)), 0)
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(k_smem.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=ASYNC_PV)
        m_i = m_new
    if ASYNC_PV:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_i, l_i


@gluon.jit
def _rows(first, end, num_heads, HP: gl.constexpr, HT: gl.constexpr, layout: gl.constexpr):
    """The MMA rows' tokens and heads (row ``r``: token ``first + r // HT``, head ``r %
    HT``) and which rows are real (a head below ``num_heads`` of a token before ``end``)."""
    r = gl.arange(0, HP, layout=layout)
    tok = first + r // HT
    head = r % HT
    return tok, head, (head < num_heads) & (tok < end)


@gluon.jit
def _shared_buffers(HP: gl.constexpr):
    """A program's shared memory: the key tile ``K [BN, 512]``, ``q [HP, 512]`` and ``P^T
    [HP, BN]``.  Shared by this kernel and the decode's split kernel
    (:mod:`._gluon_decode`), which allocate them before anything else."""
    k_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [1, BN, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.bfloat16),
    )
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [1, HP, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([HP, HEAD_DIM], gl.bfloat16),
    )
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [1, HP, BN], gl.NVMMASharedLayout.get_default_for([HP, BN], gl.bfloat16)
    )
    return k_smem, q_smem, p_smem


@gluon.jit
def _stage_q(
    q_smem, q_ptr, first, end, num_heads, q_stride_t, q_stride_h,
    HP: gl.constexpr, HT: gl.constexpr, REG_A: gl.constexpr, IO_VEC: gl.constexpr,
    L_QW: gl.constexpr,
):  # fmt: skip
    """Store the q rows of tokens ``[first, end)`` (:func:`_rows`; 0 on padded rows) to
    ``q_smem``, fenced for wgmma and with every thread past the store; ``L_QW``: q's
    register layout as loaded (16-byte rows, one warp a row, each warp its rows)."""
    tq, hq, q_ok = _rows(first, end, num_heads, HP, HT, gl.SliceLayout(1, L_QW))
    q_row = tq * q_stride_t + hq.to(gl.int64) * q_stride_h
    if IO_VEC:  # strides of whole 16-byte vectors (the launcher checked): 16-byte accesses
        q_row = gl.multiple_of(q_row, 8)
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, L_QW))
    q = gl.load(
        q_ptr + gl.expand_dims(q_row, 1) + gl.expand_dims(dq, 0),
        mask=gl.expand_dims(q_ok, 1),
        other=0.0,
    )
    if REG_A:  # q's columns in the blocks' relabelled order (as :func:`_as_a_operand`)
        q = gl.reshape(q, [HP, 8, 2, 2, 2, 2, 2, 2])  # [HP, block, p5, p4, p3, p2, p1, p0]
        q = gl.reshape(gl.permute(q, (0, 1, 4, 5, 6, 2, 3, 7)), [HP, HEAD_DIM])
    q_smem.index(0).store(q)
    fence_async_shared()  # q is read by wgmma (the async proxy) from the first tile on
    _cta_barrier()


@gluon.jit
def _row_range(len_ptr, start_ptr, width, tok, row_ok,
               HAS_LENS: gl.constexpr, HAS_STARTS: gl.constexpr):  # fmt: skip
    """Per row (a token's head): the source columns ``[lo, hi)`` its token reads."""
    hi = gl.zeros_like(tok) + width
    if HAS_LENS:
        hi = gl.minimum(gl.load(len_ptr + tok, mask=row_ok, other=0), width)
    lo = gl.zeros_like(tok)
    if HAS_STARTS:
        lo = gl.load(start_ptr + tok, mask=row_ok, other=0)
        hi = gl.minimum(lo + hi, width)
    return gl.where(row_ok, lo, width), gl.where(row_ok, hi, 0)


@gluon.jit
def _block_row(req_ptr, token, BLOCKS: gl.constexpr):
    """The row of a source's index rows that ``token`` reads: its own, or with ``BLOCKS``
    its request's row of the block table (``req_ptr[token]``)."""
    row = token
    if BLOCKS:
        row = gl.load(req_ptr + token).to(gl.int64)
    return row


@gluon.jit(do_not_specialize=[*RUNTIME_ARGS, "lead_ptr", "a_start_ptr", "b_start_ptr"])
def _sparse_mla_wgmma_kernel(
    q_ptr, out_ptr, lse_ptr, sink_ptr,
    a_src_ptr, a_idx_ptr, a_len_ptr, b_src_ptr, b_idx_ptr, b_len_ptr,
    num_tokens, num_heads,
    a_idx_stride, a_width, a_row_stride, a_num_rows,
    b_idx_stride, b_width, b_row_stride, b_num_rows,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, lse_stride_t,
    qk_scale,
    lead_ptr, a_start_ptr, b_start_ptr,
    A_SLOTS: gl.constexpr, A_HAS_LENS: gl.constexpr, HAS_B: gl.constexpr,
    B_SLOTS: gl.constexpr, B_HAS_LENS: gl.constexpr, HAS_SINK: gl.constexpr,
    HT: gl.constexpr, ASYNC_PV: gl.constexpr, REG_A: gl.constexpr, IO_VEC: gl.constexpr,
    G: gl.constexpr = 1, A_HAS_STARTS: gl.constexpr = False,
    B_HAS_STARTS: gl.constexpr = False, WG: gl.constexpr = 1, HBLOCKS: gl.constexpr = 1,
    b_req_ptr=None, B_BLOCKS: gl.constexpr = False,
):  # fmt: skip
    """One program per query token (``G == 1``) or per ``G`` consecutive tokens that share
    key rows: token ``t`` reads the rows of token ``lead_ptr[t]`` (its leader, at or
    after ``t``'s group's first token), columns ``[start[t], start[t] + len[t])``, so
    each key is loaded and dequantised once for all of them.  MMA rows: ``G`` tokens x
    ``HT`` heads.  ``HBLOCKS`` > 1 (``G == 1``): one program per (token, block of ``HT``
    heads), the block fastest; ``WG == 2``: two warpgroups (wide blocks of 32 or 64
    heads, DP attention: ``S^T`` splits the heads between them, ``O^T`` the 512 output
    columns; each key tile is dequantised once for the block)."""
    HP: gl.constexpr = G * HT
    W: gl.constexpr = 4 * WG  # warps
    L_CODE: gl.constexpr = (
        L_CODE_REG_A if REG_A else gl.BlockedLayout([1, 16], [8, 4], [W, 1], [1, 0])
    )
    L_ROPE: gl.constexpr = (
        L_CODE_REG_A if REG_A else gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    )
    L_QW: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [W, 1], [1, 0])
    L_OUT: gl.constexpr = gl.BlockedLayout([8 // WG, 1], [32, 1], [W, 1], [0, 1])
    L_MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, HP // WG, 16]
    )
    L_ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, HP, 16]
    )
    k_smem, q_smem, p_smem = _shared_buffers(HP)
    pid = gl.program_id(0)
    if HBLOCKS > 1:  # this program's heads: its block's, as if the call had only those
        h0 = (pid % HBLOCKS) * HT
        pid = pid // HBLOCKS
        q_ptr = q_ptr + h0.to(gl.int64) * q_stride_h
        out_ptr = out_ptr + h0.to(gl.int64) * out_stride_h
        lse_ptr = lse_ptr + h0
        sink_ptr = sink_ptr + h0
        num_heads = gl.minimum(num_heads - h0, HT)
    first = pid.to(gl.int64) * G
    end = gl.minimum(first + G, num_tokens)
    _stage_q(q_smem, q_ptr, first, end, num_heads, q_stride_t, q_stride_h, HP, HT, REG_A, IO_VEC,
             L_QW)  # fmt: skip

    m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_MMA))
    l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, L_MMA))
    acc = gl.zeros([HEAD_DIM, HP], gl.float32, layout=L_ACC)

    if G == 1:  # one token: its length (scalars only; nothing more lives across the loop)
        a_end = a_width
        if A_HAS_LENS:
            a_end = gl.minimum(gl.load(a_len_ptr + first), a_width)
        a_row = a_idx_ptr + first * a_idx_stride
        ok, data, scales = _gather(a_src_ptr, a_row, 0, a_end, a_row_stride, a_num_rows,
                                   A_SLOTS, BN, L_CODE)  # fmt: skip
        acc, m_i, l_i = _attend_source(
            acc, m_i, l_i, q_smem, k_smem, p_smem, a_src_ptr, a_row, 0, a_end, a_end, a_end,
            a_row_stride, a_num_rows, qk_scale, ok, data, scales, A_SLOTS, BN, HP, L_CODE,
            L_ROPE, L_MMA, ASYNC_PV, REG_A, False, L_ACC,
        )  # fmt: skip
        if HAS_B:
            b_end = b_width
            if B_HAS_LENS:
                b_end = gl.minimum(gl.load(b_len_ptr + first), b_width)
            b_row = b_idx_ptr + _block_row(b_req_ptr, first, B_BLOCKS) * b_idx_stride
            ok, data, scales = _gather(b_src_ptr, b_row, 0, b_end, b_row_stride, b_num_rows,
                                       B_SLOTS, BN, L_CODE, B_BLOCKS)  # fmt: skip
            acc, m_i, l_i = _attend_source(
                acc, m_i, l_i, q_smem, k_smem, p_smem, b_src_ptr, b_row, 0, b_end, b_end, b_end,
                b_row_stride, b_num_rows, qk_scale, ok, data, scales, B_SLOTS, BN, HP,
                L_CODE, L_ROPE, L_MMA, ASYNC_PV, REG_A, False, L_ACC, B_BLOCKS,
            )  # fmt: skip
    else:
        # One pass per leader among the group's tokens (one, unless a request starts
        # inside the group): the leader's rows, each MMA row restricted to its own
        # token's columns and to the tokens this leader leads (other rows see only
        # -inf scores in the pass, which leaves their softmax state as it was).
        ts, hs, row_ok = _rows(first, end, num_heads, HP, HT, gl.SliceLayout(0, L_MMA))
        lead = gl.load(lead_ptr + ts, mask=row_ok, other=-1)
        for g in range(G):
            leader = first + g
            if gl.load(lead_ptr + leader, mask=leader < end, other=-1) == leader:
                mine = row_ok & (lead == leader)
                a_lo, a_hi = _row_range(a_len_ptr, a_start_ptr, a_width, ts, mine, A_HAS_LENS,
                                        A_HAS_STARTS)  # fmt: skip
                a_row = a_idx_ptr + leader * a_idx_stride
                a0 = gl.min(a_lo, axis=0)
                a1 = gl.max(a_hi, axis=0)
                ok, data, scales = _gather(a_src_ptr, a_row, a0, a1, a_row_stride, a_num_rows,
                                           A_SLOTS, BN, L_CODE)  # fmt: skip
                acc, m_i, l_i = _attend_source(
                    acc, m_i, l_i, q_smem, k_smem, p_smem, a_src_ptr, a_row, a0, a1, a_lo,
                    a_hi, a_row_stride, a_num_rows, qk_scale, ok, data, scales, A_SLOTS, BN,
                    HP, L_CODE, L_ROPE, L_MMA, ASYNC_PV, REG_A, True, L_ACC,
                )  # fmt: skip
                if HAS_B:
                    b_lo, b_hi = _row_range(b_len_ptr, b_start_ptr, b_width, ts, mine,
                                            B_HAS_LENS, B_HAS_STARTS)  # fmt: skip
                    b_row = b_idx_ptr + _block_row(b_req_ptr, leader, B_BLOCKS) * b_idx_stride
                    b0 = gl.min(b_lo, axis=0)
                    b1 = gl.max(b_hi, axis=0)
                    ok, data, scales = _gather(b_src_ptr, b_row, b0, b1, b_row_stride,
                                               b_num_rows, B_SLOTS, BN, L_CODE,
                                               B_BLOCKS)  # fmt: skip
                    acc, m_i, l_i = _attend_source(
                        acc, m_i, l_i, q_smem, k_smem, p_smem, b_src_ptr, b_row, b0, b1, b_lo,
                        b_hi, b_row_stride, b_num_rows, qk_scale, ok, data, scales, B_SLOTS,
                        BN, HP, L_CODE, L_ROPE, L_MMA, ASYNC_PV, REG_A, True, L_ACC, B_BLOCKS,
                    )  # fmt: skip

    LN2: gl.constexpr = 0.6931471805599453
    LOG2E: gl.constexpr = 1.4426950408889634
    ts, hs, row_ok = _rows(first, end, num_heads, HP, HT, gl.SliceLayout(0, L_MMA))
    has_key = l_i > 0.0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse2 = gl.where(has_key, m_i, 0.0) + gl.log2(l_safe)
    factor = gl.where(has_key, 1.0 / l_safe, 0.0)
    if HAS_SINK:
        sink = gl.load(sink_ptr + hs, mask=row_ok, other=float("-inf"))
        factor = factor / (1.0 + gl.exp2(sink * LOG2E - lse2))
    lse = gl.where(has_key, lse2 * LN2, float("-inf"))
    gl.store(lse_ptr + ts * lse_stride_t + hs, lse, mask=row_ok)
    factor = gl.convert_layout(factor, gl.SliceLayout(0, L_ACC))
    o = gl.convert_layout((acc * gl.expand_dims(factor, 0)).to(gl.bfloat16), L_OUT)
    do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, L_OUT))
    to, ho, o_ok = _rows(first, end, num_heads, HP, HT, gl.SliceLayout(0, L_OUT))
    o_row = to * out_stride_t + ho.to(gl.int64) * out_stride_h
    if IO_VEC:
        o_row = gl.multiple_of(o_row, 8)
    gl.store(
        out_ptr + gl.expand_dims(o_row, 0) + gl.expand_dims(do, 1),
        o,
        mask=gl.expand_dims(o_ok, 0),
    )


def compiled_variants() -> int:
    """How many variants of the kernel this process has compiled (0: never built)."""
    caches = getattr(_sparse_mla_wgmma_kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())
