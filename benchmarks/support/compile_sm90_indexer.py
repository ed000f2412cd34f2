"""Compile the decode indexer's kernels for sm_90 on a machine without a GPU.

``python -m benchmarks.support.compile_sm90_indexer``: one public
``dsv4_kernels.indexer_decode_topk`` call per shape (V4's 64 index heads at top-512 and
top-1,024, V4.1-Flash's 32 heads) on CPU tensors, and a key shard's
``indexer_shard_topk`` and ``indexer_merge_topk`` (TP8's split of issue 40), with each
launch replaced by an offline compile for an H100/H200
(:func:`benchmarks.support.compile_sm90.compile_offline`), one JSON line per compiled
kernel: registers, stack (spill) bytes, shared memory, SASS instructions, local-memory
traffic.  Run without ``TRITON_INTERPRET`` (the CPU suite
runs it in a child process: ``tests/kernels/test_codegen_indexer.py``); nothing runs on
a GPU, so this says what the compiler made, never how fast it is.
"""

from __future__ import annotations

import json
from typing import Any

import torch

SHAPES = (("v4-flash", 64, 512), ("v4-pro", 64, 1024), ("v41-flash", 32, 512))


def compile_shape(heads: int, topk: int) -> list[tuple[str, Any]]:
    import dsv4_kernels as dk
    from dsv4_kernels import _triton_indexer as k
    from dsv4_kernels import indexer
    from dsv4_kernels.testing.common import generator
    from dsv4_kernels.testing.indexer import make_indexer_step

    from .compile_sm90 import _Offline

    compiled: list[tuple[str, Any]] = []
    names = ("_index_scores_kernel", "_row_topk_kernel", "_merge_topk_kernel")
    saved = [indexer.use_triton, *(getattr(k, n) for n in names)]
    try:
        indexer.use_triton = lambda device: True  # type: ignore[assignment]
        for name, kernel in zip(names, saved[1:], strict=True):
            setattr(k, name, _Offline(kernel, compiled))
        step = make_indexer_step([topk + 100, 40], generator(0), heads=heads, topk=topk)
        args = (step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk)
        out = torch.empty((2, topk), dtype=torch.int32)
        dk.indexer_decode_topk(*args, out, max_entries=topk + 100)
        packed = torch.empty((2, 2 * topk), dtype=torch.int32)
        dk.indexer_shard_topk(*args, packed, shard=3, shards=8, max_entries=topk + 100)
        dk.indexer_merge_topk(torch.empty((16, 2 * topk), dtype=torch.int32), topk, out, shards=8)
    finally:
        indexer.use_triton = saved[0]  # type: ignore[assignment]
        for name, kernel in zip(names, saved[1:], strict=True):
            setattr(k, name, kernel)
    return compiled


def main() -> int:
    from .compile_sm90 import describe

    for name, heads, topk in SHAPES:
        for kernel_name, kernel in compile_shape(heads, topk):
            row = {"shape": name, "kernel": kernel_name, **describe(kernel)}
            row.pop("sass")
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
