"""Our own implementation of the upstream launch design, for the A/B in the benchmark.

Upstream (vLLM before and after the seed PR) fills the whole output with -1
in a separate pass, then launches a grid of (requests x NUM_WORKERS) programs;
each program walks its request's tokens ``w, w + NUM_WORKERS, ...`` one token
at a time, storing that token's top-k part and window part.  The seed PR
changed NUM_WORKERS from 128 to 256.  Written from that description; the
results are checked against the reference before timing like every provider.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.geometry import combined_width


@triton.jit
def _per_request_combine_kernel(
    out_ptr,
    out_stride,
    lens_ptr,
    topk_ptr,
    topk_stride,
    qsl_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    M,
    N,
    topk,
    NUM_WORKERS: tl.constexpr,
    TOPK_WIDTH: tl.constexpr,
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    HAS_TOPK: tl.constexpr,
):
    b = tl.program_id(0)
    w = tl.program_id(1)
    qs0 = tl.load(qsl_ptr)
    q_start = tl.load(qsl_ptr + b) - qs0
    q_end = tl.load(qsl_ptr + b + 1) - qs0
    seq_len = tl.load(seq_lens_ptr + b)
    gather_start = seq_len - tl.load(gather_lens_ptr + b)
    offs_k = tl.arange(0, TOPK_WIDTH)
    offs_w = tl.arange(0, WINDOW)
    for t in range(q_start + w, q_end, NUM_WORKERS):
        pos = seq_len - (q_end - q_start) + (t - q_start)
        if RATIO > 0:
            topk_len = tl.minimum(tl.maximum((pos + 1) // RATIO, 0), topk)
        else:
            topk_len = 0
        swa_len = tl.maximum(tl.minimum(pos + 1, WINDOW), 0)
        swa_start = tl.maximum(pos - (WINDOW - 1), 0)
        row = out_ptr + tl.cast(t, tl.int64) * out_stride
        if RATIO > 0:
            kmask = offs_k < topk_len
            if HAS_TOPK:
                local = tl.load(
                    topk_ptr + tl.cast(t, tl.int64) * topk_stride + offs_k, mask=kmask, other=-1
                )
            else:
                local = offs_k
            val = tl.where(local >= 0, local + M * b, -1)
            tl.store(row + offs_k, val, mask=kmask)
        tl.store(
            row + topk_len + offs_w,
            M * b + N + swa_start - gather_start + offs_w,
            mask=offs_w < swa_len,
        )
        tl.store(lens_ptr + t, topk_len + swa_len)


def combine_per_request_workers(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: torch.Tensor,
    lens: torch.Tensor,
    num_workers: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's design: fill ``out`` with -1, then a (requests x workers) grid.

    ``out`` is ``[num_tokens, combined_width(topk, window_size)]`` int32 and
    ``lens`` ``[num_tokens]`` int32 (upstream allocates the first with
    ``torch.full(-1)``; here the fill pass runs on the given buffer).
    """
    if out.shape[1] != combined_width(topk, window_size):
        raise ValueError(f"out must be {combined_width(topk, window_size)} wide, got {out.shape}")
    out.fill_(-1)
    ratio = compress_ratio if compress_ratio > 1 else 0
    has_topk = topk_indices is not None and topk > 0
    _per_request_combine_kernel[(seq_lens.shape[0], num_workers)](
        out,
        out.stride(0),
        lens,
        topk_indices if has_topk else out,
        topk_indices.stride(0) if has_topk else 0,  # type: ignore[union-attr]
        query_start_loc,
        seq_lens,
        gather_lens,
        M,
        N,
        topk if ratio else 0,
        NUM_WORKERS=num_workers,
        TOPK_WIDTH=triton.next_power_of_2(max(topk, 1)),
        WINDOW=window_size,
        RATIO=ratio,
        HAS_TOPK=has_topk,
    )
    return out, lens


@triton.jit
def _per_token_global_kernel(
    out_ptr, out_stride, lens_ptr, topk_ptr, topk_stride, req_ptr, table_ptr, table_stride,
    block_size, valid_ptr, K, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    req = tl.load(req_ptr + t)
    valid_tok = tl.load(valid_ptr + t)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < K
        local = tl.load(topk_ptr + t * topk_stride + offs, mask=in_row, other=-1)
        live = local >= 0
        page = local // block_size
        block = tl.load(table_ptr + req * table_stride + page, mask=in_row & live, other=0)
        slot = tl.where(live, block * block_size + local - page * block_size, -1)
        tl.store(out_ptr + t * out_stride + offs, slot, mask=in_row)
        count += live.to(tl.int32)
    tl.store(lens_ptr + t, tl.where(valid_tok != 0, tl.sum(count, axis=0), 0))


def global_per_token_program(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    out: torch.Tensor,
    lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's design: one program per token, a block of next_pow2(K) entries at a time.

    Writes ``out`` (shaped like ``topk_indices``) and ``lens`` ``[num_tokens]``.
    As upstream, it maps every entry of every token (padding tokens' rows too)
    and only zeroes their lengths; the benchmark checks it on all-valid batches.
    """
    num_tokens, k = topk_indices.shape
    _per_token_global_kernel[(num_tokens,)](
        out, out.stride(0), lens, topk_indices, topk_indices.stride(0), token_to_req_indices,
        block_table, block_table.stride(0), block_size, is_valid_token, k,
        BLOCK=min(1024, triton.next_power_of_2(k)),
    )  # fmt: skip
    return out, lens
