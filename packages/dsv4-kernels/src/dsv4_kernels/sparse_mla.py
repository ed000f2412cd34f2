"""Sparse MLA attention with sink for DeepSeek-V4 prefill: public, typed wrappers.

``sparse_mla_paged`` reads the keys straight from the FP8 (UE8M0) paged K
caches (window cache and compressed cache, global slots); ``sparse_mla_workspace``
reads a bf16 workspace with request-local rows (what vLLM passes FlashMLA
today).  Both compute exactly the query heads they are given (any H from 1 to
128, no padding), with FlashMLA's contract (DESIGN.md, "Sparse MLA with
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
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
import triton

from . import _triton_sparse_mla as _k
from ._validation import (
    check_out,
    check_page_cache,
    check_positive_int,
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import (
    HEAD_DIM,
    NOPE_DIM,
    TOKEN_DATA_BYTES,
    TOKEN_SCALE_BYTES,
    kernel_layout,
)
from .reference.prefill_indices import expand_grouped_rows

__all__ = ["MAX_HEADS", "sparse_mla_paged", "sparse_mla_workspace"]

MAX_HEADS = 128

# The UE8M0 layout constants the Triton kernel takes (one source: geometry).
_LAYOUT = kernel_layout(_k._sparse_mla_kernel)

# Tile sizes (compile-time constants): see docs/attention.md for the H200 sweep.
MMA_MIN_M = 16  # tl.dot's smallest M: heads are padded to this inside the kernel
# Per head count: up to SMALL_HEADS heads (TP8: 8 for V4-Flash, 16 for V4-Pro)
# one program per token; more heads (DP: 64, 128) split into blocks of
# MAX_BLOCK_H.  BLOCK_N keys per tile; PREFETCH requests the next tile's bytes
# before this tile's math; BF16_DEQUANT dequantises with (exact) bf16
# multiplies (float32 under the interpreter, whose bf16 arithmetic is wrong);
# NUM_STAGES is Triton's own loop pipelining (1: off).  The prefetch applies to
# FP8 pages only: a bf16 workspace tile is too large to hold twice.
# ASM (absent: off) reads the FP8 codes as int32 words and dequantises them in inline
# PTX; MAXNREG caps registers per thread.  Both are for sweeps: on the H200 they were
# slower at 8/16 heads in the Triton kernel (docs/attention.md, run 6).
# KERNEL=2 runs the Gluon wgmma kernel (:mod:`._gluon_sparse_mla`) where it can run
# (Hopper, up to 16 heads, 16-byte aligned FP8 pages; else the Triton kernel), with
# ASYNC_PV (the P V product overlapping the next tile's loads) and MAXNREG_H8, a
# register cap for up to 8 heads that lets three programs share a multiprocessor
# (the shared memory allows three at 8 heads, two at 16).  REG_A (REG_A_H8: at up to 8
# heads) computes S = K q^T with each dequantised block of K as wgmma's register
# operand, so the tile is read from shared memory once (for P V), not twice; IO_VEC
# (default on) moves q and out in 16-byte accesses where their strides allow.  H200
# runs 7-12 in docs/attention.md.
SMALL_HEADS = 16
TILES: dict[str, dict[str, int]] = {
    "small": dict(
        MAX_BLOCK_H=64,
        BLOCK_N=32,
        NUM_WARPS=4,
        NUM_STAGES=1,
        PREFETCH=1,
        BF16_DEQUANT=0,
        KERNEL=2,
        ASYNC_PV=1,
        MAXNREG_H8=168,
        REG_A_H8=1,
    ),
    "large": dict(
        MAX_BLOCK_H=64, BLOCK_N=32, NUM_WARPS=8, NUM_STAGES=1, PREFETCH=0, BF16_DEQUANT=1
    ),
}

_LOG2E = 1.4426950408889634


def _wgmma_ok(q: torch.Tensor, tiles: dict[str, int], paged: bool, aligned: bool) -> bool:
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
    tiles: dict[str, int],
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
            DATA_BYTES=TOKEN_DATA_BYTES,
            SCALE_BYTES=TOKEN_SCALE_BYTES,
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


_Grouping = tuple[torch.Tensor, int, "torch.Tensor | None", "torch.Tensor | None"]
# The most MMA rows (a group's tokens x heads padded to 8 or 16) the wgmma kernel takes.
MAX_GROUP_ROWS = 32


def group_rows(num_heads: int, group_size: int) -> int:
    """MMA rows of a group in the wgmma kernel: ``group_size`` x heads padded to 8 or 16."""
    return group_size * (8 if num_heads <= 8 else 16)


def _groups_run(q: torch.Tensor) -> bool:
    """Whether grouped rows can reach the wgmma kernel for this q (else they are expanded)."""
    return _wgmma_ok(q, TILES["small" if q.shape[1] <= SMALL_HEADS else "large"], True, True)


def prefill_group_size(q: torch.Tensor) -> int:
    """Tokens per group that the grouped rows should have for these queries on this
    device: the most whose rows fit the wgmma kernel (``MAX_GROUP_ROWS``) where it runs
    (Hopper, up to 16 heads), else 1 (grouping would only be expanded again)."""
    if q.shape[1] > SMALL_HEADS or not _groups_run(q):
        return 1
    return max(1, MAX_GROUP_ROWS // group_rows(q.shape[1], 1))


def _check_groups(
    leads: object,
    group_size: object,
    swa_starts: object,
    comp_starts: object,
    has_comp: bool,
    num_tokens: int,
    device: torch.device,
) -> _Grouping | None:
    """Validate the grouped-rows arguments (no synchronisation); None without leads."""
    if leads is None:
        for name, v in (("swa_starts", swa_starts), ("comp_starts", comp_starts)):
            if v is not None:
                raise ValueError(f"{name} is only meaningful with leads (grouped rows)")
        return None
    size = check_positive_int("group_size", group_size)
    g = check_tensor("leads", leads, dtype=torch.int32, ndim=1, device=device)
    if g.shape[0] != num_tokens:
        raise ValueError(
            f"leads must have {num_tokens} entries (one per query token), got {g.shape[0]}"
        )
    if comp_starts is not None and not has_comp:
        raise ValueError("comp_starts given without comp_cache / comp_indices")
    starts = []
    for name, v in (("swa_starts", swa_starts), ("comp_starts", comp_starts)):
        if v is not None:
            v = check_tensor(name, v, dtype=torch.int32, ndim=1, device=device)
            if v.shape[0] != num_tokens:
                raise ValueError(
                    f"{name} must have {num_tokens} entries (one per query token), got {v.shape[0]}"
                )
        starts.append(v)
    return (g, size, starts[0], starts[1])


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


def _block_h(num_heads: int, max_block_h: int) -> int:
    return min(max(MMA_MIN_M, triton.next_power_of_2(num_heads)), max_block_h)


def _check_q(q: object) -> torch.Tensor:
    q = check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    if q.shape[2] != HEAD_DIM:
        raise ValueError(
            f"q must be [num_tokens, num_heads, {HEAD_DIM}] (head size {HEAD_DIM}: "
            f"{NOPE_DIM} nope + {HEAD_DIM - NOPE_DIM} rope), got shape {tuple(q.shape)}"
        )
    if not 1 <= q.shape[1] <= MAX_HEADS:
        raise ValueError(f"q must have 1 to {MAX_HEADS} heads, got {q.shape[1]}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    return q


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return float(scale)


def _check_page_cache(name: str, cache: object, block_size: int, device: torch.device) -> int:
    """Validate a paged FP8 cache view (:func:`._validation.check_page_cache`, the one
    rule for every kernel); return its page stride in bytes.  Never syncs."""
    return check_page_cache(name, cache, block_size, device)[1]


def _check_rows(
    name: str,
    indices: object,
    lens_name: str,
    lens: object,
    num_tokens: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = check_tensor(name, indices, dtype=torch.int32, ndim=2, device=device)
    if idx.shape[0] != num_tokens:
        raise ValueError(
            f"{name} must have {num_tokens} rows (one per query token, like q), got {idx.shape[0]}"
        )
    if idx.shape[1] > 1 and idx.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if lens is None:
        return idx, None
    ln = check_tensor(lens_name, lens, dtype=torch.int32, ndim=1, device=device)
    if ln.shape[0] != num_tokens:
        raise ValueError(
            f"{lens_name} must have {num_tokens} entries (one per query token), got {ln.shape[0]}"
        )
    return idx, ln


def _check_sink_and_outputs(
    q: torch.Tensor,
    attn_sink: object,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    sink = None
    if attn_sink is not None:
        sink = check_tensor("attn_sink", attn_sink, dtype=torch.float32, ndim=1, device=q.device)
        if sink.shape[0] != H:
            raise ValueError(f"attn_sink must have {H} entries (one per head), got {sink.shape[0]}")
    check_out("out", out, (T, H, HEAD_DIM), torch.bfloat16, q.device)
    check_out("lse", lse, (T, H), torch.float32, q.device)
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return sink, out, lse


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
    if grouping is not None and not (use_triton(device) and _groups_run(q)):
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
        scale, attn_sink, out, lse: as in :func:`sparse_mla_paged`.

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
) -> None:
    """Launch the kernel (inputs already validated).

    The tile constants are read from this module at each call, so a sweep
    (``benchmarks/cases_sparse_mla.py --sweep``) can set them between calls.
    """
    T, H, _ = q.shape
    if T == 0:
        return
    tiles = TILES["small" if H <= SMALL_HEADS else "large"]
    max_block_h, block_n = tiles["MAX_BLOCK_H"], tiles["BLOCK_N"]
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
        and _wgmma_ok(q, tiles, a_paged, aligned)
        and _launch_wgmma(T, H, args, sources, tiles, grouping)
    ):
        return
    if grouping is not None:  # the wgmma kernel did not take them: per-token rows
        a_idx, a_lens, b_idx, b_lens = _per_token_rows(  # type: ignore[assignment]
            grouping, a_idx, a_lens, b_idx if b is not None else None, b_lens, T
        )
        _launch(
            q, out, lse, sink, a=(a_src, a_idx, a_lens, a_stride, a_rows), a_slots=a_slots,
            a_paged=a_paged, b=None if b is None else (b_src, b_idx, b_lens, b_stride, b_rows),
            b_slots=b_slots, scale=scale, aligned=aligned,
        )  # fmt: skip
        return
    meta = dict(
        **sources,
        A_PAGED=a_paged,
        ALIGNED=aligned,
        **_LAYOUT,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_FP32=interpreter_enabled(),
    )
    # ASM (absent: off): the FP8 codes as int32 words through inline PTX (CUDA only).
    words = bool(tiles.get("ASM", 0)) and aligned and not interpreter_enabled()
    extra: dict[str, Any] = {}
    if words:
        extra.update(A_WORDS=a_paged, B_WORDS=True)
    if tiles.get("MAXNREG") and not interpreter_enabled():
        extra["maxnreg"] = tiles["MAXNREG"]
    _k._sparse_mla_kernel[grid](
        *args,
        **meta,
        **extra,
        PREFETCH=bool(tiles["PREFETCH"]) and a_paged,
        BF16_DEQUANT=bool(tiles["BF16_DEQUANT"]) and not interpreter_enabled(),
        num_warps=tiles["NUM_WARPS"],
        num_stages=tiles["NUM_STAGES"],
    )
