"""Write a table's prefill choices that a GPU run of the prefill benchmark decides.

``python -m benchmarks.support.prefill_table RESULTS.jsonl [--table TABLE.json]``

``RESULTS.jsonl`` is what ``python3 -m benchmarks.kernels`` (or
``python3 -m benchmarks.cases_sparse_mla``) writes on the GPU.  Two choices, each
printed with the ratios behind it, and written into the table's ``prefill`` section
with ``--table`` (only from a GPU run: a CPU run writes nothing):

* ``c128a_block_rows`` (issue 38): for every C128A case, the provider that reads the
  C128A rows through the compressed block table against the one that builds them as
  rows of slots, both timed with their index build (per token:
  ``dsv4-kernels-blocks+index`` against ``dsv4-kernels+index``; grouped:
  ``dsv4-kernels-grouped-blocks+index`` against ``dsv4-kernels-grouped+index``).  True
  when no pair is slower than :data:`BLOCKS_TOLERANCE` (the noise between two medians
  of the same kernel), so the memory saving never costs time.  Run it only after
  ``tests/kernels/test_sparse_mla_gpu.py::test_block_rows_equal_the_rows_of_slots``
  passed on that GPU.
* ``wide`` (issue 41): for every case above 16 heads, ours in the wgmma kernel's wide
  head blocks with its index build (``dsv4-kernels-wide+index``) against the fastest of
  vLLM's paths that ran (FlashMLA with vLLM's gathers and combine:
  ``flashmla-64h+gather``, ``vllm-flashmla-native+gather``).  A layer kind is taken at a
  head count when ours was faster in every case of that kind and head count; the row
  records the tiles the benchmark ran (``cases_sparse_mla.wide_tiles``).  Head counts
  not measured get no row (a row is never borrowed for another count); a table's rows
  at head counts this run did not measure, and its block-rows flag when the run has no
  C128A pair, are left as they are.  Run it only
  after ``tests/kernels/test_sparse_mla_gpu.py::test_wide_head_blocks_match_reference_and_triton``
  passed on that GPU.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from dsv4_attention.tables import WIDE_KINDS

from .. import cases_sparse_mla as cs

# (block rows, rows of slots): providers of benchmarks.cases_sparse_mla
BLOCK_PAIRS = (
    (cs.OURS_BLOCKS, cs.OURS_INDEX),
    (cs.OURS_GROUPED_BLOCKS, cs.OURS_GROUPED),
)
BLOCKS_TOLERANCE = 1.02  # block rows' median at most 2% above the rows of slots'
# vLLM's path per layer and chunk (the gathers, the combine, then FlashMLA)
VLLM_PATHS = (cs.FLASHMLA_GATHER, cs.VLLM_FLASHMLA_GATHER)


def _medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(case, provider) -> median us of the sparse MLA kernel's results."""
    return {
        (r["case"], r["provider"]): float(r["p50_us"]) for r in rows if r.get("kernel") == cs.KERNEL
    }


def _params(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["case"]: r.get("params", {}) for r in rows if r.get("kernel") == cs.KERNEL}


def block_pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(case, block-rows provider, its median us, the rows of slots' median us) for every
    C128A case where both providers ran."""
    p50, params = _medians(rows), _params(rows)
    found = []
    for case in sorted(c for c, p in params.items() if p.get("layer") == "c128a"):
        for blocks, slots in BLOCK_PAIRS:
            if (case, blocks) in p50 and (case, slots) in p50:
                found.append((case, blocks, p50[(case, blocks)], p50[(case, slots)]))
    return found


def block_rows(rows: list[dict[str, Any]]) -> tuple[bool, list[str]]:
    """Whether the block rows are taken, and one line per pair (module docstring)."""
    found = block_pairs(rows)
    lines = [
        f"{case} {name}: {b:.1f} us vs {s:.1f} us with rows of slots ({s / b:.3f}x)"
        for case, name, b, s in found
    ]
    ok = bool(found) and all(b <= s * BLOCKS_TOLERANCE for _, _, b, s in found)
    return ok, lines


def wide_rows(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str], set[str]]:
    """The table's ``prefill.wide`` rows this run decides (head count -> kinds and tiles),
    one line per case above 16 heads, and the head counts it measured (module
    docstring)."""
    p50, params = _medians(rows), _params(rows)
    faster: dict[int, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    lines = []
    for case, p in sorted(params.items()):
        heads, layer = int(p.get("heads", 0)), p.get("layer")
        ours = p50.get((case, cs.OURS_WIDE_INDEX))
        peers = {name: p50[(case, name)] for name in VLLM_PATHS if (case, name) in p50}
        if heads <= 16 or layer not in WIDE_KINDS or ours is None or not peers:
            continue
        name, best = min(peers.items(), key=lambda kv: kv[1])
        faster[heads][layer].append(ours < best)
        lines.append(f"{case} ({heads} heads): ours {ours:.1f} us, {name} {best:.1f} us "
                     f"({best / ours:.3f}x)")  # fmt: skip
    table = {}
    for heads, by_kind in sorted(faster.items()):
        kinds = sorted(k for k, wins in by_kind.items() if wins and all(wins))
        if kinds:
            table[str(heads)] = {"kinds": kinds, "tiles": cs.wide_tiles(heads)}
    return table, lines, {str(h) for h in faster}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.support.prefill_table")
    p.add_argument("results", type=Path)
    p.add_argument("--table", type=Path, help="the measured table file to write into")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    blocks, block_lines = block_rows(rows)
    wide, wide_lines, measured = wide_rows(rows)
    print("\n".join(block_lines) or "no C128A case with both row providers in this run")
    print(f"c128a_block_rows: {str(blocks).lower()} (block rows at most "
          f"{BLOCKS_TOLERANCE}x in every pair)")  # fmt: skip
    print("\n".join(wide_lines) or "no case above 16 heads with ours and vLLM's path")
    print(f"wide: {json.dumps({h: r['kinds'] for h, r in wide.items()})}")
    if args.table is not None:
        modes = {r.get("mode") for r in rows}
        if modes != {"gpu"}:
            p.error(f"--table needs a GPU run; this one's mode is {sorted(map(str, modes))}")
        table = json.loads(args.table.read_text())
        prefill = table["prefill"]
        if block_lines:
            prefill["c128a_block_rows"] = blocks
        kept = {h: r for h, r in prefill.get("wide", {}).items() if h not in measured}
        prefill["wide"] = dict(sorted({**kept, **wide}.items(), key=lambda kv: int(kv[0])))
        if not prefill["wide"]:
            del prefill["wide"]
        args.table.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
