"""Triton kernels of the decode lightning indexer (launched from :mod:`.indexer`).

Two launches, the first version (correct on every shape; tiles and the split not yet
tuned on a GPU), plus the merge of a key-split step (issue 40):

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
* Key shards (``shard`` of ``shards``): each row scores only its share of its request's
  entries, ``[n * shard // shards, n * (shard + 1) // shards)``, and the top-k writes
  their request-local positions and, with ``SCORES``, the scores beside them: a shard's
  candidates.  :func:`_merge_topk_kernel` selects each row's top-k of all shards'
  candidates (gathered rank-major) by the same select, the entry an index instead of a
  position: exact, since the top-k of a union is the top-k of the parts' top-ks and the
  candidates tied with the k-th score sit in position order (each shard lists its
  tied entries lowest position first, and the shards' ranges ascend).

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
    "row_offset",
    "shard",
    "shards",
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
    row_offset,  # row t of the inputs is row row_offset + t of the step (a row shard)
    shard,  # this program scores its row's key share ``shard`` of ``shards``
    shards,
):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    full = tl.load(lens_ptr + t)
    lo = full * shard // shards
    n = full * (shard + 1) // shards - lo
    j0 = nb * BLOCK_N
    if j0 >= n:
        return
    if ROW_REQ:
        req = tl.load(row_req_ptr + t).to(tl.int64)
    else:
        req = (t + row_offset) // rows_per_request
    j = j0 + tl.arange(0, BLOCK_N)  # in the share; its position lo + j
    ok = j < n
    pos = lo + j
    page = tl.load(table_ptr + req * table_stride + pos // ENTRIES, mask=ok, other=0).to(tl.int64)
    e = (pos % ENTRIES).to(tl.int64)
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


@triton.jit
def _candidates(row, j, n, K, rank_stride, GATHER: tl.constexpr):
    """(order keys, validity, entries, scores) at places ``j`` of a row.  A row of scores
    (``row``: float32): place j is position j.  Gathered candidates (``GATHER``, ``row``:
    int32): place j is slot ``j % K`` of shard ``j // K``, its entry at the slot and its
    score's bits ``K`` further; entries < 0 are no candidate."""
    inb = j < n
    if GATHER:
        at = (j // K).to(tl.int64) * rank_stride + j % K
        entry = tl.load(row + at, mask=inb, other=-1)
        valid = inb & (entry >= 0)
        s = tl.load((row + K + at).to(tl.pointer_type(tl.float32), bitcast=True), mask=valid,
                    other=0.0)  # fmt: skip
    else:
        valid = inb
        entry = j.to(tl.int32)
        s = tl.load(row + j, mask=valid, other=0.0)
    return _order_key(s), valid, entry, s


@triton.jit
def _select_topk(
    row, n, topk, K, rank_stride, out, out_scores, base,
    BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr, GATHER: tl.constexpr, SCORES: tl.constexpr,
):  # fmt: skip
    """Write a row's ``topk`` highest candidates (entries + ``base``; their scores too
    with ``SCORES``) to ``out``: every valid one in place order when at most ``topk``
    are valid, then -1; else those above the k-th largest key (a radix select over the
    scores' order keys, four 8-bit passes of histograms) in place order, then as many
    ties of it as fit, lowest place first."""
    offs = tl.arange(0, BLOCK)
    count = n
    if GATHER:
        count = tl.full([], 0, tl.int32)
        for start in range(0, n, BLOCK):
            _, valid, _, _ = _candidates(row, start + offs, n, K, rank_stride, GATHER)
            count += tl.sum(valid.to(tl.int32), axis=0)
    if count <= topk:  # every valid candidate, in place order, then -1
        written = tl.full([], 0, tl.int32)
        for start in range(0, n, BLOCK):
            _, valid, entry, s = _candidates(row, start + offs, n, K, rank_stride, GATHER)
            at = written + tl.cumsum(valid.to(tl.int32), axis=0) - 1
            tl.store(out + at, entry + base, mask=valid)
            if SCORES:
                tl.store(out_scores + at, s, mask=valid)
            written += tl.sum(valid.to(tl.int32), axis=0)
        for o in range(0, topk, OUT_BLOCK):
            c = o + tl.arange(0, OUT_BLOCK)
            pad = (c >= count) & (c < topk)
            tl.store(out + c, tl.full([OUT_BLOCK], -1, tl.int32), mask=pad)
            if SCORES:
                tl.store(out_scores + c, tl.full([OUT_BLOCK], float("-inf"), tl.float32),
                         mask=pad)  # fmt: skip
        return
    # radix select of the topk-th largest key, 8 bits a pass from the top
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)
    remaining = topk
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            key, valid, _, _ = _candidates(row, start + offs, n, K, rank_stride, GATHER)
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
        key, valid, entry, s = _candidates(row, start + offs, n, K, rank_stride, GATHER)
        take = valid & (key > prefix)
        at = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out + at, entry + base, mask=take)
        if SCORES:
            tl.store(out_scores + at, s, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
    ties = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK):
        key, valid, entry, s = _candidates(row, start + offs, n, K, rank_stride, GATHER)
        tie = valid & (key == prefix)
        rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = tie & (rank < remaining)
        tl.store(out + written + rank, entry + base, mask=keep)
        if SCORES:
            tl.store(out_scores + written + rank, s, mask=keep)
        ties += tl.sum(tie.to(tl.int32), axis=0)


TOPK_RUNTIME_ARGS = [
    "lens_ptr",
    "scores_stride",
    "out_stride",
    "topk",
    "num_rows",
    "shard",
    "shards",
]


@triton.jit(do_not_specialize=TOPK_RUNTIME_ARGS)
def _row_topk_kernel(
    scores_ptr,  # [T, W] float32 (a row's share of scores from column 0)
    lens_ptr,  # [T] int32
    out_ptr,  # [T, >= topk] int32; with SCORES the scores' bits from column topk
    scores_stride,
    out_stride,
    topk,
    num_rows,  # rows with scores; programs past them write a row of -1
    shard,
    shards,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    SCORES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    full = tl.load(lens_ptr + t, mask=t < num_rows, other=0)
    lo = full * shard // shards
    n = full * (shard + 1) // shards - lo
    out = out_ptr + t * out_stride
    out_scores = (out + topk).to(tl.pointer_type(tl.float32), bitcast=True)
    _select_topk(scores_ptr + t * scores_stride, n, topk, 0, 0, out, out_scores, lo,
                 BLOCK, OUT_BLOCK, False, SCORES)  # fmt: skip


MERGE_RUNTIME_ARGS = ["cand_stride", "rank_stride", "out_stride", "topk", "num_rows", "shards"]


@triton.jit(do_not_specialize=MERGE_RUNTIME_ARGS)
def _merge_topk_kernel(
    cand_ptr,  # [shards * T', >= 2 * topk] int32: each shard's candidates, rank-major
    out_ptr,  # [T, >= topk] int32
    cand_stride,  # between a shard's rows
    rank_stride,  # between shards
    out_stride,
    topk,
    num_rows,  # rows with candidates; programs past them write a row of -1
    shards,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.where(t < num_rows, shards * topk, 0)
    _select_topk(cand_ptr + t * cand_stride, n, topk, topk, rank_stride,
                 out_ptr + t * out_stride, out_ptr, 0, BLOCK, OUT_BLOCK, True, False)  # fmt: skip
