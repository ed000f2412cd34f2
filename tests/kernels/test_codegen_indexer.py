"""The decode indexer's Triton kernels build for Hopper (sm_90) with the installed Triton,
through the public call at V4's and V4.1's shapes, without spills (the interpreter,
which the rest of the CPU suite runs them under, compiles nothing: a kernel it accepts
can still fail to build for a GPU); the key shard's variants and the merge (issue 40)
too."""

from __future__ import annotations

import json

from ._uninterpreted import run_module


def test_indexer_kernels_build_for_sm90_without_spills() -> None:
    out = run_module("benchmarks.support.compile_sm90_indexer")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kernels = [(r["shape"], r["kernel"]) for r in rows]
    for shape in ("v4-flash", "v4-pro", "v41-flash"):
        # the whole step's two, a key shard's two (scores kept), the merge
        assert kernels.count((shape, "_index_scores_kernel")) == 2, kernels
        assert kernels.count((shape, "_row_topk_kernel")) == 2, kernels
        assert kernels.count((shape, "_merge_topk_kernel")) == 1, kernels
    for row in rows:
        assert row["stack_bytes"] == 0 and row["local_stores"] == 0, row
        assert row["sass_instructions"] > 100, row
