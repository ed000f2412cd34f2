"""Compile the head-exact prefill's kernels before the first request.

vLLM's warm-up knows nothing of our Triton/Gluon kernels, so without this the
first prefill on each rank pays their compilation.  The plugin's attention
class calls :func:`warm_up_prefill` from vLLM's profile run (the forward pass
without metadata that sizes memory), once per device, head count and layer
type, on a tiny batch of the same dtypes and layout as a real step (index
rows, then attention over FP8 pages), so the compiled variants are the ones a
real step launches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from dsv4_kernels.geometry import (
    HEAD_DIM,
    KV_BLOCK_SIZE,
    SWA_BLOCK_SIZE,
    TOKEN_BYTES,
    page_stride_bytes,
    slots_per_page,
)

from .prefill import PrefillPlan, forward_prefill

__all__ = ["warm_up_decode", "warm_up_prefill"]

# Decode batch sizes compiled before vLLM captures its graphs: split over keys (few
# tokens), and one program per token (many).
_DECODE_TOKENS = (1, 24, 512)

# Two requests whose chunks end deep enough to give every row kind some keys; two
# token counts, so both of Triton's integer specialisations (a multiple of 16 or not)
# are compiled where a kernel specialises on them.
_SEQ_LENS = (600, 90)
_QUERY_LENS = ((12, 4), (9, 4))


def _pages(per_page: int) -> int:
    return sum(-(-s // per_page) for s in _SEQ_LENS)


def _cache(pages: int, slots: int, device: torch.device) -> torch.Tensor:
    """A zeroed ``[pages, slots, 584]`` page view with the layout's page stride."""
    stride = page_stride_bytes(slots)
    flat = torch.zeros((pages * stride,), dtype=torch.uint8, device=device)
    return flat.as_strided((pages, slots, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))


def _table(per_page: int, device: torch.device) -> torch.Tensor:
    cols = max(-(-s // per_page) for s in _SEQ_LENS)
    table = torch.zeros((len(_SEQ_LENS), cols), dtype=torch.int32)
    start = 0
    for r, s in enumerate(_SEQ_LENS):
        n = -(-s // per_page)
        table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return table.to(device)


def _query_lens(max_tokens: int | None) -> tuple[tuple[int, ...], ...]:
    """The warm-up's chunks that fit the token budget (shrunk when none does)."""
    if max_tokens is None:
        return _QUERY_LENS
    fits = tuple(q for q in _QUERY_LENS if sum(q) <= max_tokens)
    if fits:
        return fits
    if max_tokens < 2:
        return ((max_tokens, 0),) if max_tokens == 1 else ()
    return ((max_tokens - 1, 1),)


def warm_up_prefill(
    device: torch.device | str,
    heads: int,
    compress_ratio: int,
    topk: int = 512,
    *,
    max_tokens: int | None = None,
    topk_rows: bool | None = None,
    window: int = 128,
    window_floor: bool = True,
    c128a_blocks: bool = False,
    tiles: dict[str, dict[str, int]] | None = None,
) -> float:
    """Run one layer's head-exact prefill on a tiny batch; seconds it took (the compile).

    Args:
        device: where the kernels run (the layer's device).
        heads: the layer's local query heads.
        compress_ratio: the ratio the kernels are given: 1 (SWA-only), 4 (C4A) or 128
            (C128A); DeepSeek-V4.1's compressed layers 1 or 2 with ``topk_rows``.
        topk: top-k rows: the indexer's top-k width (the layer's top-k buffer's).
        max_tokens: the token budget of a step; the warm-up stays within it.
        topk_rows: whether the layer reads the indexer's top-k rows (default: ratio 4).
        window: the layer's sliding window.
        window_floor: build the rows with a window floor, as serving does wherever vLLM's
            metadata has gather lengths (every DSV4 release here): the index kernel is
            compiled with and without one, so the variant serving launches is this one.
        c128a_blocks: C128A rows read through the block table, as serving builds them
            when the table says so (the attention kernel compiles a variant for it).
        tiles: the prefill's tiles where a measured table names them (wide head blocks
            above 16 heads), as serving passes them.
    """
    if topk_rows is None:
        topk_rows = compress_ratio == 4
    device = torch.device(device)
    began = time.perf_counter()
    swa_cache = _cache(_pages(SWA_BLOCK_SIZE), SWA_BLOCK_SIZE, device)
    comp: dict[str, object] = {}
    if topk_rows or compress_ratio == 128:
        per_page = slots_per_page(compress_ratio)
        comp = {
            "comp_cache": _cache(_pages(KV_BLOCK_SIZE), per_page, device),
            "comp_block_table": _table(KV_BLOCK_SIZE, device),
            "comp_block_size": per_page,
        }
    for query_lens in _query_lens(max_tokens):
        tokens = sum(query_lens)
        qsl = torch.tensor([0, query_lens[0], tokens], dtype=torch.int32, device=device)
        seq = torch.tensor(_SEQ_LENS, dtype=torch.int32, device=device)
        layer = dict(comp)
        if topk_rows:
            rows = torch.full((tokens, topk), -1, dtype=torch.int32, device=device)
            rows[:, :8] = torch.arange(8, dtype=torch.int32, device=device)
            layer["topk_indices"] = rows
        elif compress_ratio == 128:
            layer["c128a_topk"] = 128
        q = torch.zeros((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
        floor = None
        if window_floor:  # vLLM's window region: each request's last query + W - 1 tokens
            floor = (seq - torch.tensor(query_lens, device=device) - (window - 1)).clamp(min=0)
        forward_prefill(
            q,
            PrefillPlan(qsl, seq, num_tokens=tokens, window_size=window, c128a_blocks=c128a_blocks),
            compress_ratio=compress_ratio,
            scale=HEAD_DIM**-0.5,
            swa_cache=swa_cache,
            swa_block_table=_table(SWA_BLOCK_SIZE, device),
            attn_sink=torch.zeros((heads,), dtype=torch.float32, device=device),
            window_floor=None if floor is None else floor.to(torch.int32),
            tiles=tiles,
            **layer,  # type: ignore[arg-type]
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def warm_up_decode(
    device: torch.device | str,
    heads: int,
    compress_ratio: int,
    max_keys: int,
    scratch: object,
    *,
    tokens: tuple[int, ...] = _DECODE_TOKENS,
    window_width: int = 128,
    compressed: bool | None = None,
    policy: Mapping[str, int] | None = None,
) -> float:
    """Run one layer's head-exact decode on a few batch sizes; seconds it took.

    Args:
        device: the layer's device.
        heads: local query heads.
        compress_ratio: 1, 4 or 128 (V4.1: 1 or 2 with ``compressed``): the
            compressed pages hold ``256 // compress_ratio`` entries.
        max_keys: most columns per token (window + compressed width).
        scratch: the decode scratch the real calls use (its views are reused).
        tokens: the step sizes to run (within the scratch's token budget).
        window_width: the window rows' width (DSpark's drafter rows are wider than 128).
        compressed: whether the layer reads a compressed cache (default: ratio > 1).
        policy: the launch entries serving uses (the measured table's, for these heads):
            the warm-up compiles the kernels serving runs.
    """
    from .decode import forward_decode

    device = torch.device(device)
    began = time.perf_counter()
    swa_cache = _cache(4, SWA_BLOCK_SIZE, device)
    width = max(0, max_keys - window_width)
    comp_cache = None
    if compress_ratio > 1 if compressed is None else compressed:
        comp_cache = _cache(4, slots_per_page(compress_ratio), device)
    for n in tokens:
        window = torch.full((n, window_width), -1, dtype=torch.int32, device=device)
        window[:, :128] = torch.arange(128, dtype=torch.int32, device=device)
        lens = torch.full((n,), 128, dtype=torch.int32, device=device)
        comp: dict[str, object] = {}
        if comp_cache is not None:
            entries = comp_cache.shape[0] * comp_cache.shape[1]
            rows = torch.full((n, width), -1, dtype=torch.int32, device=device)
            rows[:, : min(width, entries)] = torch.arange(min(width, entries), device=device)
            comp = {
                "comp_cache": comp_cache,
                "comp_indices": rows,
                "comp_lens": torch.full(
                    (n,), min(width, entries), dtype=torch.int32, device=device
                ),
            }
        q = torch.zeros((n, heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
        forward_decode(
            q,
            swa_cache,
            window,
            lens,
            torch.zeros((heads,), dtype=torch.float32, device=device),
            HEAD_DIM**-0.5,
            torch.empty_like(q),
            scratch,  # type: ignore[arg-type]
            policy=policy,
            **comp,  # type: ignore[arg-type]
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began
