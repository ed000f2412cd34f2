"""DeepSeek-V4 attention geometry: the model constants every kernel shares.

The kernels, their wrappers and the references take every byte layout,
width and constant of DSV4 from the names here; in the package's code nothing
else spells these numbers (docstrings and comments restate them for the
reader; the tests' slow spec oracles restate them from docs/design.md on purpose,
as an independent check, and the benchmarks' upstream re-implementations
spell them as upstream does).  The kernels read the page layout as compile-time
globals made from these names once (:mod:`dsv4_kernels._jit_layout`).
"""

from __future__ import annotations

import enum

# --- latent KV head -------------------------------------------------------
HEAD_DIM = 512  # one latent KV head: 448 "nope" + 64 "rope" values
NOPE_DIM = 448
ROPE_DIM = 64

# --- FP8 (UE8M0) K cache layout -------------------------------------------
QUANT_BLOCK = 64  # values sharing one power-of-two scale
NUM_QUANT_BLOCKS = NOPE_DIM // QUANT_BLOCK  # 7 exponents per token
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# FP8_MAX = 1.75 * 2**8 as float32: its exponent and 23-bit mantissa field, from
# which ceil(log2(amax / 448)) is read off amax's bits exactly (no log2, no division).
FP8_MAX_EXP = 8
FP8_MAX_MANTISSA = int((FP8_MAX / 2**FP8_MAX_EXP - 1.0) * (1 << 23))  # 0x600000
AMAX_FLOOR = 1e-4  # amax is clamped below by this before taking log2
UE8M0_BIAS = 127  # scale byte = exponent + 127
ROPE_BYTES = ROPE_DIM * 2  # bf16
TOKEN_DATA_BYTES = NOPE_DIM + ROPE_BYTES  # 576 bytes of data per token
TOKEN_SCALE_BYTES = NUM_QUANT_BLOCKS + 1  # 7 exponents + 1 zero byte
TOKEN_BYTES = TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES  # 584
PAGE_ALIGN = TOKEN_DATA_BYTES  # page stride is rounded up to 576 bytes

# --- lightning indexer key cache (vLLM's FP8 layout) ----------------------
INDEX_DIM = 128  # index_head_dim: values per compressed index key
INDEX_SCALE_BYTES = 4  # one float32 power-of-two scale per key
INDEX_ENTRY_BYTES = INDEX_DIM + INDEX_SCALE_BYTES  # 132: a page holds all codes, then all scales

# --- paging ---------------------------------------------------------------
KV_BLOCK_SIZE = 256  # tokens per KV page (`--block-size 256`)
SWA_BLOCK_SIZE = 64  # tokens per sliding-window cache page

# --- sparse attention -----------------------------------------------------
WINDOW_SIZE = 128  # sliding window W
C4A_RATIO = 4  # compress ratio of C4A layers (lightning-indexer top-k)
C128A_RATIO = 128  # compress ratio of C128A layers (every compressed entry)
SUPPORTED_COMPRESS_RATIOS = (1, C4A_RATIO, C128A_RATIO)  # SWA-only, C4A, C128A
# DeepSeek-V4.1 (vLLM's ``compress_ratios``): 0 window only, 1 a full-length
# compressed cache, 2 ratio 2; its compressed layers read top-k rows like C4A.
V41_COMPRESS_RATIOS = (0, 1, 2)
# Ratios of a compressed cache whose pages the kernels read (256 / ratio entries).
PAGED_COMPRESS_RATIOS = (1, 2, C4A_RATIO, C128A_RATIO)
# Ratios a layer's index rows are built for (the kernels' convention): 1 window only (or,
# with top-k indices, DeepSeek-V4.1's full-length compressed layers), 2 V4.1's ratio 2,
# 4 C4A, 128 C128A.
LAYER_RATIOS = (1, 2, C4A_RATIO, C128A_RATIO)
TOPK_RATIOS = (1, 2, C4A_RATIO)  # compressed rows from the indexer's top-k
TOPK_FLASH = 512  # index_topk, DeepSeek-V4-Flash
TOPK_PRO = 1024  # index_topk, DeepSeek-V4-Pro
COMBINED_ALIGNMENT = 128  # combined rows are padded to a multiple of this


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def combined_width(topk: int, window_size: int = WINDOW_SIZE, max_image_tokens: int = 0) -> int:
    """Width of a ``combine_topk_swa_indices`` row: ceil((topk + W + images) / 128) * 128."""
    return round_up(topk + window_size + max_image_tokens, COMBINED_ALIGNMENT)


def slots_per_page(compress_ratio: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """Entries in one compressed-cache page: 256 / ratio (ratio 1 gives the whole page:
    V4's window pages, or V4.1's full-length compressed cache)."""
    if compress_ratio not in PAGED_COMPRESS_RATIOS:
        raise ValueError(
            f"compress_ratio must be one of {PAGED_COMPRESS_RATIOS}, got {compress_ratio}"
        )
    return block_size // compress_ratio


def page_stride_bytes(slots: int) -> int:
    """Bytes between two pages of an FP8 K cache holding ``slots`` tokens per page."""
    if slots <= 0:
        raise ValueError(f"slots per page must be positive, got {slots}")
    return round_up(slots * TOKEN_BYTES, PAGE_ALIGN)


class RowKind(enum.IntEnum):
    """What a layer's index rows hold after its window: the one rule from compress ratio
    to rows (the index kernels' ``MODE``; :data:`FAMILY_ROW_KINDS` for vLLM's ratios)."""

    WINDOW = 0  # the window only: V4's SWA-only layers (ratio 1), V4.1's (ratio 0)
    TOPK = 1  # the indexer's top-k compressed entries: V4's C4A, V4.1's ratios 1 and 2
    ALL = 2  # every compressed entry so far, generated: V4's C128A

    @property
    def compressed(self) -> bool:
        """Whether the rows read a compressed cache."""
        return self is not RowKind.WINDOW


# vLLM's ``compress_ratio`` of a layer -> its rows, per model family (DeepSeek-V4,
# DeepSeek-V4.1); a ratio missing here is a layer kind nothing of ours knows.
FAMILY_ROW_KINDS: dict[str, dict[int, RowKind]] = {
    "v4": {1: RowKind.WINDOW, C4A_RATIO: RowKind.TOPK, C128A_RATIO: RowKind.ALL},
    "v41": {0: RowKind.WINDOW, 1: RowKind.TOPK, 2: RowKind.TOPK},
}


def row_kind(compress_ratio: int | None, has_topk: bool) -> RowKind:
    """The rows of a layer the kernels are given ``compress_ratio`` for (None or 1
    without top-k indices: window only; 1, 2 or 4 with them: top-k rows; 128: every
    entry); ``ValueError`` naming the ratio otherwise."""
    if compress_ratio is None or (compress_ratio == 1 and not has_topk):
        return RowKind.WINDOW
    if compress_ratio in TOPK_RATIOS:
        return RowKind.TOPK
    if compress_ratio == C128A_RATIO:
        return RowKind.ALL
    raise ValueError(
        "compress_ratio must be None, 1 (SWA-only, or top-k rows with topk_indices), "
        f"2 or 4 (top-k rows) or 128 (C128A), got {compress_ratio!r}"
    )
