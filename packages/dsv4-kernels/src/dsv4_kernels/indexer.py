"""The lightning indexer's decode step over vLLM's paged FP8 index cache.

:func:`indexer_decode_topk` computes, for every query row (a decode token; MTP and
DSpark rows are rows of their own, each with its own length), the scores of its
request's compressed entries and writes the ``topk`` highest as request-local
positions into vLLM's top-k buffer, -1 after a row's valid entries: what vLLM 0.33
does with DeepGEMM's ``fp8_fp4_paged_mqa_logits`` and its top-k kernel
(``docs/design.md``, "The lightning indexer"; the semantics, ties included, are
:mod:`dsv4_kernels.reference.indexer`'s).  It never synchronises with the host and
allocates nothing when ``scores`` is given, so it can be captured in a CUDA graph.

This is the first version (issue 39): two launches, the scores through HBM; its tiles
and a fused or split design are for the GPU's profile to decide.
"""

from __future__ import annotations

import torch
import triton

from ._validation import (
    INDEX_DTYPES,
    check_min_length,
    check_nonnegative_int,
    check_positive_int,
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import INDEX_DIM, INDEX_ENTRY_BYTES

__all__ = ["indexer_decode_topk"]

BLOCK_N = 64  # entries per scores program (one C4A index page)
TOPK_BLOCK = 1024  # scores per step of the top-k passes
OUT_BLOCK = 256


def indexer_decode_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    row_req: torch.Tensor | None,
    block_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    *,
    max_entries: int,
    scores: torch.Tensor | None = None,
    rows_per_request: int = 1,
    clear_rows: int = 0,
) -> torch.Tensor:
    """The top-k entries of every row (module docstring), into ``out[:T, :topk]``.

    Args:
        q: ``[T, H, 128]`` float8_e4m3fn index queries (vLLM folds their scale into
            ``weights``); any row and head strides, unit last one.
        weights: ``[T, H]`` float32 head weights.
        cache: the index cache, ``[num_pages, entries, 132]`` uint8 (vLLM's view; any
            page stride).
        lens: ``[>= T]`` int32 valid entries of each row (at most ``max_entries``).
        row_req: ``[>= T]`` int32 the request (block-table row) of each row; None: row
            ``t`` belongs to request ``t // rows_per_request`` (vLLM's uniform decode
            batches: one block-table row per request, or per row where vLLM flattened).
        block_table: ``[B, pages]`` int32 index-cache pages of each request.
        topk: entries per row (512 V4-Flash, 1024 V4-Pro).
        out: ``[>= T, >= topk]`` int32 (vLLM's top-k buffer); its first ``topk``
            columns of the first ``T`` rows are written, nothing else.
        max_entries: a host bound on ``lens`` (vLLM's ``max_model_len // ratio``): the
            width of the scores scratch.
        scores: ``[>= T, >= max_entries]`` float32 scratch; allocated when None.
        rows_per_request: rows of each request when ``row_req`` is None (1 to 4: MTP
            and DSpark steps).
        clear_rows: rows of ``out`` to cover (at least ``T``): rows ``T ..
            clear_rows - 1`` are set to -1, as vLLM clears its buffer up to the step's
            padded token count before its top-k kernel runs (0: only the ``T`` rows).

    Returns:
        ``out[:T, :topk]``.
    """
    check_tensor("q", q, dtype=torch.float8_e4m3fn, ndim=3)
    device = q.device
    T, H, D = (int(x) for x in q.shape)
    if D != INDEX_DIM or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, H, {INDEX_DIM}] with a unit last stride, got {tuple(q.shape)}"
        )
    check_tensor("weights", weights, dtype=torch.float32, ndim=2, device=device)
    if weights.shape[0] < T or weights.shape[1] != H or weights.stride(1) != 1:
        raise ValueError(f"weights must be [>= {T}, {H}] float32 with a unit last stride")
    check_tensor("cache", cache, dtype=torch.uint8, ndim=3, device=device)
    if (
        cache.shape[2] != INDEX_ENTRY_BYTES
        or cache.stride(2) != 1
        or cache.stride(1) != INDEX_ENTRY_BYTES
    ):
        raise ValueError(
            f"cache must be a [num_pages, entries, {INDEX_ENTRY_BYTES}] uint8 page view with "
            f"packed entries, got shape {tuple(cache.shape)} strides {cache.stride()}"
        )
    entries = int(cache.shape[1])
    page_stride = int(cache.stride(0)) if cache.shape[0] > 1 else entries * INDEX_ENTRY_BYTES
    if page_stride < entries * INDEX_ENTRY_BYTES:
        raise ValueError(f"cache's page stride {page_stride} is smaller than a page")
    for name, t in (("lens", lens), ("row_req", row_req)):
        if t is None:
            continue
        check_tensor(name, t, dtype=INDEX_DTYPES, ndim=1, device=device)
        check_min_length(name, t, T, "one per query row")
    check_positive_int("rows_per_request", rows_per_request)
    check_nonnegative_int("clear_rows", clear_rows)
    rows = max(T, clear_rows)
    check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2, device=device)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    check_positive_int("topk", topk)
    check_nonnegative_int("max_entries", max_entries)
    check_tensor("out", out, dtype=torch.int32, ndim=2, device=device)
    if out.shape[0] < rows or out.shape[1] < topk or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [>= {rows}, >= {topk}] int32 (rows: max(T, clear_rows)), contiguous "
            f"in its last dimension, got {tuple(out.shape)}"
        )
    width = max(max_entries, 1)
    if scores is None:
        scores = torch.empty((max(T, 1), width), dtype=torch.float32, device=device)
    check_tensor("scores", scores, dtype=torch.float32, ndim=2, device=device)
    if scores.shape[0] < T or scores.shape[1] < max_entries or scores.stride(1) != 1:
        raise ValueError(
            f"scores must be [>= {T}, >= {max_entries}] float32, got {tuple(scores.shape)}"
        )
    if rows == 0:
        return out[:0, :topk]
    if not use_triton(device):
        from .reference.indexer import indexer_decode_topk as reference

        out[T:rows, :topk] = -1
        if row_req is None:
            row_req = torch.arange(T, device=device, dtype=torch.int32) // rows_per_request
        reference(q, weights, cache, lens[:T], row_req[:T], block_table, topk, out=out[:T])
        return out[:T, :topk]
    from . import _triton_indexer as _k

    hp = max(16, triton.next_power_of_2(H))
    if max_entries and T:
        _k._index_scores_kernel[(T, triton.cdiv(max_entries, BLOCK_N))](
            q.view(torch.uint8),
            weights,
            cache,
            block_table,
            lens,
            lens if row_req is None else row_req,
            scores,
            block_table.stride(0),
            page_stride,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            scores.stride(0),
            H=H,
            HP=hp,
            D=INDEX_DIM,
            ENTRIES=entries,
            BLOCK_N=BLOCK_N,
            UPCAST=interpreter_enabled(),
            ROW_REQ=row_req is not None,
            rows_per_request=rows_per_request,
        )
    _k._row_topk_kernel[(rows,)](
        scores,
        lens,
        out,
        scores.stride(0),
        out.stride(0),
        topk,
        T,
        BLOCK=TOPK_BLOCK,
        OUT_BLOCK=OUT_BLOCK,
    )
    return out[:T, :topk]
