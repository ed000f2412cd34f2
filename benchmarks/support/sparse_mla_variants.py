"""Tile variants of the sparse MLA kernels: what ``benchmarks.experiments.sweep_sparse_mla``
times and ``benchmarks.support.compile_sm90`` compiles offline.

Each variant is one head class's entry of :data:`dsv4_kernels.sparse_mla.TILES`, passed
to the kernels as their ``tiles=`` argument.
"""

from __future__ import annotations

from ..inputs_sparse_mla import AttnShape

OLD_SMALL = dict(MAX_BLOCK_H=64, BLOCK_N=32, NUM_WARPS=4, NUM_STAGES=1, PREFETCH=1, BF16_DEQUANT=0)
OLD_LARGE = dict(MAX_BLOCK_H=64, BLOCK_N=32, NUM_WARPS=8, NUM_STAGES=1, PREFETCH=0, BF16_DEQUANT=1)
WG = {**OLD_SMALL, "KERNEL": 2, "ASYNC_PV": 1}
VARIANTS: dict[str, list[tuple[str, dict[str, int]]]] = {
    "small": [
        ("old-default", OLD_SMALL),
        # the Gluon wgmma kernel (Hopper): keys on M, one shared bf16 tile per 64 keys, P V
        # asynchronous, 168 registers at up to 8 heads; S = K q^T with K from shared memory
        # or (REG_A) from registers; q and out in 16-byte accesses (IO_VEC, where aligned)
        ("wgmma-smem-a", {**WG, "MAXNREG_H8": 168, "REG_A": 0}),
        ("wgmma-smem-a-noio", {**WG, "MAXNREG_H8": 168, "REG_A": 0, "IO_VEC": 0}),
        ("wgmma-reg-a", {**WG, "MAXNREG_H8": 168, "REG_A": 1}),
        ("wgmma-reg-a-noio", {**WG, "MAXNREG_H8": 168, "REG_A": 1, "IO_VEC": 0}),
    ],
    "large": [
        ("old-default", OLD_LARGE),
        ("old-words", {**OLD_LARGE, "ASM": 1}),
        # the Gluon wgmma kernel in wide head blocks (issue 41): two warpgroups, each key
        # tile dequantised once per block of 32 or 64 heads, S^T's heads and O^T's 512
        # columns shared between the warpgroups
        ("wgmma-wide64", {**OLD_LARGE, "KERNEL": 2, "ASYNC_PV": 1, "WIDE_HT": 64}),
        ("wgmma-wide32", {**OLD_LARGE, "KERNEL": 2, "ASYNC_PV": 1, "WIDE_HT": 32}),
        ("wgmma-wide64-sync", {**OLD_LARGE, "KERNEL": 2, "ASYNC_PV": 0, "WIDE_HT": 64}),
    ],
}
# The bf16 workspace path (the sweep's first case only).
WORKSPACE_VARIANTS = ("old-default",)


def head_class(heads: int) -> str:
    """The key of :data:`dsv4_kernels.sparse_mla.TILES` (and :data:`VARIANTS`) for ``heads``."""
    from dsv4_kernels import sparse_mla as sm

    return "small" if heads <= sm.SMALL_HEADS else "large"


def tiny_shape(shape: AttnShape) -> AttnShape:
    """Same compile-time shape (layer, head count, page sizes), a few tokens."""
    return AttnShape(shape.name + "-tiny", shape.layer, 1, 8, 1024, shape.heads, shape.topk)
