"""Decide a table's ``prefill.c128a_block_rows`` from a GPU run of the prefill benchmark.

``python -m benchmarks.support.block_rows_flag RESULTS.jsonl [--table TABLE.json]``

``RESULTS.jsonl`` is what ``python3 -m benchmarks.kernels`` (or
``python3 -m benchmarks.cases_sparse_mla``) writes on the GPU.  For every C128A case it
pairs the provider that reads the C128A rows through the compressed block table with
the one that builds them as rows of slots, both timed with their index build (per
token: ``dsv4-kernels-blocks+index`` against ``dsv4-kernels+index``; grouped:
``dsv4-kernels-grouped-blocks+index`` against ``dsv4-kernels-grouped+index``) and
prints the ratio of their medians.  Block rows are taken when no pair is slower than
:data:`TOLERANCE` (a run's noise between two medians of the same kernel), so the
memory saving never costs time; with ``--table`` the decision is written into the
table's ``prefill.c128a_block_rows`` (only from a GPU run: a CPU run is refused).  Run
it only after ``tests/kernels/test_sparse_mla_gpu.py::test_block_rows_equal_the_rows_of_slots``
passed on that GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# (block rows, rows of slots): providers of benchmarks.cases_sparse_mla
PAIRS = (
    ("dsv4-kernels-blocks+index", "dsv4-kernels+index"),
    ("dsv4-kernels-grouped-blocks+index", "dsv4-kernels-grouped+index"),
)
TOLERANCE = 1.02  # block rows' median at most 2% above the rows of slots'


def pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(case, block-rows provider, its median us, the rows of slots' median us) for every
    C128A case of the sparse MLA kernel where both providers ran."""
    p50: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.get("kernel") == "sparse_mla" and r.get("params", {}).get("layer") == "c128a":
            p50[(r["case"], r["provider"])] = float(r["p50_us"])
    found = []
    for case in sorted({c for c, _ in p50}):
        for blocks, slots in PAIRS:
            if (case, blocks) in p50 and (case, slots) in p50:
                found.append((case, blocks, p50[(case, blocks)], p50[(case, slots)]))
    return found


def decide(rows: list[dict[str, Any]]) -> tuple[bool, list[str]]:
    """Whether the block rows are taken, and one line per pair (module docstring)."""
    found = pairs(rows)
    lines = [
        f"{case} {name}: {b:.1f} us vs {s:.1f} us with rows of slots ({s / b:.3f}x)"
        for case, name, b, s in found
    ]
    ok = bool(found) and all(b <= s * TOLERANCE for _, _, b, s in found)
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.support.block_rows_flag")
    p.add_argument("results", type=Path)
    p.add_argument("--table", type=Path, help="the measured table file to write the flag into")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    ok, lines = decide(rows)
    print("\n".join(lines) or "no C128A case with both providers in this run")
    print(f"c128a_block_rows: {str(ok).lower()} (block rows at most {TOLERANCE}x in every pair)")
    if args.table is not None:
        modes = {r.get("mode") for r in rows}
        if modes != {"gpu"}:
            p.error(f"--table needs a GPU run; this one's mode is {sorted(map(str, modes))}")
        table = json.loads(args.table.read_text())
        table["prefill"]["c128a_block_rows"] = ok
        args.table.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
