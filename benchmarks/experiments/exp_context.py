"""C4A at 16 local heads (V4-Pro TP8) across context lengths: ours against FlashMLA (GPU).

``python -m benchmarks.experiments.exp_context [--out DIR] [--rep-ms N] [--heads 16] [--topk 1024]``

For C4A layers ours (the per-token wgmma kernel, index build included) costs
in proportion to each token's valid keys; at a 131,072-token context, where
every token has its full top-k, FlashMLA padded to 64 heads (plus vLLM's gather
and combine) is 1.05x faster at 16 heads and ours is 1.18x faster on the
fresh 16 x 1,024 batch (docs/attention.md).  This measures where the two
cross: for each shape (fresh requests and chunks deep into long requests) both
providers are checked against the float32 reference on a token sample
(poisoned outputs, every element written) and timed side by side in one run,
and the case's mean valid keys per token is recorded with them.  One JSON line
per (case, provider) in ``DIR/results.jsonl``; the plugin's selection rule for
C4A layers at 9-16 heads on Hopper follows these numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .. import harness
from ..cases_sparse_mla import FLASHMLA_GATHER, OURS_INDEX, AttnShape, build_cases

# (requests, tokens each, context of each after the chunk)
BATCHES = (
    (16, 1024, 1024),
    (4, 2048, 2048),
    (1, 4096, 4096),
    (1, 8192, 8192),
    (1, 4096, 8192),
    (1, 8192, 16384),
    (1, 8192, 32768),
    (1, 8192, 65536),
    (1, 16384, 131072),
)


def shapes(heads: int, topk: int) -> list[AttnShape]:
    return [
        AttnShape(f"c4a-h{heads}-{b}x{q}@{ctx}", "c4a", b, q, ctx, heads, topk)
        for b, q, ctx in BATCHES
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.exp_context")
    p.add_argument("--out", type=Path, default=Path("exp-context"))
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=1024)
    p.add_argument("--tiny", action="store_true", help="two small shapes (a CPU smoke run)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    todo = shapes(args.heads, args.topk)
    if args.tiny:
        todo = [
            AttnShape(f"c4a-h{args.heads}-2x6@40", "c4a", 2, 6, 40, args.heads, 8),
            AttnShape(f"c4a-h{args.heads}-1x8@64", "c4a", 1, 8, 64, args.heads, 8),
        ]
    env = harness.environment(device)
    bw = harness.copy_bandwidth(device) if gpu else 1e10
    keep = {OURS_INDEX, FLASHMLA_GATHER}
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in todo:
        (case,) = build_cases(device, not gpu, [shape])
        case.providers = [pr for pr in case.providers if pr.name in keep]
        results += harness.run_cases([case], device, bw, args.rep_ms)
        if gpu:
            torch.cuda.empty_cache()
    harness.write_jsonl(results, env, args.out / "results.jsonl")
    by_case: dict[str, dict[str, float]] = {}
    for r in results:
        by_case.setdefault(r.case, {"keys_mean": r.params["keys_mean"]})[r.provider] = (
            r.p50_us * 1e3 / r.tokens
        )
    for name, row in by_case.items():
        ours, fm = row.get(OURS_INDEX), row.get(FLASHMLA_GATHER)
        ratio = f"{fm / ours:.2f}x" if ours and fm else "n/a"
        print(
            json.dumps({"case": name, "keys_mean": round(row["keys_mean"], 1), "ours_ns": ours,
                        "flashmla_gather_ns": fm, "flashmla_over_ours": ratio}),
            flush=True,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
