"""Write the decode rows of a measured table file from curated decode runs.

``python -m benchmarks.support.decode_table TABLE.json CURATED.json [CURATED.json ...]``

Each ``CURATED.json`` is the ``decode_table.json`` a decode run writes
(``python -m benchmarks.cases_decode --out DIR``): per ``layer/heads``, FlashMLA's
time over ours per step size (``ratios``) and, where the step was also measured at
two tokens per request, those (``mtp_ratios``).  The table's ``decode.ratios`` become,
for every row of those files (later files win), the smaller of the two ratios per
step rounded to two decimals, and ``decode.max_heads`` the largest head row.  Rows of
a kernel variant (``layer/heads/wide64``: issue 41's wide head blocks, run beside the
default) compete with the default's per head row: the one whose ratios' geomean over
every layer and step of that row is higher is written, and ``decode.kernels`` names
the launch entries of each row a variant won.  Every other field of the table is left
as it is (name the runs in its ``source`` by hand).
``tests/attention/test_decode_table.py`` checks the package's H200 table against its
curated runs with the same rule.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

# the launch entries of each kernel variant a decode run measures beside the default
VARIANTS = {"wide64": {"WIDE_HT": 64}}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def decode_rows(curated: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``ratios[layer][heads][tokens]`` from curated runs (module docstring)."""
    return decode_rows_and_kernels(curated)[0]


def decode_rows_and_kernels(
    curated: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, int]]]:
    """``ratios[layer][heads][tokens]`` and ``kernels[heads]`` (the launch entries of
    the rows a variant won) from curated runs (module docstring)."""
    by_variant: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for run in curated:
        for key, measured in run.items():
            layer, heads, *variant = key.split("/")
            name = variant[0] if variant else ""
            if name and name not in VARIANTS:
                raise ValueError(
                    f"{key}: unknown kernel variant {name!r} (known: {sorted(VARIANTS)})"
                )
            mtp = measured.get("mtp_ratios", {})
            by_variant.setdefault(name, {}).setdefault(layer, {})[heads] = {
                t: round(min(r, mtp.get(t, r)), 2)
                for t, r in sorted(measured["ratios"].items(), key=lambda x: int(x[0]))
            }
    rows = by_variant.get("", {})
    kernels: dict[str, dict[str, int]] = {}
    for name, variant_rows in by_variant.items():
        if not name:
            continue
        for heads in sorted({h for by in variant_rows.values() for h in by}, key=int):

            def score(src: dict[str, dict[str, dict[str, float]]], h: str = heads) -> float:
                return _geomean([x for by in src.values() for x in by.get(h, {}).values()])

            if score(variant_rows) > score(rows):
                for layer, by in variant_rows.items():
                    if heads in by:
                        rows.setdefault(layer, {})[heads] = by[heads]
                kernels[heads] = dict(VARIANTS[name])
    return rows, kernels


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    table_path = Path(args[0])
    table = json.loads(table_path.read_text())
    rows, kernels = decode_rows_and_kernels([json.loads(Path(p).read_text()) for p in args[1:]])
    table["decode"]["ratios"] = rows
    if kernels:
        table["decode"]["kernels"] = kernels
    else:
        table["decode"].pop("kernels", None)
    table["decode"]["max_heads"] = max(int(h) for by in rows.values() for h in by)
    table_path.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
