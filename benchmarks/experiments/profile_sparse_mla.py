"""Where the sparse MLA kernel's time goes, on the GPU: ablations and an ``ncu`` target.

``python -m benchmarks.experiments.profile_sparse_mla [--case NAME] [--ablate] [--launches N]``

* ``--launches N`` (default 3): run the case's paged kernel N times, after one
  checked run, so ``ncu --launch-skip 1 --launch-count 1`` can profile a warm
  launch.  The committed profile (``docs/results/h200-profile/``) was taken with
  ``ncu --clock-control none --kernel-name regex:_sparse_mla_kernel --launch-skip 1
  --launch-count 1 --set full -o prof python3 -m benchmarks.experiments.profile_sparse_mla
  --launches 2`` and read with ``ncu --import prof.ncu-rep --page details`` and
  ``--page source --print-source sass --csv``, summarised by ``--summarise FILE``
  (no GPU needed for that).
* ``--ablate``: time the default kernel against variants that leave one stage out
  (each in a fresh process; the shipped kernel is never touched):

  - ``no-gather``: the keys' bytes are not gathered from all over the cache: every
    tile of an index row repeats the row's first ``BLOCK_N`` slots (same lengths and
    holes), so each tile's bytes are the first tile's, already in L1 (the rows are
    changed, not the kernel);
  - ``no-dequant`` (a copy of the kernel module's ``_keys_from_raw`` swapped in):
    the FP8 codes become keys by a plain integer conversion;
  - with ``--wgmma``, the Gluon wgmma kernel as it is (``wgmma``) and with its
    dequantisation replaced by one hardware conversion per two codes and no
    scale (``wgmma-convert-only``: what holding the tile in f16 would cost).

  The Triton kernel's ablations run with ``KERNEL=0`` tiles.

  The differences say how much of the time the gather and the dequantisation
  hold; the ablated outputs are wrong by design and not checked.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dsv4_kernels._jit_layout import HEAD_DIM, NQ, NQ_PAD

from ..cases_metadata import fresh_seed
from ..inputs_sparse_mla import (
    MATRIX,
    assert_close_attention,
    check_tokens,
    make_inputs,
    reference_sample,
)

ABLATIONS = ("default", "no-gather", "no-dequant")  # of the Triton kernel
WGMMA_ABLATIONS = ("wgmma", "wgmma-convert-only")  # of the Gluon wgmma kernel (Hopper)


def _patch(kind: str) -> None:
    """Swap one helper of the kernel module for a cheaper copy (before the first compile)."""
    import triton
    import triton.language as tl

    from dsv4_kernels import _triton_sparse_mla as k

    if kind in ("default", "wgmma"):
        return
    if kind == "wgmma-convert-only":
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl

        from dsv4_kernels import _gluon_sparse_mla as g

        @gluon.jit
        def convert_only(codes, sb, b: gl.constexpr):
            # one hardware conversion per two codes (what keeping the tile in f16 costs),
            # no scale: the tile's values are wrong, its instruction count is the point
            v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            return v.to(gl.bfloat16, bitcast=True)

        g._block_bf16 = convert_only  # both S operand kinds dequantise through it
        return
    if kind == "no-dequant":

        @triton.jit
        def keys_int(
            a,
            b,
            sbytes,
            PAGED: tl.constexpr,
            BLOCK_N: tl.constexpr,
            BF16_DEQUANT: tl.constexpr,
            WORDS: tl.constexpr = False,
        ):
            is_nope = (tl.arange(0, NQ_PAD) < NQ)[None, :, None]
            k_ = tl.where(is_nope, a.to(tl.bfloat16), b)
            return tl.reshape(k_, (BLOCK_N, HEAD_DIM))

        k._keys_from_raw = keys_int
    elif kind == "no-gather":
        return  # the index rows change instead (_first_tile_only)
    else:
        raise ValueError(f"unknown ablation {kind!r}")


def _first_tile_only(rows: torch.Tensor | None, block_n: int) -> None:
    """Make every ``block_n``-column tile of each index row repeat the row's first tile."""
    if rows is None or rows.shape[1] <= block_n:
        return
    reps = -(-rows.shape[1] // block_n)
    rows.copy_(rows[:, :block_n].repeat(1, reps)[:, : rows.shape[1]].clone())


def _time_one(job: tuple[str, str, int]) -> dict[str, Any]:
    kind, case, rep = job
    import triton.testing

    from dsv4_kernels.sparse_mla import TILES

    tiles = None
    if not kind.startswith("wgmma"):  # the Triton kernel's ablations
        tiles = {"small": {**TILES["small"], "KERNEL": 0}}
    _patch(kind)
    shape = next(s for s in MATRIX if s.name == case)
    device = torch.device("cuda")
    seed = fresh_seed()
    inp = make_inputs(shape, device, seed, tiles=tiles)
    if kind == "no-gather":
        block_n = (tiles or TILES)["small" if shape.heads <= 16 else "large"]["BLOCK_N"]
        _first_tile_only(inp.rows.window, block_n)
        _first_tile_only(inp.rows.comp, block_n)
    T, H, _ = inp.q.shape
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
    lse = torch.empty((T, H), dtype=torch.float32, device=device)
    inp.run_paged(out, lse)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(lambda: inp.run_paged(out, lse), rep=rep)
    return dict(case=case, ablation=kind, seed=seed, ns_per_token=ms * 1e6 / T)


def summarise(sass_csv: Path, tokens: int, top: int = 16) -> str:
    """A markdown table of the profiled kernel's instruction mix and stall reasons from
    ``ncu --page source --print-source sass --csv`` (warp instructions per query token)."""
    rows = list(csv.reader(sass_csv.open()))
    head = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    hdr, data = rows[head], rows[head + 1 :]
    col = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    inst: Counter[str] = Counter()
    samples: Counter[str] = Counter()
    stalls: Counter[str] = Counter()
    for r in data:
        words = r[col["Source"]].split() if len(r) == len(hdr) else []
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        inst[op] += num(r[col["Instructions Executed"]])
        samples[op] += num(r[col["Warp Stall Sampling (All Samples)"]])
        for c in stall_cols:
            stalls[c] += num(r[col[c]])
    n_inst, n_samp, n_stall = sum(inst.values()), sum(samples.values()), sum(stalls.values())
    out = [
        f"Warp instructions per query token: {n_inst / tokens:,.0f}",
        "",
        "| opcode | per token | share of instructions | share of stall samples |",
        "|---|---|---|---|",
    ]
    for op, n in inst.most_common(top):
        share = 100 * samples[op] / max(n_samp, 1)
        out.append(f"| {op} | {n / tokens:,.0f} | {100 * n / n_inst:.1f}% | {share:.1f}% |")
    out += ["", "| stall reason | share of samples |", "|---|---|"]
    for c, n in stalls.most_common(8):
        out.append(f"| {c.removeprefix('stall_')} | {100 * n / max(n_stall, 1):.1f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.profile_sparse_mla")
    p.add_argument("--case", default="c4a-flash-tp8-1x16384@131072")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--ablate", action="store_true")
    p.add_argument("--wgmma", action="store_true", help="with --ablate: the wgmma kernel's too")
    p.add_argument("--kinds", default="", help="with --ablate: only these ablations (a,b,...)")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument(
        "--tiles",
        default="",
        help="KEY=VALUE,... set on the small-head tiles (for example KERNEL=2: the wgmma kernel)",
    )
    p.add_argument("--summarise", type=Path, help="an ncu SASS csv: print its summary")
    p.add_argument("--tokens", type=int, default=16384, help="query tokens of that profile")
    args = p.parse_args(argv)
    if args.summarise:
        print(summarise(args.summarise, args.tokens))
        return 0
    if not torch.cuda.is_available():
        print("profile_sparse_mla needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.ablate:
        ctx = mp.get_context("spawn")
        kinds = ABLATIONS + (WGMMA_ABLATIONS if args.wgmma else ())
        if args.kinds:
            kinds = tuple(k for k in args.kinds.split(",") if k)
        for kind in kinds:  # one fresh process each: the patch happens before any compile
            with ctx.Pool(1) as pool:
                row = pool.map(_time_one, [(kind, args.case, args.rep_ms)])[0]
            print(json.dumps(row), flush=True)
        return 0
    tiles = None
    if args.tiles:
        from dsv4_kernels.sparse_mla import TILES

        extra = {k: int(v) for k, v in (kv.split("=") for kv in args.tiles.split(","))}
        tiles = {"small": {**TILES["small"], **extra}}
    shape = next(s for s in MATRIX if s.name == args.case)
    device = torch.device("cuda")
    inp = make_inputs(shape, device, fresh_seed(), tiles=tiles)
    T, H, _ = inp.q.shape
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    inp.run_paged(out, lse)
    tokens = check_tokens(T, device)
    assert_close_attention((out[tokens], lse[tokens]), reference_sample(inp, tokens), "paged")
    for _ in range(args.launches):
        inp.run_paged(out, lse)
    torch.cuda.synchronize()
    print(f"{args.case}: {args.launches} launches after one checked run", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
