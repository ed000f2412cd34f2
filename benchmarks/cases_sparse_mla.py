"""Benchmark cases for sparse MLA with sink: DSV4 prefill attention, per layer.

Matrix (issue 9): 1 x 16,384 query tokens at a 131,072-token context and 16 x
1,024 fresh tokens; C4A (128 window keys + top-k 512 for Flash, 1024 for
Pro), C128A (window + every compressed entry so far: 1,024 at 131,072) and
SWA-only (128); H = 8 (V4-Flash at TP8), 16 (V4-Pro at TP8) and 64 (Flash
at DP).  The prefill chunk's metadata (block tables, indexer top-k) comes from
:func:`dsv4_kernels.prefill_indices.make_prefill_index_case`; the FP8 caches
are filled through our insert; keys are random.

Providers, all checked after poisoning their outputs (every token written and
NaN-free; a strided sample of tokens against the float32 reference):

* ``dsv4-kernels``: :func:`dsv4_kernels.sparse_mla_paged` from the FP8 pages
  with the global-slot rows prebuilt;
* ``dsv4-kernels+index``: the same plus building those rows
  (:func:`dsv4_kernels.build_prefill_indices`, one launch per call here; vLLM
  would build them once per layer type and step, so this is an upper bound);
* ``dsv4-kernels-grouped+index``: SWA-only and C128A layers, whose neighbouring
  tokens share keys: grouped rows (:func:`dsv4_kernels.build_grouped_prefill_indices`,
  one launch) and :func:`dsv4_kernels.sparse_mla_paged` on them, each key loaded and
  dequantised once per group of ``prefill_group_size`` tokens (4 at 8 heads, 2 at
  16 on Hopper; the layer forward's choice); absent where it does not group
  (C4A, 64 heads; on a CPU smoke run it groups 2 tokens through the per-token path);
* ``dsv4-kernels-workspace``: :func:`dsv4_kernels.sparse_mla_workspace` on
  vLLM's bf16 workspace and combined rows;
* ``flashmla-64h``: FlashMLA's ``flash_mla_sparse_fwd`` with heads padded to
  64 (128 above 64) on that workspace, as vLLM runs it (when FlashMLA imports);
* ``flashmla-64h+gather``: what vLLM runs per layer and chunk: the two
  workspace gathers and the combine (our kernels: vLLM's CuTe-DSL gather takes
  0.94-1.04x their time and its Triton combine is slower, docs/plugin.md)
  then FlashMLA.

Over 500 lines on purpose: the case matrix, its five providers and their
checks share one case geometry; the FlashMLA provider lives in
``flashmla_provider.py`` and the input factories in ``dsv4_kernels.testing``.

``floor``: the bytes a per-token kernel must read from the FP8 pages (584 B
per valid key, its 4-byte index, q) and write (out, lse), over the copy
bandwidth: keys shared by neighbouring tokens come from L2, so the floor can
be beaten.  ``summarise_per_token`` prints ns per query token, useful TF/s
(``4 * H * keys * 512`` FLOP per token: QK and PV over the real heads) and
bytes/s against that byte count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cases_metadata import fresh_seed
from .harness import BenchCase, Provider, Result

KERNEL = "sparse_mla"
OURS = "dsv4-kernels"
OURS_INDEX = "dsv4-kernels+index"
OURS_WS = "dsv4-kernels-workspace"
OURS_GROUPED = "dsv4-kernels-grouped+index"
FLASHMLA = "flashmla-64h"
FLASHMLA_GATHER = "flashmla-64h+gather"
SCALE = 512**-0.5
WINDOW = 128
SWA_BLOCK = 64
# Tokens whose output is compared with the reference (every CHECK_STRIDE-th, and the last).
CHECK_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class AttnShape:
    name: str
    layer: str  # c4a | c128a | swa
    num_reqs: int
    query_len: int
    context: int  # tokens of each request after this chunk (query included)
    heads: int
    topk: int  # C4A top-k (512 Flash, 1024 Pro); ignored otherwise

    @property
    def ratio(self) -> int:
        return {"c4a": 4, "c128a": 128, "swa": 1}[self.layer]


MODELS = (("flash-tp8", 8, 512), ("pro-tp8", 16, 1024), ("flash-dp", 64, 512))
BATCHES = (("1x16384@131072", 1, 16384, 131072), ("16x1024", 16, 1024, 1024))
MATRIX = [
    AttnShape(f"{layer}-{model}-{bname}", layer, b, q, ctx, heads, topk)
    for bname, b, q, ctx in BATCHES
    for layer in ("c4a", "c128a", "swa")
    for model, heads, topk in MODELS
]
SMOKE = [
    AttnShape("c4a-h3-1x6@300", "c4a", 1, 6, 300, 3, 16),
    AttnShape("c128a-h16-2x4@700", "c128a", 2, 4, 700, 16, 0),
    AttnShape("swa-h8-2x5", "swa", 2, 5, 5, 8, 0),
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
    index_case: Any  # dsv4_kernels.prefill_indices.PrefillIndexCase
    rows: Any  # PrefillIndices (window, window_lens, comp, comp_lens)
    gather_lens: torch.Tensor
    M: int
    N: int
    workspace: torch.Tensor  # [num_reqs * M, 512] bf16
    combined: torch.Tensor  # [T, width] int32 workspace rows
    combined_lens: torch.Tensor  # [T] int32

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
        import dsv4_kernels as dk

        r = self.rows if rows is None else rows
        kw = self.paged_kwargs()
        if self.comp_cache is not None:
            kw.update(comp_indices=r.comp, comp_lens=r.comp_lens)
        dk.sparse_mla_paged(
            self.q, self.swa_cache, r.window, r.window_lens, SCALE, out=out, lse=lse, **kw
        )

    def build_grouped(self, group_size: int) -> Any:
        """Grouped rows (``GroupedPrefillIndices``) of this SWA-only or C128A chunk."""
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
        )

    def run_grouped(self, out: torch.Tensor, lse: torch.Tensor, rows: Any) -> None:
        """Attention on grouped rows (from :meth:`build_grouped`)."""
        import dsv4_kernels as dk

        kw = self.paged_kwargs()
        if self.comp_cache is not None:
            kw.update(comp_indices=rows.comp, comp_lens=rows.comp_lens)
        dk.sparse_mla_paged(
            self.q,
            self.swa_cache,
            rows.window,
            rows.window_lens,
            SCALE,
            out=out,
            lse=lse,
            leads=rows.leads,
            group_size=rows.group_size,
            swa_starts=rows.window_starts,
            **kw,
        )

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
            c.topk_indices if self.shape.layer == "c4a" else None,
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


def make_inputs(shape: AttnShape, device: torch.device, seed: int) -> AttnInputs:
    """Random inputs for one case (queries, sinks, keys, block tables, top-k), all from ``seed``."""
    from dsv4_kernels.geometry import combined_width
    from dsv4_kernels.prefill_indices import make_prefill_index_case
    from dsv4_kernels.testing import sparse_mla as ts

    g = torch.Generator(device=device).manual_seed(seed)
    ratio = shape.ratio
    case = make_prefill_index_case(
        [shape.query_len] * shape.num_reqs,
        [shape.context - shape.query_len] * shape.num_reqs,
        compress_ratio=ratio,
        topk=shape.topk if shape.layer == "c4a" else None,
        device=device,
        seed=seed,
    )
    T = case.num_tokens
    q = ts.random_q(T, shape.heads, generator=g, device=device)
    sink = ts.random_sink(shape.heads, generator=g, device=device)
    swa = ts.paged_cache(case.window_num_pages, SWA_BLOCK, generator=g, device=device)
    comp = None
    comp_bs = None
    if ratio > 1:
        comp_bs = case.comp_block_size  # geometry.slots_per_page(ratio)
        comp = ts.paged_cache(case.comp_num_pages, comp_bs, generator=g, device=device)
    rows = case.build()
    seq = case.seq_lens
    gather = torch.clamp(seq, max=shape.query_len + WINDOW - 1)
    N = shape.context // ratio if ratio > 1 else 0
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


def _provider(
    name: str,
    run: Callable[[], None],
    outputs: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    poison: Callable[[], None],
    inp: AttnInputs,
    want: tuple[torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
) -> Provider:
    def check() -> None:
        out, lse = outputs()
        assert not torch.isnan(out.float()).any(), f"{name}: unwritten (NaN) output elements"
        assert not torch.isnan(lse).any(), f"{name}: unwritten (NaN) lse elements"
        assert_close_attention((out[tokens], lse[tokens]), want, f"{name} (seed {inp.seed})")

    return Provider(name, run, poison, check)


def index_build_provider(
    inp: AttnInputs, out: torch.Tensor, lse: torch.Tensor
) -> Callable[[], None]:
    """Hook: build the global-slot rows (one launch) then attend, as a layer forward would."""
    c = inp.index_case
    outs = dict(
        window_out=torch.empty_like(inp.rows.window),
        window_lens_out=torch.empty_like(inp.rows.window_lens),
    )
    if inp.rows.comp is not None:
        outs.update(
            comp_out=torch.empty_like(inp.rows.comp),
            comp_lens_out=torch.empty_like(inp.rows.comp_lens),
        )

    def run() -> None:
        rows = c.build(**outs)
        inp.run_paged(out, lse, rows)

    return run


def grouped_size(inp: AttnInputs) -> int:
    """Tokens per group for the grouped provider (0: none for this case)."""
    from dsv4_kernels.sparse_mla import prefill_group_size

    if inp.shape.layer == "c4a":
        return 0
    size = prefill_group_size(inp.q)
    if size == 1:
        return 2 if inp.q.device.type == "cpu" else 0
    return size


def floor_bytes(inp: AttnInputs) -> int:
    T, H, _ = inp.q.shape
    keys = int(valid_keys(inp).sum())
    return keys * (584 + 4) + T * H * (1024 + 1024 + 4)


def build_cases(
    device: torch.device, smoke: bool, shapes: Sequence[AttnShape] | None = None
) -> list[BenchCase]:
    from dsv4_kernels.testing import sparse_mla as ts

    from .flashmla_provider import PaddedFlashMLA, load_sparse_fwd

    fmla, why = load_sparse_fwd()
    if fmla is None:
        print(f"(FlashMLA provider unavailable: {why})")
    cases = []
    for shape in shapes if shapes is not None else (SMOKE if smoke else MATRIX):
        seed = fresh_seed()
        inp = make_inputs(shape, device, seed)
        T, H, _ = inp.q.shape
        tokens = check_tokens(T, device)
        want = reference_sample(inp, tokens)
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
        lse = torch.empty((T, H), dtype=torch.float32, device=device)

        def poison(o: torch.Tensor = out, l: torch.Tensor = lse) -> None:
            ts.poison_outputs(o, l)

        def ours_outputs(
            o: torch.Tensor = out, l: torch.Tensor = lse
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return o, l

        def ours(
            name: str,
            run: Callable[[], None],
            i: AttnInputs = inp,
            w: tuple[torch.Tensor, torch.Tensor] = want,
            tk: torch.Tensor = tokens,
        ) -> Provider:
            return _provider(name, run, ours_outputs, poison, i, w, tk)

        providers = [
            ours(OURS, lambda i=inp, o=out, l=lse: i.run_paged(o, l)),
            ours(OURS_INDEX, index_build_provider(inp, out, lse)),
            ours(OURS_WS, lambda i=inp, o=out, l=lse: i.run_workspace(o, l)),
        ]
        group = grouped_size(inp)
        if group:
            providers.insert(
                2,
                ours(
                    OURS_GROUPED,
                    lambda i=inp, o=out, l=lse, g=group: i.run_grouped(o, l, i.build_grouped(g)),
                ),
            )
        if fmla is not None:
            fm = PaddedFlashMLA(
                inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink
            )

            def fm_poison(f: PaddedFlashMLA = fm) -> None:
                f.result = ()

            def fm_outputs(f: PaddedFlashMLA = fm) -> tuple[torch.Tensor, torch.Tensor]:
                return f.outputs()

            def fm_vllm(i: AttnInputs = inp, f: PaddedFlashMLA = fm) -> None:
                i.build_workspace()
                i.build_combined()
                f()

            providers.append(_provider(FLASHMLA, fm, fm_outputs, fm_poison, inp, want, tokens))
            providers.append(
                _provider(FLASHMLA_GATHER, fm_vllm, fm_outputs, fm_poison, inp, want, tokens)
            )
        keys = valid_keys(inp)
        cases.append(
            BenchCase(
                KERNEL,
                shape.name,
                T,
                floor_bytes(inp),
                providers,
                {
                    "layer": shape.layer,
                    "requests": shape.num_reqs,
                    "query_len": shape.query_len,
                    "context": shape.context,
                    "heads": H,
                    "topk": shape.topk if shape.layer == "c4a" else inp.topk_width,
                    "keys_mean": float(keys.float().mean()),
                    "keys_total": int(keys.sum()),
                    "group_size": group,
                    "seed": seed,
                },
            )
        )
    return cases


def summarise_per_token(results: Sequence[Result]) -> str:
    """Markdown: ns per query token, useful TF/s and bytes/s (per the floor's byte count)."""
    lines = [
        "| case | heads | keys/token | provider | ns/token | useful TF/s | GB/s (floor bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.kernel != KERNEL:
            continue
        p = r.params
        keys = p["keys_total"]
        flop = 4 * p["heads"] * keys * 512
        sec = r.p50_us * 1e-6
        lines.append(
            f"| {r.case} | {p['heads']} | {p['keys_mean']:.0f} | {r.provider} | "
            f"{r.p50_us * 1e3 / r.tokens:.1f} | {flop / sec / 1e12:.0f} | "
            f"{r.floor_bytes / sec / 1e9:.0f} |"
        )
    return "\n".join(lines)


SWEEP_SHAPES = ("c4a-flash-tp8-1x16384", "c4a-pro-tp8-1x16384", "swa-flash-tp8-1x16384",
                "c4a-flash-dp-1x16384")  # fmt: skip


def sweep_grid(heads: int) -> list[dict[str, Any]]:
    """Tile variants for one head count.

    Earlier sweeps (2026-11-30, H200, notes in docs/attention.md): 32 keys per
    tile beat 16 and 64; 4 warps beat 8 at H <= 16, 8 warps and one 64-head
    block won at H = 64; prefetching the next tile's bytes gave 1.2-2x; bf16
    dequantisation was ~6% slower than float32; a chunked (8 x 64 batched-dot)
    formulation was 1.5-2x slower.  This sweep checks Triton's own pipelining.
    """
    if heads <= 16:
        return [
            dict(MAX_BLOCK_H=64, BLOCK_N=32, NUM_WARPS=4, NUM_STAGES=ns, PREFETCH=pf,
                 BF16_DEQUANT=0)
            for pf in (1, 0)
            for ns in (1, 3)
        ]  # fmt: skip
    return [
        dict(MAX_BLOCK_H=64, BLOCK_N=32, NUM_WARPS=8, NUM_STAGES=ns, PREFETCH=pf, BF16_DEQUANT=1)
        for pf in (1, 0)
        for ns in (1, 3)
    ]


def _apply(sm: Any, heads: int, variant: dict[str, Any]) -> None:
    cls = "small" if heads <= sm.SMALL_HEADS else "large"
    sm.TILES = {**sm.TILES, cls: {k: int(v) for k, v in variant.items()}}


def sweep(device: torch.device, rep_ms: int, log: Callable[[str], None] = print) -> list[dict]:
    """Time tile variants of the paged kernel on the Flash/Pro TP8 and DP shapes.

    Leaves the module's tiles as they were; returns one row per variant.
    """
    import triton.testing

    from dsv4_kernels import sparse_mla as sm

    rows = []
    saved = sm.TILES
    try:
        for shape in MATRIX:
            if not any(shape.name.startswith(p) for p in SWEEP_SHAPES):
                continue
            inp = make_inputs(shape, device, fresh_seed())
            T, H, _ = inp.q.shape
            out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
            lse = torch.empty((T, H), dtype=torch.float32, device=device)
            tokens = check_tokens(T, device)
            want = reference_sample(inp, tokens)
            for variant in sweep_grid(H):
                _apply(sm, H, variant)
                name = "-".join(f"{k.lower()}={v}" for k, v in variant.items())
                try:
                    out.fill_(float("nan"))
                    inp.run_paged(out, lse)
                    torch.cuda.synchronize()
                    assert_close_attention((out[tokens], lse[tokens]), want, name)
                    ms = triton.testing.do_bench(
                        lambda i=inp, o=out, l=lse: i.run_paged(o, l), rep=rep_ms
                    )
                except Exception as exc:  # a variant that fails to compile or is wrong
                    msg = f"{type(exc).__name__}: {exc}"[:200]
                    log(f"  {shape.name:<30} {name:<75} FAILED {msg}")
                    continue
                ns_tok = ms * 1e6 / T
                rows.append(
                    {"case": shape.name, "heads": H, "variant": variant, "ns_per_token": ns_tok}
                )
                log(f"  {shape.name:<30} {name:<75} {ns_tok:8.1f} ns/token")
            torch.cuda.empty_cache()
    finally:
        sm.TILES = saved
    return rows


def best_of_sweep(rows: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Per head class, the variant with the lowest summed time over every swept case."""
    from dsv4_kernels import sparse_mla as sm

    best: dict[str, dict[str, Any]] = {}
    for cls in ("small", "large"):
        mine = [r for r in rows if (r["heads"] <= sm.SMALL_HEADS) == (cls == "small")]
        cases = {r["case"] for r in mine}
        by_variant: dict[str, list[dict]] = {}
        for r in mine:
            by_variant.setdefault(repr(sorted(r["variant"].items())), []).append(r)
        complete = [v for v in by_variant.values() if len(v) == len(cases)]
        if complete:
            winner = min(complete, key=lambda v: sum(r["ns_per_token"] for r in v))
            best[cls] = winner[0]["variant"]
    return best


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.cases_sparse_mla [--only SUBSTR] [--out DIR]``: this kernel alone."""
    import argparse
    import json
    from pathlib import Path

    from . import harness

    p = argparse.ArgumentParser(prog="python -m benchmarks.cases_sparse_mla")
    p.add_argument("--only", default="", help="comma-separated case-name substrings")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--sweep", action="store_true", help="time tile variants instead (GPU)")
    p.add_argument(
        "--then-bench", action="store_true", help="after --sweep, benchmark with the best tiles"
    )
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if args.sweep:
        rows = sweep(device, args.rep_ms)
        best = best_of_sweep(rows)
        print(f"best per head class: {best}")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "sweep.json").write_text(json.dumps({"rows": rows, "best": best}) + "\n")
        if not args.then_bench:
            return 0
        from dsv4_kernels import sparse_mla as sm

        for cls, variant in best.items():
            _apply(sm, 8 if cls == "small" else 64, variant)
        print(f"benchmarking with TILES={sm.TILES}")
    only = [s for s in args.only.split(",") if s]
    pool = MATRIX if gpu else SMOKE
    shapes = [s for s in pool if not only or any(o in s.name for o in only)]
    env = harness.environment(device)
    bw = harness.copy_bandwidth(device)
    env["copy_bandwidth_gbps"] = f"{bw / 1e9:.1f}"
    from dsv4_kernels import sparse_mla as tiles_of

    env["sparse_mla_tiles"] = json.dumps(tiles_of.TILES)
    print(
        f"device: {env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}"
    )
    results = []
    for shape in shapes:
        results += harness.run_cases(build_cases(device, not gpu, [shape]), device, bw, args.rep_ms)
        if gpu:
            torch.cuda.empty_cache()
    table = summarise_per_token(results)
    print(table)
    if args.out is not None:
        harness.write_jsonl(results, env, args.out / "results.jsonl")
        (args.out / "per_token.md").write_text(table + "\n")
        (args.out / "env.json").write_text(json.dumps(env) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
