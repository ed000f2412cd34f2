"""Split-policy sweep of the sparse MLA decode (``dsv4_kernels.decode.DECODE_TILES``,
each variant passed as the kernels' ``policy=`` argument).

``python -m benchmarks.experiments.sweep_decode --variants "NOSPLIT_DIV=4;MIN_TILES_PER_SPLIT=2"
--only c4a-pro-tp8-t1,...``: for each variant (``;``-separated, each a ``,``-separated
list of ``KEY=VALUE`` over the defaults; the defaults run first) every chosen case of
:mod:`.cases_decode` is checked and timed under a CUDA graph (ours only); prints us
per call per variant and writes ``sweep.jsonl`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from .. import cases_decode as cd
    from .. import harness

    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.sweep_decode")
    p.add_argument("--variants", default="")
    p.add_argument("--only", default="", help="comma-separated exact case names (default all)")
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    names = [s for s in args.only.split(",") if s]
    shapes = [s for s in cd.matrix() if not names or s.name in names]
    variants: list[dict[str, int]] = [{}]
    for v in (x for x in args.variants.split(";") if x):
        variants.append({k: int(val) for k, val in (kv.split("=") for kv in v.split(","))})
    launch = cd.launch_floor_us(device)
    rows = []
    for shape in shapes:
        line = [f"{shape.name:<26}"]
        for var in variants:
            cases = cd.build_cases(device, False, [shape], flashmla=False, policy=var)
            res = cd.finalise(harness.run_cases(cases, device, 1e12, args.rep_ms, lambda s: None),
                              launch)  # fmt: skip
            ours = next(r for r in res if r.provider == cd.OURS)
            rows.append({"case": shape.name, "variant": var, "us": ours.p50_us,
                         "splits": ours.params["splits"]})  # fmt: skip
            line.append(f"{ours.p50_us:8.2f} ({ours.params['splits']:>2})")
            del cases
        print(" ".join(line), flush=True)
    print("variants:", ["defaults", *variants])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "sweep.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
