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

About 510 lines: the contract above, the host checks with their messages and
the benchmark-case factory (:func:`make_prefill_index_case`) that tests,
benchmarks and docs share; the kernel itself is in ``_triton_prefill_indices``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import triton

from . import _triton_prefill_indices as _k
from ._validation import (
    INDEX_DTYPES,
    check_block_table_width,
    check_min_length,
    check_nonnegative_int,
    check_out,
    check_positive_int,
    check_tensor,
    use_triton,
)
from .geometry import SWA_BLOCK_SIZE, WINDOW_SIZE, slots_per_page
from .reference.prefill_indices import GroupedPrefillIndices, PrefillIndices

__all__ = [
    "GroupedPrefillIndices",
    "PrefillIndexCase",
    "PrefillIndices",
    "build_grouped_prefill_indices",
    "build_prefill_indices",
    "make_prefill_index_case",
]

# Tile sizes (compile-time constants; not yet tuned on a GPU).
BLOCK_T = 8
BLOCK_C = 128
BLOCK_R = 16
NUM_WARPS = 2
# Compressed layers the rows are built for (C4A maps the indexer's top-k,
# C128A generates every entry).
COMPRESSED_RATIOS = (4, 128)


def _check_block_table(name: str, t: object, num_reqs: int, device: torch.device) -> torch.Tensor:
    table = check_tensor(name, t, dtype=INDEX_DTYPES, ndim=2, device=device)
    check_min_length(name, table, num_reqs, "a row per request")
    if table.shape[1] > 1 and table.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    return table


def _check_values(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int,
    tables: list[tuple[str, torch.Tensor, int, int]],
) -> None:
    """Checks that read values (a host read: CPU tensors, or ``check_values=True``).

    ``tables``: (name, block table, entries per page, compress ratio).
    """
    qsl = query_start_loc.to("cpu", torch.int64)
    num_reqs = qsl.shape[0] - 1
    qlen = qsl[1:] - qsl[:-1]
    if num_reqs and bool((qlen < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if int(qsl[-1] - qsl[0]) != num_tokens:
        raise ValueError(
            f"num_tokens ({num_tokens}) must equal query_start_loc[-1] - query_start_loc[0] "
            f"({int(qsl[-1] - qsl[0])})"
        )
    if num_reqs == 0:
        return
    seq = seq_lens[:num_reqs].to("cpu", torch.int64)
    if bool((seq < qlen).any()):
        b = int((seq < qlen).nonzero()[0, 0])
        raise ValueError(
            f"seq_lens must be >= each request's query length, got {int(seq[b])} < "
            f"{int(qlen[b])} for request {b}"
        )
    for name, table, bs, ratio in tables:
        longest = int((seq // ratio).max())
        check_block_table_width(name, table, longest, bs, f"{int(seq.max())} // {ratio}")


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
    )  # type: ignore[return-value]


def _build(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    window_block_table: torch.Tensor | None,
    window_block_size: int,
    window_size: int,
    compress_ratio: int | None,
    comp_block_table: torch.Tensor | None,
    comp_block_size: int | None,
    topk_indices: torch.Tensor | None,
    topk: int | None,
    window_out: torch.Tensor | None,
    window_lens_out: torch.Tensor | None,
    comp_out: torch.Tensor | None,
    comp_lens_out: torch.Tensor | None,
    check_values: bool,
    group: int,
    grouped: bool = False,
    leads_out: torch.Tensor | None = None,
    starts_out: torch.Tensor | None = None,
) -> PrefillIndices | GroupedPrefillIndices:
    """:func:`build_prefill_indices` (``group == 1``) and
    :func:`build_grouped_prefill_indices` (``group > 1``): checks, then one launch."""
    check_tensor("query_start_loc", query_start_loc, dtype=INDEX_DTYPES, ndim=1)
    device = query_start_loc.device
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have at least 1 entry (num_reqs + 1)")
    num_reqs = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, device=device)
    check_min_length("seq_lens", seq_lens, num_reqs, "one per request, len(query_start_loc) - 1")
    check_nonnegative_int("num_tokens", num_tokens)
    if num_tokens > 0 and num_reqs == 0:
        raise ValueError("query_start_loc describes no request but num_tokens > 0")
    check_positive_int("window_size", window_size)
    check_positive_int("window_block_size", window_block_size)
    tables: list[tuple[str, torch.Tensor, int, int]] = []
    if window_block_table is not None:
        _check_block_table("window_block_table", window_block_table, num_reqs, device)
        tables.append(("window_block_table", window_block_table, window_block_size, 1))

    ratio = 1 if compress_ratio is None else compress_ratio
    if ratio == 1:
        for name, value in (
            ("comp_block_table", comp_block_table),
            ("topk_indices", topk_indices),
            ("topk", topk),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} must be None without a compressed row (compress_ratio None or 1)"
                )
        mode = 0
        topk = 0
    else:
        if ratio not in COMPRESSED_RATIOS:
            raise ValueError(
                f"compress_ratio must be None, 1, 4 (C4A) or 128 (C128A), got {compress_ratio}"
            )
        if comp_block_table is None:
            raise ValueError(f"comp_block_table is needed for compress_ratio {ratio}")
        _check_block_table("comp_block_table", comp_block_table, num_reqs, device)
        if comp_block_size is None:
            comp_block_size = slots_per_page(ratio)
        check_positive_int("comp_block_size", comp_block_size)
        tables.append(("comp_block_table", comp_block_table, comp_block_size, ratio))
        if ratio == 4:
            if topk_indices is None:
                raise ValueError("topk_indices (the indexer's top-k) is needed for C4A rows")
            check_tensor("topk_indices", topk_indices, dtype=INDEX_DTYPES, ndim=2, device=device)
            check_min_length("topk_indices", topk_indices, num_tokens, "a row per query token")
            if topk is None:
                topk = topk_indices.shape[1]
            check_nonnegative_int("topk", topk)
            if topk > topk_indices.shape[1]:
                raise ValueError(
                    f"topk ({topk}) is wider than topk_indices ({topk_indices.shape[1]} columns)"
                )
            if topk > 1 and topk_indices.stride(1) != 1:
                raise ValueError("topk_indices must be contiguous in its last dimension")
            mode = 1
        else:
            if topk_indices is not None:
                raise ValueError(
                    "topk_indices must be None for C128A (compress_ratio 128): its rows are "
                    "generated"
                )
            if topk is None:
                raise ValueError("topk (the C128A row width) is needed for compress_ratio 128")
            check_nonnegative_int("topk", topk)
            mode = 2
    if window_block_table is None and mode == 0:
        raise ValueError("nothing to build: give window_block_table and/or compress_ratio 4 or 128")
    if group > 1 and mode == 1:
        raise ValueError("C4A rows (a top-k per token) cannot be grouped: build them per token")
    check_out(
        "window_out",
        window_out,
        (num_tokens, window_size + group - 1),
        torch.int32,
        device,
        allow_more_rows=True,
    )
    check_out(
        "window_lens_out", window_lens_out, (num_tokens,), torch.int32, device, allow_more_rows=True
    )
    check_out("comp_out", comp_out, (num_tokens, topk), torch.int32, device, allow_more_rows=True)
    check_out(
        "comp_lens_out", comp_lens_out, (num_tokens,), torch.int32, device, allow_more_rows=True
    )
    for name, given in (("leads_out", leads_out), ("starts_out", starts_out)):
        if given is not None and not grouped:
            raise ValueError(f"{name} is only meaningful for grouped rows")
        check_out(name, given, (num_tokens,), torch.int32, device, allow_more_rows=True)
    if check_values or device.type == "cpu":
        _check_values(query_start_loc, seq_lens, num_tokens, tables)

    if not use_triton(device):
        from .reference import prefill_indices as ref

        common: dict[str, Any] = dict(
            num_tokens=num_tokens,
            window_block_table=window_block_table,
            window_block_size=window_block_size,
            window_size=window_size,
            compress_ratio=ratio,
            comp_block_table=comp_block_table if mode else None,
            comp_block_size=comp_block_size,
            topk=topk if mode else None,
        )
        if grouped:
            rows = ref.build_grouped_prefill_indices(
                query_start_loc, seq_lens, group_size=group, **common
            )
            return _copy_into(
                rows,
                leads_out if group > 1 else None,
                window_out,
                starts_out if group > 1 else None,
                window_lens_out,
                comp_out,
                comp_lens_out,
            )
        return ref.build_prefill_indices(
            query_start_loc,
            seq_lens,
            topk_indices=topk_indices,
            window_out=window_out,
            window_lens_out=window_lens_out,
            comp_out=comp_out,
            comp_lens_out=comp_lens_out,
            **common,
        )

    def alloc(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=torch.int32, device=device)
        return out[:num_tokens]

    has_window = window_block_table is not None
    win = win_lens = comp = comp_lens = None
    if has_window:
        win = alloc(window_out, (num_tokens, window_size + group - 1))
        win_lens = alloc(window_lens_out, (num_tokens,))
    if mode:
        comp = alloc(comp_out, (num_tokens, topk))
        comp_lens = alloc(comp_lens_out, (num_tokens,))
    leads = alloc(leads_out, (num_tokens,)) if group > 1 else None
    starts = None
    if group > 1 and has_window:
        starts = alloc(starts_out, (num_tokens,))

    def result() -> PrefillIndices | GroupedPrefillIndices:
        if not grouped:
            return PrefillIndices(win, win_lens, comp, comp_lens)
        if leads is None:  # groups of one token: each leads itself from column 0
            ones = torch.arange(num_tokens, dtype=torch.int32, device=device)
            zeros = torch.zeros_like(ones) if has_window else None
            return GroupedPrefillIndices(ones, 1, win, zeros, win_lens, comp, comp_lens)
        return GroupedPrefillIndices(leads, group, win, starts, win_lens, comp, comp_lens)

    if num_tokens == 0:
        return result()

    # Unused pointer arguments get any int32 tensor of the call.
    any_i32 = seq_lens
    win_tiles = triton.cdiv(window_size + group - 1, BLOCK_C) if has_window else 0
    comp_tiles = triton.cdiv(topk, BLOCK_C) if mode else 0
    grid = (triton.cdiv(num_tokens, BLOCK_T), max(1, win_tiles + comp_tiles))
    _k._prefill_indices_kernel[grid](
        query_start_loc,
        seq_lens,
        window_block_table if has_window else any_i32,
        comp_block_table if mode else any_i32,
        topk_indices if mode == 1 else any_i32,
        win if win is not None else any_i32,
        win_lens if win_lens is not None else any_i32,
        comp if comp is not None else any_i32,
        comp_lens if comp_lens is not None else any_i32,
        leads if leads is not None else any_i32,
        starts if starts is not None else any_i32,
        window_block_table.stride(0) if has_window else 0,  # type: ignore[union-attr]
        comp_block_table.stride(0) if mode else 0,  # type: ignore[union-attr]
        topk_indices.stride(0) if mode == 1 else 0,  # type: ignore[union-attr]
        win.stride(0) if win is not None else 0,
        comp.stride(0) if comp is not None else 0,
        num_tokens,
        num_reqs,
        window_block_table.shape[1] if has_window else 0,  # type: ignore[union-attr]
        comp_block_table.shape[1] if mode else 0,  # type: ignore[union-attr]
        topk,
        win_tiles,
        WINDOW=window_size,
        WIN_BS=window_block_size,
        COMP_BS=comp_block_size if mode else 1,
        RATIO=ratio,
        HAS_WINDOW=has_window,
        COMP_MODE=mode,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        BLOCK_R=BLOCK_R,
        GROUP=group,
        num_warps=NUM_WARPS,
    )
    return result()


def _copy_into(rows: GroupedPrefillIndices, *outs: torch.Tensor | None) -> GroupedPrefillIndices:
    """The reference's grouped rows written into the caller's outputs where given (in
    field order after ``group_size``: leads, window, window_starts, window_lens, comp,
    comp_lens), so a caller that passes buffers gets views of its buffers back."""
    values = [rows.leads, rows.window, rows.window_starts, rows.window_lens, rows.comp]
    values.append(rows.comp_lens)
    placed = []
    for value, out in zip(values, outs, strict=True):
        if value is None or out is None:
            placed.append(value)
            continue
        view = out[: value.shape[0]]
        view.copy_(value)
        placed.append(view)
    return GroupedPrefillIndices(placed[0], rows.group_size, *placed[1:])  # type: ignore[arg-type]


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
            check_values: as in :func:`build_prefill_indices` (the compressed
            rows are C128A's: ``comp_block_size`` defaults to ``256 // 128``).
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
    )


# --- benchmark and test cases -----------------------------------------------------------


@dataclasses.dataclass
class PrefillIndexCase:
    """A prefill chunk's metadata as vLLM holds it, with random page assignments.

    Made by :func:`make_prefill_index_case`; :meth:`build` times or checks
    :func:`build_prefill_indices` on it.  Caches for it need
    ``window_num_pages`` window pages and ``comp_num_pages`` compressed pages.
    """

    query_start_loc: torch.Tensor  # a slice with a nonzero first element
    seq_lens: torch.Tensor
    num_tokens: int
    window_block_table: torch.Tensor
    window_num_pages: int
    compress_ratio: int  # 1, 4 or 128
    comp_block_table: torch.Tensor | None
    comp_num_pages: int
    topk_indices: torch.Tensor | None  # C4A only
    topk: int  # compressed row width (0 for SWA-only)
    window_block_size: int = SWA_BLOCK_SIZE
    window_size: int = WINDOW_SIZE

    @property
    def comp_block_size(self) -> int:
        return slots_per_page(self.compress_ratio) if self.compress_ratio > 1 else 1

    def build(
        self,
        *,
        window: bool = True,
        compressed: bool = True,
        window_out: torch.Tensor | None = None,
        window_lens_out: torch.Tensor | None = None,
        comp_out: torch.Tensor | None = None,
        comp_lens_out: torch.Tensor | None = None,
    ) -> PrefillIndices:
        """The rows (window and/or compressed) through :func:`build_prefill_indices`."""
        comp = compressed and self.compress_ratio > 1
        return build_prefill_indices(
            self.query_start_loc,
            self.seq_lens,
            num_tokens=self.num_tokens,
            window_block_table=self.window_block_table if window else None,
            window_block_size=self.window_block_size,
            window_size=self.window_size,
            compress_ratio=self.compress_ratio if comp else None,
            comp_block_table=self.comp_block_table if comp else None,
            topk_indices=self.topk_indices if comp else None,
            topk=self.topk if comp else None,
            window_out=window_out,
            window_lens_out=window_lens_out,
            comp_out=comp_out,
            comp_lens_out=comp_lens_out,
        )


def _random_tables(
    pages_per_req: list[int], extra_cols: int, g: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Distinct random page ids per request; ``extra_cols`` unused columns of garbage."""
    total = sum(pages_per_req)
    perm = torch.randperm(max(total, 1), generator=g).to(torch.int32)
    width = max(pages_per_req, default=0) + extra_cols
    table = torch.randint(-5, 10**6, (len(pages_per_req), width), generator=g, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[at : at + n]
        at += n
    return table, max(total, 1)


def make_prefill_index_case(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    compress_ratio: int,
    topk: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    extra_table_cols: int = 3,
    qsl_base: int = 5,
    hole_fraction: float = 0.0,
) -> PrefillIndexCase:
    """A random prefill chunk: request ``b`` has ``context_lens[b]`` cached tokens, then its query.

    Block tables map every page a request uses to distinct random pages (plus
    ``extra_table_cols`` columns of garbage past them); ``query_start_loc``
    is a slice of a longer tensor whose first element is ``qsl_base``.  C4A
    top-k rows pick ``min(topk, entries)`` distinct request-local entries
    (stratified over the token's entries, in random order; -1 after them),
    then turn ``hole_fraction`` of them into -1.  ``topk`` defaults to 512
    for C4A and to the longest request's entry count for C128A.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens must have the same length")
    if compress_ratio not in (1, 4, 128):
        raise ValueError(f"compress_ratio must be 1, 4 or 128, got {compress_ratio}")
    g = torch.Generator().manual_seed(seed)
    q = torch.tensor(list(query_lens), dtype=torch.int64)
    seq = q + torch.tensor(list(context_lens), dtype=torch.int64)
    num_tokens = int(q.sum())
    qsl_full = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.full((1,), qsl_base), qsl_base + q.cumsum(0)]
    ).to(torch.int32)
    w_pages = [-(-int(s) // SWA_BLOCK_SIZE) for s in seq]
    w_table, w_num = _random_tables(w_pages, extra_table_cols, g)
    comp_table = None
    comp_num = 0
    topk_indices = None
    width = 0
    if compress_ratio > 1:
        bs = slots_per_page(compress_ratio)
        entries = seq // compress_ratio
        comp_table, comp_num = _random_tables(
            [-(-int(e) // bs) for e in entries], extra_table_cols, g
        )
        if compress_ratio == 4:
            width = 512 if topk is None else topk
            req = torch.repeat_interleave(torch.arange(len(q)), q)
            t = torch.arange(num_tokens)
            start = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)[:-1]])
            pos = seq[req] - q[req] + (t - start[req])
            n = ((pos + 1) // 4)[:, None]
            j = torch.arange(width)[None, :]
            # n >= width: one entry from each of `width` integer strata of [0, n)
            lo = j * n // width
            hi = (j + 1) * n // width
            u = torch.rand((num_tokens, width), generator=g, dtype=torch.float64)
            pick = lo + (u * (hi - lo).double()).floor().long()
            local = torch.where(n >= width, pick, torch.where(j < n, j, -1))
            # shuffle each row's live prefix; the -1 tail stays at the end
            keys = torch.rand((num_tokens, width), generator=g)
            keys = torch.where(j < n, keys, 2.0)
            local = torch.gather(local, 1, keys.argsort(dim=1))
            if hole_fraction > 0:
                holes = torch.rand((num_tokens, width), generator=g) < hole_fraction
                local = torch.where(holes, -1, local)
            topk_indices = local.to(torch.int32)
        else:
            width = max(int(entries.max()) if len(q) else 0, 1) if topk is None else topk
    dev = torch.device(device)

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return PrefillIndexCase(
        query_start_loc=qsl_full.to(dev)[1:],
        seq_lens=seq.to(torch.int32).to(dev),
        num_tokens=num_tokens,
        window_block_table=w_table.to(dev),
        window_num_pages=w_num,
        compress_ratio=compress_ratio,
        comp_block_table=mv(comp_table),
        comp_num_pages=comp_num,
        topk_indices=mv(topk_indices),
        topk=width,
    )
