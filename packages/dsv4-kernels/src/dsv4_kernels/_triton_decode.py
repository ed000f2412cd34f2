# mypy: allow-untyped-defs
"""Triton kernels of the split-key sparse MLA decode (launched from :mod:`._paged_keys`).

Decode steps have few query tokens, each with a few hundred to a few thousand
keys: one program per token (the prefill kernels) leaves most of the GPU idle
and walks a token's keys in sequence.  The decode splits each token's key list
(window columns, then compressed columns, as one list of ``a_width +
b_width`` columns) into ``num_splits`` chunks of ``chunk`` columns, chosen on
the host from the sizes alone, and runs one program per (token, chunk, head
block):

* :func:`_decode_split_kernel` attends over its chunk's columns with the same
  tile loop as the prefill kernel (:func:`._triton_sparse_mla._attend_source`:
  gather by slot, dequantise once, online softmax) and writes a partial result
  per (token, chunk, head): the chunk's normalised output ``o_s`` (float32)
  and its base-2 log-sum-exp ``lse2_s`` of the scaled scores (``-inf`` and a
  zero output for a chunk without a valid key).  The Gluon wgmma kernel of
  :mod:`._gluon_decode` writes the same partials on Hopper.
* :func:`_decode_combine_kernel` merges a (token, head)'s chunks:
  ``lse2 = log2 sum_s 2**lse2_s``, ``o = sum_s 2**(lse2_s - lse2) o_s``, then
  the sink (``o /= 1 + exp(sink - lse)``), and writes ``out`` (bf16) and
  ``lse`` (natural log, without the sink; ``-inf`` and ``out = 0`` for a token
  without a valid key).
* With ``PDL`` (Hopper and later) the combine is launched as a programmatic
  dependent of the split kernel: each split program signals once its partial is
  stored, and the combine waits (``griddepcontrol.wait``) for the split kernel's
  memory before it reads a partial.

Partial row ``r = t * num_splits + s`` holds ``num_heads`` heads: the partial
outputs are ``[rows, num_heads, 512]`` and the partial lse ``[rows,
num_heads]``, both float32 views of the caller's scratch.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton's grid dependency control (programmatic dependent launch)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older Triton: the decode never asks for PDL (decode._pdl_runs)
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

from ._jit_layout import HEAD_DIM
from ._triton_sparse_mla import SOURCE_RUNTIME_ARGS, _attend_source, _finish, _start_heads

SPLIT_RUNTIME_ARGS = [*SOURCE_RUNTIME_ARGS, "num_splits", "chunk"]


@triton.jit
def _chunk_range(lo, hi, offset, end):
    """Columns ``[lo, hi)`` of the concatenated list intersected with a source that
    occupies ``[offset, offset + width)`` of it and counts ``end`` columns: the source's
    own columns ``[c0, c1)`` (empty when ``c1 <= c0``)."""
    c0 = tl.minimum(tl.maximum(lo - offset, 0), end)
    c1 = tl.minimum(tl.maximum(hi - offset, 0), end)
    return c0, c1


@triton.jit(do_not_specialize=SPLIT_RUNTIME_ARGS)
def _decode_split_kernel(
    q_ptr,  # [T, H, 512] bf16
    po_ptr,  # [T * num_splits, H, 512] float32 partial outputs
    plse_ptr,  # [T * num_splits, H] float32 partial base-2 lse
    a_src_ptr,  # window pages (uint8)
    a_idx_ptr,  # [T, a_width] int32
    a_len_ptr,  # [T] int32 (unused unless A_HAS_LENS)
    b_src_ptr,  # compressed pages (unused unless HAS_B)
    b_idx_ptr,
    b_len_ptr,
    num_tokens,
    num_heads,
    num_splits,
    chunk,  # columns per split
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
    qk_scale,  # scale * log2(e)
    A_SLOTS: tl.constexpr,
    A_HAS_LENS: tl.constexpr,
    HAS_B: tl.constexpr,
    B_SLOTS: tl.constexpr,
    B_HAS_LENS: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    BF16_DEQUANT: tl.constexpr,
    PDL: tl.constexpr,  # the combine is a programmatic dependent launch of this kernel
):
    pid = tl.program_id(0)
    hb = pid % HEAD_BLOCKS
    row = pid // HEAD_BLOCKS  # t * num_splits + s
    t = (row // num_splits).to(tl.int64)
    s = row % num_splits
    heads, h_ok, q, m_i, l_i, acc = _start_heads(
        q_ptr, t, hb, num_heads, q_stride_t, q_stride_h, BLOCK_H
    )

    lo = s * chunk
    hi = lo + chunk
    a_end = a_width
    if A_HAS_LENS:
        a_end = tl.maximum(tl.minimum(tl.load(a_len_ptr + t), a_width), 0)
    a0, a1 = _chunk_range(lo, hi, 0, a_end)
    acc, m_i, l_i = _attend_source(
        acc, m_i, l_i, q, a_src_ptr, a_idx_ptr + t * a_idx_stride + a0, tl.maximum(a1 - a0, 0),
        a_row_stride, a_num_rows, qk_scale, A_SLOTS, True, ALIGNED, BLOCK_N, DOT_FP32, PREFETCH,
        BF16_DEQUANT,
    )  # fmt: skip
    if HAS_B:
        b_end = b_width
        if B_HAS_LENS:
            b_end = tl.maximum(tl.minimum(tl.load(b_len_ptr + t), b_width), 0)
        b0, b1 = _chunk_range(lo, hi, a_width, b_end)
        acc, m_i, l_i = _attend_source(
            acc, m_i, l_i, q, b_src_ptr, b_idx_ptr + t * b_idx_stride + b0,
            tl.maximum(b1 - b0, 0), b_row_stride, b_num_rows, qk_scale, B_SLOTS, True, ALIGNED,
            BLOCK_N, DOT_FP32,
            PREFETCH, BF16_DEQUANT,
        )  # fmt: skip

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse2 = tl.where(has_key, m_i + tl.log2(l_safe), float("-inf"))
    o = acc * tl.where(has_key, 1.0 / l_safe, 0.0)[:, None]
    prow = row.to(tl.int64) * num_heads + heads
    d = tl.arange(0, HEAD_DIM)
    tl.store(po_ptr + prow[:, None] * HEAD_DIM + d[None, :], o, mask=h_ok[:, None])
    tl.store(plse_ptr + prow, lse2, mask=h_ok)
    if PDL:  # this program's partial is stored: the combine may start launching
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_heads", "num_splits", "out_stride_t", "out_stride_h",
                               "lse_stride_t"])  # fmt: skip
def _decode_combine_kernel(
    po_ptr,  # [T * num_splits, H, 512] float32
    plse_ptr,  # [T * num_splits, H] float32 (base 2)
    out_ptr,  # [T, H, 512] bf16
    lse_ptr,  # [T, H] float32
    sink_ptr,  # [H] float32 (unused unless HAS_SINK)
    num_heads,
    num_splits,
    out_stride_t,
    out_stride_h,
    lse_stride_t,
    HAS_SINK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,  # partials merged per step
    PDL: tl.constexpr,  # launched as a programmatic dependent of the split kernel
):
    """One program per (token, head): merge its ``num_splits`` partials."""
    if PDL:  # wait for the split kernel's partials (it signals once each is stored)
        gdc_wait()
    pid = tl.program_id(0)
    t = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    d = tl.arange(0, HEAD_DIM)
    m = tl.full((1,), float("-inf"), tl.float32)
    l_sum = tl.zeros((1,), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        sp = s0 + tl.arange(0, SPLIT_BLOCK)
        prow = (t * num_splits + sp) * num_heads + h
        lse_s = tl.load(plse_ptr + prow, mask=sp < num_splits, other=float("-inf"))
        live = lse_s > float("-inf")
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.where(live, tl.exp2(lse_s - m_use), 0.0)
        # not masked by the lse: a chunk without keys stored a zero output, so both loads
        # are in flight at once (one trip to L2, not two)
        o = tl.load(po_ptr + prow[:, None] * HEAD_DIM + d[None, :],
                    mask=(sp < num_splits)[:, None], other=0.0)  # fmt: skip
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        l_sum = l_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    hv = h + tl.zeros((1,), tl.int32)
    factor, lse = _finish(m, l_sum, sink_ptr, hv, True, HAS_SINK)
    o = acc * tl.sum(factor, axis=0)
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + d, o.to(tl.bfloat16))
    tl.store(lse_ptr + t * lse_stride_t + hv, lse)
