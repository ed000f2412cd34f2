"""Compile the metadata kernels for sm_90 without a GPU and report their PTX access widths.

Run as a script (``python -m tests.kernels.codegen_probe``) in a process without
``TRITON_INTERPRET``: the interpreter replaces Triton's code generator.
Prints one JSON object: variant name -> counts of 16-byte and 4-byte accesses.
"""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import dsv4_kernels.metadata as md
from dsv4_kernels import _triton_metadata as kernels

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED = [["tt.divisibility", 16]]  # what Triton specialises 16-byte aligned args to

COMBINE_SIG = {
    "topk_ptr": "*i32",
    "qsl_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "gather_lens_ptr": "*i32",
    "left_ptr": "*i32",
    "right_ptr": "*i32",
    "out_ptr": "*i32",
    "lens_ptr": "*i32",
    "topk_stride_units": "i32",
    "out_stride": "i32",
    "num_tokens": "i32",
    "num_reqs": "i32",
    "topk": "i32",
    "row_tiles": "i32",
    "M": "i32",
    "N": "i32",
}
GLOBAL_SIG = {
    "topk_ptr": "*i32",
    "req_ptr": "*i32",
    "valid_ptr": "*i1",
    "block_table_ptr": "*i32",
    "out_ptr": "*i32",
    "lens_ptr": "*i32",
    "topk_stride": "i32",
    "out_stride": "i32",
    "block_table_stride": "i32",
    "num_tokens": "i32",
    "num_pages": "i32",
}


def _ptx(
    fn: object,
    signature: dict[str, str],
    constexprs: dict[str, object],
    aligned: list[int],
    num_warps: int,
) -> dict[str, int]:
    src = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs={(i,): ALIGNED for i in aligned},
    )
    ptx = str(triton.compile(src, target=TARGET, options={"num_warps": num_warps}).asm["ptx"])
    return {
        "ld_v4": ptx.count("ld.global.v4.b32"),
        "st_v4": ptx.count("st.global.v4.b32"),
    }


def main() -> None:
    report = {}
    for has_topk in (True, False):
        for images in (False, True):
            const = md.combine_constexprs(128, 4 if has_topk else 128, has_topk, images, 4)
            report[f"combine topk={has_topk} images={images}"] = _ptx(
                kernels._combine_topk_swa_indices_kernel,
                COMBINE_SIG,
                const,
                [0, 6, 9],
                md.COMBINE_NUM_WARPS,
            )
    report["global"] = _ptx(
        kernels._global_topk_indices_kernel,
        GLOBAL_SIG,
        md.global_constexprs(512, 64),
        [0, 3, 4, 6, 7],
        md.GLOBAL_NUM_WARPS,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
