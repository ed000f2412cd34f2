"""Measure the plugin's table for the GPU this runs on (one that has none shipped).

``python3 -m benchmarks.measure_table --out DIR [--rep-ms N]`` (from a clone of this
repository, on the GPU, with FlashMLA built: ``bash .fmla/build-on-gpu.sh``, see
``docs/contributing.md``), then serve with ``DSV4_TABLES_DIR=DIR``.

The plugin uses a table only on the GPU it was measured on (exact device name, as
vLLM's platform reports it).  This runs the decode matrix of
:mod:`benchmarks.cases_decode` (V4's C4A, C128A and SWA-only layers at 8, 16 and 64
heads, and V4.1's top-k layers at 8 and 16, every step size, ours beside FlashMLA
padded to 64 heads as vLLM calls it, under CUDA graphs) and writes
``DIR/<device name>.json`` (spaces as underscores) with:

* ``decode.ratios``: FlashMLA's time over ours per layer kind, head row and step size
  (the smaller of the one- and two-token-per-request ratios, as the shipped table's);
  the plugin takes ours only at step sizes measured faster;
* ``indexer`` (where vLLM 0.33's DeepGEMM + top-k are staged:
  ``python3 -m benchmarks.support.fetch_vllm_indexer``): vLLM's decode indexer time over
  ours per index heads, top-k and row count, the smallest over the contexts
  (:mod:`benchmarks.cases_indexer`'s grid); the plugin takes ours only at row counts
  measured faster; without the pair the section is left out (vLLM's indexer runs);
  ``--sharded FILE`` adds a several-GPU run's split section (``sharded.json`` of
  ``python3 -m benchmarks.tp_indexer``) as ``indexer.sharded``;
* ``prefill``: every limit 0 (vLLM's prefill everywhere) and ``combine.replace``
  false: this command does not measure them (the shipped H200 limits came from curated
  prefill runs, ``docs/results/h200-run17``); edit the file after measuring them with
  ``python3 -m benchmarks.kernels`` and ``python3 -m benchmarks.cases_prefill_layer``.

The raw results (``results.jsonl``, ``decode.md``, ``decode_table.json``) are written
beside the table.  Without CUDA, or without FlashMLA to measure against, it writes
nothing and says why (exit 2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch


def table_from_decode(
    device_name: str,
    capability: tuple[int, int],
    decode_table: dict[str, Any],
    source: str,
) -> dict[str, Any]:
    """A table file's JSON from a decode run's ``decode_table`` (``cases_decode``'s
    summary: ``"layer/heads" -> {"ratios", "mtp_ratios"}``): decode rows as measured,
    prefill and combine left to vLLM (module docstring)."""
    from .support.decode_table import decode_rows_and_kernels

    rows, kernels = decode_rows_and_kernels([decode_table])
    if not rows:
        raise ValueError("decode_table has no measured rows (did FlashMLA run beside ours?)")
    return {
        "device_name": device_name,
        "family": f"sm{capability[0]}0",
        "source": source,
        "combine": {"replace": False, "note": "not measured by benchmarks.measure_table"},
        "prefill": {
            "requires_wgmma": True,
            "c4a_max_heads": 0,
            "shared_keys_max_heads": 0,
            "c4a_short_rows_max_heads": 0,
            "c4a_short_rows_mean_keys": 0,
            "note": "not measured by benchmarks.measure_table: vLLM's prefill everywhere",
        },
        "decode": {
            "requires_wgmma": True,
            "max_heads": max(int(h) for by in rows.values() for h in by),
            "min_ratio": 1.0,
            "ratios": rows,
            **({"kernels": kernels} if kernels else {}),
        },
    }


def write_table(out: Path, table: dict[str, Any]) -> Path:
    """Write ``table`` as ``out/<device name>.json`` after the plugin's own parser
    accepted it; the path."""
    from dsv4_attention import tables

    tables.parse_table(table, "the measured table")
    out.mkdir(parents=True, exist_ok=True)
    path = out / tables.file_name(str(table["device_name"]))
    path.write_text(json.dumps(table, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    from . import cases_decode, harness

    p = argparse.ArgumentParser(prog="python3 -m benchmarks.measure_table", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for the table (DSV4_TABLES_DIR)")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench's repetition time per case")
    p.add_argument(
        "--sharded", type=Path, default=None,
        help="sharded.json of benchmarks.tp_indexer (several GPUs): the split section",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "measure_table: no CUDA device: a table is measured on the GPU it is for",
            file=sys.stderr,
        )
        return 2
    from .flashmla_decode import load_decode

    if load_decode()[0] is None:
        why = load_decode()[1]
        print(
            f"measure_table: FlashMLA does not import ({why}); build it first "
            "(docs/contributing.md): the table is FlashMLA's time over ours",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    capability = torch.cuda.get_device_capability(device)
    env = harness.environment(device)
    bandwidth = harness.copy_bandwidth(device)
    print(f"measuring the decode table of {name} (sm{capability[0]}{capability[1]})")
    pool = cases_decode.matrix() + cases_decode.matrix(cases_decode.V41_LAYERS, dp=False)
    results = cases_decode.run(device, False, bandwidth, args.rep_ms, shapes_pool=pool)
    harness.write_jsonl(results, env, args.out / "results.jsonl")
    text = cases_decode.write_outputs(results, args.out)
    _, decode_table = cases_decode.summarise(results)
    print(text)
    stamp = datetime.date.today().isoformat()
    source = (
        f"benchmarks.measure_table on {name}, {stamp}, git {env.get('git_sha', '?')}, torch "
        f"{env.get('torch', '?')}, triton {env.get('triton', '?')}: decode matrix against "
        f"FlashMLA padded to 64 heads under CUDA graphs; prefill and combine not measured"
    )
    try:
        table = table_from_decode(name, capability, decode_table, source)
    except ValueError as exc:
        print(f"measure_table: {exc}; build FlashMLA first (docs/contributing.md)", file=sys.stderr)
        return 2
    from . import cases_indexer

    indexer_results = harness.run_cases(
        cases_indexer.build_cases(device, False), device, bandwidth, rep_ms=args.rep_ms
    )
    harness.write_jsonl(results + indexer_results, env, args.out / "results.jsonl")
    section = cases_indexer.indexer_section(
        indexer_results, f"benchmarks.measure_table on {name}, {stamp}: decode indexer grid"
    )
    if section is None:
        print("measure_table: vLLM's decode indexer pair did not run: no indexer section")
    else:
        if args.sharded is not None:
            section["sharded"] = json.loads(args.sharded.read_text())
        table["indexer"] = section
    path = write_table(args.out, table)
    print(f"wrote {path}; serve with DSV4_TABLES_DIR={args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
