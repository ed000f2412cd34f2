"""The decode indexer split across a TP group, on several GPUs (issue 40).

``python3 -m benchmarks.tp_indexer --tp 8 --out DIR`` starts one process per GPU (NCCL
over ``torch.distributed``; vLLM is not needed, its indexer pair is staged as for
``benchmarks.kernels``: ``benchmarks/vllm_indexer.py``).  Every rank builds the same
step (the same seed: the same cache, queries and weights, as vLLM's replicated inputs
are) and times, each in a CUDA graph replayed back to back after a barrier:

* ``vllm-0.33``: vLLM's replicated pair (DeepGEMM's scores + its top-k) on the whole
  step, what every rank runs today (where staged);
* ``dsv4-kernels``: ours on the whole step, replicated;
* ``split-rows/TP{P}`` (at least ``P`` rows) and ``split-keys/TP{P}``: the plugin's
  split (``dsv4_attention.indexer_tp``'s steps: rank ``r``'s part, the all-gather
  captured in the graph, the copy or the merge).

A rank's time is its graph's mean replay; the case's time is the slowest rank's (what
the step waits for).  Before timing, every rank's split output is checked against the
float64 reference on its first and last rows.  Rank 0 writes ``results.jsonl`` and
``sharded.json``: the measured table's ``indexer.sharded`` section (vLLM's replicated
time over the split's, per TP size, index heads, top-k, split, rows and context), only
where vLLM's pair ran.  NCCL's multicast (NVLS) is left off (``NCCL_NVLS_ENABLE=0``),
as the issue asks.

``--smoke``: two CPU processes over gloo, tiny steps, wall-clock times (the code path,
not a measurement; ``tests/kernels/test_benchmark_tooling.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv4_kernels.geometry import INDEX_DIM

REQUESTS = (1, 8, 32, 128)
CONTEXTS = (131072, 1048576)
MODELS = (("flash", 64, 512), ("pro", 64, 1024))
SMOKE = (("smoke", 16, 32, (1, 3), (1200,)),)


def _grid(smoke: bool) -> list[tuple[str, int, int, int, int]]:
    if smoke:
        return [(m, h, k, r, c) for m, h, k, rs, cs in SMOKE for r in rs for c in cs]
    return [(m, h, k, r, c) for m, h, k in MODELS for c in CONTEXTS for r in REQUESTS]


def _timer(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Mean microseconds of ``fn``: replays of its CUDA graph on a GPU, calls on a CPU;
    after a barrier, so the ranks start together."""
    import torch.distributed as dist

    fn()  # compiled, and the exchange's buffers made, before capture
    if device.type != "cuda":
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - began) * 1e6 / iters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


class _Group:
    """What ``indexer_tp`` asks of vLLM's ``GroupCoordinator``: ``all_gather`` along rows
    (here ``torch.distributed``'s into one tensor, as vLLM's communicators do)."""

    def __init__(self, size: int) -> None:
        self.world_size = size

    def all_gather(self, part: torch.Tensor, dim: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty((self.world_size * part.shape[0], *part.shape[1:]),
                          dtype=part.dtype, device=part.device)  # fmt: skip
        dist.all_gather_into_tensor(out, part.contiguous())
        return out


def _case(rank: int, tp: int, device: torch.device, case: tuple[str, int, int, int, int],
          iters: int, seed: int) -> dict[str, Any]:  # fmt: skip
    import dsv4_kernels as dk
    from dsv4_attention import indexer_tp
    from dsv4_attention.facts import IndexerFacts
    from dsv4_kernels.reference import indexer as ref
    from dsv4_kernels.testing.common import generator
    from dsv4_kernels.testing.indexer import fill_index_cache, make_index_cache

    model, heads, topk, reqs, context = case
    g = generator(seed, device)
    entries, per = context // 4, 1
    rows, page = reqs * per, 64
    pages_per_req = -(-entries // page)
    cache = make_index_cache(reqs * pages_per_req, page, device)
    fill_index_cache(cache, g)
    perm = torch.randperm(reqs * pages_per_req, generator=g, device=device).to(torch.int32)
    table = perm.view(reqs, pages_per_req).contiguous()
    q = (torch.randn(rows, heads, INDEX_DIM, generator=g, device=device) * 8).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, generator=g, device=device) * heads**-0.5
    lens = torch.full((rows,), entries, dtype=torch.int32, device=device)
    facts = IndexerFacts(name=model, compress_ratio=4, heads=heads, head_dim=INDEX_DIM,
                         topk=topk, max_entries=entries, page_entries=page,
                         buffer_width=topk, max_rows=rows)  # fmt: skip
    share = indexer_tp.TpShare(tp, rank, _Group(tp))
    sizes = indexer_tp.split_elements(facts, tp)
    check = sorted({0, rows - 1})
    want = ref.indexer_decode_topk(q[check], weights[check], cache, lens[check],
                                   torch.tensor(check, device=device, dtype=torch.int32),
                                   table, topk)  # fmt: skip
    times: dict[str, float] = {}
    problems: list[str] = []
    whole_scores = torch.empty((rows, entries), dtype=torch.float32, device=device)
    out = torch.empty((rows, topk), dtype=torch.int32, device=device)

    def ours() -> None:
        dk.indexer_decode_topk(q, weights, cache, lens, None, table, topk, out,
                               max_entries=entries, scores=whole_scores)  # fmt: skip

    runs: dict[str, Callable[[], None]] = {"dsv4-kernels": ours}
    for split in indexer_tp.SPLITS:
        if split == "rows" and rows < tp:
            continue
        scores = torch.empty(sizes[split][0], dtype=torch.float32, device=device)
        local = torch.empty(sizes[split][1], dtype=torch.int32, device=device)

        def run(split: str = split, scores: torch.Tensor = scores,
                local: torch.Tensor = local) -> None:  # fmt: skip
            indexer_tp.run_split(split, share, facts, q=q, weights=weights, cache=cache,
                                 lens=lens, block_table=table, rows=rows, rows_per_request=per,
                                 out=out, padded_rows=rows, scores=scores,
                                 local=local)  # fmt: skip

        runs[f"split-{split}/TP{tp}"] = run
    if device.type == "cuda":
        from . import vllm_indexer

        deep_gemm, why = vllm_indexer.load()
        if deep_gemm is not None:
            runs[vllm_indexer_label()] = vllm_indexer.runner(
                deep_gemm, q.view(reqs, per, heads, INDEX_DIM), weights, cache,
                lens.view(reqs, per), table, entries, topk, context, out,
            )  # fmt: skip
        elif rank == 0:
            print(f"vLLM's pair not run: {why}", flush=True)
    for name, run in runs.items():
        out.fill_(-7)
        run()
        got = out[check]
        for i, t in enumerate(check):
            if sorted(got[i].tolist()) != sorted(want[i].tolist()):
                problems.append(f"rank {rank} {name} row {t}: not the reference's set")
        times[name] = _timer(run, device, iters)
    return {"times": times, "problems": problems}


def vllm_indexer_label() -> str:
    return "vllm-0.33"


def _rank(rank: int, tp: int, port: int, smoke: bool, iters: int, out: str, seed: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp)  # fmt: skip
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp, device_id=device)  # fmt: skip
    rows_out = []
    for i, case in enumerate(_grid(smoke)):
        result = _case(rank, tp, device, case, iters, seed + i)
        # the slowest rank's time, every rank's problems
        names = sorted(result["times"])
        t = torch.tensor([result["times"][n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        said: list[Any] = [None] * tp
        dist.all_gather_object(said, result["problems"])
        model, heads, topk, reqs, context = case
        for n, us in zip(names, t.tolist(), strict=True):
            rows_out.append({"model": model, "heads": heads, "topk": topk, "rows": reqs,
                             "context": context, "tp": tp, "provider": n, "us": round(us, 2),
                             "problems": [p for ps in said for p in ps]})  # fmt: skip
        if rank == 0:
            line = ", ".join(f"{n} {us:.1f} us" for n, us in zip(names, t.tolist(), strict=True))
            print(f"{model} {reqs} rows x {context // 1024}K at TP{tp}: {line}", flush=True)
    if rank == 0:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "results.jsonl").open("w") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")
        section = sharded_section(rows_out)
        (folder / "sharded.json").write_text(json.dumps(section, indent=1) + "\n")
    dist.destroy_process_group()


def sharded_section(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's ``indexer.sharded``: vLLM's replicated time over a split's, per TP
    size -> heads -> topk -> split -> rows -> context; cases with a problem or without
    vLLM's pair are left out."""
    vllm = vllm_indexer_label()
    base = {(r["tp"], r["heads"], r["topk"], r["rows"], r["context"]): r["us"]
            for r in rows if r["provider"] == vllm and not r["problems"]}  # fmt: skip
    out: dict[str, Any] = {}
    for r in rows:
        if not r["provider"].startswith("split-") or r["problems"] or r["us"] <= 0:
            continue
        key = (r["tp"], r["heads"], r["topk"], r["rows"], r["context"])
        if key not in base:
            continue
        split = r["provider"].split("/")[0].removeprefix("split-")
        level = out
        for k in (str(r["tp"]), str(r["heads"]), str(r["topk"]), split, str(r["rows"])):
            level = level.setdefault(k, {})
        level[str(r["context"])] = round(base[key] / r["us"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from dsv4_kernels.testing.common import fresh_seed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8, help="ranks (GPUs) of the TP group")
    parser.add_argument("--out", default="tp-indexer", help="folder for the results")
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--smoke", action="store_true", help="two CPU ranks over gloo")
    args = parser.parse_args(argv)
    tp = 2 if args.smoke else args.tp
    if not args.smoke and torch.cuda.device_count() < tp:
        print(f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    iters = 3 if args.smoke else args.iters
    mp.start_processes(_rank, args=(tp, port, args.smoke, iters, args.out, fresh_seed()),
                       nprocs=tp, start_method="spawn")  # fmt: skip
    problems = [
        r for r in map(json.loads, (Path(args.out) / "results.jsonl").open()) if r["problems"]
    ]
    for r in problems:
        print("problem:", r["provider"], r["problems"][:3])
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
