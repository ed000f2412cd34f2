"""Decode steps of the lightning indexer: vLLM's paged index cache, index q, weights, rows.

:func:`make_indexer_step` builds one step as vLLM's indexer sees it: requests of
``entries`` compressed index entries each, ``rows_per_request`` query rows per request
(1, or MTP/DSpark's several, the later rows one entry longer or as given), the FP8
index cache filled with random keys in vLLM's page layout (``reference.indexer``) on
pages handed out at random (so a request's pages are scattered and the block table's
trailing entries are holes), an FP8 index query and float32 head weights.  Optional
ties: a few entries of a row copied onto others, so equal scores straddle the k-th
place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import INDEX_DIM, INDEX_ENTRY_BYTES
from ..reference.indexer import insert_index_k

__all__ = ["IndexerStep", "fill_index_cache", "make_index_cache", "make_indexer_step"]


@dataclass
class IndexerStep:
    q: torch.Tensor  # [T, H, 128] float8_e4m3fn
    weights: torch.Tensor  # [T, H] float32
    cache: torch.Tensor  # [pages, entries, 132] uint8 (vLLM's view)
    lens: torch.Tensor  # [T] int32 valid entries per row
    row_req: torch.Tensor  # [T] int32 request of each row
    block_table: torch.Tensor  # [B, max_pages] int32
    topk: int


def make_index_cache(
    pages: int, entries: int, device: torch.device | str = "cpu", page_stride: int | None = None
) -> torch.Tensor:
    """A zeroed ``[pages, entries, 132]`` uint8 page view, pages ``page_stride`` bytes
    apart (default: packed), as vLLM's allocator hands a layer its index cache."""
    stride = page_stride or entries * INDEX_ENTRY_BYTES
    if stride < entries * INDEX_ENTRY_BYTES:
        raise ValueError(f"page_stride must be >= {entries * INDEX_ENTRY_BYTES}, got {stride}")
    flat = torch.zeros(pages * stride, dtype=torch.uint8, device=device)
    return flat.as_strided((pages, entries, INDEX_ENTRY_BYTES), (stride, INDEX_ENTRY_BYTES, 1))


def fill_index_cache(cache: torch.Tensor, g: torch.Generator) -> None:
    """Every entry of ``cache`` random and finite, fast at any size (benchmarks' multi-GB
    caches): E4M3 codes with every bit pattern but the two NaNs, scales powers of two
    from 2^-8 to 1 (``g`` on the cache's device)."""
    entries, pages = cache.shape[1], cache.shape[0]
    stride = cache.stride(0) if pages > 1 else entries * INDEX_ENTRY_BYTES
    flat = torch.as_strided(cache, (pages, entries * INDEX_ENTRY_BYTES), (stride, 1))
    code_bytes = flat[:, : entries * INDEX_DIM]
    code_bytes.random_(0, 255, generator=g)  # 0..254: no 0xFF
    code_bytes[code_bytes == 0x7F] = 0x7E  # no 0x7F (E4M3's other NaN)
    exps = torch.randint(-8, 1, (pages, entries), generator=g, device=cache.device)
    scales = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps)
    flat[:, entries * INDEX_DIM :] = scales.view(torch.uint8).view(pages, entries * 4)


def make_indexer_step(
    entries_per_request: list[int],
    g: torch.Generator,
    *,
    heads: int = 64,
    topk: int = 512,
    rows_per_request: int = 1,
    row_lens: list[list[int]] | None = None,
    entries_per_page: int = 64,
    spare_pages: int = 3,
    ties: int = 0,
    device: torch.device | str = "cpu",
) -> IndexerStep:
    """One decode step (module docstring).  ``row_lens``: per request, each row's valid
    entries (default: the last row has all of the request's entries, each earlier row
    one fewer, as MTP's rows are one token apart; lengths are clamped at 0)."""
    reqs = len(entries_per_request)
    need = [-(-n // entries_per_page) for n in entries_per_request]
    width = max(need, default=0) + 1  # one hole past the longest request
    pages = sum(need) + spare_pages
    cache = make_index_cache(pages, entries_per_page, device)
    perm = torch.randperm(pages, generator=g)
    table = torch.zeros((reqs, width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    for b, n in enumerate(entries_per_request):
        if not n:
            continue
        j = torch.arange(n)
        slots = table[b, j // entries_per_page].to(torch.int64) * entries_per_page
        keys = torch.randn(n, INDEX_DIM, generator=g) * torch.rand(n, 1, generator=g) * 4
        if ties and n > 2 * ties:  # entries copied onto others: equal scores
            src = torch.randperm(n, generator=g)[: 2 * ties]
            keys[src[ties:]] = keys[src[:ties]]
        insert_index_k(keys, cache, slots + j % entries_per_page)
    lens, row_req = [], []
    for b, n in enumerate(entries_per_request):
        given = None if row_lens is None else row_lens[b]
        for r in range(rows_per_request):
            lens.append(max(0, given[r] if given is not None else n - (rows_per_request - 1 - r)))
            row_req.append(b)
    T = len(lens)
    q = (torch.randn(T, heads, INDEX_DIM, generator=g) * 8).clamp(-448, 448)
    weights = torch.randn(T, heads, generator=g) * heads**-0.5
    return IndexerStep(
        q=q.to(torch.float8_e4m3fn).to(device),
        weights=weights.to(device),
        cache=cache,
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        row_req=torch.tensor(row_req, dtype=torch.int32, device=device),
        block_table=table.to(device),
        topk=topk,
    )
