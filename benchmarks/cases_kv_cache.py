"""Benchmark cases for the FP8 (UE8M0) paged K cache: insert and gather.

Matrix (issue 3): insert and gather at 1x1024, 16x1024 and 1x16384 tokens on
64-slot pages; the sliding-window gather (window 128, 64-token pages) at a
131,072-token context, for 1 and 16 requests; the compressed gather at a
131,072-token context: C4A (64 entries per page, 32,768 entries) and C128A
(2 entries per page, 1,024 entries); and a C128A insert of 16,384 entries.
Next to the page-contiguous 1x16384 case, a ``-block-outer-3`` row inserts
into and gathers from the middle layer of a 3-layer block-outer group, the
per-layer view vLLM 0.32 gives (pages a whole block apart, nonzero offset).

On the GPU a ``torch-copy-same-bytes`` provider times one torch copy moving
exactly the floor's bytes, in the same run: a yardstick for what one launch
can reach at these sizes under the same timing (docs/kernels.md gives what it
measured on an H200).

Inputs are fresh random draws from :mod:`dsv4_kernels.testing` (the seed is
recorded with every case).  Every provider is checked after poisoning its
output: ours byte for byte against the torch reference (the whole cache
allocation, all layers of a block-outer group included / the whole ``out``,
so stray writes fail too); the upstream insert, which rounds its scale in
floating point, within the quantisation step.  Floors count each byte once:
insert reads ``k`` (1024 B) and the slot (8 B) and writes 584 B per token;
gather reads 584 B per token plus the block-table entries and lengths, and
writes 1024 B per token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from dsv4_kernels.testing import fresh_seed, generator
from dsv4_kernels.testing.k_cache import (
    WIDE_SPREAD,
    assert_same_bytes,
    block_outer_k_cache_group,
    fill_every_slot,
    poisoned_bf16,
    random_keys,
)

from .harness import BenchCase, Provider, same_bytes_copy

INSERT = "quantize_and_insert_k_cache"
GATHER = "dequantize_and_gather_k_cache"
OURS = "dsv4-kernels"
UPSTREAM_GATHER = "per-request-workers-128"
UPSTREAM_INSERT = "upstream-token-per-program"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_reqs: int
    seq_len: int  # tokens (entries) of each request in the cache
    gather_len: int | None  # None: the whole request
    block_size: int
    layer: str  # swa | c4a | c128a | kv
    # Layers per block of a block-outer cache group (vLLM's allocation, see
    # dsv4_kernels.testing.k_cache); 0: one layer's pages side by side.
    block_outer_layers: int = 0


INSERT_MATRIX = [
    Shape("1x1024", 1, 1024, None, 64, "swa"),
    Shape("16x1024", 16, 1024, None, 64, "swa"),
    Shape("1x16384", 1, 16384, None, 64, "swa"),
    Shape("1x16384-block-outer-3", 1, 16384, None, 64, "swa", 3),
    Shape("c128a-1x16384", 1, 16384, None, 2, "c128a"),
]
GATHER_MATRIX = [
    Shape("1x1024", 1, 1024, None, 64, "swa"),
    Shape("16x1024", 16, 1024, None, 64, "swa"),
    Shape("1x16384", 1, 16384, None, 64, "swa"),
    Shape("1x16384-block-outer-3", 1, 16384, None, 64, "swa", 3),
    Shape("swa-1x131072-w128", 1, 131072, 128, 64, "swa"),
    Shape("swa-16x131072-w128", 16, 131072, 128, 64, "swa"),
    Shape("c4a-1x32768@131072", 1, 131072 // 4, None, 64, "c4a"),
    Shape("c128a-1x1024@131072", 1, 131072 // 128, None, 2, "c128a"),
]
INSERT_SMOKE = [
    Shape("2x40", 2, 40, None, 64, "swa"),
    Shape("2x40-block-outer-3", 2, 40, None, 64, "swa", 3),
    Shape("c128a-1x33", 1, 33, None, 2, "c128a"),
]
GATHER_SMOKE = [
    Shape("2x40", 2, 40, None, 64, "swa"),
    Shape("2x40-block-outer-3", 2, 40, None, 64, "swa", 3),
    Shape("swa-2x1000-w128", 2, 1000, 128, 64, "swa"),
    Shape("c128a-1x33", 1, 33, None, 2, "c128a"),
]
POOL_SLACK = 1.25  # pages in the cache beyond what the requests use (shuffled among them)


def _cache(shape: Shape, num_pages: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache the kernel gets, every byte it may touch) for ``shape``.

    Page-contiguous: ``empty_k_cache`` and itself.  Block-outer: the middle
    layer's view of a group of ``block_outer_layers`` window caches and the
    group's whole allocation (other layers' bytes must stay as they were).
    """
    import dsv4_kernels as dk

    if not shape.block_outer_layers:
        cache = dk.empty_k_cache(num_pages, shape.block_size, device)
        return cache, cache
    layers = shape.block_outer_layers
    group = block_outer_k_cache_group(num_pages, [(shape.block_size, layers)], device)
    return group.views[0][layers // 2], group.raw


def _same_view(view: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``view``'s shape, strides and offset over ``raw`` (a copy of the view's allocation)."""
    return torch.as_strided(raw, view.shape, view.stride(), view.storage_offset())


def _layout(shape: Shape, device: torch.device, g: torch.Generator) -> tuple[int, torch.Tensor]:
    """(pages in the cache, block table [B, pages per request] int32) with shuffled pages."""
    per_req = math.ceil(shape.seq_len / shape.block_size)
    used = per_req * shape.num_reqs
    if shape.gather_len is not None:
        # Sliding window: requests share one pool the size of a single request's pages
        # (only the window's pages are read); the table still spans the whole context.
        used = per_req
    num_pages = max(int(used * POOL_SLACK), used + 1)
    perm = torch.randperm(num_pages, generator=g, device=device)
    if shape.gather_len is not None:
        table = torch.stack(
            [
                perm[torch.randperm(per_req, generator=g, device=device)]
                for _ in range(shape.num_reqs)
            ]
        )
    else:
        table = perm[:used].reshape(shape.num_reqs, per_req)
    return num_pages, table.to(torch.int32).contiguous()


def _gather_provider(
    name: str, fn: Callable[[], None], out: torch.Tensor, poison: torch.Tensor, want: torch.Tensor
) -> Provider:
    def fill() -> None:
        out.copy_(poison)

    def check() -> None:
        assert_same_bytes(out, want, f"{name} out (whole buffer)")

    return Provider(name, fn, fill, check)


def build_gather_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref
    from dsv4_kernels._validation import use_triton

    from .upstream_kv_cache import gather_per_request_workers

    seed = fresh_seed()
    g = generator(seed, device)
    cases = []
    for shape in GATHER_SMOKE if smoke else GATHER_MATRIX:
        bs = shape.block_size
        num_pages, table = _layout(shape, device, g)
        cache, allocation = _cache(shape, num_pages, device)
        allocation.random_(0, 256, generator=g)
        fill_every_slot(cache, bs, generator=g)
        seq = torch.full((shape.num_reqs,), shape.seq_len, dtype=torch.int32, device=device)
        gl = None
        rows = shape.seq_len
        if shape.gather_len is not None:
            gl = torch.full_like(seq, shape.gather_len)
            rows = shape.gather_len
        offset = 0
        out = torch.empty((shape.num_reqs, rows, 512), dtype=torch.bfloat16, device=device)
        poison = poisoned_bf16(out.shape, generator=g, device=device)
        want = poison.clone()
        ref.dequantize_and_gather_k_cache(want, cache, seq, gl, table, bs, offset)
        args = (out, cache, seq, gl, table, bs, offset)
        providers = [
            _gather_provider(
                OURS, lambda a=args: dk.dequantize_and_gather_k_cache(*a), out, poison, want
            ),
        ]
        if use_triton(device) and not shape.block_outer_layers:
            providers.append(
                _gather_provider(
                    UPSTREAM_GATHER,
                    lambda a=args: gather_per_request_workers(*a),
                    out,
                    poison,
                    want,
                )
            )
        tokens = shape.num_reqs * rows
        pages_read = shape.num_reqs * math.ceil(rows / bs)
        floor = tokens * (584 + 1024) + pages_read * 4 + shape.num_reqs * 4 * (1 + (gl is not None))
        if device.type == "cuda":
            providers.append(same_bytes_copy(floor, device))
        cases.append(
            BenchCase(
                GATHER,
                shape.name,
                tokens,
                floor,
                providers,
                {
                    "layer": shape.layer,
                    "requests": shape.num_reqs,
                    "seq_len": shape.seq_len,
                    "gather_len": shape.gather_len,
                    "slots_per_page": bs,
                    "page_stride": cache.stride(0),
                    "block_outer_layers": shape.block_outer_layers,
                    "seed": seed,
                },
            )
        )
    return cases


def _decode_slots(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[n, 512]`` bf16 values of the given slots, through the reference gather."""
    from dsv4_kernels import reference as ref

    n = slots.shape[0]
    in_page = slots % block_size
    table = (slots // block_size).to(torch.int32).reshape(n, 1)
    out = torch.empty((n, 1, 512), dtype=torch.bfloat16, device=cache.device)
    seq = (in_page + 1).to(torch.int32)
    ref.dequantize_and_gather_k_cache(out, cache, seq, torch.ones_like(seq), table, block_size, 0)
    return out[:, 0]


def _check_upstream_insert(
    cache: torch.Tensor, want: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, bs: int
) -> None:
    """Float-rounded scales may pick the next exponent up: check values, not bytes.

    Rope exact; each value within one quantisation step at twice the
    reference's scale; every byte outside the written slots untouched.
    """
    got = _decode_slots(cache, slots, bs).float()
    x = k[: slots.shape[0]].float()
    assert torch.equal(got[:, 448:], x[:, 448:]), "rope values differ"
    amax = x[:, :448].reshape(-1, 7, 64).abs().amax(-1).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / 448.0)) + 1
    err = (got[:, :448] - x[:, :448]).reshape(-1, 7, 64).abs()
    assert bool((err <= torch.exp2(e + 4).unsqueeze(-1)).all()), "values off by more than a step"
    written = torch.zeros_like(cache, dtype=torch.bool)
    flat = written.view(-1)
    page, s = slots // bs, slots % bs
    stride = cache.shape[1]
    data_at = (page * stride + s * 576).unsqueeze(1) + torch.arange(576, device=cache.device)
    scale_at = (page * stride + bs * 576 + s * 8).unsqueeze(1) + torch.arange(
        8, device=cache.device
    )
    flat[data_at.flatten()] = True
    flat[scale_at.flatten()] = True
    assert torch.equal(cache[~written], want[~written]), "bytes outside the written slots changed"


def build_insert_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref

    from .upstream_kv_cache import insert_token_per_program

    seed = fresh_seed()
    g = generator(seed, device)
    cases = []
    for shape in INSERT_SMOKE if smoke else INSERT_MATRIX:
        bs = shape.block_size
        num_pages, table = _layout(shape, device, g)
        pos = torch.arange(shape.seq_len, device=device)
        slots = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1)
        n = slots.shape[0]
        k = random_keys(n, generator=g, device=device, spread=WIDE_SPREAD)
        cache, allocation = _cache(shape, num_pages, device)
        poison = torch.randint(
            0, 256, allocation.shape, dtype=torch.uint8, generator=g, device=device
        )
        want = poison.clone()
        ref.quantize_and_insert_k_cache(k, _same_view(cache, want), slots, bs)

        def poison_cache(c: torch.Tensor = allocation, p: torch.Tensor = poison) -> None:
            c.copy_(p)

        providers = [
            Provider(OURS, lambda a=(k, cache, slots, bs): dk.quantize_and_insert_k_cache(*a),
                     poison_cache,
                     lambda c=allocation, w=want: assert_same_bytes(c, w, "cache (whole)")),
        ]  # fmt: skip
        # Under the interpreter the upstream float->fp8 cast loses mantissa carries (the
        # trap our kernel avoids), so its output is wrong there: GPU only.
        if device.type == "cuda" and not shape.block_outer_layers:
            providers.append(
                Provider(
                    UPSTREAM_INSERT,
                    lambda a=(k, cache, slots, bs): insert_token_per_program(*a),
                    poison_cache,
                    lambda c=cache, w=want, kk=k, s=slots, b=bs: _check_upstream_insert(
                        c, w, kk, s, b
                    ),
                )
            )
        floor = n * (1024 + 8 + 584)
        if device.type == "cuda":
            providers.append(same_bytes_copy(floor, device))
        cases.append(
            BenchCase(
                INSERT,
                shape.name,
                n,
                floor,
                providers,
                {
                    "layer": shape.layer,
                    "requests": shape.num_reqs,
                    "slots_per_page": bs,
                    "page_stride": cache.stride(0),
                    "block_outer_layers": shape.block_outer_layers,
                    "seed": seed,
                },
            )
        )
    return cases


def build_cases(device: torch.device, smoke: bool) -> list[BenchCase]:
    """Insert and gather cases (``smoke``: tiny CPU shapes, still checked)."""
    return build_insert_cases(device, smoke) + build_gather_cases(device, smoke)
