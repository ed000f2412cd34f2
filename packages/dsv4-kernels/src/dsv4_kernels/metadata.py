"""Sparse top-k metadata for DeepSeek-V4 attention: public, typed wrappers.

Both functions are drop-in compatible with vLLM's functions of the same name.
CUDA tensors run the Triton kernels in :mod:`._triton_metadata`; CPU tensors
run :mod:`dsv4_kernels.reference` unless Triton's interpreter is on.
"""

from __future__ import annotations

import torch
import triton

from . import _triton_metadata as _k
from ._validation import (
    INDEX_DTYPES,
    check_length,
    check_min_length,
    check_nonnegative_int,
    check_out,
    check_positive_int,
    check_tensor,
    use_triton,
)
from .geometry import (
    C128A_RATIO,
    COMBINED_ALIGNMENT,
    PAGED_COMPRESS_RATIOS,
    combined_width,
)

__all__ = ["combine_topk_swa_indices", "compute_global_topk_indices_and_lens"]

# Tile sizes (compile-time constants, tuned on an H200; see docs/kernels.md).
COMBINE_BLOCK_T = 8
COMBINE_BLOCK_C = 128
COMBINE_BLOCK_R = 16
COMBINE_NUM_WARPS = 2
GLOBAL_BLOCK_T = 1
GLOBAL_BLOCK_K = 512
GLOBAL_NUM_WARPS = 1


def _outputs(
    out: torch.Tensor | None,
    lens_out: torch.Tensor | None,
    num_tokens: int,
    width: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's (checked) output buffers, or new int32 ones of the right shapes."""
    if out is None:
        out = torch.empty((num_tokens, width), dtype=torch.int32, device=device)
    if lens_out is None:
        lens_out = torch.empty(num_tokens, dtype=torch.int32, device=device)
    return out, lens_out


def _combine_args(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: torch.Tensor | None,
    left_visible: torch.Tensor | None,
    right_visible: torch.Tensor | None,
    max_image_tokens: int,
    num_tokens: int | None,
) -> tuple[int, int]:
    """Validate :func:`combine_topk_swa_indices`'s arguments on the host (its parameters,
    in its order, with ``out`` a tensor or None); return (num_tokens, row width).  Its own
    function so the metadata sweep can time the validation alone."""
    check_tensor("query_start_loc", query_start_loc, dtype=INDEX_DTYPES, ndim=1)
    device = query_start_loc.device
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, device=device)
    check_tensor("gather_lens", gather_lens, dtype=INDEX_DTYPES, ndim=1, device=device)
    num_reqs = seq_lens.shape[0]
    check_length("query_start_loc", query_start_loc, num_reqs + 1, "len(seq_lens) + 1")
    check_length("gather_lens", gather_lens, num_reqs, "one per request, like seq_lens")
    check_positive_int("window_size", window_size)
    if compress_ratio not in PAGED_COMPRESS_RATIOS:
        raise ValueError(
            f"compress_ratio must be one of {PAGED_COMPRESS_RATIOS} (SWA-only or V4.1's "
            f"full-length top-k rows, V4.1's ratio 2, C4A, C128A), got {compress_ratio}"
        )
    check_nonnegative_int("topk", topk)
    check_nonnegative_int("M", M)
    check_nonnegative_int("N", N)
    check_nonnegative_int("max_image_tokens", max_image_tokens)
    if compress_ratio == 1 and topk != 0 and topk_indices is None:
        raise ValueError(
            f"topk must be 0 for SWA-only layers (compress_ratio 1 without topk_indices), "
            f"got {topk}"
        )

    if num_tokens is not None:
        check_nonnegative_int("num_tokens", num_tokens)
    if topk_indices is not None:
        check_tensor("topk_indices", topk_indices, dtype=INDEX_DTYPES, ndim=2, device=device)
        if topk_indices.shape[1] < topk:
            raise ValueError(
                f"topk ({topk}) is wider than topk_indices "
                f"({topk_indices.shape[1]} columns); expected topk <= topk_indices.shape[1]"
            )
        if topk > 0 and topk_indices.stride(1) != 1:
            raise ValueError("topk_indices must be contiguous in its last dimension")
        if num_tokens is None:
            num_tokens = topk_indices.shape[0]
        check_length("topk_indices", topk_indices, num_tokens, "one row per query token")
    elif topk > 0 and compress_ratio != C128A_RATIO:
        raise ValueError(
            "topk_indices may be None only for C128A layers (compress_ratio 128) or topk 0, "
            f"got compress_ratio {compress_ratio} with topk {topk}"
        )
    for name, t in (("left_visible", left_visible), ("right_visible", right_visible)):
        if t is not None:
            check_tensor(name, t, dtype=INDEX_DTYPES, ndim=1, device=device)
            if num_tokens is None:
                num_tokens = t.shape[0]
            check_length(name, t, num_tokens, "one per query token")
    if (left_visible is None) != (right_visible is None):
        raise ValueError("left_visible and right_visible must be given together")
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, ndim=2, device=device)
        if num_tokens is None:
            num_tokens = out.shape[0]
    if num_tokens is None:
        # Only C128A / SWA-only calls without topk_indices, out, image masks
        # or num_tokens get here: the token count lives on the device.  This
        # reads it back (a synchronisation); pass `num_tokens=` to avoid it.
        num_tokens = int(query_start_loc[-1].item() - query_start_loc[0].item())
    width = combined_width(topk, window_size, max_image_tokens)
    check_out("out", out, (num_tokens, width), torch.int32, device, allow_more_rows=True)
    return num_tokens, width


def combine_topk_swa_indices(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
    *,
    lens_out: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build each prefill query token's row of KV-workspace indices (top-k + sliding window).

    The workspace holds, for request ``b``, rows ``[b*M, (b+1)*M)``: its
    compressed entries first (``b*M + c``), then from row ``b*M + N`` its last
    ``gather_lens[b]`` tokens.  For token ``t`` of request ``b`` at position
    ``pos = seq_lens[b] - query_len_b + (t - qs_b)``:

    * ``topk_len = clamp((pos + 1) // compress_ratio, 0, topk)``;
    * ``swa_start = max(pos - (W-1), 0)``, ``swa_len = max(min(pos+1, W), 0)``;
      with images ``swa_start = max(pos - (W-1) - max(left - (W-1), 0), 0)`` and
      ``swa_len = max(pos + right - swa_start + 1, 0)``;
    * columns ``j < topk_len`` hold ``b*M + topk_indices[t, j]`` (an entry
      that is negative stays -1); the next ``swa_len`` columns hold
      ``b*M + N + swa_start - (seq_lens[b] - gather_lens[b]) + (j - topk_len)``;
      every other column is -1.

    Args:
        topk_indices: ``[num_tokens, K]`` int32, ``K >= topk``, request-local
            compressed indices from the indexer.  ``None`` for C128A layers
            (the top-k part is ``0..topk_len-1``) or ``topk == 0``.
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths;
            may be a slice of a longer tensor (values are rebased by its first).
        seq_lens: ``[num_reqs]`` int32 total tokens of each request.
        gather_lens: ``[num_reqs]`` int32 tokens of each request gathered
            into the window region of the workspace.
        window_size: sliding window W (128 for DSV4).
        compress_ratio: 1 (SWA-only), 4 (C4A) or 128 (C128A); DeepSeek-V4.1's
            top-k layers 1 (full-length, with ``topk_indices`` and ``topk > 0``)
            or 2, as vLLM's V4.1 combine reads them.
        topk: top-k width (``index_topk`` for C4A and V4.1, the active compressed
            width for C128A, 0 for SWA-only).
        M: workspace rows per request.  N: first window row within a request.
        out: optional ``[>= num_tokens, Wc]`` int32 output (its first
            ``num_tokens`` rows are written and returned), ``Wc = ceil((topk + W
            + max_image_tokens) / 128) * 128``, or a ``(combined, lens)`` pair
            of preallocated outputs as vLLM 0.32 passes it.  With both outputs
            given nothing is allocated and nothing synchronises, so the call
            can be captured in a CUDA graph.
        left_visible, right_visible: optional ``[num_tokens]`` int32 image
            bidirectional visibility (given together).
        max_image_tokens: extra row width reserved for image windows.
        lens_out: optional ``[>= num_tokens]`` int32 buffer for ``lens`` (an
            extension of vLLM's signature); with ``out`` and ``lens_out`` the
            call allocates nothing.
        num_tokens: optional number of query tokens (an extension): needed
            only when ``topk_indices`` is None and neither ``out`` nor the
            image masks give it; without it such a call reads the count back
            from the device (one synchronisation).

    Returns:
        ``(combined [num_tokens, Wc] int32, lens [num_tokens] int32)`` with
        ``lens[t] = topk_len + swa_len``.

    Raises:
        ValueError: naming the argument, for wrong dtypes, ranks, lengths,
            devices, an ``out`` of the wrong shape, an unsupported ratio, a
            ``topk`` wider than ``topk_indices`` or negative ``M``/``N``.
    """
    if isinstance(out, (tuple, list)):
        if len(out) != 2 or lens_out is not None:
            raise ValueError(
                "out must be a tensor or a (combined, lens) pair, and lens_out must not be "
                "given with a pair"
            )
        out, lens_out = out
    # the row arguments, in the order every step below takes them
    rows = (
        topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
        topk, M, N,
    )  # fmt: skip
    num_tokens, width = _combine_args(
        *rows, out, left_visible, right_visible, max_image_tokens, num_tokens
    )
    device = query_start_loc.device
    check_out("lens_out", lens_out, (num_tokens,), torch.int32, device, allow_more_rows=True)
    # Workspaces sized for the largest batch (as vLLM passes them): use their first rows.
    if out is not None:
        out = out[:num_tokens]
    if lens_out is not None:
        lens_out = lens_out[:num_tokens]
    if not use_triton(device):
        from .reference import metadata as ref

        return ref.combine_topk_swa_indices(
            *rows,
            out=out,
            left_visible=left_visible,
            right_visible=right_visible,
            max_image_tokens=max_image_tokens,
            lens_out=lens_out,
            num_tokens=num_tokens,
        )
    out, lens = _outputs(out, lens_out, num_tokens, width, device)
    if num_tokens == 0:
        return out, lens
    if seq_lens.shape[0] == 0:
        raise ValueError("seq_lens must not be empty when there are query tokens")
    _launch_combine(*rows, out, lens, left_visible, right_visible)  # no top-k read at topk 0
    return out, lens


def combine_constexprs(
    window_size: int, compress_ratio: int, has_topk: bool, has_images: bool, topk_align: int
) -> dict[str, object]:
    """The combine kernel's compile-time arguments (the launch and the codegen probe share them)."""
    return dict(
        WINDOW=window_size,
        RATIO=compress_ratio if compress_ratio > 1 or has_topk else 0,
        HAS_TOPK=has_topk,
        HAS_IMAGES=has_images,
        TOPK_ALIGN=topk_align,
        ROW_ALIGN=COMBINED_ALIGNMENT,
        BLOCK_T=COMBINE_BLOCK_T,
        BLOCK_C=COMBINE_BLOCK_C,
        BLOCK_R=COMBINE_BLOCK_R,
    )


def _launch_combine(
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
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
) -> None:
    """Launch the combine kernel on validated arguments (``out`` holds exactly the chunk's rows).

    The one place the launch is spelled: the public wrapper and the tile
    sweep (which times it without the validation) call it.
    """
    num_tokens, width = out.shape
    has_topk = topk_indices is not None and topk > 0
    has_images = left_visible is not None
    grid = (triton.cdiv(num_tokens, COMBINE_BLOCK_T), triton.cdiv(width, COMBINE_BLOCK_C))
    # 16-byte top-k loads need 16-byte aligned rows whose width is a multiple of 4.
    topk_align = 1
    if topk_indices is not None and has_topk:
        k_width, k_stride = topk_indices.shape[1], topk_indices.stride(0)
        if k_width % 4 == 0 and k_stride % 4 == 0 and topk_indices.data_ptr() % 16 == 0:
            topk_align = 4
        topk_stride_units = k_stride // topk_align
    else:
        topk_stride_units = 0
    _k._combine_topk_swa_indices_kernel[grid](
        topk_indices if has_topk else out,
        query_start_loc,
        seq_lens,
        gather_lens,
        left_visible if has_images else lens,
        right_visible if has_images else lens,
        out,
        lens,
        topk_stride_units,
        out.stride(0),
        num_tokens,
        seq_lens.shape[0],
        topk if compress_ratio > 1 or has_topk else 0,
        width // COMBINED_ALIGNMENT,
        M,
        N,
        **combine_constexprs(window_size, compress_ratio, has_topk, has_images, topk_align),
        num_warps=COMBINE_NUM_WARPS,
    )


def global_constexprs(width: int, block_size: int) -> dict[str, object]:
    """The global-index kernel's compile-time arguments (the launch and the codegen probe)."""
    return dict(
        K=width,
        BLOCK_SIZE=block_size,
        BLOCK_T=GLOBAL_BLOCK_T,
        BLOCK_K=min(GLOBAL_BLOCK_K, max(16, triton.next_power_of_2(width))),
    )


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map request-local compressed indices to compressed-cache slots.

    ``global[t, j] = block_table[req, l // block_size] * block_size + l % block_size``
    for ``l = topk_indices[t, j] >= 0`` whose page is inside the block table,
    else -1.  Rows of invalid (padding) tokens are all -1 with length 0.  The
    block table is never read for negative entries, invalid tokens or pages
    past its width.

    Args:
        topk_indices: ``[num_tokens, K]`` int32 request-local compressed indices.
        token_to_req_indices: ``[>= num_tokens]`` int32 request row of each token
            (vLLM passes the whole batch's; the first ``num_tokens`` are used).
        block_table: ``[num_reqs, max_pages]`` int32 page ids (compressed cache).
        block_size: entries per compressed-cache page (256 / compress_ratio).
        is_valid_token: ``[>= num_tokens]`` bool (or int32, nonzero = valid).
        out, lens_out: optional preallocated outputs (``[num_tokens, K]`` and
            ``[num_tokens]`` int32; an extension of vLLM's signature): with
            both, the call allocates nothing and can be captured in a graph.

    Returns:
        ``(global_indices [num_tokens, K] int32, lens [num_tokens] int32)``;
        ``lens[t]`` counts the entries of row ``t`` that are not -1.
    """
    check_tensor("topk_indices", topk_indices, dtype=INDEX_DTYPES, ndim=2)
    device = topk_indices.device
    num_tokens, width = topk_indices.shape
    check_tensor(
        "token_to_req_indices", token_to_req_indices, dtype=INDEX_DTYPES, ndim=1, device=device
    )
    check_min_length("token_to_req_indices", token_to_req_indices, num_tokens, "one per token")
    check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2, device=device)
    check_positive_int("block_size", block_size)
    check_tensor(
        "is_valid_token", is_valid_token, dtype=(torch.bool, torch.int32), ndim=1, device=device
    )
    check_min_length("is_valid_token", is_valid_token, num_tokens, "one per token")
    if width > 0 and topk_indices.stride(1) != 1:
        raise ValueError("topk_indices must be contiguous in its last dimension")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    check_out("out", out, (num_tokens, width), torch.int32, device)
    check_out("lens_out", lens_out, (num_tokens,), torch.int32, device)
    if not use_triton(device):
        from .reference import metadata as ref

        return ref.compute_global_topk_indices_and_lens(
            topk_indices,
            token_to_req_indices,
            block_table,
            block_size,
            is_valid_token,
            out=out,
            lens_out=lens_out,
        )
    out, lens = _outputs(out, lens_out, num_tokens, width, device)
    if num_tokens == 0:
        return out, lens
    grid = (triton.cdiv(num_tokens, GLOBAL_BLOCK_T),)
    _k._global_topk_indices_kernel[grid](
        topk_indices,
        token_to_req_indices,
        is_valid_token,
        block_table,
        out,
        lens,
        topk_indices.stride(0),
        out.stride(0),
        block_table.stride(0),
        num_tokens,
        block_table.shape[1],
        **global_constexprs(width, block_size),
        num_warps=GLOBAL_NUM_WARPS,
    )
    return out, lens
