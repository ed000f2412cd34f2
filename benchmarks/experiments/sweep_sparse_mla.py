"""Sparse MLA kernel variants, timed against each other on the 1 x 16,384-token cases (GPU).

The one tile sweep of the sparse MLA kernels (``cases_sparse_mla.py --sweep`` is gone):
each variant's tiles go to the kernels as their ``tiles=`` argument.

``python -m benchmarks.experiments.sweep_sparse_mla [--out DIR] [--rep-ms N] [--cases a,b]
[--variants x,y] [--tiny]``

For each case (C4A Flash TP8, C4A Pro TP8, SWA Flash TP8 and C4A Flash DP at a
131,072-token context; the workspace path too on the first) and each variant of
:data:`benchmarks.support.sparse_mla_variants.VARIANTS` (one head class's entry of
:data:`dsv4_kernels.sparse_mla.TILES`), the outputs are poisoned, the kernel runs, every
element must be written and NaN-free and a strided sample of 256 tokens must match the
float32 reference; then ``triton.testing.do_bench`` times it.
One JSON line per (case, variant) is appended to ``DIR/sweep.jsonl`` as soon as
it is measured (a run cut short keeps what it measured).  The kernels are
compiled first in parallel worker processes on tiny inputs of the same
compile-time shape, which fills Triton's on-disk cache for the timed process.
``--tiny`` runs the same flow on tiny shapes (on CPU with ``TRITON_INTERPRET=1``:
a check of the script, times meaningless).  Runs 5 and 6 (docs/attention.md)
measured earlier variant sets, among them a column-piece kernel since removed;
run 16 measured two kernels kept only in git history (``REG_V`` at commit
``54b0a05``, the warp-specialised kernel at ``8f98350``: docs/attention.md), and
run 18 the gathers as ``ld.global.cg`` (``GATHER_CG`` at ``a6a0cd2``), run 19 a
tensor-map-copy kernel (``TMA`` at ``85fc3a1``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from ..cases_metadata import fresh_seed
from ..inputs_sparse_mla import (
    MATRIX,
    AttnShape,
    assert_close_attention,
    check_tokens,
    make_inputs,
    reference_sample,
)
from ..support.sparse_mla_variants import VARIANTS, WORKSPACE_VARIANTS, head_class, tiny_shape

CASES = (
    "c4a-flash-tp8-1x16384",
    "c4a-pro-tp8-1x16384",
    "swa-flash-tp8-1x16384",
    "c4a-flash-dp-1x16384",
)


def _warm(job: tuple[AttnShape, dict[str, int], bool]) -> str:
    shape, tiles, workspace = job
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        inp = make_inputs(tiny_shape(shape), device, 1, tiles={head_class(shape.heads): tiles})
        T, H, _ = inp.q.shape
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
        lse = torch.empty((T, H), dtype=torch.float32, device=device)
        if workspace:
            inp.run_workspace(out, lse)
        else:
            inp.run_paged(out, lse)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # reported, the timed run skips nothing on its account
        return f"{type(exc).__name__}: {exc}"[:300]


def main(argv: list[str] | None = None) -> int:
    import argparse

    import triton.testing

    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.sweep_sparse_mla")
    p.add_argument("--out", type=Path, default=Path("sparse-mla-sweep"))
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--variants", default="", help="variant names to run (default: all)")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--warm-s", type=int, default=90, help="limit for the parallel compiles")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a smoke run of the script itself on tiny shapes (CPU: TRITON_INTERPRET=1)",
    )
    args = p.parse_args(argv)
    variants = dict(VARIANTS)
    if args.variants:  # only these (names of VARIANTS, any head class)
        keep = set(args.variants.split(","))
        known = {n for runs in VARIANTS.values() for n, _ in runs}
        if keep - known:
            p.error(f"--variants: unknown {sorted(keep - known)}; known: {sorted(known)}")
        variants = {c: [(n, t) for n, t in runs if n in keep] for c, runs in VARIANTS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "sweep.jsonl"
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    names = [c for c in args.cases.split(",") if c]
    shapes = [s for s in MATRIX if any(s.name.startswith(n) for n in names)]
    if args.tiny:
        shapes = [tiny_shape(s) for s in shapes]
    t0 = time.time()
    jobs, seen = [], set()
    for i, s in enumerate(shapes):
        for name, tiles in variants[head_class(s.heads)]:
            for ws in (False, True) if i == 0 else (False,):
                if ws and name not in WORKSPACE_VARIANTS:
                    continue
                key = (s.layer, s.heads > 16, ws, name)  # one compile per constexpr set
                if key not in seen:
                    seen.add(key)
                    jobs.append((s, tiles, ws))
    if gpu:
        with mp.get_context("spawn").Pool(min(args.workers, len(jobs))) as pool:
            pending = pool.map_async(_warm, jobs)
            try:
                warm = pending.get(timeout=args.warm_s)
            except mp.TimeoutError:  # compile the rest in the timed process
                warm = [f"warm-up not finished in {args.warm_s} s"] * len(jobs)
                pool.terminate()
    else:
        warm = ["ok"] * len(jobs)
    for (s, tiles, ws), w in zip(jobs, warm, strict=True):
        if w != "ok":
            print(f"warm-up {s.name} {tiles} workspace={ws}: {w}", flush=True)
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s", flush=True)
    for shape in shapes:
        seed = fresh_seed()
        inp = make_inputs(shape, device, seed)
        T, H, _ = inp.q.shape
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
        lse = torch.empty((T, H), dtype=torch.float32, device=device)
        tokens = check_tokens(T, device)
        want = reference_sample(inp, tokens)
        cls = head_class(H)
        runs = [(n, t, False) for n, t in variants[cls]]
        if shape is shapes[0]:
            runs += [(n, t, True) for n, t in variants[cls] if n in WORKSPACE_VARIANTS]
        for name, tiles, ws in runs:
            inp.tiles = {cls: tiles}
            row: dict[str, Any] = dict(
                case=shape.name, heads=H, seed=seed, variant=name, tiles=tiles, workspace=ws
            )
            run = inp.run_workspace if ws else inp.run_paged
            try:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                run(out, lse)
                if gpu:
                    torch.cuda.synchronize()
                assert not torch.isnan(out.float()).any(), "unwritten (NaN) output"
                assert not torch.isnan(lse).any(), "unwritten (NaN) lse"
                assert_close_attention((out[tokens], lse[tokens]), want, name)
                if gpu:
                    ms = triton.testing.do_bench(
                        lambda r=run, o=out, l=lse: r(o, l), rep=args.rep_ms
                    )
                else:  # the smoke run: one call, timed roughly
                    t1 = time.perf_counter()
                    run(out, lse)
                    ms = (time.perf_counter() - t1) * 1e3
                row["ns_per_token"] = ms * 1e6 / T
                row["checked"] = True
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            ns = row.get("ns_per_token")
            tag = name + (" (workspace)" if ws else "")
            print(
                f"{shape.name:<28} {tag:<34} "
                + (f"{ns:8.1f} ns/token" if ns is not None else row["error"]),
                flush=True,
            )
        del inp, out, lse
        if gpu:
            torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
