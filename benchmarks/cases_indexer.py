"""Benchmark cases for the decode lightning indexer (issue 39): scores + top-k of one C4A
layer's decode step, ours (:func:`dsv4_kernels.indexer_decode_topk`) against the
index-cache bytes floor.

Grid (GPU): 1, 8, 32 and 128 requests x 8K, 128K and 1M tokens of context (2K, 32K
and 256K index entries) at one token per request, V4-Flash (64 index heads, top-512)
and V4-Pro (64 heads, top-1,024).  Every request's index cache is its own pages (a
random page order, filled with random finite FP8 keys: ``testing.indexer.fill_index_cache``),
so the keys are cold after the harness's L2 flush.  Checked before timing: the output
poisoned, then each checked row's selected set equal to the float64 reference's
(``dsv4_kernels.reference.indexer``; the first and last rows of the step).

``floor``: the bytes that must move: each request's index entries once (132 bytes
each), the queries, weights and the top-k written.  vLLM's own pair (DeepGEMM's
``fp8_fp4_paged_mqa_logits`` and its top-k kernel, staged from the vLLM 0.33 wheel) is
not a provider yet: it is added, beside ours in the same run, in the first GPU session
that can load and check it.  On a CPU (smoke) tiny steps run through the interpreter.
"""

from __future__ import annotations

import torch

from dsv4_kernels.geometry import INDEX_DIM, INDEX_ENTRY_BYTES
from dsv4_kernels.testing import POISON, fresh_seed, generator

from .harness import BenchCase, Provider

KERNEL = "indexer_decode_topk"
ENTRIES_PER_PAGE = 64  # C4A: 256 tokens a block / ratio 4
REQUESTS = (1, 8, 32, 128)
CONTEXTS = (8192, 131072, 1048576)
MODELS = (("flash", 64, 512), ("pro", 64, 1024))
SMOKE = [("smoke-2x300", 2, 300 * 4, 16, 32)]


def _case(
    name: str, reqs: int, context: int, heads: int, topk: int, device: torch.device
) -> BenchCase:
    import dsv4_kernels as dk
    from dsv4_kernels.reference import indexer as ref
    from dsv4_kernels.testing.indexer import fill_index_cache, make_index_cache

    seed = fresh_seed()
    g = generator(seed, device)
    entries = context // 4
    pages_per_req = -(-entries // ENTRIES_PER_PAGE)
    pages = reqs * pages_per_req
    cache = make_index_cache(pages, ENTRIES_PER_PAGE, device)
    fill_index_cache(cache, g)
    perm = torch.randperm(pages, generator=g, device=device).to(torch.int32)
    table = perm.view(reqs, pages_per_req).contiguous()
    q = (torch.randn(reqs, heads, INDEX_DIM, generator=g, device=device) * 8).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn)
    weights = torch.randn(reqs, heads, generator=g, device=device) * heads**-0.5
    lens = torch.full((reqs,), entries, dtype=torch.int32, device=device)
    row_req = torch.arange(reqs, dtype=torch.int32, device=device)
    out = torch.empty((reqs, topk), dtype=torch.int32, device=device)
    scores = torch.empty((reqs, entries), dtype=torch.float32, device=device)
    check_rows = sorted({0, reqs - 1})
    want = ref.indexer_decode_topk(
        q[check_rows], weights[check_rows], cache, lens[check_rows], row_req[check_rows],
        table, topk,
    )  # fmt: skip

    def run() -> None:
        dk.indexer_decode_topk(
            q, weights, cache, lens, row_req, table, topk, out,
            max_entries=entries, scores=scores,
        )  # fmt: skip

    def poison() -> None:
        out.fill_(POISON)

    def check() -> None:
        got = out[check_rows]
        for i in range(len(check_rows)):
            g_row, w_row = sorted(got[i].tolist()), sorted(want[i].tolist())
            assert g_row == w_row, f"row {check_rows[i]}: not the reference's top-{topk} set"

    floor = reqs * entries * INDEX_ENTRY_BYTES + reqs * heads * (INDEX_DIM + 4) + reqs * topk * 4
    return BenchCase(
        KERNEL,
        name,
        reqs,
        floor,
        [Provider("dsv4-kernels", run, poison, check)],
        {
            "requests": reqs,
            "context": context,
            "entries": entries,
            "heads": heads,
            "topk": topk,
            "seed": seed,
        },
    )


def build_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    if smoke or device.type != "cuda":
        return [_case(n, r, c, h, k, device) for n, r, c, h, k in SMOKE]
    cases = []
    for model, heads, topk in MODELS:
        for context in CONTEXTS:
            for reqs in REQUESTS:
                name = f"{model}-{reqs}x{context // 1024}K"
                cases.append(_case(name, reqs, context, heads, topk, device))
    return cases
