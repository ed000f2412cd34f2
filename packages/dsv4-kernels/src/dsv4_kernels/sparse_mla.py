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

Over 500 lines on purpose: the public wrappers, the kernel choice with its
process-wide fallback record (``_WGMMA_BROKEN``, :func:`wgmma_available`) and the two
launchers stay in one module because they look each other up here, where the tests of
both packages replace them (``monkeypatch`` on this module).  The argument checks are
in :mod:`._sparse_mla_checks`, the tile table (the measured defaults, passed as
``tiles=``) and the grouping limit in :mod:`._sparse_mla_tiles`, the kernels in
:mod:`._triton_sparse_mla` and :mod:`._gluon_sparse_mla`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import triton

from . import _triton_sparse_mla as _k
from ._sparse_mla_checks import (
    MAX_HEADS,
    _check_groups,
    _check_page_cache,
    _check_q,
    _check_rows,
    _check_scale,
    _check_sink_and_outputs,
    _Grouping,
)
from ._sparse_mla_tiles import (
    MAX_GROUP_ROWS,
    SMALL_HEADS,
    TILES,
    TileTable,
    group_rows,
    head_class,
)
from ._sparse_mla_tiles import MMA_MIN_M as MMA_MIN_M  # re-exported
from ._sparse_mla_tiles import block_h as _block_h
from ._validation import (
    check_positive_int,
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import (
    HEAD_DIM,
)
from .reference.prefill_indices import expand_grouped_rows

__all__ = ["MAX_HEADS", "TILES", "sparse_mla_paged", "sparse_mla_workspace"]

_LOG2E = 1.4426950408889634


def _wgmma_ok(q: torch.Tensor, tiles: Mapping[str, int], paged: bool, aligned: bool) -> bool:
    """Whether the Gluon wgmma kernel (:mod:`._gluon_sparse_mla`) runs this call: a tile
    naming ``KERNEL=2`` (wgmma), up to 16 heads, FP8 pages with 16-byte aligned rows,
    a CUDA device of compute capability 9.x and a Triton with Gluon's Hopper API."""
    if tiles.get("KERNEL", 0) != 2 or not paged or not aligned or q.shape[1] > 16:
        return False
    return _hopper_runs_wgmma(q.device)


def _hopper_runs_wgmma(device: torch.device) -> bool:
    """Whether ``device`` can run the wgmma kernel: CUDA of compute capability 9.x, no
    interpreter, and a Triton that has built it (or not yet tried)."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return wgmma_available()


_WGMMA_BROKEN: list[str] = []  # why the wgmma kernel failed to compile here, if it did


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


def _whole_vectors(*tensors: torch.Tensor) -> bool:
    """Whether each tensor's base is 16-byte aligned and its token and head strides are
    whole 16-byte vectors (8 bf16 elements): the kernel may then move q and out in
    16-byte accesses.  Host-side metadata only, no synchronisation."""
    return all(
        x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0 for x in tensors
    )


def _launch_wgmma(
    T: int,
    H: int,
    args: tuple[Any, ...],
    meta: dict[str, Any],
    tiles: Mapping[str, int],
    grouping: _Grouping | None = None,
) -> bool:
    """Launch the wgmma kernel; False (after one warning) when it does not compile with
    this Triton, so the caller runs the Triton kernel instead."""
    from . import _gluon_sparse_mla as g

    q, out = args[0], args[1]

    hp = 8 if H <= 8 else 16
    nreg = tiles.get("MAXNREG") or (tiles.get("MAXNREG_H8") if hp == 8 else None)
    grid = T
    unused = args[5] if len(args) > 5 else q  # any tensor for the unused pointers
    extra: tuple[Any, ...] = (unused, unused, unused)
    group_meta: dict[str, Any] = {}
    if grouping is not None:
        leads, size, a_st, b_st = grouping
        grid = triton.cdiv(T, size)
        extra = (leads, a_st if a_st is not None else leads, b_st if b_st is not None else leads)
        group_meta = dict(G=size, A_HAS_STARTS=a_st is not None, B_HAS_STARTS=b_st is not None)
        nreg = None  # more rows than the cap was measured for
    try:
        g._sparse_mla_wgmma_kernel[(grid,)](
            *args,
            *extra,
            **meta,
            **group_meta,
            HT=hp,
            ASYNC_PV=bool(tiles.get("ASYNC_PV", 0)),
            REG_A=bool(
                tiles.get("REG_A_G", 0)
                if grouping is not None
                else tiles.get("REG_A", tiles.get("REG_A_H8", 0) if hp == 8 else 0)
            ),
            IO_VEC=bool(tiles.get("IO_VEC", 1)) and _whole_vectors(q, out),
            num_warps=4,
            **({"maxnreg": nreg} if nreg else {}),
        )
    except Exception as exc:
        # A failed build leaves no compiled variant: once one exists, Gluon can build the
        # kernel here and this is a real error, not a fallback case.
        if g.compiled_variants():
            raise
        _WGMMA_BROKEN.append(f"{type(exc).__name__}: {exc}"[:400])
        warnings.warn(
            f"dsv4_kernels: the Gluon wgmma sparse MLA kernel did not build with Triton "
            f"{triton.__version__} ({_WGMMA_BROKEN[0]}); the Triton kernel runs instead",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _tiles(num_heads: int, tiles: TileTable | None) -> Mapping[str, int]:
    """One launch's tile constants: the head class's entry of ``tiles``, else the measured
    default (:data:`TILES`)."""
    cls = head_class(num_heads)
    if tiles is not None and cls in tiles:
        return tiles[cls]
    return TILES[cls]


def _groups_run(q: torch.Tensor, tiles: TileTable | None = None) -> bool:
    """Whether grouped rows can reach the wgmma kernel for this q (else they are expanded)."""
    return _wgmma_ok(q, _tiles(q.shape[1], tiles), True, True)


def prefill_group_size(q: torch.Tensor, tiles: TileTable | None = None) -> int:
    """Tokens per group that the grouped rows should have for these queries on this
    device: the most whose rows fit the wgmma kernel (``MAX_GROUP_ROWS``) where it runs
    (Hopper, up to 16 heads), else 1 (grouping would only be expanded again).  ``tiles``:
    as in :func:`sparse_mla_paged`."""
    if q.shape[1] > SMALL_HEADS or not _groups_run(q, tiles):
        return 1
    return max(1, MAX_GROUP_ROWS // group_rows(q.shape[1], 1))


def _per_token_rows(
    grouping: _Grouping,
    a_idx: torch.Tensor,
    a_lens: torch.Tensor | None,
    b_idx: torch.Tensor | None,
    b_lens: torch.Tensor | None,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Both sources' grouped rows expanded to the equivalent per-token rows and lengths."""
    leads, _, a_starts, b_starts = grouping
    a_idx, a_lens = expand_grouped_rows(leads, a_idx, a_lens, a_starts, num_tokens)
    if b_idx is not None:
        b_idx, b_lens = expand_grouped_rows(leads, b_idx, b_lens, b_starts, num_tokens)
    return a_idx, a_lens, b_idx, b_lens


def sparse_mla_paged(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    scale: float,
    *,
    swa_block_size: int,
    attn_sink: torch.Tensor | None = None,
    comp_cache: torch.Tensor | None = None,
    comp_indices: torch.Tensor | None = None,
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
            576)`` (block-outer views, nonzero storage offsets are fine).
        swa_indices: ``[T, K]`` int32 global slots ``page * swa_block_size +
            slot_in_page``; ``-1`` is a hole.
        swa_lens: ``[T]`` int32, only the first ``swa_lens[t]`` columns
            count; None counts all ``K``.
        scale: softmax scale (``512 ** -0.5`` for DSV4).
        swa_block_size: slots per window-cache page (64 in DSV4).
        attn_sink: ``[H]`` float32 per-head sink (natural-log units; ``-inf``
            is no sink), or None.
        comp_cache: the compressed cache (same layout rules, ``comp_block_size``
            entries per page), or None for SWA-only layers.
        comp_indices: ``[T, Kc]`` int32 global compressed slots, ``-1`` holes.
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
    check_positive_int("swa_block_size", swa_block_size)
    a_stride = _check_page_cache("swa_cache", swa_cache, swa_block_size, device)
    a_idx, a_lens = _check_rows("swa_indices", swa_indices, "swa_lens", swa_lens, T, device)
    comp_given = [x is not None for x in (comp_cache, comp_indices, comp_block_size)]
    if any(comp_given) and not all(comp_given):
        raise ValueError(
            "comp_cache, comp_indices and comp_block_size must be given together "
            "(all None for SWA-only layers)"
        )
    if comp_lens is not None and comp_cache is None:
        raise ValueError("comp_lens given without comp_cache / comp_indices")
    b_stride = 0
    b_idx = b_lens = None
    if comp_cache is not None:
        check_positive_int("comp_block_size", comp_block_size)
        assert comp_block_size is not None
        b_stride = _check_page_cache("comp_cache", comp_cache, comp_block_size, device)
        b_idx, b_lens = _check_rows("comp_indices", comp_indices, "comp_lens", comp_lens, T, device)
    sink, out, lse = _check_sink_and_outputs(q, attn_sink, out, lse)
    grouping = _check_groups(
        leads, group_size, swa_starts, comp_starts, b_idx is not None, T, device
    )
    if grouping is not None and not (use_triton(device) and _groups_run(q, tiles)):
        # paths without grouped tiles read the same keys from per-token rows
        a_idx, a_lens, b_idx, b_lens = _per_token_rows(grouping, a_idx, a_lens, b_idx, b_lens, T)
        grouping = None
    if not use_triton(device):
        from .reference import sparse_mla as ref

        return ref.sparse_mla_paged(
            q,
            swa_cache,
            a_idx,
            a_lens,
            scale,
            swa_block_size=swa_block_size,
            attn_sink=sink,
            comp_cache=comp_cache,
            comp_indices=b_idx,
            comp_lens=b_lens,
            comp_block_size=comp_block_size,
            out=out,
            lse=lse,
        )
    caches = [swa_cache] if comp_cache is None else [swa_cache, comp_cache]
    aligned = all(c.data_ptr() % 16 == 0 for c in caches) and a_stride % 16 == 0
    aligned = aligned and b_stride % 16 == 0
    _launch(
        q,
        out,
        lse,
        sink,
        a=(swa_cache, a_idx, a_lens, a_stride, swa_cache.shape[0] * swa_block_size),
        a_slots=swa_block_size,
        a_paged=True,
        b=None
        if comp_cache is None or b_idx is None
        else (comp_cache, b_idx, b_lens, b_stride, comp_cache.shape[0] * (comp_block_size or 1)),
        b_slots=comp_block_size or 1,
        scale=scale,
        aligned=aligned,
        grouping=grouping,
        tiles=tiles,
    )
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
    _launch(
        q,
        out,
        lse,
        sink,
        a=(rows, idx, ln, row_stride, rows.shape[0]),
        a_slots=1,
        a_paged=False,
        b=None,
        b_slots=1,
        scale=scale,
        aligned=False,
        tiles=tiles,
    )
    return out, lse


_Src = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]


def _launch(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor | None,
    *,
    a: _Src,
    a_slots: int,
    a_paged: bool,
    b: _Src | None,
    b_slots: int,
    scale: float,
    aligned: bool,
    grouping: _Grouping | None = None,
    tiles: TileTable | None = None,
) -> None:
    """Launch the kernel (inputs already validated) with the tile constants of ``tiles``
    (:func:`sparse_mla_paged`'s argument; None: :data:`TILES`)."""
    T, H, _ = q.shape
    if T == 0:
        return
    cfg = _tiles(H, tiles)
    max_block_h, block_n = cfg["MAX_BLOCK_H"], cfg["BLOCK_N"]
    block_h = _block_h(H, max_block_h)
    head_blocks = triton.cdiv(H, block_h)
    a_src, a_idx, a_lens, a_stride, a_rows = a
    b_src, b_idx, b_lens, b_stride, b_rows = b if b is not None else (a_src, a_idx, None, 0, 0)
    grid = (T * head_blocks,)
    args = (
        q,
        out,
        lse,
        sink if sink is not None else lse,
        a_src,
        a_idx,
        a_lens if a_lens is not None else a_idx,
        b_src,
        b_idx,
        b_lens if b_lens is not None else b_idx,
        T,
        H,
        a_idx.stride(0),
        a_idx.shape[1],
        a_stride,
        a_rows,
        b_idx.stride(0),
        b_idx.shape[1],
        b_stride,
        b_rows,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        scale * _LOG2E,
    )
    sources = dict(  # what both kernels specialise on
        A_SLOTS=a_slots,
        A_HAS_LENS=a_lens is not None,
        HAS_B=b is not None,
        B_SLOTS=b_slots,
        B_HAS_LENS=b_lens is not None,
        HAS_SINK=sink is not None,
    )
    fits = grouping is None or (grouping[1] > 1 and group_rows(H, grouping[1]) <= MAX_GROUP_ROWS)
    if (
        fits
        and _wgmma_ok(q, cfg, a_paged, aligned)
        and _launch_wgmma(T, H, args, sources, cfg, grouping)
    ):
        return
    if grouping is not None:  # the wgmma kernel did not take them: per-token rows
        a_idx, a_lens, b_idx, b_lens = _per_token_rows(  # type: ignore[assignment]
            grouping, a_idx, a_lens, b_idx if b is not None else None, b_lens, T
        )
        _launch(
            q, out, lse, sink, a=(a_src, a_idx, a_lens, a_stride, a_rows), a_slots=a_slots,
            a_paged=a_paged, b=None if b is None else (b_src, b_idx, b_lens, b_stride, b_rows),
            b_slots=b_slots, scale=scale, aligned=aligned, tiles=tiles,
        )  # fmt: skip
        return
    meta = dict(
        **sources,
        A_PAGED=a_paged,
        ALIGNED=aligned,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_FP32=interpreter_enabled(),
    )
    # ASM (absent: off): the FP8 codes as int32 words through inline PTX (CUDA only).
    words = bool(cfg.get("ASM", 0)) and aligned and not interpreter_enabled()
    extra: dict[str, Any] = {}
    if words:
        extra.update(A_WORDS=a_paged, B_WORDS=True)
    if cfg.get("MAXNREG") and not interpreter_enabled():
        extra["maxnreg"] = cfg["MAXNREG"]
    _k._sparse_mla_kernel[grid](
        *args,
        **meta,
        **extra,
        PREFETCH=bool(cfg["PREFETCH"]) and a_paged,
        BF16_DEQUANT=bool(cfg["BF16_DEQUANT"]) and not interpreter_enabled(),
        num_warps=cfg["NUM_WARPS"],
        num_stages=cfg["NUM_STAGES"],
    )
