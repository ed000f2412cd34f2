"""The metadata kernels compile for Hopper (sm_90) with 16-byte accesses on the hot path.

Triton compiles for a GPU target without a GPU present, so this runs in the
CPU suite: it catches kernels that only the interpreter accepts, and a change
that silently turns the streaming loads and stores into 4-byte ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_metadata_kernels_compile_for_sm90_with_16_byte_accesses() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-m", "tests.kernels.codegen_probe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for variant, counts in report.items():
        assert counts["st_v4"] > 0, f"{variant}: row stores are not 16 bytes wide"
        if "topk=False" not in variant:
            assert counts["ld_v4"] > 0, f"{variant}: index loads are not 16 bytes wide"
