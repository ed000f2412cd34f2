"""Benchmark cases for the sparse-attention metadata kernels (the seed's matrix and more).

Inputs come from :mod:`dsv4_kernels.testing.metadata`, fresh on every run
(the seed is recorded with every case).  Every provider writes into
preallocated ``out=`` buffers that are filled with ``POISON`` before its
checked run, and the whole buffers are compared with the reference after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dsv4_kernels.testing import POISON, fresh_seed, generator
from dsv4_kernels.testing.metadata import combine_bench_inputs, global_bench_inputs

from .harness import BenchCase, Provider, same_bytes_copy


@dataclasses.dataclass(frozen=True)
class CombineShape:
    name: str
    layer: str  # c4a | c128a | swa
    num_reqs: int
    query_len: int
    context: int  # total tokens of each request after this chunk (>= query_len)


WINDOW = 128
C4A_TOPK = 512

# The matrix (its targets are computed over these) ...
COMBINE_MATRIX = [
    CombineShape("c4a-1x1024", "c4a", 1, 1024, 1024),
    CombineShape("c4a-4x1024", "c4a", 4, 1024, 1024),
    CombineShape("c4a-16x1024", "c4a", 16, 1024, 1024),
    CombineShape("c4a-1x4096", "c4a", 1, 4096, 4096),
    CombineShape("c4a-1x16384", "c4a", 1, 16384, 16384),
    CombineShape("swa-16x1024", "swa", 16, 1024, 1024),
    CombineShape("c128a-16x1024", "c128a", 16, 1024, 1024),
    CombineShape("c4a-1x16384@131072", "c4a", 1, 16384, 131072),
    CombineShape("c128a-1x16384@131072", "c128a", 1, 16384, 131072),
]
# ... and the rest of docs/design.md's minimum: every layer type at every seed size.
COMBINE_EXTRA = [
    CombineShape(f"{layer}-{n}x{q}", layer, n, q, q)
    for layer in ("swa", "c128a")
    for n, q in ((1, 1024), (4, 1024), (1, 4096), (1, 16384))
]
COMBINE_SMOKE = [
    CombineShape("c4a-2x96", "c4a", 2, 96, 300),
    CombineShape("swa-2x96", "swa", 2, 96, 96),
    CombineShape("c128a-1x64@1024", "c128a", 1, 64, 1024),
]
# (name, requests, query tokens per request, context per request)
GLOBAL_MATRIX = [
    ("1x1024", 1, 1024, 1024),
    ("4x1024", 4, 1024, 1024),
    ("16x1024", 16, 1024, 1024),
    ("1x16384@131072", 1, 16384, 131072),
]
GLOBAL_SMOKE = [("2x32@512", 2, 32, 512)]


def _out_provider(
    name: str,
    run: Callable[[torch.Tensor, torch.Tensor], object],
    want: tuple[torch.Tensor, torch.Tensor],
) -> Provider:
    """A provider writing ``(rows, lens)`` into buffers poisoned before its checked run."""
    out, lens = torch.empty_like(want[0]), torch.empty_like(want[1])

    def poison() -> None:
        out.fill_(POISON)
        lens.fill_(POISON)

    def check() -> None:
        assert torch.equal(out, want[0]), "rows differ from the reference (whole buffer)"
        assert torch.equal(lens, want[1]), "lens differ from the reference (whole buffer)"

    return Provider(name, lambda: run(out, lens), poison, check)


def build_combine_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref

    from .upstream_metadata import combine_per_request_workers

    seed = fresh_seed()
    g = generator(seed)
    cases = []
    for shape in COMBINE_SMOKE if smoke else COMBINE_MATRIX + COMBINE_EXTRA:
        inp = combine_bench_inputs(
            shape.layer, shape.num_reqs, shape.query_len, shape.context, device, g, topk=C4A_TOPK
        )
        T, args = inp.num_tokens, inp.args
        want = ref.combine_topk_swa_indices(*args, num_tokens=T)
        width = want[0].shape[1]
        providers = [
            _out_provider(
                "dsv4-kernels",
                lambda o, n, a=args: dk.combine_topk_swa_indices(*a, out=(o, n)),
                want,
            )
        ]
        for workers in (128, 256):
            providers.append(
                _out_provider(
                    f"per-request-workers-{workers}",
                    lambda o, n, a=args, w=workers: combine_per_request_workers(*a, o, n, w),
                    want,
                )
            )
        floor = inp.topk_read * 4 + T * width * 4 + T * 4 + (3 * shape.num_reqs + 1) * 4
        if device.type == "cuda":
            providers.append(same_bytes_copy(floor, device))
        cases.append(
            BenchCase(
                "combine_topk_swa_indices",
                shape.name,
                T,
                floor,
                providers,
                {
                    "layer": shape.layer,
                    "requests": shape.num_reqs,
                    "query_len": shape.query_len,
                    "context": shape.context,
                    "topk": inp.topk,
                    "width": width,
                    "issue_matrix": shape in COMBINE_MATRIX,
                    "seed": seed,
                },
            )
        )
    return cases


def build_global_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    """The C4A indexer's top-k rows of prefill chunks, mapped to compressed-cache slots.

    Inputs from :func:`dsv4_kernels.testing.metadata.global_bench_inputs`.
    """
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref

    from .upstream_metadata import global_per_token_program

    seed = fresh_seed()
    g = generator(seed)
    cases = []
    block_size, K = 64, C4A_TOPK
    for name, num_reqs, q, context in GLOBAL_SMOKE if smoke else GLOBAL_MATRIX:
        inp = global_bench_inputs(num_reqs, q, context, device, g, topk=K, block_size=block_size)
        T, args = inp.num_tokens, inp.args
        table = args[2]
        assert isinstance(table, torch.Tensor)
        want = ref.compute_global_topk_indices_and_lens(*args)
        ours = _out_provider(
            "dsv4-kernels",
            lambda o, n, a=args: dk.compute_global_topk_indices_and_lens(*a, out=o, lens_out=n),
            want,
        )
        upstream = _out_provider(
            "per-token-program", lambda o, n, a=args: global_per_token_program(*a, o, n), want
        )
        # each top-k entry read once, each output written once, each live entry's table
        # word read once (at most the table), the per-token metadata once.
        floor = T * K * 4 * 2 + T * (4 + 1 + 4) + min(inp.live, table.numel()) * 4
        providers = [ours, upstream]
        if device.type == "cuda":
            providers.append(same_bytes_copy(floor, device))
        cases.append(
            BenchCase(
                "compute_global_topk_indices_and_lens",
                name,
                T,
                floor,
                providers,
                {
                    "topk": K,
                    "block_size": block_size,
                    "requests": num_reqs,
                    "context": context,
                    "seed": seed,
                },
            )
        )
    return cases


def build_launch_case(device: torch.device) -> BenchCase:
    """An empty Triton kernel: the launch cost the small cases are measured against."""
    from .empty_kernel import launch_empty

    return BenchCase(
        "empty_triton_launch",
        "launch",
        0,
        0,
        [Provider("triton", lambda: launch_empty(device), lambda: None, lambda: None)],
    )
