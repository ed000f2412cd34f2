"""The FP8 (UE8M0) paged K cache of DeepSeek-V4 attention: public, typed wrappers.

``quantize_and_insert_k_cache`` and ``dequantize_and_gather_k_cache`` are
drop-in compatible with vLLM's functions of the same name.  CUDA tensors run
the Triton kernels in :mod:`._triton_kv_cache`; CPU tensors run
:mod:`dsv4_kernels.reference` unless Triton's interpreter is on.

Layout (per page of ``slots_per_page`` tokens or compressed entries, docs/design.md
"FP8 K cache"): token ``s`` keeps 448 E4M3 codes (7 blocks of 64) and its 64
rope values as bf16 at byte ``s * 576``; after all the page's data come 8
scale bytes per token (7 UE8M0 exponents ``e + 127`` and a zero byte) at
``slots_per_page * 576 + s * 8``.  Pages are at least
``k_cache_page_stride(slots)`` = ``round_up(slots * 584, 576)`` bytes apart:
exactly that in a cache of one layer (:func:`empty_k_cache`), a whole block
in vLLM's block-outer views, where one block holds a page of every layer of
a cache group; the kernels take the stride from ``k_cache.stride(0)`` at run
time (64-bit offsets, one compiled kernel for every layer).

Quantisation of a block of 64 values ``x``: ``e = ceil(log2(max(amax, 1e-4) /
448))``, codes ``e4m3(clamp(x / 2**e, -448, 448))`` rounded to nearest, ties to
even (the same bytes as torch's ``.to(torch.float8_e4m3fn)``); dequantisation
``code * 2**(byte - 127)``, so each element is off by at most half an E4M3
step at its own code's magnitude, ``|y - x| <= 2**(floor(log2 |x / 2**e|) - 4 + e)``
(subnormal codes below ``2**-6``: ``2**(e - 10)``), and rope values are exact.
"""

from __future__ import annotations

import torch
import triton

from . import _triton_kv_cache as _k
from ._validation import (
    check_block_table_width,
    check_nonnegative_int,
    check_page_cache,
    check_positive_int,
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import (
    AMAX_FLOOR,
    FP8_MAX,
    FP8_MAX_EXP,
    FP8_MAX_MANTISSA,
    HEAD_DIM,
    NOPE_DIM,
    ROPE_DIM,
    SWA_BLOCK_SIZE,
    UE8M0_BIAS,
    page_stride_bytes,
)

__all__ = [
    "dequantize_and_gather_k_cache",
    "empty_k_cache",
    "k_cache_page_stride",
    "quantize_and_insert_k_cache",
]

# dtypes accepted for slot mappings, lengths and block tables (vLLM passes
# int64 slot mappings and int32 lengths / block tables).
SLOT_DTYPES = (torch.int64, torch.int32)
LEN_DTYPES = (torch.int32, torch.int64)

# Tile sizes (compile-time constants).  On an H200 (benchmarks/experiments/sweep_kv_cache.py,
# 2026-11-29, two runs) the fastest variants, 4-8 tokens and 1-2 warps per
# program, were within run-to-run noise of each other at 16K tokens; 1 token or
# 8 warps per program was up to 2x slower.  Evict-first stores gained nothing,
# and the next kernel usually reads what these write.
INSERT_BLOCK_T = 8
INSERT_NUM_WARPS = 2
GATHER_BLOCK_T = 8
GATHER_NUM_WARPS = 2
EVICT_FIRST = False
# Requests run along grid axis 1, which CUDA limits to 65535 programs.
MAX_GRID_REQUESTS = 65535

# (major, minor) compute capability per CUDA device index (a host query, cached).
_CAPABILITY: dict[int, tuple[int, int]] = {}


def _hardware_fp8_rounding(device: torch.device) -> bool:
    """True where the GPU's float->E4M3 conversion can be used (sm_89+, not interpreted).

    Elsewhere the kernel rounds in integer arithmetic: the interpreter's own
    cast rounds half-up and can lose the mantissa carry.
    """
    if device.type != "cuda" or interpreter_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= (8, 9)


def k_cache_page_stride(slots_per_page: int) -> int:
    """Bytes between two pages of an FP8 K cache with ``slots_per_page`` slots.

    ``round_up(slots_per_page * 584, 576)``: 37440 for 64 slots (the
    sliding-window cache and C4A), 1728 for 2 slots (C128A).
    """
    check_positive_int("slots_per_page", slots_per_page)
    return page_stride_bytes(slots_per_page)


def empty_k_cache(
    num_pages: int, slots_per_page: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Allocate an (uninitialised) FP8 K cache.

    Args:
        num_pages: number of pages.
        slots_per_page: tokens per page (64 for the sliding-window cache),
            or compressed entries per page (``256 // compress_ratio``).
        device: where to allocate (default: torch's default device).

    Returns:
        ``[num_pages, k_cache_page_stride(slots_per_page)]`` uint8.
    """
    check_nonnegative_int("num_pages", num_pages)
    stride = k_cache_page_stride(slots_per_page)
    return torch.empty((num_pages, stride), dtype=torch.uint8, device=device)


def _check_k_cache(k_cache: object, block_size: int) -> tuple[torch.Tensor, int, int]:
    """Validate the cache (:func:`._validation.check_page_cache`, the one rule for every
    kernel); return (cache, num_pages, bytes between pages).  Never syncs."""
    check_positive_int("block_size", block_size)
    cache, stride = check_page_cache("k_cache", k_cache, block_size)
    return cache, cache.shape[0], stride


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = SWA_BLOCK_SIZE,
) -> None:
    """Quantise keys to FP8 (UE8M0) and write them into the paged cache, in place.

    Token ``t`` goes to page ``slot_mapping[t] // block_size``, slot
    ``slot_mapping[t] % block_size``: its 448 nope values as E4M3 codes in 7
    blocks of 64 with one power-of-two exponent each, its 64 rope values as
    bf16, its 8 scale bytes (7 exponents and a zero byte).  Nothing else in
    the cache is written.  A negative slot (``-1``: padding) or a slot at or
    past ``num_pages * block_size`` writes nothing.  Slots must be distinct.

    Args:
        k: ``[n, 512]`` bf16 keys (448 nope then 64 rope), contiguous in the
            last dimension; ``n >= num_tokens`` (extra rows, e.g. padding, are
            ignored, as in vLLM).
        k_cache: ``[num_pages, k_cache_page_stride(block_size)]`` uint8 (see
            :func:`empty_k_cache`), or a ``[num_pages, block_size, 584]``
            uint8 view with strides ``(stride, 584, 1)``; pages may be any
            ``stride >= k_cache_page_stride(block_size)`` bytes apart, at any
            storage offset (vLLM's block-outer per-layer views).
        slot_mapping: ``[num_tokens]`` int64 (or int32) cache slot of each token.
        block_size: slots per page (64 for the sliding-window cache,
            ``256 // compress_ratio`` for compressed caches).

    Raises:
        ValueError: naming the argument, for wrong dtypes, ranks, devices,
            ``k`` not 512 wide or shorter than ``slot_mapping``, or a cache
            whose pages are closer than ``k_cache_page_stride(block_size)``
            or whose inner strides are not ``(584, 1)`` / ``1``.
    """
    cache, num_pages, stride = _check_k_cache(k_cache, block_size)
    device = cache.device
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2, device=device)
    check_tensor("slot_mapping", slot_mapping, dtype=SLOT_DTYPES, ndim=1, device=device)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(
            f"k must be [num_tokens, {HEAD_DIM}] ({NOPE_DIM} nope + {ROPE_DIM} rope), "
            f"got shape {tuple(k.shape)}"
        )
    num_tokens = slot_mapping.shape[0]
    if k.shape[0] < num_tokens:
        raise ValueError(
            f"k must have at least {num_tokens} rows (one per slot_mapping entry), got {k.shape[0]}"
        )
    if k.stride(1) != 1:
        raise ValueError("k must be contiguous in its last dimension")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")
    if not use_triton(device):
        from .reference import kv_cache as ref

        ref.quantize_and_insert_k_cache(k, cache, slot_mapping, block_size)
        return
    if num_tokens == 0 or num_pages == 0:
        return
    _launch_insert(k, cache, slot_mapping, block_size, stride, num_pages)


def _launch_insert(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    stride: int,
    num_pages: int,
    *,
    block_t: int = INSERT_BLOCK_T,
    num_warps: int = INSERT_NUM_WARPS,
    exact_rounding: bool | None = None,
    evict_first: bool = EVICT_FIRST,
) -> None:
    """Launch the insert kernel (inputs already validated).

    ``exact_rounding`` None picks integer rounding unless the hardware
    conversion is available (both give torch's bytes).
    """
    if exact_rounding is None:
        exact_rounding = not _hardware_fp8_rounding(cache.device)
    num_tokens = slot_mapping.shape[0]
    grid = (triton.cdiv(num_tokens, block_t),)
    _k._quantize_and_insert_k_cache_kernel[grid](
        k,
        cache,
        slot_mapping,
        k.stride(0),
        stride,
        num_tokens,
        num_pages * block_size,
        SLOTS=block_size,
        PAGE_ALIGNED=stride % 16 == 0,
        FP8_MAX=FP8_MAX,
        FP8_MAX_EXP=FP8_MAX_EXP,
        FP8_MAX_MANTISSA=FP8_MAX_MANTISSA,
        AMAX_FLOOR=AMAX_FLOOR,
        BIAS=UE8M0_BIAS,
        BLOCK_T=block_t,
        EXACT_ROUNDING=exact_rounding,
        EVICT_FIRST=evict_first,
        num_warps=num_warps,
    )


def _check_gather_values(
    out_rows: int,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """Checks that read the lengths' values (a host read: CPU tensors or check_values)."""
    seq = seq_lens.to("cpu", torch.int64)
    if seq.numel() == 0:
        return
    if int(seq.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {int(seq.min())}")
    glen = seq
    if gather_lens is not None:
        glen = gather_lens.to("cpu", torch.int64)
        if int(glen.min()) < 0:
            raise ValueError(f"gather_lens must be >= 0, got min {int(glen.min())}")
        if bool((glen > seq).any()):
            b = int((glen > seq).nonzero()[0, 0])
            raise ValueError(
                f"gather_lens must be <= seq_lens, got {int(glen[b])} > {int(seq[b])} "
                f"for request {b}"
            )
    need_rows = offset + int(glen.max())
    if need_rows > out_rows:
        raise ValueError(
            f"out has {out_rows} rows per request, too short for offset + max(gather_lens) "
            f"= {offset} + {int(glen.max())} = {need_rows}"
        )
    longest = int(seq.max())
    check_block_table_width("block_table", block_table, longest, block_size, f"{longest}")


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    *,
    check_values: bool = False,
) -> None:
    """Dequantise and gather each request's last tokens from the paged cache into ``out``.

    For request ``b``, with ``g = gather_lens[b]`` (``seq_lens[b]`` when
    ``gather_lens`` is None) and ``start = seq_lens[b] - g``, writes
    ``out[b, offset + i, :] = dequant(token start + i)`` for ``0 <= i < g``,
    reading token ``p`` from page ``block_table[b, p // block_size]``, slot
    ``p % block_size``.  Nothing else in ``out`` is written.

    Args:
        out: ``[num_reqs, rows, 512]`` bf16 workspace, contiguous in the last
            dimension (any strides otherwise).
        k_cache: as for :func:`quantize_and_insert_k_cache`: pages
            ``stride(0) >= k_cache_page_stride(block_size)`` bytes apart,
            2-D ``[num_pages, >= page]`` or 3-D ``[num_pages, block_size,
            584]`` with strides ``(stride, 584, 1)``, any storage offset.
        seq_lens: ``[num_reqs]`` int32 (or int64) tokens (entries) of each
            request in the cache.
        gather_lens: ``[num_reqs]`` int32 (or int64) tokens to gather from the
            end of each request, or None for all of them.
        block_table: ``[num_reqs, max_pages]`` int32 (or int64) page ids.
        block_size: slots per page.
        offset: first row of ``out`` written for every request.
        check_values: also check, on CUDA tensors, what depends on the
            lengths' values (``offset + gather_lens <= rows``, ``gather_lens <=
            seq_lens``, the block table wide enough).  This reads the lengths
            back (a host synchronisation); CPU tensors are always checked.
            Unchecked, the kernel never reads or writes out of bounds: rows
            past ``out``, pages past the block table's width or the cache and
            negative page ids are skipped.

    Raises:
        ValueError: naming the argument, for wrong dtypes, ranks, devices,
            lengths, ``out`` not 512 wide, a cache whose pages are closer than
            ``k_cache_page_stride(block_size)`` or whose inner strides are
            wrong, and (see ``check_values``) an ``out`` too
            short for ``offset + gather_lens`` or a block table narrower than
            the longest request needs.
    """
    cache, num_pages, stride = _check_k_cache(k_cache, block_size)
    device = cache.device
    check_tensor("out", out, dtype=torch.bfloat16, ndim=3, device=device)
    check_tensor("seq_lens", seq_lens, dtype=LEN_DTYPES, ndim=1, device=device)
    check_tensor("block_table", block_table, dtype=LEN_DTYPES, ndim=2, device=device)
    num_reqs = seq_lens.shape[0]
    if gather_lens is not None:
        check_tensor("gather_lens", gather_lens, dtype=LEN_DTYPES, ndim=1, device=device)
        if gather_lens.shape[0] != num_reqs:
            raise ValueError(
                f"gather_lens must have {num_reqs} entries (one per request, like seq_lens), "
                f"got {gather_lens.shape[0]}"
            )
    if out.shape[0] < num_reqs or out.shape[2] != HEAD_DIM:
        raise ValueError(
            f"out must be [num_reqs >= {num_reqs}, rows, {HEAD_DIM}] bf16, "
            f"got shape {tuple(out.shape)}"
        )
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must have a row per request ({num_reqs}), got {block_table.shape[0]}"
        )
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    check_nonnegative_int("offset", offset)
    if offset > out.shape[1]:
        raise ValueError(f"offset must be <= out.shape[1] ({out.shape[1]}), got {offset}")
    if check_values or device.type == "cpu":
        _check_gather_values(out.shape[1], seq_lens, gather_lens, block_table, block_size, offset)
    if not use_triton(device):
        from .reference import kv_cache as ref

        ref.dequantize_and_gather_k_cache(
            out, cache, seq_lens, gather_lens, block_table, block_size, offset
        )
        return
    if num_reqs == 0 or num_pages == 0 or out.shape[1] == offset:
        return
    if num_reqs > MAX_GRID_REQUESTS:
        raise ValueError(f"seq_lens has {num_reqs} requests; at most {MAX_GRID_REQUESTS} per call")
    _launch_gather(out, cache, seq_lens, gather_lens, block_table, block_size, offset, stride)


def _launch_gather(
    out: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    stride: int,
    *,
    block_t: int = GATHER_BLOCK_T,
    num_warps: int = GATHER_NUM_WARPS,
    evict_first: bool = EVICT_FIRST,
) -> None:
    """Launch the gather kernel (inputs already validated).

    The grid covers every output row a request could receive
    (``out.shape[1] - offset``); programs past a request's gather length exit
    at once, so nothing is read back from the device.
    """
    num_reqs = seq_lens.shape[0]
    out_rows = out.shape[1]
    grid = (triton.cdiv(out_rows - offset, block_t), num_reqs)
    _k._dequantize_and_gather_k_cache_kernel[grid](
        out,
        cache,
        seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        block_table,
        stride,
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        out_rows,
        offset,
        block_table.shape[1],
        cache.shape[0],
        SLOTS=block_size,
        PAGE_ALIGNED=stride % 16 == 0,
        BIAS=UE8M0_BIAS,
        HAS_GATHER_LENS=gather_lens is not None,
        BLOCK_T=block_t,
        EVICT_FIRST=evict_first,
        num_warps=num_warps,
    )
