"""Benchmark cases for sparse MLA with sink: DSV4 prefill attention, per layer.

Matrix (issue 9): 1 x 16,384 query tokens at a 131,072-token context and 16 x
1,024 fresh tokens; C4A (128 window keys + top-k 512 for Flash, 1024 for
Pro), C128A (window + every compressed entry so far: 1,024 at 131,072) and
SWA-only (128); H = 8 (V4-Flash at TP8), 16 (V4-Pro at TP8) and 64 (Flash
at DP).  The prefill chunk's metadata (block tables, indexer top-k) comes from
:func:`dsv4_kernels.testing.prefill_indices.make_prefill_index_case`; the FP8 caches
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
  then FlashMLA;
* ``vllm-flashmla-native`` and ``vllm-flashmla-native+gather``: the same two with
  vLLM 0.33's bundled FlashMLA (``vllm/_flashmla_C.abi3.so``, :mod:`.flashmla_vllm`)
  at the real heads (8, 16, 32, 64 or 128 on SM90; others padded to the next),
  writing into a preallocated output poisoned before the checked run (when its
  files are staged, ``python3 -m benchmarks.support.fetch_vllm_flashmla``, and load).

The case matrix, its inputs and the reference checks are in ``inputs_sparse_mla.py``
(re-exported here), the FlashMLA provider in ``flashmla_provider.py``, the input
factories in ``dsv4_kernels.testing``; this module holds the providers, the summary and
the command line.  Tile sweeps: ``sweep_sparse_mla.py`` (the one sweep system).

``floor``: the bytes a per-token kernel must read from the FP8 pages (584 B
per valid key, its 4-byte index, q) and write (out, lse), over the copy
bandwidth: keys shared by neighbouring tokens come from L2, so the floor can
be beaten.  ``summarise_per_token`` prints ns per query token, useful TF/s
(``4 * H * keys * 512`` FLOP per token: QK and PV over the real heads) and
bytes/s against that byte count (a CPU smoke run: ns per token only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cases_metadata import fresh_seed
from .harness import FLOOR, BenchCase, Provider, Result, not_run
from .inputs_sparse_mla import (  # re-exported: the sweeps, profiler and tests import them here
    MATRICES,
    MATRIX,
    SCALE,
    SMOKE,
    AttnInputs,
    AttnShape,
    assert_close_attention,
    check_tokens,
    make_inputs,
    reference_sample,
    valid_keys,
)

KERNEL = "sparse_mla"
OURS = "dsv4-kernels"
OURS_INDEX = "dsv4-kernels+index"
OURS_WS = "dsv4-kernels-workspace"
OURS_GROUPED = "dsv4-kernels-grouped+index"
# more than 16 heads in wide blocks on the wgmma kernel's two warpgroups (issue 41; the
# shipped large tiles run the Triton kernel): blocks of 32 heads up to 32, else of 64
OURS_WIDE = "dsv4-kernels-wide"
# the same with the index build, as the plugin runs a layer: what a table's prefill.wide
# rows are decided on against vLLM's path (FlashMLA with its gathers and combine)
OURS_WIDE_INDEX = "dsv4-kernels-wide+index"
# C128A rows read through the compressed block table (BlockRows; the H200 table's
# prefill.c128a_block_rows once measured): build lengths and requests, then attend
OURS_BLOCKS = "dsv4-kernels-blocks+index"
OURS_GROUPED_BLOCKS = "dsv4-kernels-grouped-blocks+index"
FLASHMLA = "flashmla-64h"
FLASHMLA_GATHER = "flashmla-64h+gather"
VLLM_FLASHMLA = "vllm-flashmla-native"
VLLM_FLASHMLA_GATHER = "vllm-flashmla-native+gather"
# the bundled kernel padded to 64 heads: what vLLM 0.33's V4 class calls
VLLM_FLASHMLA_PADDED = "vllm-flashmla-64h"


def attention_provider(
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


def flashmla_available() -> bool:
    """Whether FlashMLA's sparse prefill imports; says why not when it does not."""
    from .flashmla_provider import load_sparse_fwd

    fn, why = load_sparse_fwd()
    if fn is None:
        not_run("FlashMLA", why)
    return fn is not None


def flashmla_providers(
    inp: AttnInputs, want: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor
) -> list[Provider]:
    """vLLM's path (FlashMLA importing): :data:`FLASHMLA`, FlashMLA on heads padded to 64
    (128 above 64) on the bf16 workspace, and :data:`FLASHMLA_GATHER`, what vLLM runs per
    layer and chunk: the two workspace gathers and the combine, then FlashMLA."""
    from .flashmla_provider import PaddedFlashMLA

    fm = PaddedFlashMLA(inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink)

    def poison() -> None:
        fm.result = ()

    def vllm_layer() -> None:
        inp.build_workspace()
        inp.build_combined()
        fm()

    return [
        attention_provider(name, run, fm.outputs, poison, inp, want, tokens)
        for name, run in ((FLASHMLA, fm), (FLASHMLA_GATHER, vllm_layer))
    ]


def vllm_flashmla_available() -> bool:
    """Whether vLLM 0.33's bundled FlashMLA loads; says why not when it does not."""
    from .flashmla_vllm import LABEL, load_sparse_fwd

    fn, why = load_sparse_fwd()
    if fn is None:
        not_run(LABEL, why)
    return fn is not None


def vllm_flashmla_providers(
    inp: AttnInputs, want: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor
) -> list[Provider]:
    """vLLM 0.33's bundled FlashMLA (loaded) at the real heads: :data:`VLLM_FLASHMLA` on
    the bf16 workspace and :data:`VLLM_FLASHMLA_GATHER` (the workspace gathers and the
    combine, then the kernel); below 64 heads also :data:`VLLM_FLASHMLA_PADDED`, the same
    build padded to 64 heads as vLLM's V4 class calls it.  One call first: a case the
    kernel refuses (a head count it does not take, an ABI mismatch at the first call) is
    reported, not timed."""
    from .flashmla_provider import PaddedFlashMLA
    from .flashmla_vllm import NativeFlashMLA, load_sparse_fwd

    try:
        fm = NativeFlashMLA(inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink)
        fm()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as exc:
        print(f"({VLLM_FLASHMLA} unavailable for {inp.shape.name}: {type(exc).__name__}: {exc})")
        return []

    def vllm_layer() -> None:
        inp.build_workspace()
        inp.build_combined()
        fm()

    found = [
        attention_provider(name, run, fm.outputs, fm.poison, inp, want, tokens)
        for name, run in ((VLLM_FLASHMLA, fm), (VLLM_FLASHMLA_GATHER, vllm_layer))
    ]
    fn, _ = load_sparse_fwd()
    if fn is not None and inp.q.shape[1] < 64:
        padded = PaddedFlashMLA(
            inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink,
            fn=fn, heads=64, out=True,
        )  # fmt: skip
        found.append(
            attention_provider(
                VLLM_FLASHMLA_PADDED, padded, padded.outputs, padded.poison, inp, want, tokens
            )
        )
    return found


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


def blocks_provider(
    inp: AttnInputs, out: torch.Tensor, lse: torch.Tensor, group: int = 0
) -> Callable[[], None]:
    """Hook: a C128A chunk's rows with the compressed part as ``BlockRows`` (per token, or
    grouped rows of ``group`` tokens), built (one launch) then attended."""

    def run() -> None:
        rows = inp.build_grouped(group, blocks=True) if group else inp.build_blocks()
        inp.run_paged(out, lse, rows)

    return run


def wide_tiles(heads: int) -> dict[str, int]:
    """The large head class's tiles with the wgmma kernel's wide head blocks that the
    benchmark runs more than 16 heads with: blocks of 32 heads up to 32 (V4-Pro at TP4),
    else of 64 (a table's ``prefill.wide`` row records the ones measured)."""
    from dsv4_kernels.sparse_mla import TILES

    block = 32 if heads <= 32 else 64
    return {**TILES["large"], "KERNEL": 2, "ASYNC_PV": 1, "WIDE_HT": block}


def grouped_size(inp: AttnInputs) -> int:
    """Tokens per group for the grouped provider (0: none for this case)."""
    from dsv4_kernels.sparse_mla import prefill_group_size

    if inp.shape.topk_rows:
        return 0
    size = prefill_group_size(inp.q, inp.tiles)
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

    fmla = flashmla_available()
    vllm_fmla = vllm_flashmla_available()
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
            return attention_provider(name, run, ours_outputs, poison, i, w, tk)

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
                    lambda i=inp, o=out, l=lse, g=group: i.run_paged(o, l, i.build_grouped(g)),
                ),
            )
        if shape.layer == "c128a":
            providers.append(ours(OURS_BLOCKS, blocks_provider(inp, out, lse)))
            if group:
                blocks = blocks_provider(inp, out, lse, group)
                providers.append(ours(OURS_GROUPED_BLOCKS, blocks))
        if H > 16:
            wide = dataclasses.replace(inp, tiles={"large": wide_tiles(H)})
            providers.append(ours(OURS_WIDE, lambda i=wide, o=out, l=lse: i.run_paged(o, l)))
            providers.append(ours(OURS_WIDE_INDEX, index_build_provider(wide, out, lse)))
        if fmla:
            providers += flashmla_providers(inp, want, tokens)
        if vllm_fmla:
            providers += vllm_flashmla_providers(inp, want, tokens)
        params = {**case_params(inp), "group_size": group}
        cases.append(BenchCase(KERNEL, shape.name, T, floor_bytes(inp), providers, params))
    return cases


def case_params(inp: AttnInputs) -> dict[str, Any]:
    """The parameters recorded with a case's results (:func:`summarise_per_token` reads
    ``heads``, ``keys_mean`` and ``keys_total``)."""
    shape = inp.shape
    keys = valid_keys(inp)
    return {
        "layer": shape.layer,
        "requests": shape.num_reqs,
        "query_len": shape.query_len,
        "context": shape.context,
        "heads": shape.heads,
        "topk": shape.topk if shape.topk_rows else inp.topk_width,
        "keys_mean": float(keys.float().mean()),
        "keys_total": int(keys.sum()),
        "seed": inp.seed,
    }


def summarise_per_token(
    results: Sequence[Result], kernel: str = KERNEL, smoke: bool = False
) -> str:
    """Markdown: ns per query token, useful TF/s and bytes/s (per the floor's byte count) of
    ``kernel``'s results (whose params carry ``heads``, ``keys_mean`` and ``keys_total``).

    A CPU smoke run (``smoke``) gets ns per token only: TF/s and bytes/s of interpreter
    wall clock mean nothing, and neither does the floor, whose rows are left out.
    """
    head = "| case | heads | keys/token | provider | ns/token |"
    if not smoke:
        head += " useful TF/s | GB/s (floor bytes) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if r.kernel != kernel or (smoke and r.provider == FLOOR):
            continue
        p = r.params
        keys = p["keys_total"]
        flop = 4 * p["heads"] * keys * 512
        sec = r.p50_us * 1e-6
        line = (
            f"| {r.case} | {p['heads']} | {p['keys_mean']:.0f} | {r.provider} | "
            f"{r.p50_us * 1e3 / r.tokens:.1f} |"
        )
        if not smoke:
            line += f" {flop / sec / 1e12:.0f} | {r.floor_bytes / sec / 1e9:.0f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.cases_sparse_mla [--only SUBSTR] [--out DIR]``: this kernel alone
    (tile sweeps: ``python -m benchmarks.experiments.sweep_sparse_mla``, the one sweep system)."""
    import argparse
    import json
    from pathlib import Path

    from . import harness

    p = argparse.ArgumentParser(prog="python -m benchmarks.cases_sparse_mla")
    p.add_argument("--only", default="", help="comma-separated case-name substrings")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument(
        "--matrix",
        default="default",
        choices=sorted(MATRICES),
        help="default: 1x16384@128K and 16x1024 at 8, 16, 32, 64 heads; context: 4K and 16K "
        "tokens at 8K, 128K, 1M context (TP8); v41: DeepSeek-V4.1's top-k layers",
    )
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    only = [s for s in args.only.split(",") if s]
    pool = MATRICES[args.matrix] if gpu else SMOKE
    shapes = [s for s in pool if not only or any(o in s.name for o in only)]
    env = harness.environment(device)
    bw = harness.copy_bandwidth(device)
    env["copy_bandwidth_gbps"] = f"{bw / 1e9:.1f}"
    from dsv4_kernels.sparse_mla import TILES

    env["sparse_mla_tiles"] = json.dumps(TILES)
    print(
        f"device: {env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}"
    )
    results = []
    for shape in shapes:
        results += harness.run_cases(build_cases(device, not gpu, [shape]), device, bw, args.rep_ms)
        if gpu:
            torch.cuda.empty_cache()
    table = summarise_per_token(results, smoke=not gpu)
    print(table)
    if args.out is not None:
        harness.write_jsonl(results, env, args.out / "results.jsonl")
        (args.out / "per_token.md").write_text(table + "\n")
        (args.out / "env.json").write_text(json.dumps(env) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
