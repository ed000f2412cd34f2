"""Tile-size sweep for the metadata kernels (GPU only): ``python -m benchmarks.sweep_metadata``.

Times our kernels under alternative compile-time tile sizes on the cases that
decide the targets; each variant is checked against the reference first.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import dsv4_kernels as dk
import dsv4_kernels.metadata as md
from dsv4_kernels import reference as ref

from .cases_metadata import COMBINE_MATRIX, _combine_inputs


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    shapes = [s for s in COMBINE_MATRIX
              if s.name in ("c4a-1x1024", "c4a-16x1024", "c4a-1x16384@131072", "swa-16x1024")]
    inputs = {}
    for s in shapes:
        inp = _combine_inputs(s, dev, g)
        inp.pop("_T"), inp.pop("_topk_read")
        inputs[s.name] = list(inp.values())
    wants = {k: ref.combine_topk_swa_indices(*a) for k, a in inputs.items()}
    print("combine: BLOCK_T BLOCK_C warps | " + " | ".join(inputs))
    for bt, bc, nw in itertools.product((2, 4, 8, 16), (128, 256), (2, 4, 8)):
        if bt * bc > 4096:
            continue
        md.COMBINE_BLOCK_T, md.COMBINE_BLOCK_C, md.COMBINE_NUM_WARPS = bt, bc, nw
        times = []
        for name, args in inputs.items():
            got = dk.combine_topk_swa_indices(*args)
            assert torch.equal(got[0], wants[name][0])
            times.append(triton.testing.do_bench(lambda a=args: dk.combine_topk_swa_indices(*a),
                                                 warmup=25, rep=60, return_mode="median") * 1e3)
        print(f"combine {bt:3d} {bc:4d} {nw:2d} | " + " | ".join(f"{t:8.2f}" for t in times),
              flush=True)
    T, K = 16384, 512
    topk = torch.randint(-1, 32768, (T, K), dtype=torch.int32, device=dev)
    req = torch.zeros(T, dtype=torch.int32, device=dev)
    table = torch.randint(0, 10**6, (1, 512), dtype=torch.int32, device=dev)
    valid = torch.ones(T, dtype=torch.bool, device=dev)
    args = (topk, req, table, 64, valid)
    want = ref.compute_global_topk_indices_and_lens(*args)
    for bt, bk, nw in itertools.product((1, 2, 4, 8), (128, 256, 512), (2, 4, 8)):
        md.GLOBAL_BLOCK_T, md.GLOBAL_BLOCK_K, md.GLOBAL_NUM_WARPS = bt, bk, nw
        got = dk.compute_global_topk_indices_and_lens(*args)
        assert torch.equal(got[0], want[0])
        t = triton.testing.do_bench(lambda: dk.compute_global_topk_indices_and_lens(*args),
                                    warmup=25, rep=60, return_mode="median") * 1e3
        print(f"global {bt:3d} {bk:4d} {nw:2d} | {t:8.2f}", flush=True)


if __name__ == "__main__":
    main()
