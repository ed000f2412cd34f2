"""Shared pieces of the FP8 K-cache tests: the implementations under test and CPU inputs.

Input factories live in :mod:`dsv4_kernels.testing.k_cache`; these are thin
seeded adapters and byte comparisons used by the three test modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import dsv4_kernels.kv_cache as kvc
from dsv4_kernels import geometry
from dsv4_kernels.reference import kv_cache as ref
from dsv4_kernels.testing import generator as gen
from dsv4_kernels.testing.k_cache import edge_case_keys, poisoned_bf16, poisoned_k_cache

Insert = Callable[..., None]
Gather = Callable[..., None]
INSERTS = {"triton": kvc.quantize_and_insert_k_cache, "reference": ref.quantize_and_insert_k_cache}
GATHERS = {
    "triton": kvc.dequantize_and_gather_k_cache,
    "reference": ref.dequantize_and_gather_k_cache,
}
# Page sizes of the three caches: sliding window, C4A (256/4), C128A (256/128).
LAYERS = {
    "swa": geometry.SWA_BLOCK_SIZE,
    "c4a": geometry.slots_per_page(4),
    "c128a": geometry.slots_per_page(128),
}


make_keys = edge_case_keys


def poisoned_cache(num_pages: int, block_size: int, seed: int) -> torch.Tensor:
    return poisoned_k_cache(num_pages, block_size, generator=gen(seed), device="cpu")


def poisoned_out(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bf16 filled with random bit patterns (NaNs and infinities included)."""
    return poisoned_bf16(shape, generator=gen(seed), device="cpu")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = a.cpu().contiguous().view(torch.uint8) != b.cpu().contiguous().view(torch.uint8)
    idx = d.nonzero()
    return f"{idx.shape[0]} bytes differ, first at {idx[0].tolist()}" if idx.numel() else "equal"


def fill_requests(
    seq_lens: list[int], block_size: int, spare_pages: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A poisoned cache holding every position of every request, its block table, and keys.

    Pages are shuffled; block-table columns past a request's need hold junk
    (page ids that would be wrong to read).  Returns (cache, block_table
    [B, width] int32, keys [B, max_seq, 512] bf16).
    """
    g = gen(seed)
    pages_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    width = max([*pages_needed, 1]) + 2
    table = torch.randint(0, num_pages, (len(seq_lens), width), generator=g, dtype=torch.int32)
    cache = poisoned_cache(num_pages, block_size, seed + 1)
    max_seq = max([*seq_lens, 1])
    keys = make_keys(len(seq_lens) * max_seq, seed + 2).reshape(len(seq_lens), max_seq, 512)
    used = 0
    slots = []
    for b, (s, npg) in enumerate(zip(seq_lens, pages_needed, strict=True)):
        table[b, :npg] = perm[used : used + npg].to(torch.int32)
        used += npg
        pos = torch.arange(s)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
        slots.append(torch.full((max_seq - s,), -1, dtype=torch.long))
    ref.quantize_and_insert_k_cache(keys.reshape(-1, 512), cache, torch.cat(slots), block_size)
    return cache, table, keys
