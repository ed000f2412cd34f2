"""The sparse MLA decode's Gluon wgmma split kernel builds for Hopper (sm_90) with the
installed Triton through the public ``sparse_mla_decode`` call: TP8's 8 and 16 heads
(one block), DP attention's 64 heads in 16-head blocks (the shipped default) and in wide
blocks of 32 or 64 heads on two warpgroups, 128 heads in two wide blocks (issue 41).
Gluon has no interpreter, so this is the CPU suite's only build of these kernels; whether
the wide blocks are right and faster is the GPU suite's and the decode benchmark's."""

from __future__ import annotations

import json

from ._uninterpreted import run_module


def test_decode_split_kernels_build_for_sm90() -> None:
    out = run_module("benchmarks.support.compile_sm90_decode")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    rows = {r["case"]: r for r in map(json.loads, lines)}
    want = {"h8-wide0", "h16-wide0", "h64-wide0", "h64-wide32", "h64-wide64", "h128-wide64"}
    assert set(rows) == want, sorted(rows)
    for row in rows.values():
        assert row["kernel"] == "_decode_split_wgmma_kernel", row
        assert row["sass_instructions"] > 1000, row
    # the 8-head register cap that lets three programs share a multiprocessor
    assert rows["h8-wide0"]["registers"] <= 168 and rows["h8-wide0"]["stack_bytes"] == 0
    for case in ("h64-wide32", "h64-wide64", "h128-wide64"):  # two warpgroups, no spills
        assert rows[case]["stack_bytes"] == 0 and rows[case]["local_stores"] == 0, rows[case]
    # a wide block's shared memory holds q and P for all its heads: more than a 16-head
    # block's, within the H200's 227 KiB per program
    assert rows["h64-wide0"]["shared_bytes"] < rows["h64-wide64"]["shared_bytes"] <= 227 * 1024
