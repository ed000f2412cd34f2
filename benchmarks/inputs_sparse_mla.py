"""Sparse MLA benchmark inputs: the case matrix (:data:`MATRIX`, :data:`SMOKE`), one
prefill chunk of one layer in both forms (:class:`AttnInputs`: FP8 pages with global
rows, vLLM's bf16 workspace with combined rows) and the reference checks every sparse
MLA benchmark, sweep and profile shares (re-exported by ``cases_sparse_mla.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

SCALE = 512**-0.5
TOPK_LAYERS = ("c4a", "c1a", "c2a")
WINDOW = 128
SWA_BLOCK = 64
# Tokens whose output is compared with the reference (every CHECK_STRIDE-th, and the last).
CHECK_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class AttnShape:
    name: str
    layer: str  # c4a | c128a | swa; DeepSeek-V4.1's top-k layers c1a | c2a
    num_reqs: int
    query_len: int
    context: int  # tokens of each request after this chunk (query included)
    heads: int
    topk: int  # top-k rows' width (512 Flash, 1024 Pro); ignored for SWA and C128A

    @property
    def ratio(self) -> int:
        return {"c4a": 4, "c128a": 128, "swa": 1, "c1a": 1, "c2a": 2}[self.layer]

    @property
    def topk_rows(self) -> bool:
        """Whether the layer reads the indexer's top-k (C4A, V4.1's ratio-1 and -2 layers)."""
        return self.layer in TOPK_LAYERS


def shape_matrix(
    batches: tuple[tuple[str, int, int, int], ...],
    models: tuple[tuple[str, int, int], ...],
    layers: tuple[str, ...] = ("c4a", "c128a", "swa"),
) -> list[AttnShape]:
    """Every (batch: name, requests, query tokens, context) x layer x (model: name, heads,
    top-k) shape, named ``{layer}-{model}-{batch}``."""
    return [
        AttnShape(f"{layer}-{model}-{bname}", layer, b, q, ctx, heads, topk)
        for bname, b, q, ctx in batches
        for layer in layers
        for model, heads, topk in models
    ]


MODELS = (("flash-tp8", 8, 512), ("pro-tp8", 16, 1024), ("flash-dp", 64, 512))
# 32 local heads: V4-Pro at TP4, V4-Flash at TP2 (the bundled FlashMLA's largest small-heads
# count on SM90)
MODELS_32 = (("pro-tp4", 32, 1024), ("flash-tp2", 32, 512))
# 128 local heads: V4-Pro under DP attention (issue 41)
MODELS_128 = (("pro-dp", 128, 1024),)
BATCHES = (("1x16384@131072", 1, 16384, 131072), ("16x1024", 16, 1024, 1024))
MATRIX = (
    shape_matrix(BATCHES, MODELS)
    + shape_matrix(BATCHES, MODELS_32)
    + shape_matrix(BATCHES, MODELS_128)
)
# Issue 30's prefill sweep: one request's chunk of 4,096 or 16,384 tokens at 8K, 128K and
# 1M context (``python -m benchmarks.cases_sparse_mla --matrix context``)
CONTEXT_BATCHES = tuple(
    (f"1x{q}@{ctx}", 1, q, ctx) for q in (4096, 16384) for ctx in (8192, 131072, 1048576)
)
CONTEXT_MATRIX = shape_matrix(CONTEXT_BATCHES, MODELS[:2])
# DeepSeek-V4.1's layers (top-k rows over full-length and ratio-2 caches; window-only)
V41_MATRIX = shape_matrix(
    (("1x4096@131072", 1, 4096, 131072), ("16x1024", 16, 1024, 1024)),
    MODELS[:2],
    layers=("c1a", "c2a"),
)
MATRICES = {"default": MATRIX, "context": CONTEXT_MATRIX, "v41": V41_MATRIX}
SMOKE = [
    AttnShape("c4a-h3-1x6@300", "c4a", 1, 6, 300, 3, 16),
    AttnShape("c128a-h16-2x4@700", "c128a", 2, 4, 700, 16, 0),
    AttnShape("swa-h8-2x5", "swa", 2, 5, 5, 8, 0),
    AttnShape("c1a-h3-1x6@300", "c1a", 1, 6, 300, 3, 16),
    AttnShape("c2a-h8-2x4@90", "c2a", 2, 4, 90, 8, 16),
    AttnShape("swa-h20-1x3", "swa", 1, 3, 3, 20, 0),  # more than 16 heads: the wide provider
]


@dataclasses.dataclass
class AttnInputs:
    """One prefill chunk of one layer, in both forms: FP8 pages + global rows, and vLLM's
    bf16 workspace + combined rows."""

    shape: AttnShape
    seed: int
    q: torch.Tensor
    sink: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    comp_block_size: int | None
    index_case: Any  # dsv4_kernels.testing.prefill_indices.PrefillIndexCase
    rows: Any  # PrefillIndices (window, window_lens, comp, comp_lens)
    gather_lens: torch.Tensor
    M: int
    N: int
    workspace: torch.Tensor  # [num_reqs * M, 512] bf16
    combined: torch.Tensor  # [T, width] int32 workspace rows
    combined_lens: torch.Tensor  # [T] int32
    # the kernels' tiles (``sparse_mla_paged(tiles=...)``; None: the shipped defaults)
    tiles: Any = None

    def paged_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(swa_block_size=SWA_BLOCK, attn_sink=self.sink)
        if self.comp_cache is not None:
            kw.update(
                comp_cache=self.comp_cache,
                comp_indices=self.rows.comp,
                comp_lens=self.rows.comp_lens,
                comp_block_size=self.comp_block_size,
            )
        return kw

    def run_paged(self, out: torch.Tensor, lse: torch.Tensor, rows: Any = None) -> None:
        """Attention over the paged caches on this chunk's rows, or on ``rows``: per-token
        rows, or grouped rows (from :meth:`build_grouped`: leaders, starts, group size)."""
        import dsv4_kernels as dk

        r = self.rows if rows is None else rows
        kw = self.paged_kwargs()
        if self.comp_cache is not None:
            kw.update(comp_indices=r.comp, comp_lens=r.comp_lens)
        if isinstance(r, dk.GroupedPrefillIndices):
            kw.update(r.grouping())
        dk.sparse_mla_paged(
            self.q,
            self.swa_cache,
            r.window,
            r.window_lens,
            SCALE,
            out=out,
            lse=lse,
            tiles=self.tiles,
            **kw,
        )

    def build_grouped(self, group_size: int, blocks: bool = False) -> Any:
        """Grouped rows (``GroupedPrefillIndices``) of this SWA-only or C128A chunk
        (``blocks``: C128A's as ``BlockRows``)."""
        import dsv4_kernels as dk

        c = self.index_case
        comp = self.comp_cache is not None
        return dk.build_grouped_prefill_indices(
            c.query_start_loc,
            c.seq_lens,
            num_tokens=c.num_tokens,
            group_size=group_size,
            window_block_table=c.window_block_table,
            comp_block_table=c.comp_block_table if comp else None,
            comp_block_size=self.comp_block_size if comp else None,
            topk=c.topk if comp else None,
            comp_blocks=blocks and comp,
        )

    def build_blocks(self) -> Any:
        """This C128A chunk's per-token rows with the compressed rows as ``BlockRows``
        (no ``[T, entries]`` row of slots)."""
        return self.index_case.build(comp_blocks=True)

    def run_workspace(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        import dsv4_kernels as dk

        dk.sparse_mla_workspace(
            self.q,
            self.workspace,
            self.combined,
            self.combined_lens,
            SCALE,
            attn_sink=self.sink,
            out=out,
            lse=lse,
            tiles=self.tiles,
        )

    def build_workspace(self) -> None:
        """vLLM's per-chunk gathers of the compressed entries and the window region."""
        import dsv4_kernels as dk

        c = self.index_case
        B = self.shape.num_reqs
        ws = self.workspace.view(B, self.M, 512)
        if self.comp_cache is not None:
            dk.dequantize_and_gather_k_cache(
                ws,
                self.comp_cache,
                c.seq_lens // self.shape.ratio,
                None,
                c.comp_block_table,
                self.comp_block_size or 1,
                0,
            )
        dk.dequantize_and_gather_k_cache(
            ws,
            self.swa_cache,
            c.seq_lens,
            self.gather_lens,
            c.window_block_table,
            SWA_BLOCK,
            self.N,
        )

    def build_combined(self) -> None:
        import dsv4_kernels as dk

        c = self.index_case
        topk = self.topk_width
        dk.combine_topk_swa_indices(
            c.topk_indices if self.shape.topk_rows else None,
            c.query_start_loc,
            c.seq_lens,
            self.gather_lens,
            WINDOW,
            self.shape.ratio,
            topk,
            self.M,
            self.N,
            out=(self.combined, self.combined_lens),
            num_tokens=c.num_tokens,
        )

    @property
    def topk_width(self) -> int:
        return 0 if self.shape.layer == "swa" else int(self.index_case.topk)


def make_inputs(shape: AttnShape, device: torch.device, seed: int, tiles: Any = None) -> AttnInputs:
    """Random inputs for one case (queries, sinks, keys, block tables, top-k), all from
    ``seed``; ``tiles``: the kernels' tiles for its runs (None: the shipped ones)."""
    from dsv4_kernels.geometry import combined_width
    from dsv4_kernels.testing import sparse_mla as ts
    from dsv4_kernels.testing.prefill_indices import make_prefill_index_case

    g = torch.Generator(device=device).manual_seed(seed)
    ratio = shape.ratio
    case = make_prefill_index_case(
        [shape.query_len] * shape.num_reqs,
        [shape.context - shape.query_len] * shape.num_reqs,
        compress_ratio=ratio,
        topk=shape.topk if shape.topk_rows else None,
        device=device,
        seed=seed,
        topk_rows=shape.topk_rows,
    )
    T = case.num_tokens
    q = ts.random_q(T, shape.heads, generator=g, device=device)
    sink = ts.random_sink(shape.heads, generator=g, device=device)
    swa = ts.paged_cache(case.window_num_pages, SWA_BLOCK, generator=g, device=device)
    comp = None
    comp_bs = None
    if shape.layer != "swa":
        comp_bs = case.comp_block_size  # geometry.slots_per_page(ratio)
        comp = ts.paged_cache(case.comp_num_pages, comp_bs, generator=g, device=device)
    rows = case.build()
    seq = case.seq_lens
    gather = torch.clamp(seq, max=shape.query_len + WINDOW - 1)
    N = shape.context // ratio if shape.layer != "swa" else 0
    M = N + min(shape.context, shape.query_len + WINDOW - 1)
    width = combined_width(0 if shape.layer == "swa" else case.topk)
    inp = AttnInputs(
        shape=shape,
        seed=seed,
        q=q,
        sink=sink,
        swa_cache=swa.cache,
        comp_cache=None if comp is None else comp.cache,
        comp_block_size=comp_bs,
        index_case=case,
        rows=rows,
        gather_lens=gather,
        M=M,
        N=N,
        workspace=torch.zeros((shape.num_reqs * M, 512), dtype=torch.bfloat16, device=device),
        combined=torch.empty((T, width), dtype=torch.int32, device=device),
        combined_lens=torch.empty((T,), dtype=torch.int32, device=device),
        tiles=tiles,
    )
    inp.build_workspace()
    inp.build_combined()
    return inp


def valid_keys(inp: AttnInputs) -> torch.Tensor:
    """[T] keys each token attends to (window + compressed lengths)."""
    n = inp.rows.window_lens.to(torch.int64)
    if inp.rows.comp_lens is not None:
        n = n + inp.rows.comp_lens.to(torch.int64)
    return n


def check_tokens(T: int, device: torch.device) -> torch.Tensor:
    step = max(1, T // CHECK_TOKENS)
    idx = torch.arange(0, T, step, device=device)
    return torch.unique(torch.cat([idx, torch.tensor([T - 1], device=device)]))


def reference_sample(inp: AttnInputs, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 reference on a sample of tokens (their rows only)."""
    from dsv4_kernels import reference as ref

    r = inp.rows
    kw = inp.paged_kwargs()
    if inp.comp_cache is not None:
        kw.update(comp_indices=r.comp[tokens], comp_lens=r.comp_lens[tokens])
    return ref.sparse_mla_paged(
        inp.q[tokens], inp.swa_cache, r.window[tokens], r.window_lens[tokens], SCALE, **kw
    )


def assert_close_attention(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    what: str,
    *,
    atol: float = 3e-2,
    rtol: float = 3e-2,
    lse_atol: float = 2e-3,
) -> None:
    out, lse = got
    w_out, w_lse = want
    assert not torch.isnan(out.float()).any(), f"{what}: out has NaN"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    torch.testing.assert_close(out.float(), w_out.float(), atol=atol, rtol=rtol, msg=what)
    empty = torch.isneginf(w_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse -inf pattern differs"
    torch.testing.assert_close(lse[~empty], w_lse[~empty], atol=lse_atol, rtol=1e-4, msg=what)
