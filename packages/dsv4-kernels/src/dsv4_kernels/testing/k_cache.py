"""Inputs for the FP8 (UE8M0) paged K cache: keys, poisoned buffers, vLLM's cache views.

Block-outer views: vLLM 0.32 allocates each KV-cache group block-outer
(``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups`` with a
block-outermost layout, BLHNC or BLNHC, the layouts DeepSeek-V4's backends
declare; with one KV head both give the same bytes).  One block holds a page
of every layer of the group, so a layer's cache is a view whose pages are a
whole block apart, not a page apart:

* every block is ``block_bytes`` long: the largest, over all the model's
  cache groups, of the group's summed page sizes, rounded up to the least
  common multiple of the pages' alignments (576 for ``fp8_ds_mla``);
* within a group, the layers of one cache spec (one page size) come in a run:
  layer ``l`` of the run starts ``run_offset + l * page`` bytes into every
  block, and the next spec's run follows the last page of this one;
* a layer's view is ``[num_blocks, slots, 584]`` uint8 with strides
  ``(block_bytes, 584, 1)`` and storage offset ``run_offset + l * page``
  (vLLM's 4-D ``[B, 1, N, 584]`` view after the layer's ``squeeze(1)``).

DeepSeek-V4 has two kinds of groups.  The window caches (64-token pages of
``round_up(64 * 584, 576)`` = 37,440 B, every layer has one) form groups of
same-size pages side by side.  The compressed KV caches of C4A (64 entries
per 256-token block, 37,440 B) and C128A (2 entries, 1,728 B) pack into one
group: the C4A run first, then the C128A run, in the same block.  For
example, with vLLM's own DSV4 specs for 2 SWA-only, 3 C4A and 3 C128A layers,
vLLM makes two window groups of 4 layers and one compressed group of 6; the
block is 149,760 B (4 x 37,440, the widest group); the C4A layers sit at
offsets 0, 37,440, 74,880 and the C128A layers at 112,320, 114,048, 115,776.
The issue's example, shape (569, 64, 584) with strides (112320, 584, 1), is a
group of 3 window layers.  :func:`block_outer_k_cache_group` builds exactly
these views; give ``block_bytes`` when a wider group elsewhere sets the block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..geometry import (
    FP8_MAX,
    HEAD_DIM,
    NUM_QUANT_BLOCKS,
    PAGE_ALIGN,
    QUANT_BLOCK,
    TOKEN_BYTES,
    page_stride_bytes,
    round_up,
)
from .common import generator as make_generator

__all__ = [
    "WIDE_SPREAD",
    "BlockOuterGroup",
    "assert_same_bytes",
    "block_outer_k_cache_group",
    "block_outer_k_cache_views",
    "edge_case_keys",
    "fill_every_slot",
    "poisoned_bf16",
    "poisoned_k_cache",
    "random_keys",
]


# Exponent spread of the keys the K-cache checks write (wide: many UE8M0 scales).
WIDE_SPREAD = 20


def random_keys(
    n: int, *, generator: torch.Generator, device: torch.device | str, spread: int = 2
) -> torch.Tensor:
    """``[n, 512]`` bf16 keys, each 64-value block scaled by ``2**U(-spread, spread)``
    (the K-cache checks pass ``spread=WIDE_SPREAD``)."""
    blocks = NUM_QUANT_BLOCKS + 1
    x = torch.randn(n, blocks, QUANT_BLOCK, generator=generator, device=device)
    e = torch.randint(-spread, spread + 1, (n, blocks, 1), generator=generator, device=device)
    return (x * torch.exp2(e.float())).reshape(n, HEAD_DIM).to(torch.bfloat16)


def edge_case_keys(n: int, seed: int) -> torch.Tensor:
    """``[n, 512]`` bf16 keys (CPU) whose 7 nope blocks span many exponents and edge cases.

    Each block gets its own magnitude (2**-30 .. 2**30); some blocks are made
    tiny (amax under the 1e-4 floor), some get an element of exactly
    448 * 2**j (amax on a scale boundary) or the next bf16 above it, some hold
    zeros and negative zeros.  Never all zeros.
    """
    g = make_generator(seed)
    nq = NUM_QUANT_BLOCKS
    x = torch.randn(n, nq + 1, QUANT_BLOCK, generator=g)
    x *= torch.exp2(torch.randint(-30, 31, (n, nq + 1, 1), generator=g).float())
    nope = x[:, :nq]
    kind = torch.randint(0, 8, (n, nq, 1), generator=g)
    # amax under the floor
    tiny = torch.randn(n, nq, QUANT_BLOCK, generator=g) * 1e-6
    nope.copy_(torch.where(kind == 1, tiny, nope))
    # amax exactly 448 * 2**j (kind 2) or the next bf16 above it (kind 3)
    scale = torch.exp2(torch.randint(-12, 13, (n, nq, 1), generator=g).float())
    edge = (torch.randn(n, nq, QUANT_BLOCK, generator=g) * 100 * scale).clamp(
        -440 * scale, 440 * scale
    )
    top = (FP8_MAX * scale).to(torch.bfloat16)
    above = (top.view(torch.int16) + 1).view(torch.bfloat16)
    top = torch.where(kind == 3, above, top).float()
    sign = torch.where(torch.rand(n, nq, 1, generator=g) < 0.5, -1.0, 1.0)
    at = torch.randint(0, QUANT_BLOCK, (n, nq, 1), generator=g)
    edge.scatter_(2, at, sign * top)
    nope.copy_(torch.where((kind == 2) | (kind == 3), edge, nope))
    # zeros and negative zeros among the values
    zeros = nope.clone()
    zeros[..., ::5] = 0.0
    zeros[..., 1::7] = -0.0
    nope.copy_(torch.where(kind == 4, zeros, nope))
    return x.reshape(n, HEAD_DIM).to(torch.bfloat16)


def fill_every_slot(
    cache: torch.Tensor, block_size: int, *, generator: torch.Generator
) -> torch.Tensor:
    """Write :func:`random_keys` (``spread=WIDE_SPREAD``) into every slot of ``cache``
    (our insert); return the keys.

    Slot ``s`` holds key ``s``: ``[cache.shape[0] * block_size, 512]`` bf16.
    """
    from ..kv_cache import quantize_and_insert_k_cache

    n = cache.shape[0] * block_size
    keys = random_keys(n, generator=generator, device=cache.device, spread=WIDE_SPREAD)
    quantize_and_insert_k_cache(keys, cache, torch.arange(n, device=cache.device), block_size)
    return keys


def poisoned_k_cache(
    num_pages: int, block_size: int, *, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """A ``[num_pages, k_cache_page_stride(block_size)]`` cache of random bytes."""
    cache = torch.empty(
        (num_pages, page_stride_bytes(block_size)), dtype=torch.uint8, device=device
    )
    return cache.random_(0, 256, generator=generator)


def poisoned_bf16(
    shape: Sequence[int], *, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """bf16 filled with random bit patterns (NaNs and infinities included)."""
    bits = torch.randint(
        -(2**15), 2**15, tuple(shape), dtype=torch.int32, generator=generator, device=device
    )
    return bits.to(torch.int16).view(torch.bfloat16)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise AssertionError naming ``what`` and the first differing byte unless equal bytewise."""
    a = got.contiguous().view(torch.uint8)
    b = want.contiguous().view(torch.uint8)
    if a.shape != b.shape or not torch.equal(a, b):
        bad = (a != b).nonzero() if a.shape == b.shape else None
        where = (
            f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
            if bad is not None
            else f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
        raise AssertionError(f"{what}: {where}")


@dataclasses.dataclass(frozen=True)
class BlockOuterGroup:
    """One block-outer KV-cache group: its backing bytes and every layer's cache view."""

    raw: torch.Tensor  # [num_blocks * block_bytes] uint8, the group's allocation
    block_bytes: int  # bytes between two blocks (= every view's stride(0))
    # views[i][l]: the l-th layer of the i-th run of ``pages``; offsets likewise.
    views: tuple[tuple[torch.Tensor, ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    def layer_bytes(self, run: int, layer: int) -> torch.Tensor:
        """A bool mask over ``raw``: True on the bytes of that layer's pages (page stride long)."""
        num_blocks = self.raw.numel() // self.block_bytes
        mask = torch.zeros(num_blocks, self.block_bytes, dtype=torch.bool, device=self.raw.device)
        start = self.offsets[run][layer]
        page = page_stride_bytes(self.views[run][layer].shape[1])
        mask[:, start : start + page] = True
        return mask.reshape(-1)


def block_outer_k_cache_group(
    num_blocks: int,
    pages: Sequence[tuple[int, int]],
    device: torch.device | str | None = None,
    *,
    block_bytes: int | None = None,
    generator: torch.Generator | None = None,
) -> BlockOuterGroup:
    """Allocate one KV-cache group block-outer, as vLLM 0.32 does, and view every layer.

    Args:
        num_blocks: blocks in the allocation.
        pages: ``(slots_per_page, num_layers)`` per run of same-size pages, in
            the order vLLM packs them: ``[(64, n)]`` for a window-cache group,
            ``[(64, n4), (2, n128)]`` for a compressed group (C4A, then C128A).
        device: where to allocate.
        block_bytes: bytes per block when a wider group of the model sets it
            (vLLM sizes every group's block by the widest); default: this
            group's pages rounded up to 576.
        generator: fill the allocation with random bytes from it (else zeros).

    Returns:
        The allocation and ``views[run][layer]``: ``[num_blocks, slots, 584]``
        uint8 with strides ``(block_bytes, 584, 1)`` at storage offset
        ``offsets[run][layer]`` (see the module docstring).
    """
    page_sizes = [page_stride_bytes(slots) for slots, _ in pages]
    used = sum(p * n for p, (_, n) in zip(page_sizes, pages, strict=True))
    needed = round_up(max(used, 1), PAGE_ALIGN)
    if block_bytes is None:
        block_bytes = needed
    elif block_bytes < used or block_bytes % PAGE_ALIGN:
        raise ValueError(
            f"block_bytes must be a multiple of {PAGE_ALIGN} and >= the group's pages ({used}), "
            f"got {block_bytes}"
        )
    raw = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device=device)
    if generator is not None:
        # drawn where the generator lives (a CPU generator for a CUDA cache too)
        raw.copy_(
            torch.randint(
                0, 256, raw.shape, generator=generator, dtype=torch.uint8, device=generator.device
            )
        )
    views, offsets = [], []
    run_offset = 0
    for page, (slots, num_layers) in zip(page_sizes, pages, strict=True):
        run_offsets = tuple(run_offset + layer * page for layer in range(num_layers))
        views.append(
            tuple(
                torch.as_strided(
                    raw, (num_blocks, slots, TOKEN_BYTES), (block_bytes, TOKEN_BYTES, 1), off
                )
                for off in run_offsets
            )
        )
        offsets.append(run_offsets)
        run_offset += num_layers * page
    return BlockOuterGroup(raw, block_bytes, tuple(views), tuple(offsets))


def block_outer_k_cache_views(
    num_blocks: int,
    block_size: int,
    num_layers: int,
    device: torch.device | str | None = None,
    *,
    block_bytes: int | None = None,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """The per-layer views of a group of ``num_layers`` same-size pages (a window-cache group).

    ``block_outer_k_cache_views(569, 64, 3)[l]`` has shape (569, 64, 584),
    strides (112320, 584, 1) and storage offset ``l * 37440``.
    """
    group = block_outer_k_cache_group(
        num_blocks, [(block_size, num_layers)], device, block_bytes=block_bytes, generator=generator
    )
    return list(group.views[0])
