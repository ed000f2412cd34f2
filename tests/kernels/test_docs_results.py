"""docs/kernels.md quotes only what the committed H200 result shows.

Every range and ratio the document quotes from ``docs/results/h200`` is
recomputed here from ``results.jsonl`` and must appear in the text as quoted;
a new curated result (or an edit of the text) that disagrees fails.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "h200" / "results.jsonl"
DOC = ROOT / "docs" / "kernels.md"
OURS, COPY, FLOOR = "dsv4-kernels", "torch-copy-same-bytes", "floor"
COMBINE, GLOBAL = "combine_topk_swa_indices", "compute_global_topk_indices_and_lens"
INSERT, GATHER = "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache"
LONG = 16384  # "at 16,384 tokens and more"


def _load() -> dict[str, dict[str, dict[str, dict]]]:
    table: dict[str, dict[str, dict[str, dict]]] = {}
    for line in RESULTS.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            table.setdefault(r["kernel"], {}).setdefault(r["case"], {})[r["provider"]] = r
    return table


RUN = _load()
TEXT = re.sub(r"\s+", " ", DOC.read_text())


def _p50(kernel: str, case: str, provider: str) -> float:
    return float(RUN[kernel][case][provider]["p50_us"])


def _ratios(kernel: str, num: str, den: str, min_tokens: int = 0) -> list[float]:
    return [
        row[num]["p50_us"] / row[den]["p50_us"]
        for row in RUN[kernel].values()
        if num in row and den in row and row[num]["tokens"] >= min_tokens
    ]


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x"


def _quoted(text: str) -> None:
    assert text in TEXT, f"docs/kernels.md should say {text!r} (recomputed from {RESULTS.name})"


def test_same_bytes_copy_over_floor_at_16k_tokens() -> None:
    copies = [
        row[COPY]["p50_us"] / row[FLOOR]["p50_us"]
        for rows in RUN.values()
        for row in rows.values()
        if COPY in row and row[COPY]["tokens"] >= LONG
    ]
    _quoted(f"At 16,384 tokens and more it takes {_span(copies)} the floor")


@pytest.mark.parametrize(
    ("kernel", "label"),
    [(COMBINE, "combine"), (GLOBAL, "global-index"), (INSERT, "K-cache insert"),
     (GATHER, "K-cache gather")],
)  # fmt: skip
def test_ours_over_the_same_bytes_copy(kernel: str, label: str) -> None:
    every = _ratios(kernel, OURS, COPY)
    long = _ratios(kernel, OURS, COPY, LONG)
    faster = sum(r < 1 for r in every)
    quote = f"{label}: {_span(every)} of the copy"
    if faster:
        quote += f", faster in {faster} of {len(every)} cases"
    _quoted(f"{quote} ({_span(long)})")


def test_k_cache_floor_ratios_in_the_targets_table() -> None:
    insert = _ratios(INSERT, OURS, FLOOR, LONG)
    gather = {c: r[OURS]["p50_us"] / r[FLOOR]["p50_us"] for c, r in RUN[GATHER].items()}
    c4a = [
        v
        for c, v in gather.items()
        if c.startswith("c4a") and RUN[GATHER][c][OURS]["tokens"] >= LONG
    ]
    swa = [
        v
        for c, v in gather.items()
        if not c.startswith("c4a") and RUN[GATHER][c][OURS]["tokens"] >= LONG
    ]
    _quoted(f"insert {_span(insert)}; gather {_span(swa)}; C4A gather {c4a[0]:.2f}x")


def test_global_index_floor_ratios_and_upstream_speed_ups() -> None:
    _quoted(
        f"{_p50(GLOBAL, '16x1024', OURS) / _p50(GLOBAL, '16x1024', FLOOR):.2f}x (16x1024); "
        f"{_p50(GLOBAL, '1x16384@131072', OURS) / _p50(GLOBAL, '1x16384@131072', FLOOR):.2f}x"
    )
    ups = [f"{x:.2f}x" for x in _ratios(GLOBAL, "per-token-program", OURS)]
    _quoted(", ".join(ups[:-1]) + f" and {ups[-1]}")


def test_combine_geomean_and_seed_table() -> None:
    def geomean(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    rows = RUN[COMBINE]
    issue = [r for r in rows.values() if r[OURS]["params"].get("issue_matrix")]
    speed = [r["per-request-workers-256"]["p50_us"] / r[OURS]["p50_us"] for r in issue]
    every = _ratios(COMBINE, "per-request-workers-256", OURS)
    _quoted(f"{geomean(speed):.2f}x ({geomean(every):.2f}x over all {len(every)} cases)")
    for case in ("c4a-1x1024", "c4a-1x4096", "c4a-1x16384"):
        a, b = (
            _p50(COMBINE, case, "per-request-workers-128"),
            _p50(COMBINE, case, "per-request-workers-256"),
        )
        ours = _p50(COMBINE, case, OURS)
        _quoted(
            f"({case}) | {a:.2f} us | {b:.2f} us | {(a - b) / a * 100:.1f}% faster | "
            f"{ours:.2f} us | {b / ours:.2f}x |"
        )


def test_copy_bandwidth_and_commit() -> None:
    row = next(iter(next(iter(RUN.values())).values()))[OURS]
    _quoted(f"Copy bandwidth measured in that run: {row['copy_bandwidth_gbps']} GB/s")
    _quoted(f"at commit `{row['git_sha']}`")
