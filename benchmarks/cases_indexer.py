"""Benchmark cases for the decode lightning indexer (issue 39): scores + top-k of one C4A
layer's decode step, ours (:func:`dsv4_kernels.indexer_decode_topk`, called as the plugin
calls it: rows by request, no ``row_req``) beside vLLM 0.33's pair (DeepGEMM's
``fp8_fp4_paged_mqa_logits`` + its ``cooperative_topk``/``persistent_topk``, staged from
the wheel: :mod:`benchmarks.vllm_indexer`) on the same pages, against the index-cache
bytes floor.

Grid (GPU): 1, 2, 4, 8, 16, 32, 64, 128 and 256 requests x 8K, 128K and 1M tokens of
context (2K, 32K and 256K index entries) x 1 or 2 tokens per request (MTP: row ``j``
of a request of ``L`` tokens sees ``(L - n + j + 1) // 4`` entries, as vLLM's
``(B, next_n)`` lengths), V4-Flash (64 index heads, top-512) and V4-Pro (64, top-1,024).
Every request's index cache is its own pages (a random page order, filled with random
finite FP8 keys: ``testing.indexer.fill_index_cache``), so the keys are cold after the
harness's L2 flush.  Checked before timing, for every provider: the output poisoned,
then each checked row's selected set equal to the float64 reference's
(``dsv4_kernels.reference.indexer``; the first and last rows of the step; random keys
leave no ties at the k-th place).  vLLM's pair is timed as its op runs it: the top-k
buffer cleared, the scores, the top-k (its schedule metadata is built by vLLM's
metadata builder, outside the op, and is not timed).  Where the pair is not staged the
run says so and times ours alone.

The split across a TP group (issue 40), one rank's part on this one GPU: at TP ``P``
(``SPLIT_TP``), ``split-keys/TP{P}`` is rank 0's key share of every row
(``indexer_shard_topk``) and the merge of all ranks' candidates
(``indexer_merge_topk``, the gathered tensor made beforehand by running every share),
checked like the others; ``split-rows/TP{P}`` is rank 0's ``ceil(rows / P)`` rows
(at least ``P`` rows), its first row checked.  Against vLLM's replicated time divided
by ``P``, what is left is the budget of the exchange (``benchmarks.tp_indexer``
measures the exchange itself on several GPUs).

``floor``: the bytes that must move: each row's index entries once (132 bytes each;
a request's rows share them), the queries, weights and the top-k written.  On a CPU
(smoke) tiny steps run ours through the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dsv4_kernels.geometry import INDEX_DIM, INDEX_ENTRY_BYTES
from dsv4_kernels.testing import POISON, fresh_seed, generator

from .harness import BenchCase, Provider, not_run

KERNEL = "indexer_decode_topk"
ENTRIES_PER_PAGE = 64  # C4A: 256 tokens a block / ratio 4
REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (8192, 131072, 1048576)
TOKENS = (1, 2)  # query rows per request (MTP k=1: vLLM's native (B, 2) lengths)
MODELS = (("flash", 64, 512), ("pro", 64, 1024))
SMOKE = [("smoke-2x300", 2, 300 * 4, 1, 16, 32)]  # 2 rows: both splits at TP2
VLLM_PROVIDER = "vllm-0.33"
SPLIT_TP = 8  # the TP size whose one-rank parts are timed (V4 at TP8)


def _case(
    name: str, reqs: int, context: int, per: int, heads: int, topk: int, device: torch.device
) -> BenchCase:
    import dsv4_kernels as dk
    from dsv4_kernels.reference import indexer as ref
    from dsv4_kernels.testing.indexer import fill_index_cache, make_index_cache

    seed = fresh_seed()
    g = generator(seed, device)
    entries = context // 4
    rows = reqs * per
    pages_per_req = -(-entries // ENTRIES_PER_PAGE)
    pages = reqs * pages_per_req
    cache = make_index_cache(pages, ENTRIES_PER_PAGE, device)
    fill_index_cache(cache, g)
    perm = torch.randperm(pages, generator=g, device=device).to(torch.int32)
    table = perm.view(reqs, pages_per_req).contiguous()
    q = (torch.randn(rows, heads, INDEX_DIM, generator=g, device=device) * 8).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, generator=g, device=device) * heads**-0.5
    # row j of a request of ``context`` tokens and ``per`` rows (vLLM's rule)
    row_lens = [(context - per + j + 1) // 4 for j in range(per)]
    lens = torch.tensor(row_lens * reqs, dtype=torch.int32, device=device)
    row_req = torch.arange(rows, dtype=torch.int32, device=device) // per
    scores = torch.empty((rows, entries), dtype=torch.float32, device=device)
    check_rows = sorted({0, rows - 1})
    want = ref.indexer_decode_topk(
        q[check_rows], weights[check_rows], cache, lens[check_rows], row_req[check_rows],
        table, topk,
    )  # fmt: skip

    def provider(
        label: str, run: Callable[[], None], out: torch.Tensor, only_first: bool = False
    ) -> Provider:
        def poison() -> None:
            out.fill_(POISON)

        def check() -> None:
            got = out[check_rows]
            for i in range(1 if only_first else len(check_rows)):
                g_row, w_row = sorted(got[i].tolist()), sorted(want[i].tolist())
                assert g_row == w_row, (
                    f"{label}, row {check_rows[i]}: not the reference's top-{topk} set"
                )

        return Provider(label, run, poison, check)

    ours_out = torch.empty((rows, topk), dtype=torch.int32, device=device)

    def ours() -> None:
        dk.indexer_decode_topk(
            q, weights, cache, lens, None, table, topk, ours_out,
            max_entries=entries, scores=scores, rows_per_request=per,
        )  # fmt: skip

    providers = [provider("dsv4-kernels", ours, ours_out)]
    providers += _split_providers(
        provider, q, weights, cache, lens, table, topk, entries, per, device,
        SPLIT_TP if device.type == "cuda" else 2,
    )  # fmt: skip
    params: dict[str, object] = {
        "requests": reqs,
        "tokens_per_request": per,
        "context": context,
        "entries": entries,
        "heads": heads,
        "topk": topk,
        "seed": seed,
    }
    if device.type == "cuda":
        from . import vllm_indexer

        deep_gemm, why = vllm_indexer.load()
        if deep_gemm is None:
            not_run(vllm_indexer.LABEL, why)
        else:
            vllm_out = torch.empty((rows, topk), dtype=torch.int32, device=device)
            run = vllm_indexer.runner(
                deep_gemm, q.view(reqs, per, heads, INDEX_DIM), weights, cache,
                lens.view(reqs, per), table, entries, topk, context, vllm_out,
            )  # fmt: skip
            providers.append(provider(VLLM_PROVIDER, run, vllm_out))
    floor = reqs * entries * INDEX_ENTRY_BYTES + rows * heads * (INDEX_DIM + 4) + rows * topk * 4
    return BenchCase(KERNEL, name, rows, floor, providers, params)


def _split_providers(
    provider: Callable[..., Provider],
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    table: torch.Tensor,
    topk: int,
    entries: int,
    per: int,
    device: torch.device,
    tp: int,
) -> list[Provider]:
    """Rank 0's part of a step split across ``tp`` ranks (module docstring)."""
    import dsv4_kernels as dk

    rows = q.shape[0]
    width = -(-entries // tp)
    scores = torch.empty((rows, width), dtype=torch.float32, device=device)
    parts = []
    for r in range(tp):  # every rank's candidates: the all-gather's result
        part = torch.empty((rows, 2 * topk), dtype=torch.int32, device=device)
        dk.indexer_shard_topk(q, weights, cache, lens, None, table, topk, part, shard=r,
                              shards=tp, max_entries=entries, scores=scores,
                              rows_per_request=per)  # fmt: skip
        parts.append(part)
    gathered = torch.cat(parts)
    local = parts[0].clone()
    keys_out = torch.empty((rows, topk), dtype=torch.int32, device=device)

    def keys() -> None:
        dk.indexer_shard_topk(q, weights, cache, lens, None, table, topk, local, shard=0,
                              shards=tp, max_entries=entries, scores=scores,
                              rows_per_request=per)  # fmt: skip
        dk.indexer_merge_topk(gathered, topk, keys_out, shards=tp)

    out = [provider(f"split-keys/TP{tp}", keys, keys_out)]
    if rows >= tp:
        c = -(-rows // tp)
        rows_out = torch.empty((rows, topk), dtype=torch.int32, device=device)
        row_scores = torch.empty((c, entries), dtype=torch.float32, device=device)

        def rank0_rows() -> None:
            dk.indexer_decode_topk(q[:c], weights[:c], cache, lens[:c], None, table, topk,
                                   rows_out, max_entries=entries, scores=row_scores,
                                   rows_per_request=per)  # fmt: skip

        out.append(provider(f"split-rows/TP{tp}", rank0_rows, rows_out, only_first=True))
    return out


def build_cases(device: torch.device, smoke: bool) -> Iterable[BenchCase]:
    """The cases; on a GPU built one at a time as the harness reaches them (the whole
    grid's index caches together would not fit)."""
    if smoke or device.type != "cuda":
        return [_case(n, r, c, t, h, k, device) for n, r, c, t, h, k in SMOKE]
    return (
        _case(f"{model}-{reqs}x{per}-{context // 1024}K", reqs, context, per, heads, topk, device)
        for model, heads, topk in MODELS
        for context in CONTEXTS
        for per in TOKENS
        for reqs in REQUESTS
    )


def indexer_section(results: Iterable[Any], source: str = "") -> dict[str, Any] | None:
    """A measured table's ``indexer`` section from a run's results: vLLM's time over ours
    per index heads, top-k and query rows, the smallest over the contexts (and token
    mixes) measured at that row count; None where vLLM's pair did not run beside ours."""
    times: dict[tuple[str, str], float] = {}
    params: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.kernel == KERNEL:
            times[(r.case, r.provider)] = r.p50_us
            params[r.case] = r.params
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for case, p in params.items():
        ours, vllm = times.get((case, "dsv4-kernels")), times.get((case, VLLM_PROVIDER))
        if ours is None or vllm is None or ours <= 0:
            continue
        rows = str(int(p["requests"]) * int(p.get("tokens_per_request", 1)))
        row = ratios.setdefault(str(p["heads"]), {}).setdefault(str(p["topk"]), {})
        row[rows] = round(min(row.get(rows, float("inf")), vllm / ours), 3)
    if not ratios:
        return None
    return {"min_ratio": 1.0, "ratios": ratios, "source": source}
