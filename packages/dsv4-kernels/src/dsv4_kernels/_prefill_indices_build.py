"""The prefill index rows' host side behind :mod:`.prefill_indices`' public functions:
argument and value checks, dispatch (Triton kernel or torch reference), output
allocation and the launch of ``_triton_prefill_indices``."""

from __future__ import annotations

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
from .geometry import RowKind, row_kind, slots_per_page
from .reference.prefill_indices import BlockRows, GroupedPrefillIndices, PrefillIndices

# Tile sizes (compile-time constants; not yet tuned on a GPU).
BLOCK_T = 8
BLOCK_C = 128
BLOCK_R = 16
NUM_WARPS = 2
# Compressed rows by ratio: ``geometry.row_kind`` (a top-k row maps the indexer's
# local indices, a generated row lists every entry; ratio 1 without ``topk_indices`` is
# V4's SWA-only).


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
    window_floor: torch.Tensor | None = None,
    comp_blocks: bool = False,
    req_out: torch.Tensor | None = None,
) -> PrefillIndices | GroupedPrefillIndices:
    """:func:`build_prefill_indices` (``group == 1``) and
    :func:`build_grouped_prefill_indices` (``group > 1``): checks, then one launch.
    ``comp_blocks``: C128A rows as :class:`~dsv4_kernels.BlockRows` (the lengths and each
    token's request, written into ``req_out``; no row of entries)."""
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
    if window_floor is not None:
        check_tensor("window_floor", window_floor, dtype=INDEX_DTYPES, ndim=1, device=device)
        check_min_length("window_floor", window_floor, num_reqs, "one per request")
    tables: list[tuple[str, torch.Tensor, int, int]] = []
    if window_block_table is not None:
        _check_block_table("window_block_table", window_block_table, num_reqs, device)
        tables.append(("window_block_table", window_block_table, window_block_size, 1))

    ratio = 1 if compress_ratio is None else compress_ratio
    kind = row_kind(compress_ratio, topk_indices is not None)
    if kind is RowKind.WINDOW:
        for name, value in (
            ("comp_block_table", comp_block_table),
            ("topk_indices", topk_indices),
            ("topk", topk),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} must be None without a compressed row (compress_ratio None or 1 "
                    "without topk_indices)"
                )
        mode = int(RowKind.WINDOW)
        topk = 0
    else:
        if comp_block_table is None:
            raise ValueError(f"comp_block_table is needed for compress_ratio {ratio}")
        _check_block_table("comp_block_table", comp_block_table, num_reqs, device)
        if comp_block_size is None:
            comp_block_size = slots_per_page(ratio)
        check_positive_int("comp_block_size", comp_block_size)
        tables.append(("comp_block_table", comp_block_table, comp_block_size, ratio))
        if kind is RowKind.TOPK:
            if topk_indices is None:
                raise ValueError(
                    "topk_indices (the indexer's top-k) is needed for C4A rows (top-k rows "
                    f"at compress_ratio {ratio})"
                )
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
            mode = int(RowKind.TOPK)
        else:
            if topk_indices is not None:
                raise ValueError(
                    "topk_indices must be None for C128A (compress_ratio 128): its rows are "
                    "generated"
                )
            if topk is None:
                raise ValueError("topk (the C128A row width) is needed for compress_ratio 128")
            check_nonnegative_int("topk", topk)
            mode = int(RowKind.ALL)
    if window_block_table is None and mode == 0:
        raise ValueError(
            "nothing to build: give window_block_table and/or a compressed row (top-k rows "
            "with topk_indices, or compress_ratio 128)"
        )
    if comp_blocks and mode != int(RowKind.ALL):
        raise ValueError(
            "comp_blocks is only for C128A rows (compress_ratio 128, every entry so far); "
            f"got {'no compressed row' if mode == 0 else 'top-k rows'}"
        )
    if comp_blocks and comp_out is not None:
        raise ValueError("comp_out must be None with comp_blocks (no row of slots is written)")
    if req_out is not None and not comp_blocks:
        raise ValueError("req_out is only meaningful with comp_blocks")
    check_out("req_out", req_out, (num_tokens,), torch.int32, device, allow_more_rows=True)
    if group > 1 and mode == 1:
        raise ValueError(
            "C4A rows (top-k rows: one top-k per token) cannot be grouped: build them per token"
        )
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
            window_floor=window_floor,
            comp_blocks=comp_blocks,
            req_out=req_out,
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
    comp_rows: torch.Tensor | BlockRows | None = None
    if mode:
        comp = alloc(req_out, (num_tokens,)) if comp_blocks else alloc(comp_out, (num_tokens, topk))
        comp_lens = alloc(comp_lens_out, (num_tokens,))
        comp_rows = BlockRows(comp_block_table, comp) if comp_blocks else comp  # type: ignore[arg-type]
    leads = alloc(leads_out, (num_tokens,)) if group > 1 else None
    starts = None
    if group > 1 and has_window:
        starts = alloc(starts_out, (num_tokens,))

    def result() -> PrefillIndices | GroupedPrefillIndices:
        if not grouped:
            return PrefillIndices(win, win_lens, comp_rows, comp_lens)
        if leads is None:  # groups of one token: each leads itself from column 0
            ones = torch.arange(num_tokens, dtype=torch.int32, device=device)
            zeros = torch.zeros_like(ones) if has_window else None
            return GroupedPrefillIndices(ones, 1, win, zeros, win_lens, comp_rows, comp_lens)
        return GroupedPrefillIndices(leads, group, win, starts, win_lens, comp_rows, comp_lens)

    if num_tokens == 0:
        return result()

    # Unused pointer arguments get any int32 tensor of the call.
    any_i32 = seq_lens
    win_tiles = triton.cdiv(window_size + group - 1, BLOCK_C) if has_window else 0
    comp_tiles = (1 if comp_blocks else triton.cdiv(topk, BLOCK_C)) if mode else 0
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
        window_floor if window_floor is not None else any_i32,
        window_block_table.stride(0) if has_window else 0,  # type: ignore[union-attr]
        comp_block_table.stride(0) if mode else 0,  # type: ignore[union-attr]
        topk_indices.stride(0) if mode == 1 else 0,  # type: ignore[union-attr]
        win.stride(0) if win is not None else 0,
        comp.stride(0) if comp is not None and not comp_blocks else 0,
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
        COMP_MODE=3 if comp_blocks else mode,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        BLOCK_R=BLOCK_R,
        GROUP=group,
        HAS_FLOOR=window_floor is not None and has_window,
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
        if value is None or out is None or isinstance(value, BlockRows):
            placed.append(value)
            continue
        view = out[: value.shape[0]]
        view.copy_(value)
        placed.append(view)
    return GroupedPrefillIndices(placed[0], rows.group_size, *placed[1:])  # type: ignore[arg-type]
