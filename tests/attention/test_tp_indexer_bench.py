"""The several-GPU benchmark of the split indexer (``benchmarks.tp_indexer``) on the CPU:
its smoke run (two ranks over gloo, the plugin's split steps, every output checked
against the reference) reports no problem, and the table section it writes is the one
the plugin reads: parsed by ``tables``, each split's row counts the smallest ratio over
the contexts up to the engine's longest, ``policy.indexer_mode`` taking the fastest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.tp_indexer import sharded_section

from dsv4_attention import policy
from dsv4_attention.tables import _indexer_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_checks_every_split(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.tp_indexer", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    providers = {(r["rows"], r["provider"]) for r in rows}
    assert (1, "split-keys/TP2") in providers and (3, "split-rows/TP2") in providers
    assert (1, "split-rows/TP2") not in providers, "a row split needs at least TP rows"
    assert all(not r["problems"] and r["us"] > 0 for r in rows), rows
    assert json.loads((tmp_path / "sharded.json").read_text()) == {}, "no vLLM pair: none"


def _row(provider: str, rows: int, context: int, us: float, problems: bool = False) -> dict:  # type: ignore[type-arg]
    return {"model": "flash", "heads": 64, "topk": 512, "rows": rows, "context": context,
            "tp": 8, "provider": provider, "us": us,
            "problems": ["x"] if problems else []}  # fmt: skip


def test_the_section_is_what_the_plugin_reads() -> None:
    rows = [
        _row("vllm-0.33", 1, 131072, 40.0), _row("split-keys/TP8", 1, 131072, 20.0),
        _row("vllm-0.33", 1, 1048576, 300.0), _row("split-keys/TP8", 1, 1048576, 50.0),
        _row("vllm-0.33", 32, 131072, 100.0), _row("split-keys/TP8", 32, 131072, 50.0),
        _row("split-rows/TP8", 32, 131072, 25.0),
        _row("vllm-0.33", 32, 1048576, 800.0), _row("split-rows/TP8", 32, 1048576, 100.0),
        _row("split-keys/TP8", 32, 1048576, 900.0, problems=True),  # left out
        _row("split-rows/TP8", 8, 131072, 5.0),  # no vLLM time beside it: left out
    ]  # fmt: skip
    section = sharded_section(rows)
    assert section == {"8": {"64": {"512": {
        "keys": {"1": {"131072": 2.0, "1048576": 6.0}, "32": {"131072": 2.0}},
        "rows": {"32": {"131072": 4.0, "1048576": 8.0}},
    }}}}  # fmt: skip
    table = _indexer_table({"min_ratio": 1.0, "ratios": {}, "sharded": section})
    assert table is not None
    assert dict(table.split_row(8, 64, 512, "keys", 1 << 20) or {}) == {1: 2.0, 32: 2.0}
    assert dict(table.split_row(8, 64, 512, "rows", 1 << 20) or {}) == {32: 4.0}
    assert table.split_row(4, 64, 512, "rows", None) is None, "another TP size never borrowed"
    assert policy.indexer_mode(table, 64, 512, 32, tp=8, max_len=1 << 20) == "rows"
    assert policy.indexer_mode(table, 64, 512, 1, tp=8, max_len=1 << 20) == "keys"
    assert policy.indexer_mode(table, 64, 512, 4, tp=8, max_len=1 << 20) == "keys"
    assert policy.indexer_mode(table, 64, 512, 32, tp=1, max_len=1 << 20) == "vllm"
    assert policy.indexer_mode(table, 64, 512, 32, tp=4, max_len=1 << 20) == "vllm"
