"""``benchmarks.host_overhead``: the plugin takes every kind's decode with the layer and
metadata the benchmark stands in for vLLM's (else the timing would be of a refusal), and
an A/B run over two trees writes one record per process and tree."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import host_overhead


def test_a_paired_run_records_every_tree_and_round(tmp_path: Path) -> None:
    """Each process times every kind through the plugin's decode (a kind the plugin did
    not take raises there, failing the run)."""
    root = str(host_overhead.ROOT)
    rc = host_overhead.main(
        ["--tree", f"a={root}", "--tree", f"b={root}", "--rounds", "2", "--calls", "2",
         "--tokens", "2", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    record = json.loads((tmp_path / "host_overhead.json").read_text())
    assert record["trees"] == {"a": root, "b": root}
    assert [len(record["runs"][t]) for t in ("a", "b")] == [2, 2]
    for tree in ("a", "b"):
        assert set(record["median_us"][tree]) == set(host_overhead.KINDS)
        assert all(v > 0 for v in record["median_us"][tree].values())
