"""The CPU smoke run's ``table.md``: banner kept, times only (no bold, speed-ups, floor ratios)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import report
from benchmarks.harness import FLOOR, Result

ENV = {"gpu": "cpu", "torch": "2.13.0", "triton": "3.7.0", "git_sha": "abc", "mode": "cpu-smoke"}


def _row(kernel: str, provider: str, case: str, p50: float) -> Result:
    return Result(kernel, provider, case, 64, p50, p50, p50, 0.001, 100, {})


# Interpreter times against a tiny floor: the kind of row that printed "149545x".
ROWS = [
    _row("combine_topk_swa_indices", provider, case, p50)
    for case in ("c4a-1x64", "swa-2x32")
    for provider, p50 in (
        ("per-request-workers-128", 50.0),
        ("per-request-workers-256", 40.0),
        ("dsv4-kernels", 149545.0),
        (FLOOR, 1.0),
    )
]


def _table(tmp_path: Path, mode: str) -> str:
    text = report.write_table(ROWS, {**ENV, "mode": mode}, tmp_path / "table.md", "cmd")
    assert (tmp_path / "table.md").read_text() == text
    return text


def test_smoke_table_keeps_the_banner_and_shows_times_only(tmp_path: Path) -> None:
    text = _table(tmp_path, "cpu-smoke")
    assert text.startswith("**CPU smoke run**")
    assert "say nothing about GPU speed" in text
    body = text.split("### combine_topk_swa_indices", 1)[1]
    assert "**" not in body
    assert "x |" not in body and "149545.00x" not in text
    for word in ("speed-up", "floor", "256 vs 128", "faster"):
        assert word not in body, word
    header = next(line for line in body.splitlines() if line.startswith("| case"))
    assert header == (
        "| case | tokens | per-request-workers-128 | per-request-workers-256 | dsv4-kernels |"
    )
    assert "| c4a-1x64 | 64 | 50.00 | 40.00 | 149545.00 |" in body


def test_gpu_table_still_bolds_ours_and_prints_ratios(tmp_path: Path) -> None:
    text = _table(tmp_path, "gpu")
    assert "CPU smoke run" not in text
    assert "**149545.00**" in text
    assert "ours / floor" in text and "149545.00x" in text
    assert "speed-up vs per-request-workers-256" in text
