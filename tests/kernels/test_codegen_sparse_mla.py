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
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (case, tokens per group): V4-Flash TP8 and V4-Pro TP8, per-token and grouped rows
CASES = [
    ("c4a-flash-tp8-1x16384", 0),
    ("c4a-pro-tp8-1x16384", 0),
    ("c128a-flash-tp8-1x16384", 4),
    ("swa-pro-tp8-1x16384", 2),
]


def _compile(case: str, group: int) -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", "benchmarks.compile_sm90"]
    res = subprocess.run(
        [*cmd, "--case", case, "--group", str(group)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(("case", "group"), CASES)
def test_wgmma_kernel_builds_for_sm90(case: str, group: int) -> None:
    (row,) = _compile(case, group)
    assert row["kernel"] == "_sparse_mla_wgmma_kernel", row
    if not group:  # the per-token kernel: no spills, and the 8-head register cap
        assert row["stack_bytes"] == 0 and row["local_stores"] == 0, row
        if "flash" in case:
            assert row["registers"] <= 168, row
    assert row["sass_instructions"] > 1000, row
