"""Sparse MLA attention with sink for DeepSeek-V4 prefill: public, typed wrappers.

``sparse_mla_paged`` reads the keys straight from the FP8 (UE8M0) paged K
caches (window cache and compressed cache, global slots); ``sparse_mla_workspace``
reads a bf16 workspace with request-local rows (what vLLM passes FlashMLA
today).  Both compute exactly the query heads they are given (any H from 1 to
128, no padding), with FlashMLA's contract (docs/design.md, "Sparse MLA with
sink"): per token ``t`` and head ``h``, over its valid keys ``j``,

    s_j = scale * q[t, h] . k_j
    lse[t, h] = log sum_j exp(s_j)                 (natural log, sink excluded)
    out[t, h] = sum_j softmax(s)_j k_j * exp(lse) / (exp(lse) + exp(sink[h]))

with K = V = the key's 512 values (448 dequantised nope + 64 rope).  A key is
valid when its column is below the row's length, its index is not -1 (any
negative value is a hole) and it addresses a slot inside the cache: indices
at or past ``num_pages * block_size`` (workspace: past its rows) are treated
as holes, since the host cannot see index values without a GPU
synchronisation.  A sink of ``-inf`` means no sink; a row with no valid key
gives ``out = 0`` and ``lse = -inf``.

CUDA tensors run the Gluon wgmma kernel of :mod:`._gluon_sparse_mla` on Hopper (up
to 16 heads, aligned FP8 pages) and the Triton kernel of :mod:`._triton_sparse_mla`
otherwise; CPU tensors
run :mod:`dsv4_kernels.reference` unless Triton's interpreter is on.

Grouped rows (``leads``: SWA-only and C128A layers, whose neighbouring tokens share
keys; :func:`dsv4_kernels.build_grouped_prefill_indices`) let the wgmma kernel load
and dequantise each key once for a group of tokens (:func:`prefill_group_size`);
every other path expands them to the equivalent per-token rows.

This module holds the public wrappers and the wgmma kernels' process-wide state: the
device check (``_hopper_runs_wgmma``) and the build-failure record (``_WGMMA_BROKEN``,
published by :func:`wgmma_available`), which the tests of both packages and
benchmarks/support replace here (``monkeypatch`` on this module).  The keys' checks, the
kernel choice and the launches, shared with the decode, are in :mod:`._paged_keys`; the
other argument checks in :mod:`._sparse_mla_checks`, the tile table (the measured
defaults, passed as ``tiles=``) and the grouping limit in :mod:`._sparse_mla_tiles`, the
kernels in :mod:`._triton_sparse_mla` and :mod:`._gluon_sparse_mla`.
"""

from __future__ import annotations

import functools

import torch

from ._paged_keys import WIDE_BLOCK_HEADS as WIDE_BLOCK_HEADS  # re-exported
from ._paged_keys import (
    KeySource,
    PagedKeys,
    PageView,
    check_paged_keys,
    launch,
    tiles_for,
    wgmma_runs,
)
from ._sparse_mla_checks import (
    MAX_HEADS,
    _check_groups,
    _check_q,
    _check_rows,
    _check_scale,
    _check_sink_and_outputs,
)
from ._sparse_mla_tiles import (
    MAX_GROUP_ROWS,
    SMALL_HEADS,
    TILES,
    TileTable,
    group_rows,
)
from ._sparse_mla_tiles import MMA_MIN_M as MMA_MIN_M  # re-exported
from ._validation import (
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import (
    HEAD_DIM,
)
from .reference.prefill_indices import BlockRows

__all__ = ["MAX_HEADS", "TILES", "sparse_mla_paged", "sparse_mla_workspace"]


def _hopper_runs_wgmma(device: torch.device) -> bool:
    """Whether ``device`` can run the wgmma kernel: CUDA of compute capability 9.x, no
    interpreter, and a Triton that has built it (or not yet tried)."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return wgmma_available()


# Why the (per-token) wgmma kernel failed to compile here, if it did: appended by
# :func:`._paged_keys.launch_wgmma`.
_WGMMA_BROKEN: list[str] = []


@functools.cache
def _gluon_importable() -> bool:
    try:
        from . import _gluon_sparse_mla  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return True


def wgmma_available() -> bool:
    """Whether this process can run the Gluon wgmma kernel on a Hopper GPU: Triton has
    Gluon's Hopper API and the kernel has not failed to compile here.  (Whether a call
    runs it also depends on the GPU, the head count and the cache's alignment.)"""
    return not _WGMMA_BROKEN and _gluon_importable()


def _groups_run(q: torch.Tensor, tiles: TileTable | None = None) -> bool:
    """Whether grouped rows can reach the wgmma kernel for this q (else they are expanded)."""
    return wgmma_runs(q, tiles_for(q.shape[1], tiles), True, True)


def prefill_group_size(q: torch.Tensor, tiles: TileTable | None = None) -> int:
    """Tokens per group that the grouped rows should have for these queries on this
    device: the most whose rows fit the wgmma kernel (``MAX_GROUP_ROWS``) where it runs
    (Hopper, up to 16 heads), else 1 (grouping would only be expanded again).  ``tiles``:
    as in :func:`sparse_mla_paged`."""
    if q.shape[1] > SMALL_HEADS or not _groups_run(q, tiles):
        return 1
    return max(1, MAX_GROUP_ROWS // group_rows(q.shape[1], 1))


def sparse_mla_paged(
    q: torch.Tensor,
    swa_cache: torch.Tensor | PageView,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    scale: float,
    *,
    swa_block_size: int | None = None,
    attn_sink: torch.Tensor | None = None,
    comp_cache: torch.Tensor | PageView | None = None,
    comp_indices: torch.Tensor | BlockRows | None = None,
    comp_lens: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    leads: torch.Tensor | None = None,
    group_size: int = 1,
    swa_starts: torch.Tensor | None = None,
    comp_starts: torch.Tensor | None = None,
    tiles: TileTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with sink over keys read from FP8 (UE8M0) paged K caches.

    The window slots and the compressed slots of a token form one key set
    (FlashMLA decode's ``indices`` + ``extra_indices``).  Semantics in the
    module docstring.

    Args:
        q: ``[T, H, 512]`` bf16 queries, ``1 <= H <= 128``, contiguous in the
            last dimension.
        swa_cache: the window cache, ``[num_pages, page_bytes]`` or
            ``[num_pages, swa_block_size, 584]`` uint8 (vLLM's per-layer view)
            with any page stride ``stride(0) >= round_up(swa_block_size * 584,
            576)`` (block-outer views, nonzero storage offsets are fine); or a
            :class:`dsv4_kernels.PageView` checked once by the caller (then
            ``swa_block_size`` may be left out).
        swa_indices: ``[T, K]`` int32 global slots ``page * swa_block_size +
            slot_in_page``; ``-1`` is a hole.
        swa_lens: ``[T]`` int32, only the first ``swa_lens[t]`` columns
            count; None counts all ``K``.
        scale: softmax scale (``512 ** -0.5`` for DSV4).
        swa_block_size: slots per window-cache page (64 in DSV4); None only with a
            :class:`~dsv4_kernels.PageView`.
        attn_sink: ``[H]`` float32 per-head sink (natural-log units; ``-inf``
            is no sink), or None.
        comp_cache: the compressed cache (same layout rules, ``comp_block_size``
            entries per page; or a :class:`~dsv4_kernels.PageView`), or None for
            SWA-only layers.
        comp_indices: ``[T, Kc]`` int32 global compressed slots, ``-1`` holes; or
            :class:`~dsv4_kernels.BlockRows` (C128A's rows named by the compressed
            block table and each token's request: every entry of the request in
            order, read through the table; ``comp_lens`` then required).
        comp_lens: ``[T]`` int32 lengths for ``comp_indices``, or None (all).
        comp_block_size: entries per compressed page (``256 // compress_ratio``).
        out: optional ``[T, H, 512]`` bf16 output buffer (contiguous last dim).
        lse: optional ``[T, H]`` float32 output buffer.
        leads: grouped rows (:func:`dsv4_kernels.build_grouped_prefill_indices`):
            ``[T]`` int32 leader of each token, in ``[G * (t // G), t]`` for
            ``G = group_size``; token ``t`` then reads the rows of ``leads[t]``,
            columns ``starts[t] .. starts[t] + lens[t] - 1``, and the tokens of
            a group share each key's load and dequantisation (the wgmma kernel;
            other paths expand the rows per token).
        group_size: tokens per group of ``leads`` (a host int).
        swa_starts, comp_starts: ``[T]`` int32 first columns (with ``leads``
            only; None: 0).
        tiles: the kernels' tile constants per head class, in :data:`TILES`' form
            (``{"small": {...}, "large": {...}}``; a class left out, or None: the
            measured defaults of :data:`TILES`); for sweeps and profiles.

    Returns:
        ``(out, lse)``: ``[T, H, 512]`` bf16 and ``[T, H]`` float32 (lse
        without the sink; ``-inf`` for a token with no valid key).

    Raises:
        ValueError: naming the argument, for a head size other than 512, H
            outside 1..128, wrong dtypes, ranks, devices or shapes, a page
            stride smaller than a page or inner strides other than (584, 1),
            compressed arguments given partly, starts without leads.
    """
    q = _check_q(q)
    device = q.device
    T = q.shape[0]
    scale = _check_scale(scale)
    keys = check_paged_keys(swa_cache, swa_indices, swa_lens, swa_block_size, comp_cache,
                            comp_indices, comp_lens, comp_block_size, T, device,
                            block_rows=True)  # fmt: skip
    sink, out, lse = _check_sink_and_outputs(q, attn_sink, out, lse)
    grouping = _check_groups(
        leads, group_size, swa_starts, comp_starts, keys.comp is not None, T, device
    )
    if grouping is not None and not (use_triton(device) and _groups_run(q, tiles)):
        # paths without grouped tiles read the same keys from per-token rows
        keys = keys.per_token(grouping, T)
        grouping = None
    if not use_triton(device):
        from .reference import sparse_mla as ref

        return ref.sparse_mla_paged(
            q, scale=scale, attn_sink=sink, out=out, lse=lse, **keys.arguments()
        )
    launch(q, out, lse, sink, keys, scale=scale, grouping=grouping, tiles=tiles)
    return out, lse


def sparse_mla_workspace(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None,
    scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    tiles: TileTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with sink over a bf16 workspace (vLLM's current prefill inputs).

    Same semantics as :func:`sparse_mla_paged`, with one key source.

    Args:
        q: ``[T, H, 512]`` bf16, ``1 <= H <= 128``.
        kv: ``[N, 512]`` (or ``[N, 1, 512]``, as vLLM passes FlashMLA) bf16
            workspace rows, contiguous in the last dimension.
        indices: ``[T, K]`` int32 rows of ``kv``; ``-1`` (any negative) is a
            hole, rows ``>= N`` are holes too.
        lens: ``[T]`` int32 lengths (only the first ``lens[t]`` columns
            count), or None for all ``K``.
        scale, attn_sink, out, lse, tiles: as in :func:`sparse_mla_paged`.

    Returns:
        ``(out, lse)``: ``[T, H, 512]`` bf16 and ``[T, H]`` float32.
    """
    q = _check_q(q)
    device = q.device
    T = q.shape[0]
    scale = _check_scale(scale)
    rows = check_tensor("kv", kv, dtype=torch.bfloat16, ndim=(2, 3), device=device)
    if rows.dim() == 3:
        if rows.shape[1] != 1:
            raise ValueError(f"a 3-D kv must be [N, 1, {HEAD_DIM}], got shape {tuple(rows.shape)}")
        rows = rows[:, 0]
    if rows.shape[1] != HEAD_DIM:
        raise ValueError(f"kv must be [N, {HEAD_DIM}] bf16, got shape {tuple(kv.shape)}")
    if rows.stride(1) != 1:
        raise ValueError("kv must be contiguous in its last dimension")
    idx, ln = _check_rows("indices", indices, "lens", lens, T, device)
    sink, out, lse = _check_sink_and_outputs(q, attn_sink, out, lse)
    if not use_triton(device):
        from .reference import sparse_mla as ref

        return ref.sparse_mla_workspace(q, rows, idx, ln, scale, attn_sink=sink, out=out, lse=lse)
    row_stride = rows.stride(0) if rows.shape[0] > 1 else HEAD_DIM
    keys = PagedKeys(KeySource(rows, idx, ln, 1, row_stride, rows.shape[0]), paged=False)
    launch(q, out, lse, sink, keys, scale=scale, tiles=tiles)
    return out, lse
