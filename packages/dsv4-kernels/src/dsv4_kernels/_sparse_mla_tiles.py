"""Tile configurations of the sparse MLA kernels (the measured defaults, kept as data)
and the grouping policy's limit.

:data:`TILES` maps a head class (``"small"``: up to :data:`SMALL_HEADS` heads,
``"large"``: more) to the compile-time constants of one launch.
:func:`dsv4_kernels.sparse_mla_paged` and :func:`dsv4_kernels.sparse_mla_workspace`
take ``tiles=``, a table of this form (a class it leaves out keeps its default), so
a sweep (``benchmarks/experiments/sweep_sparse_mla.py``) or a profiler passes its variants as an
argument instead of rebinding module globals.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton

__all__ = [
    "MAX_GROUP_ROWS",
    "MMA_MIN_M",
    "SMALL_HEADS",
    "TILES",
    "TileTable",
    "block_h",
    "group_rows",
    "head_class",
]

# One launch's constants (``KEY: value``) per head class.
TileTable = Mapping[str, Mapping[str, int]]

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
TILES: dict[str, dict[str, int]] = {  # the measured defaults, per head class
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


def head_class(num_heads: int) -> str:
    """The :data:`TILES` class of a head count: ``"small"`` up to :data:`SMALL_HEADS`."""
    return "small" if num_heads <= SMALL_HEADS else "large"


def block_h(num_heads: int, max_block_h: int) -> int:
    """Heads per program of the Triton kernel: the head count padded to a power of two
    (at least :data:`MMA_MIN_M`), at most ``max_block_h``."""
    return min(max(MMA_MIN_M, triton.next_power_of_2(num_heads)), max_block_h)


# The grouping policy: the most MMA rows (a group's tokens x heads padded to 8 or 16)
# the wgmma kernel takes (:func:`dsv4_kernels.sparse_mla.prefill_group_size`).
MAX_GROUP_ROWS = 32


def group_rows(num_heads: int, group_size: int) -> int:
    """MMA rows of a group in the wgmma kernel: ``group_size`` x heads padded to 8 or 16."""
    return group_size * (8 if num_heads <= 8 else 16)
