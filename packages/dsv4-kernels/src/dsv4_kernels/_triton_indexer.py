"""Triton kernels of the decode lightning indexer (launched from :mod:`.indexer`).

Two launches, the first version (correct on every shape; tiles and the split not yet
tuned on a GPU):

* :func:`_index_scores_kernel`: one program per (query row, block of ``BLOCK_N``
  entries); it gathers the block's E4M3 codes and scales through the block table
  (vLLM's page layout: every entry's codes, then every entry's scale), computes
  ``q . k`` for all heads in one ``tl.dot``, applies relu, the head weights and the
  entry's scale, and stores the row's scores (float32) for its valid entries only.
* :func:`_row_topk_kernel`: one program per row: a radix select over the scores'
  order-preserving 32-bit keys (four 8-bit passes of histograms) finds the k-th largest
  key, then two passes write the positions above it and as many ties as fit, lowest
  position first, and -1 after a row's valid entries.  Rows with at most ``topk``
  entries skip the select; programs past the step's rows (``num_rows``: vLLM's padded
  tokens) write a row of -1.

Offsets are 64-bit; lengths, strides and counts are run-time values.
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORE_RUNTIME_ARGS = [
    "lens_ptr",
    "row_req_ptr",
    "table_stride",
    "page_stride",
    "q_stride_t",
    "q_stride_h",
    "w_stride_t",
    "scores_stride",
    "rows_per_request",
]


@triton.jit(do_not_specialize=SCORE_RUNTIME_ARGS)
def _index_scores_kernel(
    q_ptr,  # [T, H, D] float8_e4m3fn (as uint8)
    w_ptr,  # [T, H] float32
    cache_ptr,  # uint8 pages
    table_ptr,  # [B, P] int32
    lens_ptr,  # [T] int32
    row_req_ptr,  # [T] int32
    scores_ptr,  # [T, W] float32
    table_stride,
    page_stride,
    q_stride_t,
    q_stride_h,
    w_stride_t,
    scores_stride,
    H: tl.constexpr,
    HP: tl.constexpr,  # H padded to a power of two >= 16 (tl.dot's smallest M)
    D: tl.constexpr,
    ENTRIES: tl.constexpr,  # entries per page
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in float32 (Triton's interpreter; no FP8 dot there)
    ROW_REQ: tl.constexpr,  # the request of each row from row_req, else t // rows_per_request
    rows_per_request,
):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    n = tl.load(lens_ptr + t)
    j0 = nb * BLOCK_N
    if j0 >= n:
        return
    if ROW_REQ:
        req = tl.load(row_req_ptr + t).to(tl.int64)
    else:
        req = t // rows_per_request
    j = j0 + tl.arange(0, BLOCK_N)
    ok = j < n
    page = tl.load(table_ptr + req * table_stride + j // ENTRIES, mask=ok, other=0).to(tl.int64)
    e = (j % ENTRIES).to(tl.int64)
    base = page * page_stride
    d = tl.arange(0, D)
    codes = tl.load(cache_ptr + base[:, None] + e[:, None] * D + d[None, :], mask=ok[:, None])
    scale_at = base + ENTRIES * D + e * 4
    scale = tl.load(
        (cache_ptr + scale_at).to(tl.pointer_type(tl.float32), bitcast=True), mask=ok, other=0.0
    )
    h = tl.arange(0, HP)
    qb = tl.load(q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
                 mask=h[:, None] < H, other=0)  # fmt: skip
    k8 = codes.to(tl.float8e4nv, bitcast=True)
    q8 = qb.to(tl.float8e4nv, bitcast=True)
    if UPCAST:
        dots = tl.dot(q8.to(tl.float32), tl.trans(k8.to(tl.float32)))
    else:
        dots = tl.dot(q8, tl.trans(k8))
    w = tl.load(w_ptr + t * w_stride_t + h, mask=h < H, other=0.0)
    s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
    tl.store(scores_ptr + t * scores_stride + j, s, mask=ok)


@triton.jit
def _order_key(s):
    """Float32 scores as int64 keys in [0, 2^32) ordered as the scores."""
    bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    neg = (bits >> 31) == 1
    return tl.where(neg, 0xFFFFFFFF - bits, bits | 0x80000000)


TOPK_RUNTIME_ARGS = ["lens_ptr", "scores_stride", "out_stride", "topk", "num_rows"]


@triton.jit(do_not_specialize=TOPK_RUNTIME_ARGS)
def _row_topk_kernel(
    scores_ptr,  # [T, W] float32
    lens_ptr,  # [T] int32
    out_ptr,  # [T, >= topk] int32
    scores_stride,
    out_stride,
    topk,
    num_rows,  # rows with scores; programs past them write a row of -1
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t, mask=t < num_rows, other=0)
    row = scores_ptr + t * scores_stride
    out = out_ptr + t * out_stride
    offs = tl.arange(0, BLOCK)
    if n <= topk:  # every valid entry, in position order, then -1
        for o in range(0, topk, OUT_BLOCK):
            c = o + tl.arange(0, OUT_BLOCK)
            tl.store(out + c, tl.where(c < n, c, -1), mask=c < topk)
        return
    # radix select of the topk-th largest key, 8 bits a pass from the top
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)
    remaining = topk
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            j = start + offs
            valid = j < n
            key = _order_key(tl.load(row + j, mask=valid, other=0.0))
            if p == 0:
                match = valid
            else:
                match = valid & ((key >> (shift + 8)) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(tl.where(match, digit, 0), 256)
            # the unmatched went to bin 0: take them out again
            hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32), axis=0), 0)
        # the digit whose count from the top first reaches ``remaining``
        below = tl.cumsum(hist, axis=0) - hist  # keys of a smaller digit
        at_or_above = tl.sum(hist, axis=0) - below
        pick = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > pick, hist, 0), axis=0)
        remaining -= above
        prefix = (prefix << 8) | pick.to(tl.int64)
    # prefix: the topk-th largest key; ``remaining`` ties of it still to take
    written = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK):
        j = start + offs
        valid = j < n
        key = _order_key(tl.load(row + j, mask=valid, other=0.0))
        take = valid & (key > prefix)
        at = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out + at, j.to(tl.int32), mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
    ties = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK):
        j = start + offs
        valid = j < n
        key = _order_key(tl.load(row + j, mask=valid, other=0.0))
        tie = valid & (key == prefix)
        rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = tie & (rank < remaining)
        tl.store(out + written + rank, j.to(tl.int32), mask=keep)
        ties += tl.sum(tie.to(tl.int32), axis=0)
