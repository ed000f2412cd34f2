"""The lightning indexer of a decode step's C4A layers, in the model step (issues 39, 40).

vLLM's DSV4 layer runs, per C4A layer and decode step, its indexer (scores of every
compressed entry of every row, then the top-k) before the sparse attention; under TP8 it
is replicated on every GPU.  The model step times it with the attention, per path:

* vLLM's paths (``vllm-tp8``, ``vllm-dp8``): vLLM 0.33's pair (DeepGEMM's
  ``fp8_fp4_paged_mqa_logits`` + its top-k, staged: :mod:`benchmarks.vllm_indexer`);
* the plugin's path (``dsv4-tp8``): ours (:func:`dsv4_kernels.indexer_decode_topk`) where
  the H200 table's ``indexer`` section takes this row count
  (:func:`dsv4_attention.policy.indexer_mode`), vLLM's pair elsewhere (today: everywhere,
  no shipped table measures the indexer yet).

Each C4A layer reads its own index pages (random page tables over a 1 GiB pool of random
FP8 keys, larger than L2, as the attention's pools), its rows as vLLM's ``(B, next_n)``
lengths (row ``j`` of a request of ``L`` tokens and ``n`` rows sees ``(L - n + j + 1) //
4`` entries), and writes its own top-k buffer; the attention keeps reading the step's
prepared rows (so each part's check stays its own; the work timed is the same).  Checked:
the first and last C4A layer's top-k of the first and last row against the float64
reference.  Where vLLM's pair is not staged on a GPU the indexer is left out of every
path (said once, and ``indexer: false`` in the case's parameters); on a CPU (smoke) ours
stands in for vLLM's pair, labelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dsv4_kernels.geometry import INDEX_DIM, INDEX_ENTRY_BYTES

POOL_BYTES = 1 << 30  # on a GPU
SMOKE_POOL_PAGES = 32
ENTRIES_PER_PAGE = 64  # C4A: 256 tokens a block / ratio 4
INDEX_HEADS = 64  # V4's index_n_heads (benchmarks/model_facts.json)
SMOKE_INDEX_HEADS = 16
_POOLS: dict[str, torch.Tensor] = {}


@dataclasses.dataclass
class IndexerInputs:
    """One step's indexer inputs, shared by the paths (each path has its own outputs)."""

    q: torch.Tensor  # [T, H, 128] float8_e4m3fn
    weights: torch.Tensor  # [T, H] float32
    lens: torch.Tensor  # [T] int32 (request-major: a request's rows together)
    cache: torch.Tensor  # the pool's [pages, 64, 132] uint8 view
    tables: dict[int, torch.Tensor]  # C4A layer index -> its [R, pages] block table
    requests: int
    per_request: int
    context: int
    topk: int

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def entries(self) -> int:
        return self.context // 4

    @property
    def heads(self) -> int:
        return int(self.q.shape[1])


def pool(device: torch.device) -> torch.Tensor:
    """The index-key pool of ``device`` (made once, random finite FP8 keys)."""
    from dsv4_kernels.testing.indexer import fill_index_cache, make_index_cache

    key = str(device)
    if key not in _POOLS:
        per_page = ENTRIES_PER_PAGE * INDEX_ENTRY_BYTES
        pages = POOL_BYTES // per_page if device.type == "cuda" else SMOKE_POOL_PAGES
        cache = make_index_cache(pages, ENTRIES_PER_PAGE, device)
        fill_index_cache(cache, torch.Generator(device=device).manual_seed(4321))
        _POOLS[key] = cache
    return _POOLS[key]


def build(
    kinds: tuple[str, ...], requests: int, per_request: int, context: int, topk: int,
    device: torch.device, g: torch.Generator,
) -> IndexerInputs:  # fmt: skip
    """Random inputs of one step's indexer: a query and weights per row, and each C4A
    layer's page table over the pool."""
    cache = pool(device)
    heads = INDEX_HEADS if device.type == "cuda" else SMOKE_INDEX_HEADS
    T = requests * per_request
    q = (torch.randn(T, heads, INDEX_DIM, generator=g, device=device) * 8).clamp(-448, 448)
    weights = torch.randn(T, heads, generator=g, device=device) * heads**-0.5
    row = [(context - per_request + j + 1) // 4 for j in range(per_request)]
    lens = torch.tensor(row * requests, dtype=torch.int32, device=device)
    width = -(-(context // 4) // ENTRIES_PER_PAGE)
    tables = {  # each C4A layer's own pages
        i: torch.randint(
            0, cache.shape[0], (requests, width), generator=g, device=device, dtype=torch.int32
        )
        for i, kind in enumerate(kinds)
        if kind == "c4a"
    }
    return IndexerInputs(q.to(torch.float8_e4m3fn), weights, lens, cache, tables, requests,
                         per_request, context, topk)  # fmt: skip


def vllm_pair(device: torch.device) -> tuple[Any, str]:
    """vLLM's staged DeepGEMM module (None on a CPU, or where not staged) and what the
    model step's vLLM paths run for the indexer."""
    if device.type != "cuda":
        return None, "ours standing in for vLLM's indexer pair (no GPU)"
    from . import vllm_indexer

    deep_gemm, why = vllm_indexer.load()
    if deep_gemm is None:
        return None, f"the indexer left out of every path (vLLM's pair not staged: {why})"
    return deep_gemm, "vLLM 0.33's indexer pair (DeepGEMM + top-k, staged)"


def plugin_runs_ours(ix: IndexerInputs) -> bool:
    """Whether the plugin takes ours for this step's row count on the H200 table."""
    from dsv4_attention import policy
    from dsv4_attention.tables import table_for

    table = table_for("NVIDIA H200", (9, 0))
    if table is None or table.indexer is None:
        return False
    return policy.indexer_mode(table.indexer, ix.heads, ix.topk, ix.rows) == "ours"


@dataclasses.dataclass
class IndexerPath:
    """One path's indexer: a run per C4A layer (by layer index), its outputs, whose."""

    runs: dict[int, Callable[[], None]]
    outs: dict[int, torch.Tensor]
    who: str

    def poison(self) -> None:
        for out in self.outs.values():
            out.fill_(-7)


def path(ix: IndexerInputs | None, deep_gemm: Any, ours: bool) -> IndexerPath | None:
    """A path's indexer runs: ours (``ours``, or on a CPU), else vLLM's pair; None where
    the indexer is left out."""
    if ix is None:
        return None
    device = ix.q.device
    if not ours and deep_gemm is None and device.type == "cuda":
        return None
    use_ours = ours or deep_gemm is None
    outs = {i: torch.empty((ix.rows, ix.topk), dtype=torch.int32, device=device)
            for i in ix.tables}  # fmt: skip
    runs: dict[int, Callable[[], None]] = {}
    if use_ours:
        import dsv4_kernels as dk

        scores = torch.empty((ix.rows, ix.entries), dtype=torch.float32, device=device)
        for i, table in ix.tables.items():

            def run(table: torch.Tensor = table, out: torch.Tensor = outs[i]) -> None:
                dk.indexer_decode_topk(ix.q, ix.weights, ix.cache, ix.lens, None, table,
                                       ix.topk, out, max_entries=ix.entries, scores=scores,
                                       rows_per_request=ix.per_request)  # fmt: skip

            runs[i] = run
        return IndexerPath(runs, outs, "ours")
    from . import vllm_indexer

    R, G = ix.requests, ix.per_request
    for i, table in ix.tables.items():
        runs[i] = vllm_indexer.runner(
            deep_gemm, ix.q.view(R, G, ix.heads, INDEX_DIM), ix.weights, ix.cache,
            ix.lens.view(R, G), table, ix.entries, ix.topk, ix.context, outs[i],
        )  # fmt: skip
    return IndexerPath(runs, outs, "vllm")


def checker(ix: IndexerInputs) -> Callable[[IndexerPath, str], None]:
    """A check of a path's indexer outputs after its run: the first and last C4A layer's
    first and last row select the float64 reference's sets."""
    from dsv4_kernels.reference import indexer as ref

    layers = sorted(ix.tables)
    layers = sorted({layers[0], layers[-1]}) if layers else []
    rows = sorted({0, ix.rows - 1})
    req = torch.tensor(rows, device=ix.q.device) // ix.per_request
    want = {
        i: ref.indexer_decode_topk(
            ix.q[rows],
            ix.weights[rows],
            ix.cache,
            ix.lens[rows],
            req.to(torch.int32),
            ix.tables[i],
            ix.topk,
        )
        for i in layers
    }

    def check(p: IndexerPath, what: str) -> None:
        for i in layers:
            got = p.outs[i][rows]
            for k, t in enumerate(rows):
                g, w = sorted(got[k].tolist()), sorted(want[i][k].tolist())
                assert g == w, f"{what}: the indexer of layer {i}, row {t}: not the reference's"

    return check


def floor_bytes(ix: IndexerInputs | None) -> int:
    """Each C4A layer's index entries once per request, the queries, weights and top-k."""
    if ix is None:
        return 0
    per_layer = (
        ix.requests * ix.entries * INDEX_ENTRY_BYTES
        + ix.rows * ix.heads * (INDEX_DIM + 4)
        + ix.rows * ix.topk * 4
    )
    return per_layer * len(ix.tables)
