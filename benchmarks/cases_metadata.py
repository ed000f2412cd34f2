"""Benchmark cases for the sparse-attention metadata kernels (the seed's matrix and more)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from .harness import BenchCase, Provider, same_bytes_copy

POISON = -7777


def fresh_seed() -> int:
    """Fresh random inputs on every run; the seed is recorded with the results."""
    return int.from_bytes(os.urandom(4), "little")


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
# ... and the rest of DESIGN.md's minimum: every layer type at every seed size.
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


def _combine_inputs(shape: CombineShape, device: torch.device, g: torch.Generator) -> dict:
    ratio = {"c4a": 4, "c128a": 128, "swa": 1}[shape.layer]
    topk = {"c4a": C4A_TOPK, "c128a": shape.context // 128, "swa": 0}[shape.layer]
    if shape.layer == "c4a":
        topk = min(topk, C4A_TOPK)
    b, q = shape.num_reqs, shape.query_len
    T = b * q
    qsl = torch.arange(0, T + 1, q, dtype=torch.int32)
    seq = torch.full((b,), shape.context, dtype=torch.int32)
    gather = torch.full((b,), min(shape.context, q + WINDOW - 1), dtype=torch.int32)
    N = -(-shape.context // max(ratio, 1)) if ratio > 1 else 0
    M = N + int(gather.max())
    pos = (shape.context - q) + torch.arange(q).repeat(b)
    topk_len = ((pos + 1) // ratio).clamp(0, topk) if ratio > 1 else torch.zeros_like(pos)
    topk_indices = None
    if shape.layer == "c4a":
        # The indexer's output: topk_len distinct-ish entries in [0, N), then -1.
        vals = torch.randint(0, max(N, 1), (T, topk), generator=g, dtype=torch.int32)
        cols = torch.arange(topk)[None, :]
        topk_indices = torch.where(cols < topk_len[:, None], vals, -1).to(device)
    return dict(
        topk_indices=topk_indices,
        query_start_loc=qsl.to(device),
        seq_lens=seq.to(device),
        gather_lens=gather.to(device),
        window_size=WINDOW,
        compress_ratio=ratio,
        topk=topk,
        M=M,
        N=N,
        _topk_read=int(topk_len.sum()) if topk_indices is not None else 0,
        _T=T,
    )


def _provider(
    name: str,
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    want: tuple[torch.Tensor, torch.Tensor],
) -> Provider:
    state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def go() -> None:
        state["out"] = run()

    def poison() -> None:
        state.pop("out", None)

    def check() -> None:
        got, lens = state["out"]
        assert torch.equal(got, want[0]), "combined rows differ from the reference"
        assert torch.equal(lens, want[1]), "lens differ from the reference"

    return Provider(name, go, poison, check)


def build_combine_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref

    from .upstream_metadata import combine_per_request_workers

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cases = []
    for shape in COMBINE_SMOKE if smoke else COMBINE_MATRIX + COMBINE_EXTRA:
        inp = _combine_inputs(shape, device, g)
        T, topk_read = inp.pop("_T"), inp.pop("_topk_read")
        args = list(inp.values())
        want = ref.combine_topk_swa_indices(*args, num_tokens=T)
        width = want[0].shape[1]
        # Ours is checked through a poisoned out= buffer as well as in the timed form.
        out = torch.full((T, width), POISON, dtype=torch.int32, device=device)
        dk.combine_topk_swa_indices(*args, out=out)
        assert torch.equal(out, want[0]), f"{shape.name}: poisoned out= run differs"
        providers = [
            _provider(
                "dsv4-kernels",
                lambda a=args, t=T: dk.combine_topk_swa_indices(*a, num_tokens=t),
                want,
            )
        ]
        for workers in (128, 256):
            providers.append(
                _provider(
                    f"per-request-workers-{workers}",
                    lambda a=args, w=workers, t=T: combine_per_request_workers(*a, t, w),
                    want,
                )
            )
        floor = topk_read * 4 + T * width * 4 + T * 4 + (3 * shape.num_reqs + 1) * 4
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
                    "topk": inp["topk"],
                    "width": width,
                    "issue_matrix": shape in COMBINE_MATRIX,
                    "seed": seed,
                },
            )
        )
    return cases


def build_global_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    """The C4A indexer's top-k rows of prefill chunks, mapped to compressed-cache slots.

    Each token's row holds ``min(512, (pos + 1) // 4)`` random entries of its
    request's compressed history, then -1 (as the indexer leaves them); each
    request's pages are a random set of the cache's pages.
    """
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref

    from .upstream_metadata import global_per_token_program

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cases = []
    block_size, K = 64, C4A_TOPK
    for name, num_reqs, q, context in GLOBAL_SMOKE if smoke else GLOBAL_MATRIX:
        T = num_reqs * q
        pos = (context - q) + torch.arange(q).repeat(num_reqs)
        avail = (pos + 1) // 4  # compressed entries visible to each token
        topk_len = avail.clamp(max=K)
        entries = torch.floor(torch.rand((T, K), generator=g) * avail[:, None]).to(torch.int32)
        topk = torch.where(torch.arange(K)[None, :] < topk_len[:, None], entries, -1)
        req = torch.arange(num_reqs, dtype=torch.int32).repeat_interleave(q)
        pages = -(-context // 4 // block_size)
        table = torch.stack(
            [torch.randperm(pages * num_reqs * 2, generator=g)[:pages] for _ in range(num_reqs)]
        ).to(torch.int32)
        valid = torch.ones(T, dtype=torch.bool)
        args = [topk.to(device), req.to(device), table.to(device), block_size, valid.to(device)]
        want = ref.compute_global_topk_indices_and_lens(*args)
        prov = _provider(
            "dsv4-kernels", lambda a=args: dk.compute_global_topk_indices_and_lens(*a), want
        )
        live = int(topk_len.sum())
        # each top-k entry read once, each output written once, each live entry's table
        # word read once (at most the table), the per-token metadata once.
        floor = T * K * 4 * 2 + T * (4 + 1 + 4) + min(live, table.numel()) * 4
        upstream = _provider("per-token-program", lambda a=args: global_per_token_program(*a), want)
        providers = [prov, upstream]
        if device.type == "cuda":
            providers.append(same_bytes_copy(floor, device))
        cases.append(
            BenchCase(
                "compute_global_topk_indices_and_lens",
                name,
                T,
                floor,
                providers,
                {"topk": K, "block_size": block_size, "requests": num_reqs, "context": context},
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
