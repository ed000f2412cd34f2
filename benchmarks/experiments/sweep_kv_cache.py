"""Tile sweep for the FP8 K cache kernels (GPU only).

``python -m benchmarks.experiments.sweep_kv_cache``.

Times (tokens per program, warps) variants of our insert and gather, with and
without evict-first stores, and for insert both roundings (integer RNE and the
hardware cast), on the large cases of the matrix, beside an empty Triton launch
and a torch copy of the same bytes; each variant is checked byte for byte against the torch
reference before it is timed.  Prints a table and writes ``sweep_kv_cache.json``
to ``--out``.  Used to pick the constants in ``dsv4_kernels.kv_cache``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.sweep_kv_cache")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--rep-ms", type=int, default=50)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "the sweep needs a CUDA GPU"
    import triton.testing

    import dsv4_kernels as dk
    import dsv4_kernels.kv_cache as kvc
    from dsv4_kernels import reference as ref
    from dsv4_kernels.testing import fresh_seed, generator
    from dsv4_kernels.testing.k_cache import WIDE_SPREAD, fill_every_slot, random_keys

    from .. import harness
    from ..cases_kv_cache import Shape, _layout

    dev = torch.device("cuda")
    bw = harness.copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s  {torch.cuda.get_device_name()}")
    seed = fresh_seed()
    print(f"seed {seed}")
    g = generator(seed, dev)
    rows = []

    def bench(fn) -> float:  # type: ignore[no-untyped-def]
        return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median"))

    # Same-run yardsticks: one empty Triton launch, and a torch copy moving the same bytes.
    from ..empty_kernel import launch_empty

    empty_us = bench(lambda: launch_empty(dev)) * 1e3
    print(f"empty Triton launch {empty_us:.2f} us")
    rows.append(dict(kernel="empty-launch", case="-", us=empty_us, ok=True, floor_us=0.0))

    def copy_us(nbytes: int) -> float:
        src = torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        return bench(lambda: dst.copy_(src)) * 1e3

    variants = [(4, 4), (8, 2), (4, 2), (4, 1), (8, 1)]
    for shape in [
        Shape("1x16384", 1, 16384, None, 64, "swa"),
        Shape("16x1024", 16, 1024, None, 64, "swa"),
    ]:
        bs = shape.block_size
        num_pages, table = _layout(shape, dev, g)
        pos = torch.arange(shape.seq_len, device=dev)
        slots = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1)
        n = slots.numel()
        k = random_keys(n, generator=g, device=dev, spread=WIDE_SPREAD)
        cache = dk.empty_k_cache(num_pages, bs, dev)
        cache.random_(0, 256, generator=g)
        want = cache.clone()
        ref.quantize_and_insert_k_cache(k, want, slots, bs)
        floor_us = n * (1024 + 8 + 584) / bw * 1e6
        stride = kvc.k_cache_page_stride(bs)
        same = copy_us(n * (1024 + 8 + 584))
        print(f"insert {shape.name}: same-bytes copy {same:.2f} us, floor {floor_us:.2f} us")
        rows.append(dict(kernel="insert-copy", case=shape.name, us=same, ok=True,
                         floor_us=floor_us))  # fmt: skip
        for exact, evict, (bt, nw) in itertools.product((True, False), (False, True), variants):
            if exact and evict:
                continue
            c = cache.clone()
            if True:
                run = functools.partial(
                    kvc._launch_insert, k, c, slots, bs, stride, num_pages,
                    block_t=bt, num_warps=nw, exact_rounding=exact, evict_first=evict,
                )  # fmt: skip
                run()
                ok = torch.equal(c, want)
                us = bench(run) * 1e3
                rows.append(dict(kernel="insert", case=shape.name, block_t=bt, num_warps=nw,
                                 exact=exact, evict=evict, ok=ok, us=us,
                                 floor_us=floor_us))  # fmt: skip
                print(f"insert {shape.name:<16} exact={exact!s:<5} evict={evict!s:<5} T={bt} "
                      f"w={nw}  {us:8.2f} us  x{us / floor_us:5.2f} floor  "
                      f"{'ok' if ok else 'WRONG'}")  # fmt: skip

    for shape in [
        Shape("1x16384", 1, 16384, None, 64, "swa"),
        Shape("c4a-1x32768@131072", 1, 32768, None, 64, "c4a"),
        Shape("16x1024", 16, 1024, None, 64, "swa"),
    ]:
        bs = shape.block_size
        num_pages, table = _layout(shape, dev, g)
        cache = dk.empty_k_cache(num_pages, bs, dev)
        fill_every_slot(cache, bs, generator=g)
        seq = torch.full((shape.num_reqs,), shape.seq_len, dtype=torch.int32, device=dev)
        out = torch.empty((shape.num_reqs, shape.seq_len, 512), dtype=torch.bfloat16, device=dev)
        want = torch.full_like(out, float("nan"))
        ref.dequantize_and_gather_k_cache(want, cache, seq, None, table, bs, 0)
        n = shape.num_reqs * shape.seq_len
        floor_us = (n * (584 + 1024) + table.numel() * 4) / bw * 1e6
        stride = kvc.k_cache_page_stride(bs)
        same = copy_us(n * (584 + 1024))
        print(f"gather {shape.name}: same-bytes copy {same:.2f} us, floor {floor_us:.2f} us")
        rows.append(dict(kernel="gather-copy", case=shape.name, us=same, ok=True,
                         floor_us=floor_us))  # fmt: skip
        for evict, (bt, nw) in itertools.product((False, True), variants):
            run = functools.partial(
                kvc._launch_gather, out, cache, seq, None, table, bs, 0, stride,
                block_t=bt, num_warps=nw, evict_first=evict,
            )  # fmt: skip
            out.fill_(float("nan"))
            run()
            ok = torch.equal(out.view(torch.int16), want.view(torch.int16))
            us = bench(run) * 1e3
            rows.append(dict(kernel="gather", case=shape.name, block_t=bt, num_warps=nw,
                             exact=True, evict=evict, ok=ok, us=us,
                             floor_us=floor_us))  # fmt: skip
            print(f"gather {shape.name:<20} evict={evict!s:<5} T={bt} w={nw}  {us:8.2f} us  "
                  f"x{us / floor_us:5.2f} floor  {'ok' if ok else 'WRONG'}")  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_kv_cache.json").write_text(json.dumps(rows, indent=1))
    print("\nbest per case:")
    for kernel in ("insert", "gather"):
        for case in dict.fromkeys(r["case"] for r in rows if r["kernel"] == kernel):
            sel = [r for r in rows if r["kernel"] == kernel and r["case"] == case and r["ok"]]
            best = min(sel, key=lambda r: r["us"])
            ratio = best["us"] / best["floor_us"]
            print(f"  {kernel} {case:<20} T={best['block_t']} w={best['num_warps']} "
                  f"exact={best['exact']} evict={best['evict']}  {best['us']:.2f} us = "
                  f"{ratio:.2f}x floor")  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(bad)} wrong variants" + (f": {bad[:3]}" if bad else ""))
    return 1 if bad else 0 if math.isfinite(bw) else 1


if __name__ == "__main__":
    raise SystemExit(main())
