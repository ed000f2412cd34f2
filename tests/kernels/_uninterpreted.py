"""Run a module of this repository in a fresh Python without ``TRITON_INTERPRET``.

The CPU suite runs under Triton's interpreter, which replaces Triton's code
generator; the codegen tests compile for sm_90 in a child process without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str) -> str:
    """``python -m module args`` from the repository root; its stdout (it must exit 0,
    and a RuntimeWarning, such as the sparse MLA launcher's fallback, is an error)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout
