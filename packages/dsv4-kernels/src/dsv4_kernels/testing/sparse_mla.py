"""Input factories for sparse MLA with sink: queries, FP8 pages, index rows, poison.

Used by the tests, the benchmark and the sweeps alike.  The FP8 pages are
filled through :func:`dsv4_kernels.quantize_and_insert_k_cache` and their
values read back through the reference gather, so a test's oracle sees the
keys exactly as the cache holds them.  Block-outer views (several layers'
pages per block, as vLLM allocates them) are built by copying a filled
page-contiguous cache into the layer's place in a larger buffer whose other
bytes are random (any stray read of them shows up as a wrong or NaN result).
"""

from __future__ import annotations

import dataclasses

import torch

from ..geometry import HEAD_DIM, TOKEN_BYTES, page_stride_bytes
from .k_cache import random_keys

__all__ = [
    "PagedCache",
    "index_rows",
    "paged_cache",
    "poison_outputs",
    "random_keys",
    "random_q",
    "random_sink",
]


def random_q(
    num_tokens: int, num_heads: int, *, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """``[T, H, 512]`` bf16 queries, standard normal (scores of std ~1 at scale 512**-0.5)."""
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=generator, device=device)
    return q.to(torch.bfloat16)


def random_sink(
    num_heads: int, *, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """``[H]`` float32 sinks around the typical lse (a few nats), one head at ``-inf``."""
    sink = torch.randn(num_heads, generator=generator, device=device) * 2.0 + 4.0
    sink[0] = float("-inf")
    return sink


@dataclasses.dataclass
class PagedCache:
    """An FP8 paged K cache view and the values its slots hold."""

    cache: torch.Tensor  # the view a kernel gets (2-D or 3-D, any page stride)
    block_size: int
    values: torch.Tensor  # [num_pages * block_size, 512] float32, dequantised
    buffer: torch.Tensor  # the whole allocation behind the view

    @property
    def num_slots(self) -> int:
        return self.cache.shape[0] * self.block_size


def paged_cache(
    num_pages: int,
    block_size: int,
    *,
    generator: torch.Generator,
    device: torch.device | str,
    layers_per_block: int = 1,
    layer: int = 0,
    three_d: bool = True,
    keys: torch.Tensor | None = None,
) -> PagedCache:
    """A filled FP8 cache of ``num_pages`` pages of ``block_size`` slots.

    With ``layers_per_block > 1`` the view is layer ``layer`` of a block-outer
    allocation: ``stride(0) = layers_per_block * page_stride`` and storage
    offset ``layer * page_stride``, as vLLM's per-layer views.  ``three_d``
    gives the ``[num_pages, block_size, 584]`` view, else
    ``[num_pages, page_stride]``.  ``keys`` (``[num_slots, 512]`` bf16) are
    random unless given.
    """
    import dsv4_kernels as dk
    from dsv4_kernels.reference import kv_cache as ref

    num_slots = num_pages * block_size
    if keys is None:
        keys = random_keys(num_slots, generator=generator, device=device)
    ps = page_stride_bytes(block_size)
    pages = dk.empty_k_cache(num_pages, block_size, device)
    pages.random_(0, 256, generator=generator)
    slots = torch.arange(num_slots, device=device)
    dk.quantize_and_insert_k_cache(keys, pages, slots, block_size)

    values = torch.empty((1, num_slots, HEAD_DIM), dtype=torch.bfloat16, device=device)
    ref.dequantize_and_gather_k_cache(
        values,
        pages,
        torch.tensor([num_slots], dtype=torch.int32, device=device),
        None,
        torch.arange(num_pages, dtype=torch.int32, device=device).reshape(1, -1),
        block_size,
        0,
    )

    if layers_per_block == 1:
        buffer = pages
    else:
        buffer = torch.empty((num_pages, layers_per_block * ps), dtype=torch.uint8, device=device)
        buffer.random_(0, 256, generator=generator)
        buffer[:, layer * ps : (layer + 1) * ps] = pages
    row = buffer.stride(0)
    if three_d:
        cache = torch.as_strided(
            buffer, (num_pages, block_size, TOKEN_BYTES), (row, TOKEN_BYTES, 1), layer * ps
        )
    else:
        cache = torch.as_strided(buffer, (num_pages, ps), (row, 1), layer * ps)
    return PagedCache(cache, block_size, values[0].to(torch.float32), buffer)


def index_rows(
    num_tokens: int,
    width: int,
    num_slots: int,
    *,
    generator: torch.Generator,
    device: torch.device | str,
    hole_fraction: float = 0.1,
    out_of_range_fraction: float = 0.0,
    empty_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random index rows and lengths: ``([T, width] int32, [T] int32)``.

    Entries are slots in ``[0, num_slots)``; a ``hole_fraction`` of them is
    -1, an ``out_of_range_fraction`` is at or past ``num_slots`` (up to
    ``2**31 - 1``).  Lengths are uniform in ``[0, width]``, except that the
    first ``empty_rows`` tokens get length 0 and the last token the whole width;
    entries past a row's length are random slots (they must be ignored).
    """
    idx = torch.randint(
        0, max(num_slots, 1), (num_tokens, width), generator=generator, device=device
    )
    u = torch.rand(num_tokens, width, generator=generator, device=device)
    idx = torch.where(u < hole_fraction, -1, idx)
    far = num_slots + torch.randint(0, 1 << 20, idx.shape, generator=generator, device=device)
    far[:, :1] = (1 << 31) - 1
    oor = (u >= hole_fraction) & (u < hole_fraction + out_of_range_fraction)
    idx = torch.where(oor, far, idx)
    lens = torch.randint(0, width + 1, (num_tokens,), generator=generator, device=device)
    if num_tokens:
        lens[-1] = width
    lens[:empty_rows] = 0
    return idx.to(torch.int32), lens.to(torch.int32)


def poison_outputs(out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill the outputs with NaN, so any element a kernel leaves unwritten shows."""
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
