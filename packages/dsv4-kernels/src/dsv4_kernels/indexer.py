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

Under tensor parallelism the step can be shared by the ranks (issue 40): a **row
shard** is :func:`indexer_decode_topk` on a slice of the rows (``row_offset`` names the
slice's first row); a **key shard** is :func:`indexer_shard_topk`, which scores only a
share of every row's entries and writes its top-k as candidates (positions and scores),
and :func:`indexer_merge_topk` selects each row's top-k of all shards' candidates once
they are gathered: exactly the unsharded top-k, ties included.
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

__all__ = ["indexer_decode_topk", "indexer_merge_topk", "indexer_shard_topk"]

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
    row_offset: int = 0,
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
        row_offset: the inputs' row ``t`` is the step's row ``row_offset + t`` (a row
            shard without ``row_req``: its request is ``(row_offset + t) //
            rows_per_request``).

    Returns:
        ``out[:T, :topk]``.
    """
    return _launch(q, weights, cache, lens, row_req, block_table, topk, out,
                   max_entries=max_entries, scores=scores, rows_per_request=rows_per_request,
                   clear_rows=clear_rows, row_offset=row_offset, shard=0, shards=1)  # fmt: skip


def indexer_shard_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    row_req: torch.Tensor | None,
    block_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    *,
    shard: int,
    shards: int,
    max_entries: int,
    scores: torch.Tensor | None = None,
    rows_per_request: int = 1,
) -> torch.Tensor:
    """One key shard's candidates of every row: the ``topk`` highest of the row's share
    ``[n * shard // shards, n * (shard + 1) // shards)`` of its ``n = lens[t]`` entries.

    Arguments as :func:`indexer_decode_topk`, except:

    Args:
        out: ``[>= T, >= 2 * topk]`` int32, the packed candidates: columns ``:topk`` the
            request-local positions (as :func:`indexer_decode_topk` orders them: above
            the k-th score in position order, then its ties lowest position first; -1
            past the share's entries), columns ``topk : 2 * topk`` the float32 bits of
            their scores (-inf beside a -1).  What :func:`indexer_merge_topk` reads once
            the shards' ``out`` are gathered.
        shard, shards: this shard and the number of shards (``0 <= shard < shards``).
        scores: ``[>= T, >= ceil(max_entries / shards)]`` float32 scratch (a share's
            width).

    Returns:
        ``out[:T, :2 * topk]``.
    """
    check_positive_int("shards", shards)
    if not isinstance(shard, int) or not 0 <= shard < shards:
        raise ValueError(f"shard must be an int in [0, {shards}), got {shard!r}")
    return _launch(q, weights, cache, lens, row_req, block_table, topk, out,
                   max_entries=max_entries, scores=scores, rows_per_request=rows_per_request,
                   clear_rows=0, row_offset=0, shard=shard, shards=shards)  # fmt: skip


def indexer_merge_topk(
    candidates: torch.Tensor, topk: int, out: torch.Tensor, *, shards: int, clear_rows: int = 0
) -> torch.Tensor:
    """Every row's ``topk`` highest of all key shards' candidates, into ``out[:T, :topk]``.

    Args:
        candidates: ``[shards * T, >= 2 * topk]`` int32: the shards' packed
            :func:`indexer_shard_topk` outputs of ``T`` rows each, stacked shard by shard
            (what an all-gather along rows returns), shard ``r`` taking row ``t`` over
            entries of the range ``r`` scored.
        topk: entries per row.
        out: ``[>= max(T, clear_rows), >= topk]`` int32 (vLLM's top-k buffer).
        shards: the number of shards stacked.
        clear_rows: rows ``T .. clear_rows - 1`` of ``out`` are set to -1 as in
            :func:`indexer_decode_topk`.

    Returns:
        ``out[:T, :topk]``: the same entries as :func:`indexer_decode_topk` on the whole
        rows (ties at the k-th place lowest position first); -1 past a row's entries.
    """
    check_positive_int("shards", shards)
    check_positive_int("topk", topk)
    check_nonnegative_int("clear_rows", clear_rows)
    check_tensor("candidates", candidates, dtype=torch.int32, ndim=2)
    device = candidates.device
    total, width = (int(x) for x in candidates.shape)
    if total % shards or width < 2 * topk or (width > 1 and candidates.stride(1) != 1):
        raise ValueError(
            f"candidates must be [shards * T, >= {2 * topk}] int32 ({shards} shards stacked), "
            f"contiguous in its last dimension, got {tuple(candidates.shape)}"
        )
    T = total // shards
    rows = max(T, clear_rows)
    check_tensor("out", out, dtype=torch.int32, ndim=2, device=device)
    if out.shape[0] < rows or out.shape[1] < topk or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [>= {rows}, >= {topk}] int32 (rows: max(T, clear_rows)), contiguous "
            f"in its last dimension, got {tuple(out.shape)}"
        )
    if rows == 0:
        return out[:0, :topk]
    if not use_triton(device):
        from .reference.indexer import merge_topk as reference

        out[T:rows, :topk] = -1
        reference(candidates, topk, shards, out=out[:T])
        return out[:T, :topk]
    from . import _triton_indexer as _k

    _k._merge_topk_kernel[(rows,)](
        candidates,
        out,
        candidates.stride(0),
        T * candidates.stride(0),
        out.stride(0),
        topk,
        T,
        shards,
        BLOCK=TOPK_BLOCK,
        OUT_BLOCK=OUT_BLOCK,
    )
    return out[:T, :topk]


def _launch(
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
    scores: torch.Tensor | None,
    rows_per_request: int,
    clear_rows: int,
    row_offset: int,
    shard: int,
    shards: int,
) -> torch.Tensor:
    """Check and launch a whole (``shards`` 1) or a key shard's step; with more than one
    shard ``out`` takes the packed candidates (:func:`indexer_shard_topk`)."""
    packed = shards > 1
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
    check_nonnegative_int("row_offset", row_offset)
    rows = max(T, clear_rows)
    check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2, device=device)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    check_positive_int("topk", topk)
    check_nonnegative_int("max_entries", max_entries)
    check_tensor("out", out, dtype=torch.int32, ndim=2, device=device)
    cols = 2 * topk if packed else topk
    if out.shape[0] < rows or out.shape[1] < cols or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [>= {rows}, >= {cols}] int32 (rows: max(T, clear_rows)), contiguous "
            f"in its last dimension, got {tuple(out.shape)}"
        )
    width = max(-(-max_entries // shards), 1)  # a share's entries at most
    if scores is None:
        scores = torch.empty((max(T, 1), width), dtype=torch.float32, device=device)
    check_tensor("scores", scores, dtype=torch.float32, ndim=2, device=device)
    if scores.shape[0] < T or scores.shape[1] < width or scores.stride(1) != 1:
        raise ValueError(f"scores must be [>= {T}, >= {width}] float32, got {tuple(scores.shape)}")
    if rows == 0:
        return out[:0, :cols]
    if not use_triton(device):
        from .reference import indexer as reference

        out[T:rows, :topk] = -1
        if row_req is None:
            first = torch.arange(row_offset, row_offset + T, device=device, dtype=torch.int32)
            row_req = first // rows_per_request
        args = (q, weights, cache, lens[:T], row_req[:T], block_table, topk)
        if packed:
            reference.shard_topk(*args, shard, shards, out=out[:T])
        else:
            reference.indexer_decode_topk(*args, out=out[:T])
        return out[:T, :cols]
    from . import _triton_indexer as _k

    hp = max(16, triton.next_power_of_2(H))
    if max_entries and T:
        _k._index_scores_kernel[(T, triton.cdiv(width, BLOCK_N))](
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
            row_offset=row_offset,
            shard=shard,
            shards=shards,
        )
    _k._row_topk_kernel[(rows,)](
        scores,
        lens,
        out,
        scores.stride(0),
        out.stride(0),
        topk,
        T,
        shard,
        shards,
        BLOCK=TOPK_BLOCK,
        OUT_BLOCK=OUT_BLOCK,
        SCORES=packed,
    )
    return out[:T, :cols]
