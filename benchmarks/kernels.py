"""Kernel benchmark matrix: ``python -m benchmarks.kernels`` (the ``bench`` nox session).

On a CUDA machine: the full matrix, every provider checked against the
reference and then timed with ``triton.testing.do_bench`` in one run, the
floor from the copy bandwidth measured in the same run.  Without CUDA: a small,
clearly labelled CPU smoke run through Triton's interpreter that checks every
provider and prints wall-clock numbers that say nothing about GPU speed.

Writes ``results.jsonl``, ``table.md`` and ``plot.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default benchmarks/results/<timestamp>)",
    )
    p.add_argument("--only", default="", help="comma-separated kernel name substrings to run")
    p.add_argument("--smoke", action="store_true", help="force the small CPU-sized matrix")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per timing")
    p.add_argument(
        "--vllm-flashmla",
        type=Path,
        default=None,
        help="folder with vLLM 0.33's bundled FlashMLA (vllm_flashmla/_flashmla_C.abi3.so and "
        "flash_mla_interface.py; python3 -m benchmarks.support.fetch_vllm_flashmla stages it); "
        "default $DSV4_VLLM_FLASHMLA, else .vllm_flashmla",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.vllm_flashmla is not None:
        os.environ["DSV4_VLLM_FLASHMLA"] = str(args.vllm_flashmla.resolve())
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        # Must be set before any Triton kernel is decorated (dsv4_kernels import).
        os.environ["TRITON_INTERPRET"] = "1"
    smoke = args.smoke or not gpu
    device = torch.device("cuda" if gpu else "cpu")

    from . import harness
    from .cases_metadata import build_combine_cases, build_global_cases, build_launch_case
    from .report import summarise, write_plot, write_table

    out_dir = args.out or ROOT / "benchmarks" / "results" / datetime.datetime.now().strftime(
        "%Y%m%d-%H%M%S"
    )
    env = harness.environment(device)
    if not gpu:
        print("=" * 78)
        print("CPU SMOKE RUN: no CUDA GPU here. Kernels run through Triton's interpreter on tiny")
        print("shapes; every provider is checked, but the times are CPU wall clock and say")
        print("NOTHING about GPU speed. GPU figures need a GPU: run this module on one.")
        print("=" * 78)
        env["mode"] = "cpu-smoke"
    else:
        env["mode"] = "gpu"
    print(
        f"device: {env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}"
    )
    from . import flashmla_vllm

    env["vllm_flashmla"] = flashmla_vllm.status()
    module, why = flashmla_vllm.load()
    if module is None:  # said once, here: its providers say nothing more
        harness.not_run(flashmla_vllm.LABEL, why)
    else:
        print(f"{flashmla_vllm.LABEL}: {env['vllm_flashmla']}")

    builders = {
        "combine_topk_swa_indices": lambda: build_combine_cases(device, smoke),
        "compute_global_topk_indices_and_lens": lambda: build_global_cases(device, smoke),
        "empty_triton_launch": lambda: [build_launch_case(device)],
    }
    try:
        from .cases_kv_cache import build_cases as kv_cases

        builders["k_cache"] = lambda: kv_cases(device, smoke)
    except ImportError as exc:  # the FP8 cache benchmark is optional in a partial checkout
        print(f"(k-cache cases unavailable: {exc})")
    from .cases_sparse_mla import build_cases as sparse_mla_cases
    from .cases_sparse_mla import summarise_per_token as sparse_mla_per_token

    builders["sparse_mla"] = lambda: sparse_mla_cases(device, smoke)
    from .cases_prefill_layer import KERNEL as PREFILL_LAYER
    from .cases_prefill_layer import build_cases as prefill_layer_cases

    builders[PREFILL_LAYER] = lambda: prefill_layer_cases(device, smoke)
    from .cases_indexer import KERNEL as INDEXER
    from .cases_indexer import build_cases as indexer_cases

    builders[INDEXER] = lambda: indexer_cases(device, smoke)
    from . import cases_decode

    # the decode matrix runs case by case (its CUDA graphs are freed as it goes)
    builders["sparse_mla_decode"] = lambda: []
    only = [s for s in args.only.split(",") if s]

    bandwidth = harness.copy_bandwidth(device)
    env["copy_bandwidth_gbps"] = f"{bandwidth / 1e9:.1f}"
    if gpu:  # on a CPU no floor is shown: the host's copy bandwidth would only confuse
        print(f"copy bandwidth (read+write): {bandwidth / 1e9:.1f} GB/s")
    results = []
    for name, build in builders.items():
        if only and not any(s in name for s in only):
            continue
        if name == "sparse_mla_decode":
            results += cases_decode.run(device, smoke, bandwidth, min(args.rep_ms, 40))
            continue
        cases = build()
        results += harness.run_cases(cases, device, bandwidth, rep_ms=args.rep_ms)
        del cases
        if gpu:
            torch.cuda.empty_cache()
    if harness.NOT_RUN:  # recorded with the results, and said once in the table
        env["not_run"] = "; ".join(f"{peer} ({why})" for peer, why in harness.NOT_RUN)
    harness.write_jsonl(results, env, out_dir / "results.jsonl")
    table = write_table(
        results,
        env,
        out_dir / "table.md",
        command=" ".join(["python -m benchmarks.kernels", *sys.argv[1:]]),
    )
    write_plot(results, env, out_dir / "plot.png")
    print(table)
    print(summarise(results, smoke=smoke, gpu=gpu))
    for kernel in ("sparse_mla", PREFILL_LAYER):
        if any(r.kernel == kernel for r in results):
            print(f"\n### {kernel}: per query token\n")
            print(sparse_mla_per_token(results, kernel, smoke=not gpu))
    if any(r.kernel == cases_decode.KERNEL for r in results):
        print(f"\n### {cases_decode.KERNEL}: per call\n")
        print(cases_decode.write_outputs(results, out_dir, smoke=not gpu))
    print(f"results in {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
