"""The Gluon wgmma sparse MLA kernel builds for Hopper (sm_90) with the installed Triton.

Triton compiles for a GPU target without a GPU present, so this runs in the CPU
suite (Gluon has no interpreter: nothing else on CPU compiles this kernel).  A
Triton whose Gluon API moved makes the launcher fall back, with one warning, to the
Triton kernel, which is slower than vLLM's FlashMLA prefill that the plugin's
selection rule replaces; this catches that, and a change that makes the shipped
tiles spill or lose the register cap that lets three programs share a
multiprocessor at up to 8 heads (docs/attention.md).
"""

from __future__ import annotations

import json

import pytest

from ._uninterpreted import run_module

# (case, tokens per group): V4-Flash TP8 and V4-Pro TP8, per-token and grouped rows
CASES = [
    ("c4a-flash-tp8-1x16384", 0),
    ("c4a-pro-tp8-1x16384", 0),
    ("c128a-flash-tp8-1x16384", 4),
    ("swa-pro-tp8-1x16384", 2),
]


def _compile(case: str, group: int) -> list[dict[str, object]]:
    # a RuntimeWarning (the launcher's fallback to the Triton kernel) fails the run
    out = run_module("benchmarks.support.compile_sm90", "--case", case, "--group", str(group))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(("case", "group"), CASES)
def test_wgmma_kernel_builds_for_sm90(case: str, group: int) -> None:
    (row,) = _compile(case, group)
    assert row["kernel"] == "_sparse_mla_wgmma_kernel", row
    if not group:  # the per-token kernel: no spills, and the 8-head register cap
        assert row["stack_bytes"] == 0 and row["local_stores"] == 0, row
        if "flash" in case:
            assert row["registers"] <= 168, row
    assert row["sass_instructions"] > 1000, row


# DP attention's 64 heads in wide blocks on two warpgroups (issue 41; off by default,
# where the Triton kernel runs): the per-token kernel with its heads in blocks
@pytest.mark.parametrize("variant", ["wgmma-wide32", "wgmma-wide64"])
def test_wide_head_blocks_build_for_sm90(variant: str) -> None:
    out = run_module(
        "benchmarks.support.compile_sm90", "--case", "swa-flash-dp-1x16384", "--variants", variant
    )
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert row["kernel"] == "_sparse_mla_wgmma_kernel", row
    assert row["stack_bytes"] == 0 and row["local_stores"] == 0, row
    assert row["sass_instructions"] > 1000, row


# C128A rows read through the compressed block table (BlockRows: no [T, entries] row of
# slots), per token and grouped: the same kernel with the table lookup in its gather
@pytest.mark.parametrize("group", [0, 4])
def test_block_rows_build_for_sm90(group: int) -> None:
    out = run_module(
        "benchmarks.support.compile_sm90", "--case", "c128a-flash-tp8-1x16384", "--group",
        str(group), "--blocks",
    )  # fmt: skip
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert row["kernel"] == "_sparse_mla_wgmma_kernel" and row["blocks"] is True, row
    if not group:  # per token: no spills and the 8-head register cap, as with slot rows
        assert row["stack_bytes"] == 0 and row["local_stores"] == 0, row
        assert row["registers"] <= 168, row
    assert row["sass_instructions"] > 1000, row
