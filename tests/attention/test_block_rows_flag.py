"""The tool that writes a table's ``prefill.c128a_block_rows`` from a GPU benchmark run:
the providers it pairs are the prefill benchmark's, it takes block rows only where no
C128A pair is slower than the tolerance, writes a table the plugin parses, and refuses to
write from a CPU run."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from benchmarks import cases_sparse_mla as cs
from benchmarks.support import block_rows_flag as brf

from dsv4_attention import tables


def _row(case: str, provider: str, p50: float, layer: str = "c128a", mode: str = "gpu") -> dict:
    return {
        "kernel": "sparse_mla",
        "case": case,
        "provider": provider,
        "p50_us": p50,
        "params": {"layer": layer},
        "mode": mode,
    }


def _run(blocks: float, grouped_blocks: float, mode: str = "gpu") -> list[dict[str, Any]]:
    return [
        _row("c128a-h8-1x16384@131072", cs.OURS_INDEX, 100.0, mode=mode),
        _row("c128a-h8-1x16384@131072", cs.OURS_BLOCKS, blocks, mode=mode),
        _row("c128a-h8-1x16384@131072", cs.OURS_GROUPED, 50.0, mode=mode),
        _row("c128a-h8-1x16384@131072", cs.OURS_GROUPED_BLOCKS, grouped_blocks, mode=mode),
        # another layer's providers are not C128A pairs
        _row("c4a-h8-1x16384@131072", cs.OURS_INDEX, 10.0, layer="c4a", mode=mode),
    ]


def test_the_pairs_are_the_prefill_benchmarks_providers() -> None:
    assert set(brf.PAIRS) == {
        (cs.OURS_BLOCKS, cs.OURS_INDEX),
        (cs.OURS_GROUPED_BLOCKS, cs.OURS_GROUPED),
    }


@pytest.mark.parametrize(
    "blocks, grouped, taken",
    [(90.0, 45.0, True), (101.5, 50.9, True), (103.0, 45.0, False), (90.0, 52.0, False)],
)
def test_block_rows_are_taken_only_where_no_pair_is_slower(
    blocks: float, grouped: float, taken: bool
) -> None:
    ok, lines = brf.decide(_run(blocks, grouped))
    assert ok is taken
    assert len(lines) == 2 and all("c128a-h8" in line for line in lines)


def test_no_pair_takes_nothing() -> None:
    assert brf.decide([_row("c128a-x", cs.OURS_INDEX, 1.0)]) == (False, [])


def _table(tmp_path: Path) -> Path:
    shipped = resources.files("dsv4_attention").joinpath("tables", "NVIDIA_H200.json")
    path = tmp_path / "NVIDIA_H200.json"
    path.write_text(shipped.read_text())
    return path


def test_the_flag_written_is_the_one_the_plugin_reads(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    table = _table(tmp_path)
    for blocks, taken in ((90.0, True), (120.0, False)):
        results.write_text("\n".join(json.dumps(r) for r in _run(blocks, 45.0)) + "\n")
        assert brf.main([str(results), "--table", str(table)]) == 0
        parsed = tables.parse_table(json.loads(table.read_text()), table.name)
        assert parsed.prefill.c128a_block_rows is taken


def test_a_cpu_run_writes_no_table(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in _run(90.0, 45.0, mode="cpu")) + "\n")
    table = _table(tmp_path)
    before = table.read_text()
    with pytest.raises(SystemExit):
        brf.main([str(results), "--table", str(table)])
    assert table.read_text() == before
