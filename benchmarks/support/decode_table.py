"""Write the decode rows of a measured table file from curated decode runs.

``python -m benchmarks.support.decode_table TABLE.json CURATED.json [CURATED.json ...]``

Each ``CURATED.json`` is the ``decode_table.json`` a decode run writes
(``python -m benchmarks.cases_decode --out DIR``): per ``layer/heads``, FlashMLA's
time over ours per step size (``ratios``) and, where the step was also measured at
two tokens per request, those (``mtp_ratios``).  The table's ``decode.ratios`` become,
for every row of those files (later files win), the smaller of the two ratios per
step rounded to two decimals, and ``decode.max_heads`` the largest head row; every
other field of the table is left as it is (name the runs in its ``source`` by hand).
``tests/attention/test_decode_table.py`` checks the package's H200 table against its
curated runs with the same rule.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def decode_rows(curated: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``ratios[layer][heads][tokens]`` from curated runs (module docstring)."""
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for run in curated:
        for key, measured in run.items():
            layer, heads = key.split("/")
            mtp = measured.get("mtp_ratios", {})
            rows.setdefault(layer, {})[heads] = {
                t: round(min(r, mtp.get(t, r)), 2)
                for t, r in sorted(measured["ratios"].items(), key=lambda x: int(x[0]))
            }
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    table_path = Path(args[0])
    table = json.loads(table_path.read_text())
    rows = decode_rows([json.loads(Path(p).read_text()) for p in args[1:]])
    table["decode"]["ratios"] = rows
    table["decode"]["max_heads"] = max(int(h) for by in rows.values() for h in by)
    table_path.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
