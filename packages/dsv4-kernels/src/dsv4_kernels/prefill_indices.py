"""Prefill index rows as global cache slots, for :func:`dsv4_kernels.sparse_mla_paged`.

vLLM 0.32 feeds DSV4's sparse prefill from a bf16 workspace: it gathers each
request's compressed entries and window tokens out of the FP8 pages, then
builds request-local workspace rows (``combine_topk_swa_indices``).  Reading
the FP8 pages directly needs no workspace: each query token's keys are named
by their cache slots, ``page * block_size + slot_in_page``, in two rows (the
window cache and the compressed cache), as FlashMLA's decode takes them.
:func:`build_prefill_indices` builds those rows for a prefill chunk in one
launch.

For token ``t`` of request ``b`` at position ``pos = seq_lens[b] - query_len_b
+ (t - qs_b)`` (the chunk's own keys are already in the caches when attention
runs: vLLM's fused writers fill them first):

* window row (``W = window_size`` columns): column ``j < swa_len`` holds the
  slot of position ``swa_start + j`` through the window cache's block table,
  with ``swa_start = max(pos - W + 1, 0)`` and ``swa_len = max(min(pos + 1,
  W), 0)``; ``window_lens[t] = swa_len``;
* compressed row (``topk`` columns): ``topk_len = clamp((pos + 1) //
  compress_ratio, 0, topk)``; column ``j < topk_len`` holds the slot of
  compressed entry ``l`` through the compressed cache's block table, where
  ``l = topk_indices[t, j]`` (C4A, the indexer's request-local top-k) or ``l
  = j`` (C128A: every entry so far, generated without reading any top-k
  tensor); ``comp_lens[t] = topk_len``;
* entry ``e`` maps to ``block_table[b, e // bs] * bs + e % bs``; a negative
  entry, a page past the block table's width or a negative page id gives -1
  (a hole inside the length, which attention skips); every column at or past
  the length is -1.

The window rows and the C128A rows depend only on the step's metadata, so
one call serves every layer of that type (and group) in a step; C4A's top-k
differs per layer.  :func:`build_grouped_prefill_indices` builds the same keys
as grouped rows (tokens of a group read their leader's rows, which hold the
group's keys) for SWA-only and C128A layers, with the same kernel.  In-image
bidirectional visibility (vLLM's vision variant) and SWA bounded replay
(DeepSeek-V4.1) are not covered: such batches take vLLM's own path.

This module holds the contract above, the host checks with their messages and the
launch; the kernel itself is in ``_triton_prefill_indices``, the random prefill chunks
that tests, benchmarks and docs share (``make_prefill_index_case``) in
:mod:`dsv4_kernels.testing.prefill_indices`.
"""

from __future__ import annotations

import torch

from ._prefill_indices_build import _build
from ._validation import check_positive_int
from .geometry import SWA_BLOCK_SIZE, WINDOW_SIZE
from .reference.prefill_indices import BlockRows, GroupedPrefillIndices, PrefillIndices

__all__ = [
    "BlockRows",
    "GroupedPrefillIndices",
    "PrefillIndices",
    "build_grouped_prefill_indices",
    "build_prefill_indices",
]


def build_prefill_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    window_block_table: torch.Tensor | None = None,
    window_block_size: int = SWA_BLOCK_SIZE,
    window_size: int = WINDOW_SIZE,
    compress_ratio: int | None = None,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    topk_indices: torch.Tensor | None = None,
    topk: int | None = None,
    window_out: torch.Tensor | None = None,
    window_lens_out: torch.Tensor | None = None,
    comp_out: torch.Tensor | None = None,
    comp_lens_out: torch.Tensor | None = None,
    check_values: bool = False,
    window_floor: torch.Tensor | None = None,
    comp_blocks: bool = False,
    req_out: torch.Tensor | None = None,
) -> PrefillIndices:
    """Build a prefill chunk's window and/or compressed rows of global cache slots, in one launch.

    The window row is built when ``window_block_table`` is given, the
    compressed row when ``compress_ratio`` (4 or 128) is; see the module
    docstring for the rows' contents.

    Args:
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths of
            the chunk's requests; may be a slice of a longer tensor (values are
            rebased by its first).
        seq_lens: ``[>= num_reqs]`` int32 tokens of each request including this
            chunk (the first ``num_reqs`` are used).
        num_tokens: query tokens in the chunk, ``query_start_loc[-1] -
            query_start_loc[0]`` (a host int, so nothing is read back).
        window_block_table: ``[>= num_reqs, pages]`` int32 page ids of the
            window cache (more columns than needed are fine).
        window_block_size: tokens per window-cache page (64 in DSV4).
        window_size: sliding window W (128).
        compress_ratio: 4 (C4A: map ``topk_indices``) or 128 (C128A: generate);
            None or 1 builds no compressed row.
        comp_block_table: ``[>= num_reqs, pages]`` int32 page ids of the
            compressed cache (needed with ``compress_ratio``).
        comp_block_size: entries per compressed-cache page (default
            ``256 // compress_ratio``).
        topk_indices: C4A only: ``[>= num_tokens, >= topk]`` int32 request-local
            compressed indices from the indexer (-1 for none).
        topk: compressed row width: C4A default ``topk_indices.shape[1]``;
            C128A required (use at least the longest request's entry count,
            ``max(seq_lens) // 128``, or rows are clamped to it).
        window_out, window_lens_out, comp_out, comp_lens_out: optional outputs
            (``[>= num_tokens, W]``, ``[>= num_tokens]``, ``[>= num_tokens,
            topk]``, ``[>= num_tokens]`` int32; their first ``num_tokens`` rows
            are written and returned): with all of them the call allocates
            nothing.
        check_values: also check, on CUDA tensors, what depends on values
            (``num_tokens`` against ``query_start_loc``, ``seq_lens`` at least
            each query length, block tables wide enough).  This reads them
            back (a synchronisation); CPU tensors are always checked.
            Unchecked, the kernel never reads out of bounds.
        window_floor: optional ``[>= num_reqs]`` int32: the first position each
            request holds window KV from (vLLM's SWA bounded replay after a prefix
            hit: ``seq_lens - prefill_gather_lens``); window rows start no lower.
            None: position 0.
        comp_blocks: C128A only: return the compressed rows as
            :class:`~dsv4_kernels.BlockRows` (``comp_block_table`` and each token's
            request, written into ``req_out``) with their ``comp_lens``, and write no
            ``[T, topk]`` row of slots: :func:`dsv4_kernels.sparse_mla_paged` reads the
            block table itself, so a long context needs no buffer of tokens x entries.
        req_out: optional ``[>= num_tokens]`` int32 output for ``comp_blocks``.

    Returns:
        :class:`PrefillIndices` ``(window [T, W], window_lens [T], comp [T,
        topk], comp_lens [T])`` int32, None for a part not asked for.

    Raises:
        ValueError: naming the argument, for wrong dtypes, ranks, devices,
            lengths, output shapes, an unsupported ratio, missing or extra
            top-k input, nothing to build, and (see ``check_values``) values
            that contradict each other.
    """
    return _build(
        query_start_loc,
        seq_lens,
        num_tokens=num_tokens,
        window_block_table=window_block_table,
        window_block_size=window_block_size,
        window_size=window_size,
        compress_ratio=compress_ratio,
        comp_block_table=comp_block_table,
        comp_block_size=comp_block_size,
        topk_indices=topk_indices,
        topk=topk,
        window_out=window_out,
        window_lens_out=window_lens_out,
        comp_out=comp_out,
        comp_lens_out=comp_lens_out,
        check_values=check_values,
        group=1,
        window_floor=window_floor,
        comp_blocks=comp_blocks,
        req_out=req_out,
    )  # type: ignore[return-value]


def build_grouped_prefill_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    group_size: int,
    window_block_table: torch.Tensor | None = None,
    window_block_size: int = SWA_BLOCK_SIZE,
    window_size: int = WINDOW_SIZE,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    topk: int | None = None,
    window_out: torch.Tensor | None = None,
    window_lens_out: torch.Tensor | None = None,
    comp_out: torch.Tensor | None = None,
    comp_lens_out: torch.Tensor | None = None,
    leads_out: torch.Tensor | None = None,
    starts_out: torch.Tensor | None = None,
    check_values: bool = False,
    window_floor: torch.Tensor | None = None,
    comp_blocks: bool = False,
    req_out: torch.Tensor | None = None,
) -> GroupedPrefillIndices:
    """Grouped index rows for SWA-only and C128A layers, whose consecutive tokens share keys.

    A token's window is the window of the token before it shifted by one, and
    a C128A token's compressed row is a prefix of the next token's, so
    ``group_size`` consecutive tokens can read each key once for all of them
    (:func:`sparse_mla_paged` with ``leads``).  Returns
    :class:`GroupedPrefillIndices`: each token's leader, the window rows ``[T,
    W + G - 1]`` with ``window_starts`` and ``window_lens``, the C128A rows
    ``[T, topk]`` with ``comp_lens`` (C4A's top-k differs per token and is not
    grouped).  Token ``t``'s keys are exactly those of
    :func:`build_prefill_indices`'s rows.  One launch, like it.

    Args:
        query_start_loc, seq_lens, num_tokens, window_block_table,
            window_block_size, window_size, comp_block_table, comp_block_size,
            check_values, window_floor, comp_blocks, req_out: as in
            :func:`build_prefill_indices` (the compressed rows are C128A's:
            ``comp_block_size`` defaults to ``256 // 128``).
        group_size: tokens per group (``dsv4_kernels.sparse_mla.prefill_group_size``
            gives the one the kernel takes for a head count on this device).
        topk: the C128A row width (needed with ``comp_block_table``).
        window_out, window_lens_out, comp_out, comp_lens_out, leads_out, starts_out:
            optional int32 outputs (``[>= T, W + G - 1]``, ``[>= T]``, ``[>= T,
            topk]``, ``[>= T]``, ``[>= T]``, ``[>= T]``; their first ``T`` rows are
            written and returned): with all that apply the call allocates nothing
            on a GPU (the CPU reference computes and copies in).

    Raises:
        ValueError: naming the argument, as :func:`build_prefill_indices`.
    """
    group_size = check_positive_int("group_size", group_size)
    if topk is not None and comp_block_table is None:
        raise ValueError("topk must be None without comp_block_table")
    return _build(  # type: ignore[return-value]
        query_start_loc,
        seq_lens,
        num_tokens=num_tokens,
        window_block_table=window_block_table,
        window_block_size=window_block_size,
        window_size=window_size,
        compress_ratio=128 if comp_block_table is not None else None,
        comp_block_table=comp_block_table,
        comp_block_size=comp_block_size,
        topk_indices=None,
        topk=topk,
        window_out=window_out,
        window_lens_out=window_lens_out,
        comp_out=comp_out,
        comp_lens_out=comp_lens_out,
        leads_out=leads_out,
        starts_out=starts_out,
        check_values=check_values,
        group=group_size,
        grouped=True,
        window_floor=window_floor,
        comp_blocks=comp_blocks,
        req_out=req_out,
    )
