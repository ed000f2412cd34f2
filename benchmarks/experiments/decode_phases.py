"""Where a decode call's time goes, by phase: ablations of the sparse MLA decode on the GPU.

``python -m benchmarks.experiments.decode_phases [--cases c4a-flash-tp8-t1,...]
[--out DIR]``

Each ablation runs in a fresh process, with one helper of the kernel modules swapped
for a cheaper copy before the first compile (the shipped kernels are never touched;
the ablated outputs are wrong by design and not checked).  Every case is timed as
:mod:`benchmarks.cases_decode` times ours: a CUDA graph of ``ROTATE`` calls on their
own index rows over the same page pools (larger than L2), median of ``do_bench``
(which flushes L2 before each replay) per call.

* ``full``: the shipped call (split kernel and combine, or the per-token kernel);
* ``no-pdl``: the same with the combine launched after the split kernel, not as its
  programmatic dependent (decode v1's launches);
* ``no-combine``: the split kernel alone (the combine launch left out);
* ``no-keys``: the split kernel alone without reading a key byte (each tile's codes,
  scales and rope made from its pointers instead, so the dequantisation and both
  products still run on values the compiler cannot fold);
* ``no-index``: ``no-keys`` without reading the index rows either (column ``j`` is
  slot ``j``): what is left is the launch, q, the math and the partial stores;
* ``empty``: one graph-replayed empty kernel (the launch floor).

Differences give the phases: combine = full - no-combine; key load = no-combine -
no-keys; index load = no-keys - no-index; math, q and stores = no-index - empty;
launch = empty.  The per-token kernel (one split) has no combine: its ``full`` and
``no-combine`` are the same call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

ABLATIONS = ("full", "no-pdl", "no-combine", "no-keys", "no-index", "empty")
DEFAULT_CASES = (
    "c4a-flash-tp8-t1,c4a-flash-tp8-t16,c4a-flash-tp8-t256,"
    "c4a-pro-tp8-t1,c4a-pro-tp8-t16,c4a-pro-tp8-t256,"
    "c128a-flash-tp8-t1,c128a-flash-tp8-t16,c128a-flash-tp8-t256"
)
NO_PDL = {"PDL": 0}


def _patch(kind: str) -> None:
    """Swap the helpers of ``kind`` (module docstring) before anything compiles."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from dsv4_kernels import _gluon_sparse_mla as g
    from dsv4_kernels import decode as dec

    if kind in ("full", "no-pdl", "empty"):
        return

    class _NoLaunch:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: None

    # this process only (a fresh one per ablation): the combine launch does nothing
    dec._k._decode_combine_kernel = _NoLaunch()  # type: ignore[assignment]
    if kind == "no-combine":
        return

    @gluon.jit
    def load_tile_from_pointers(ok, data, scales, L_CODE: gl.constexpr, L_ROPE: gl.constexpr):
        # codes, scale bytes and rope made from each key's pointer (nothing read): distinct
        # per element, so no conversion folds; the codes avoid the e4m3 NaN patterns
        bits = (data.to(gl.int64) >> 4).to(gl.int32)
        e = gl.arange(0, 64, layout=gl.SliceLayout(0, L_CODE))
        base = gl.expand_dims(bits, 1) + gl.expand_dims(e, 0)
        c0 = (base & 0x37).to(gl.uint8)
        c1 = ((base + 1) & 0x37).to(gl.uint8)
        c2 = ((base + 2) & 0x37).to(gl.uint8)
        c3 = ((base + 3) & 0x37).to(gl.uint8)
        c4 = ((base + 4) & 0x37).to(gl.uint8)
        c5 = ((base + 5) & 0x37).to(gl.uint8)
        c6 = ((base + 6) & 0x37).to(gl.uint8)
        sb = (scales.to(gl.int64) & 0x3F3F3F3F3F3F3F) | 0x40404040404040
        bits_r = gl.convert_layout(bits, gl.SliceLayout(1, L_ROPE))
        er = gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROPE))
        rope_i = (gl.expand_dims(bits_r, 1) + gl.expand_dims(er, 0)) & 0xFF
        rope = (rope_i.to(gl.float32) * 0.01).to(gl.bfloat16)
        return c0, c1, c2, c3, c4, c5, c6, sb, rope

    g._load_tile = load_tile_from_pointers
    if kind == "no-keys":
        return

    @gluon.jit
    def gather_without_index(
        src_ptr, idx_row_ptr, start, length, row_stride, num_rows,
        SLOTS: gl.constexpr, BN: gl.constexpr, L_CODE: gl.constexpr,
    ):  # fmt: skip
        n = gl.arange(0, BN, layout=gl.SliceLayout(1, L_CODE))
        col = start + n
        idx = col.to(gl.int64)
        ok = (col < length) & (idx < num_rows)
        page = idx // SLOTS
        in_page = idx % SLOTS
        base = page * row_stride
        data = src_ptr + gl.multiple_of(base + in_page * 576, 16)
        scales = src_ptr + gl.multiple_of(base + SLOTS * 576 + in_page * 8, 8)
        return ok, data, scales

    g._gather = gather_without_index
    from dsv4_kernels import _gluon_decode as gd

    gd._gather = gather_without_index  # the split kernel gathers its first tiles itself
    if kind == "no-index":
        return
    raise ValueError(f"unknown ablation {kind!r}")


def _time_one(job: tuple[str, str, int]) -> dict[str, Any]:
    kind, case, rep = job
    import triton.testing

    import dsv4_kernels as dk
    from dsv4_kernels.testing import decode as td
    from dsv4_kernels.testing.common import fresh_seed

    from .. import cases_decode as cd

    device = torch.device("cuda")
    if kind == "empty":
        return dict(case=case, ablation=kind, us=cd.launch_floor_us(device, rep))
    _patch(kind)
    shape = next(s for s in cd.matrix() if s.name == case)
    g = torch.Generator(device=device).manual_seed(fresh_seed())
    swa_pages, comp_pages = cd.POOL_PAGES[shape.layer]
    pool = td.make_pools(shape.layer, swa_pages=swa_pages, comp_pages=comp_pages, generator=g,
                         device=device)  # fmt: skip
    topk = shape.topk if shape.layer in cd.TOPK_LAYERS else 512
    reqs = shape.tokens // shape.per_request
    sets = [td.decode_rows(pool, [cd.CONTEXT] * reqs, shape.per_request, generator=g, topk=topk,
                           comp_width=cd.C128A_WIDTH) for _ in range(cd.ROTATE)]  # fmt: skip
    T, H = shape.tokens, shape.heads
    q = td.random_q(T, H, generator=g, device=device)
    sink = td.random_sink(H, generator=g, device=device)
    case_ = td.DecodeCase(q, sink, pool, sets[-1], shape.per_request)
    policy = NO_PDL if kind == "no-pdl" else None
    sizes = dk.decode_scratch_sizes(T, H, 128 + max(cd.C128A_WIDTH, 1024), device)
    scratch = dk.make_decode_scratch(sizes, device)
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
    lse = torch.empty((T, H), dtype=torch.float32, device=device)

    def call(r: Any) -> None:
        dk.sparse_mla_decode(q, pool.swa.cache, r.swa_indices, r.swa_lens, cd.SCALE,
                             scratch=scratch, out=out, lse=lse, policy=policy,
                             **case_.kwargs(r))  # fmt: skip

    replay = cd._graph([lambda r=r: call(r) for r in sets], device)
    ms = triton.testing.do_bench(replay, rep=rep, return_mode="median")
    b_width = 0 if sets[-1].comp_indices is None else sets[-1].comp_indices.shape[1]
    splits = dk.decode.decode_splits(T, H, 128, b_width, dk.decode.num_sms(device))
    return dict(case=case, ablation=kind, us=ms * 1e3 / cd.ROTATE, splits=splits[0])


def phases(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per case: the phases (module docstring) from the ablations' times."""
    by: dict[str, dict[str, float]] = {}
    empty = next((r["us"] for r in rows if r["ablation"] == "empty"), 0.0)
    for r in rows:
        if r["ablation"] != "empty":
            by.setdefault(r["case"], {})[r["ablation"]] = r["us"]
    out = {}
    for case, t in by.items():
        if not all(k in t for k in ("full", "no-combine", "no-keys", "no-index")):
            continue
        out[case] = {
            "total": t["full"],
            "total without PDL": t.get("no-pdl", float("nan")),
            "launch": empty,
            "math, q, stores": t["no-index"] - empty,
            "index load": t["no-keys"] - t["no-index"],
            "key load": t["no-combine"] - t["no-keys"],
            "combine": t["full"] - t["no-combine"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.decode_phases")
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--ablations", default=",".join(ABLATIONS))
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    kinds = [k for k in args.ablations.split(",") if k]
    jobs = [(k, c, args.rep_ms) for k in kinds for c in ([cases[0]] if k == "empty" else cases)]
    rows = []
    ctx = mp.get_context("spawn")
    for kind in kinds:  # one fresh process per ablation: its patches never leak
        with ctx.Pool(1) as pool:
            for r in pool.map(_time_one, [j for j in jobs if j[0] == kind]):
                print(json.dumps(r), flush=True)
                rows.append(r)
    table = phases(rows)
    cols = ["total", "total without PDL", "launch", "math, q, stores", "index load", "key load",
            "combine"]  # fmt: skip
    lines = ["| case | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for case, t in table.items():
        lines.append(f"| {case} | " + " | ".join(f"{t[c]:.2f}" for c in cols) + " |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "phases.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        (args.out / "phases.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
