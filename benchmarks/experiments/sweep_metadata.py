"""Tile-size sweep for the metadata kernels (GPU only).

``python -m benchmarks.experiments.sweep_metadata``.

For each compile-time tile configuration: do_bench median (the harness's
timing), the host time per call (launch and validation, no sync), and the GPU
time per call from a CUDA graph of 20 back-to-back calls.  Every variant is
checked against the reference first.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

import dsv4_kernels as dk
import dsv4_kernels.metadata as md
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import fresh_seed, generator
from dsv4_kernels.testing.metadata import CombineInputs, combine_bench_inputs

from ..cases_metadata import COMBINE_MATRIX, CombineShape
from ..harness import _time_us


def _inputs(shape: CombineShape, dev: torch.device, g: torch.Generator) -> CombineInputs:
    return combine_bench_inputs(shape.layer, shape.num_reqs, shape.query_len, shape.context, dev, g)


def _host_us(fn: Callable[[], object], n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _graph_us(fn: Callable[[], object], n: int = 20) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * n)


def host_breakdown(dev: torch.device) -> None:
    """Where the host time of one call goes: validation, Triton's launcher, allocation."""
    from ..empty_kernel import launch_empty

    g = generator(fresh_seed())
    shape = next(s for s in COMBINE_MATRIX if s.name == "c4a-1x1024")
    inp = _inputs(shape, dev, g)
    T, args = inp.num_tokens, inp.args
    out = torch.empty((T, 640), dtype=torch.int32, device=dev)
    lens = torch.empty((T,), dtype=torch.int32, device=dev)

    def raw() -> None:
        md._launch_combine(*args, out, lens)  # type: ignore[arg-type]

    def validate() -> None:
        md._combine_args(*args, out, None, None, 0, None)

    raw()
    launch_empty(dev)
    rows = {
        "empty Triton kernel launch": lambda: launch_empty(dev),
        "combine: validation only": validate,
        "combine: raw Triton launch": raw,
        "combine: public call with out=": lambda: dk.combine_topk_swa_indices(
            *args, out=out, lens_out=lens
        ),
        "combine: public call, allocating": lambda: dk.combine_topk_swa_indices(*args),
    }
    for name, fn in rows.items():
        print(f"host {name:<36} {_host_us(fn, 500):7.2f} us/call", flush=True)


def main() -> None:
    import sys

    dev = torch.device("cuda")
    if "--global-only" in sys.argv:
        sweep_global(dev)
        return
    host_breakdown(dev)
    g = generator(fresh_seed())
    names = ("c4a-1x1024", "c4a-16x1024", "c4a-1x16384@131072", "swa-16x1024")
    inputs = {}
    for s in COMBINE_MATRIX:
        if s.name in names:
            inp = _inputs(s, dev, g)
            inputs[s.name] = (inp.args, inp.num_tokens)
    wants = {k: ref.combine_topk_swa_indices(*a, num_tokens=t) for k, (a, t) in inputs.items()}
    print("combine BT BC warps | per case: do_bench / host / graph (us)")
    for bt, bc, nw in ((8, 128, 2), (8, 128, 4), (16, 128, 4), (8, 256, 4)):
        md.COMBINE_BLOCK_T, md.COMBINE_BLOCK_C, md.COMBINE_NUM_WARPS = bt, bc, nw
        cells = []
        for name, (args, _t) in inputs.items():
            out = torch.empty_like(wants[name][0])
            lens = torch.empty_like(wants[name][1])

            def fn(a: list = args, o: torch.Tensor = out, ln: torch.Tensor = lens) -> object:
                return dk.combine_topk_swa_indices(*a, out=o, lens_out=ln)

            fn()
            assert torch.equal(out, wants[name][0]) and torch.equal(lens, wants[name][1])
            t_bench, t_host, t_graph = _time_us(fn, dev, 60)[1], _host_us(fn), _graph_us(fn)
            cells.append(f"{t_bench:6.2f}/{t_host:5.1f}/{t_graph:6.2f}")
        print(f"combine {bt:2d} {bc:3d} {nw} | " + " | ".join(cells), flush=True)
    sweep_global(dev)


def sweep_global(dev: torch.device) -> None:
    from ..cases_metadata import build_global_cases

    cases = [c for c in build_global_cases(dev, False) if c.tokens == 16384]
    for case in cases:
        for prov in case.providers[1:]:
            prov.poison()
            prov.run()
            prov.check()
            print(f"{prov.name} {case.case}: {_time_us(prov.run, dev, 60)[1]:7.2f}")
    print("global BT BK warps | per case (" + ", ".join(c.case for c in cases) + "): do_bench us")
    for bt, bk, nw in itertools.product((1, 2, 4), (128, 256, 512), (1, 2, 4, 8)):
        md.GLOBAL_BLOCK_T, md.GLOBAL_BLOCK_K, md.GLOBAL_NUM_WARPS = bt, bk, nw
        cells = []
        for case in cases:
            prov = case.providers[0]
            prov.poison()
            prov.run()
            prov.check()
            cells.append(f"{_time_us(prov.run, dev, 60)[1]:7.2f}")
        print(f"global {bt} {bk:3d} {nw} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
