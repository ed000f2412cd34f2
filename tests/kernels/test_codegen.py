"""The metadata kernels compile for Hopper (sm_90) with 16-byte accesses on the hot path.

Triton compiles for a GPU target without a GPU present, so this runs in the
CPU suite: it catches kernels that only the interpreter accepts, and a change
that silently turns the streaming loads and stores into 4-byte ones.
"""

from __future__ import annotations

import json

from ._uninterpreted import run_module


def test_metadata_kernels_compile_for_sm90_with_16_byte_accesses() -> None:
    out = run_module("tests.kernels.codegen_probe")
    report = json.loads(out.strip().splitlines()[-1])
    for variant, counts in report.items():
        assert counts["st_v4"] > 0, f"{variant}: row stores are not 16 bytes wide"
        if "topk=False" not in variant:
            assert counts["ld_v4"] > 0, f"{variant}: index loads are not 16 bytes wide"
