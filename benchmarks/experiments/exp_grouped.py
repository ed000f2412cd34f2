"""Grouped rows (tokens sharing keys) against per-token rows on the wgmma kernel (GPU).

``python -m benchmarks.experiments.exp_grouped [--out DIR] [--variants 1:0,2:0,4:0]``: for C128A
and SWA-only layers
(Flash TP8 and Pro TP8, 1 x 16,384 at 131,072 and 16 x 1,024), each variant's
poisoned outputs must be fully written and match the float32 reference on a
token sample; then the kernel alone and the kernel with its index build are
timed with ``triton.testing.do_bench``.  One JSON line per (case, variant).  A
variant is ``group:reg_a`` (``reg_a`` 1: ``S`` from registers on grouped tiles).
Run 15b (docs/attention.md) is the default variants; run 15a measured ``2:1`` and
``4:1`` too, on a first version of the grouped kernel (group boundaries from torch).
"""

# ruff: noqa: B023  (closures run inside the iteration that defines them)
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

import dsv4_kernels as dk
import dsv4_kernels.sparse_mla as sm
from dsv4_kernels.testing import sparse_mla as ts

from ..cases_metadata import fresh_seed
from ..inputs_sparse_mla import (
    MATRIX,
    SCALE,
    assert_close_attention,
    check_tokens,
    make_inputs,
    reference_sample,
)

SHAPES = [
    "c128a-flash-tp8-1x16384@131072",
    "swa-flash-tp8-1x16384@131072",
    "c128a-pro-tp8-1x16384@131072",
    "swa-pro-tp8-1x16384@131072",
    "c128a-flash-tp8-16x1024",
    "swa-flash-tp8-16x1024",
]
VARIANTS = [(1, 0), (2, 0), (4, 0)]  # (group size, REG_A on grouped tiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="exp-grouped")
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--variants", default=",".join(f"{g}:{r}" for g, r in VARIANTS))
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shapes = {s.name: s for s in MATRIX}
    for name in SHAPES:
        shape = shapes[name]
        inp = make_inputs(shape, dev, fresh_seed())
        c = inp.index_case
        T, H, _ = inp.q.shape
        tokens = check_tokens(T, dev)
        want = reference_sample(inp, tokens)
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((T, H), dtype=torch.float32, device=dev)
        comp = inp.comp_cache is not None
        base = None
        variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
        for size, reg_a in variants:
            if sm.group_rows(H, size) > sm.MAX_GROUP_ROWS or (size == 1 and reg_a):
                continue
            tiles = {"small": {**sm.TILES["small"], "REG_A_G": reg_a}}
            inp.tiles = tiles

            def build(size: int = size) -> dk.GroupedPrefillIndices:
                if size == 1:
                    return c.build()  # per-token rows
                return dk.build_grouped_prefill_indices(
                    c.query_start_loc, c.seq_lens, num_tokens=T, group_size=size,
                    window_block_table=c.window_block_table,
                    comp_block_table=c.comp_block_table if comp else None,
                    comp_block_size=inp.comp_block_size if comp else None,
                    topk=c.topk if comp else None,
                )  # fmt: skip

            def attend(gr: dk.GroupedPrefillIndices, size: int = size) -> None:
                if size == 1:
                    inp.run_paged(out, lse)
                    return
                kw = dict(swa_block_size=64, attn_sink=inp.sink, out=out, lse=lse)
                if comp:
                    kw.update(comp_cache=inp.comp_cache, comp_indices=gr.comp,
                              comp_lens=gr.comp_lens,
                              comp_block_size=inp.comp_block_size)  # fmt: skip
                dk.sparse_mla_paged(
                    inp.q, inp.swa_cache, gr.window, gr.window_lens, SCALE, tiles=tiles,
                    **gr.grouping(), **kw,
                )  # fmt: skip

            gr = build()
            ts.poison_outputs(out, lse)
            attend(gr)
            torch.cuda.synchronize()
            row = {"case": name, "group": size, "reg_a": reg_a, "heads": H, "tokens": T}
            try:
                assert not torch.isnan(out.float()).any(), "unwritten (NaN) output"
                assert not torch.isnan(lse).any(), "unwritten (NaN) lse"
                assert_close_attention((out[tokens], lse[tokens]), want, f"{name} G={size}")
                if base is None:
                    base = (out.clone(), lse.clone())
                else:
                    row["max_abs_diff_vs_per_token"] = float(
                        (out.float() - base[0].float()).abs().max()
                    )
                row["check"] = "ok"
                ms = triton.testing.do_bench(lambda: attend(gr), rep=args.rep_ms)
                ms_b = triton.testing.do_bench(lambda: attend(build()), rep=args.rep_ms)
                ms_idx = triton.testing.do_bench(build, rep=args.rep_ms)
                row.update(ns_per_token=ms * 1e6 / T, ns_per_token_with_build=ms_b * 1e6 / T,
                           build_ns_per_token=ms_idx * 1e6 / T)  # fmt: skip
            except Exception as exc:  # record and go on: one variant must not hide the rest
                row["check"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            with open(out_dir / "grouped.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
