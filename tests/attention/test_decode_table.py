"""The decode dispatch table: the bracketing rule, the head mapping, and agreement with the
curated H200 measurements it was made from."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_attention import decode_table as dt

ROOT = Path(__file__).resolve().parents[2]
CURATED = ROOT / "docs" / "results" / "h200-decode" / "decode_table.json"


def test_table_is_the_curated_measurement() -> None:
    data = json.loads(CURATED.read_text())
    for layer, by_heads in dt.MEASURED.items():
        for heads, steps in by_heads.items():
            got = data[f"{layer}/{heads}"]
            for t, ratio in steps.items():
                want = min(got["ratios"][str(t)], got["mtp_ratios"].get(str(t), 99.0))
                assert abs(ratio - want) < 0.006, (layer, heads, t, ratio, want)


def test_bracketing_rule_and_heads() -> None:
    saved = dt.MEASURED
    try:
        dt.MEASURED = {"swa": {8: {1: 1.2, 4: 1.1, 16: 0.9, 64: 1.5}, 16: {1: 0.8, 64: 1.2}}}
        assert dt.use_head_exact_decode("swa", 8, 1) and dt.use_head_exact_decode(1, 3, 2)
        assert dt.use_head_exact_decode("swa", 8, 4)
        assert not dt.use_head_exact_decode("swa", 8, 5)  # between 4 (faster) and 16 (slower)
        assert not dt.use_head_exact_decode("swa", 8, 16)
        assert not dt.use_head_exact_decode("swa", 8, 17)  # between 16 and 64
        assert dt.use_head_exact_decode("swa", 8, 64) and dt.use_head_exact_decode("swa", 8, 4096)
        assert not dt.use_head_exact_decode("swa", 16, 1)
        assert not dt.use_head_exact_decode("swa", 12, 32)
        assert dt.use_head_exact_decode("swa", 12, 100)
        assert not dt.use_head_exact_decode("swa", 17, 64)  # more than 16 heads: never
        assert not dt.use_head_exact_decode("c4a", 8, 64)  # unmeasured layer
        assert not dt.use_head_exact_decode("swa", 8, 0)
        assert dt.faster_steps("swa", 8) == (1, 4, 64)
    finally:
        dt.MEASURED = saved
