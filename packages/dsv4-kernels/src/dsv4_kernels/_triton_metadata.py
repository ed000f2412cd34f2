"""Triton kernels for the sparse-attention metadata (launched from :mod:`.metadata`).

Design (both kernels):

* token-parallel: a program owns ``BLOCK_T`` tokens and one ``BLOCK_C``-wide
  column tile of their rows, so one long request and many short ones give the
  same amount of independent work;
* every output element is written exactly once, in the same launch (no
  separate ``-1`` fill);
* row offsets are 64-bit; sizes, offsets, M, N and the row width are run-time
  values excluded from specialisation, so they never compile a new kernel.
  Only model geometry (window, compress ratio, page size, tile sizes) is
  ``tl.constexpr``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_positions(
    qsl_ptr, seq_lens_ptr, toks, tok_ok, num_reqs, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr
):
    """``(req, seq_len, pos)`` of each query token ``toks`` (``[BLOCK_T]``, rows of
    ``query_start_loc``'s slice, which may start past 0): its request, that request's
    ``seq_len`` and the token's position in the sequence.

    The request is the number of request ends ``qsl[1..B] <= t + qsl[0]``, counted over
    tiles of ``BLOCK_R`` requests (one tile for typical batches); zero-length requests
    fall out naturally.  Tokens past ``tok_ok`` get request ``B - 1`` and zeros.
    """
    x = toks + tl.load(qsl_ptr)
    req = tl.zeros([BLOCK_T], dtype=tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + 1 + tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + r, mask=r <= num_reqs, other=2147483647)
        req += tl.sum((ends[None, :] <= x[:, None]).to(tl.int32), axis=1)
    req = tl.minimum(req, num_reqs - 1)
    q_start = tl.load(qsl_ptr + req, mask=tok_ok, other=0)
    q_end = tl.load(qsl_ptr + req + 1, mask=tok_ok, other=0)
    seq_len = tl.load(seq_lens_ptr + req, mask=tok_ok, other=0)
    return req, seq_len, seq_len - (q_end - q_start) + (x - q_start)


# Run-time arguments that must not be specialised on value (==1, %16) or on
# pointer alignment: changing them must not compile a new kernel.
COMBINE_RUNTIME_ARGS = [
    "qsl_ptr",
    "seq_lens_ptr",
    "gather_lens_ptr",
    "left_ptr",
    "right_ptr",
    "lens_ptr",
    "topk_stride_units",
    "num_tokens",
    "num_reqs",
    "topk",
    "row_tiles",
    "M",
    "N",
]


@triton.jit(do_not_specialize=COMBINE_RUNTIME_ARGS)
def _combine_topk_swa_indices_kernel(
    # pointers
    topk_ptr,  # [num_tokens, >= topk] int32 (unused when HAS_TOPK is False)
    qsl_ptr,  # [num_reqs + 1] int32, not rebased
    seq_lens_ptr,  # [num_reqs] int32
    gather_lens_ptr,  # [num_reqs] int32
    left_ptr,  # [num_tokens] int32 (HAS_IMAGES)
    right_ptr,  # [num_tokens] int32 (HAS_IMAGES)
    out_ptr,  # [num_tokens, row_tiles * ROW_ALIGN] int32
    lens_ptr,  # [num_tokens] int32
    # sizes and strides
    topk_stride_units,  # topk_indices.stride(0) // TOPK_ALIGN
    out_stride,
    num_tokens,
    num_reqs,
    topk,
    row_tiles,  # row width // ROW_ALIGN
    M,
    N,
    # meta-parameters
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_IMAGES: tl.constexpr,
    TOPK_ALIGN: tl.constexpr,  # 4 when top-k rows are 16-byte aligned and 4-divisible, else 1
    ROW_ALIGN: tl.constexpr,  # 128: combined rows are a multiple of this wide
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens

    req, seq_len, pos = token_positions(
        qsl_ptr, seq_lens_ptr, toks, tok_ok, num_reqs, BLOCK_T, BLOCK_R
    )
    gather_len = tl.load(gather_lens_ptr + req, mask=tok_ok, other=0)
    if RATIO > 0:
        topk_len = tl.minimum(tl.maximum((pos + 1) // RATIO, 0), topk)
    else:
        topk_len = tl.zeros([BLOCK_T], dtype=tl.int32)
    if HAS_IMAGES:
        left = tl.load(left_ptr + toks, mask=tok_ok, other=0)
        right = tl.load(right_ptr + toks, mask=tok_ok, other=0)
        swa_start = tl.maximum(pos - (WINDOW - 1) - tl.maximum(left - (WINDOW - 1), 0), 0)
        swa_len = tl.maximum(pos + right - swa_start + 1, 0)
    else:
        swa_start = tl.maximum(pos - (WINDOW - 1), 0)
        swa_len = tl.maximum(tl.minimum(pos + 1, WINDOW), 0)
    total = topk_len + swa_len
    if pid_c == 0:
        tl.store(lens_ptr + toks, total, mask=tok_ok)

    # Per-row constants, so each element costs a handful of int32 operations.
    # Output values are int32 (as vLLM's); row offsets are 64-bit.
    base = req * M
    swa_shift = base + N + swa_start - (seq_len - gather_len) - topk_len
    rows64 = toks.to(tl.int64)[:, None]
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    in_topk = c < topk_len[:, None]
    if HAS_TOPK:
        # Masks whose bounds are multiples of TOPK_ALIGN keep the loads 16 bytes
        # wide; the entries read past topk_len (fewer than TOPK_ALIGN, inside
        # the row) are discarded by the select below.
        read_len = (topk_len + (TOPK_ALIGN - 1)) // TOPK_ALIGN * TOPK_ALIGN
        read_len = tl.multiple_of(read_len, TOPK_ALIGN)
        topk_row = topk_ptr + rows64 * (topk_stride_units * TOPK_ALIGN)
        local = tl.load(topk_row + c, mask=(c < read_len[:, None]) & tok_ok[:, None], other=-1)
    else:
        local = c
    top = tl.where(local >= 0, base[:, None] + local, -1)
    value = tl.where(in_topk, top, tl.where(c < total[:, None], swa_shift[:, None] + c, -1))
    row_width = row_tiles * ROW_ALIGN
    tl.store(out_ptr + rows64 * out_stride + c, value, mask=tok_ok[:, None] & (c < row_width))


GLOBAL_RUNTIME_ARGS = [
    "req_ptr",
    "valid_ptr",
    "block_table_ptr",
    "lens_ptr",
    "num_tokens",
    "num_pages",
    "block_table_stride",
]


@triton.jit(do_not_specialize=GLOBAL_RUNTIME_ARGS)
def _global_topk_indices_kernel(
    # pointers
    topk_ptr,  # [num_tokens, K] int32, request-local compressed indices
    req_ptr,  # [num_tokens] int32
    valid_ptr,  # [num_tokens] bool / int
    block_table_ptr,  # [num_reqs, num_pages] int32
    out_ptr,  # [num_tokens, K] int32
    lens_ptr,  # [num_tokens] int32
    # sizes and strides
    topk_stride,
    out_stride,
    block_table_stride,
    num_tokens,
    num_pages,
    # meta-parameters
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    # The three per-token loads are independent (one round trip); only the
    # block-table reads wait for validity.
    valid_tok = tl.load(valid_ptr + toks, mask=tok_ok, other=0) != 0
    req = tl.load(req_ptr + toks, mask=tok_ok, other=0)
    rows64 = toks.to(tl.int64)[:, None]
    table_row = block_table_ptr + req.to(tl.int64)[:, None] * block_table_stride
    count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)[None, :]
        col_ok = c < K
        local = tl.load(
            topk_ptr + rows64 * topk_stride + c, mask=tok_ok[:, None] & col_ok, other=-1
        )
        local = tl.where(valid_tok[:, None], local, -1)
        # Unsigned: a negative entry wraps to a page far past the table, so one
        # comparison rejects negatives and pages past the table alike.
        ul = local.to(tl.uint32)
        page = ul // BLOCK_SIZE
        live = page < num_pages.to(tl.uint32)
        block = tl.load(table_row + page.to(tl.int32), mask=live, other=0)
        slot = block * BLOCK_SIZE + (ul % BLOCK_SIZE).to(tl.int32)
        tl.store(
            out_ptr + rows64 * out_stride + c,
            tl.where(live, slot, -1),
            mask=tok_ok[:, None] & col_ok,
        )
        count += tl.sum(live.to(tl.int32), axis=1)
    tl.store(lens_ptr + toks, count, mask=tok_ok)
