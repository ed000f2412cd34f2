"""Compile the sparse MLA decode's wgmma split kernel for sm_90 on a machine without a GPU.

``python -m benchmarks.support.compile_sm90_decode [--sass DIR]``: one public
``dsv4_kernels.sparse_mla_decode`` call per (heads, policy) on CPU tensors of a C4A
decode step that splits over keys, with the split kernel's launch replaced by an
offline compile for an H100/H200
(:func:`benchmarks.support.compile_sm90.compile_offline`) and the combine's launch
skipped; one JSON line per compiled split kernel: registers, stack (spill) bytes,
shared memory, SASS instructions, local-memory traffic.  The policies: TP8's 8 and 16
heads (one block), DP attention's 64 and 128 heads in 16-head blocks (the shipped
default), and in wide blocks of 32 or 64 heads on two warpgroups (``WIDE_HT``, issue
41).  Run without ``TRITON_INTERPRET`` (the CPU suite runs it in a child process:
``tests/kernels/test_codegen_decode.py``); nothing runs on a GPU, so this says what
the compiler made, never how fast it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

# (heads, DECODE_TILES entries): the kernels the shipped and the wide policies launch
CASES: tuple[tuple[int, dict[str, int]], ...] = (
    (8, {}),
    (16, {}),
    (64, {}),
    (64, {"WIDE_HT": 32}),
    (64, {"WIDE_HT": 64}),
    (128, {"WIDE_HT": 64}),
)


class _Skipped:
    """A launch that is neither compiled nor run (the combine)."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def compile_case(heads: int, policy: dict[str, int]) -> list[tuple[str, Any]]:
    """The split kernels one two-token C4A decode call launches with ``policy``."""
    import dsv4_kernels as dk
    from dsv4_kernels import _gluon_decode as g
    from dsv4_kernels import _paged_keys as pk
    from dsv4_kernels import _triton_decode as k
    from dsv4_kernels import decode as dec
    from dsv4_kernels import sparse_mla as sm
    from dsv4_kernels.testing import decode as td

    from .compile_sm90 import _Offline

    compiled: list[tuple[str, Any]] = []
    saved = (
        sm._hopper_runs_wgmma,
        dec.use_triton,
        g._decode_split_wgmma_kernel,
        k._decode_split_kernel,
        k._decode_combine_kernel,
        list(pk.SPLIT_BROKEN),
    )
    try:
        sm._hopper_runs_wgmma = lambda device: True  # type: ignore[assignment]
        dec.use_triton = lambda device: True  # type: ignore[assignment]
        g._decode_split_wgmma_kernel = _Offline(saved[2], compiled)  # type: ignore[assignment]
        k._decode_split_kernel = _Offline(saved[3], compiled)  # type: ignore[assignment]
        k._decode_combine_kernel = _Skipped()  # type: ignore[assignment]
        gen = torch.Generator().manual_seed(0)
        case = td.make_decode_case(
            "c4a", 2, 1, heads, context=[4096, 4096], generator=gen, device="cpu", topk=512,
            comp_width=8,
        )  # fmt: skip
        scratch = dk.make_decode_scratch(dk.DecodeScratchSizes(64, heads, 2), "cpu")
        r = case.rows
        dk.sparse_mla_decode(
            case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, 512**-0.5,
            scratch=scratch, num_splits=4, policy={"PDL": 0, **policy}, **case.kwargs(),
        )  # fmt: skip
    finally:
        sm._hopper_runs_wgmma, dec.use_triton = saved[0], saved[1]  # type: ignore[assignment]
        g._decode_split_wgmma_kernel = saved[2]  # type: ignore[assignment]
        k._decode_split_kernel, k._decode_combine_kernel = saved[3], saved[4]  # type: ignore
        pk.SPLIT_BROKEN[:] = saved[5]
    return compiled


def main(argv: list[str] | None = None) -> int:
    from .compile_sm90 import describe

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.support.compile_sm90_decode",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--sass", type=Path, help="write each kernel's SASS into this folder")
    args = p.parse_args(argv)
    for heads, policy in CASES:
        for kernel_name, kernel in compile_case(heads, policy):
            info = describe(kernel)
            sass = info.pop("sass")
            name = f"h{heads}-wide{policy.get('WIDE_HT', 0)}"
            if args.sass:
                args.sass.mkdir(parents=True, exist_ok=True)
                (args.sass / f"{name}.sass").write_text(sass)
            row = dict(case=name, heads=heads, policy=policy, kernel=kernel_name)
            print(json.dumps({**row, **info}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
