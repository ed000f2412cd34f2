"""Pure-torch reference of DSV4's lightning indexer in decode, over vLLM's paged index cache.

What vLLM 0.33 computes per C4A layer and decode step (read from its source,
``model_executor/layers/sparse_attn_indexer.py`` and the fused compressor that writes
the cache; ``docs/design.md``, "The lightning indexer"), as the reference the indexer
kernels of this package are checked against:

* **The index key cache.**  A page holds ``entries`` compressed entries (64 at C4A:
  256 tokens / ratio 4): first every entry's 128 E4M3 codes (byte ``e * 128``), then
  every entry's float32 scale (byte ``entries * 128 + e * 4``), the scale being the
  power of two ``2^ceil(log2(max(amax, 1e-4) / 448))`` of the entry's 128 values.
  vLLM's views are ``[num_pages, entries, 132]`` uint8 with any page stride
  (``stride(0)``, its allocator's block-outer layout).
* **Scores.**  For query row ``t`` (a decode token; MTP/DSpark rows are rows of their
  own, each with its own length) and request-local entry ``j < lens[t]``:
  ``s[t, j] = scale_j * sum_h weights[t, h] * relu(q[t, h] . k_j)``, with ``q`` the
  FP8 index query (its per-(token, head) scale folded into ``weights`` by vLLM), ``k_j``
  the entry's E4M3 codes, entry ``j`` at slot ``block_table[req, j // entries] *
  entries + j % entries`` of the cache (``req = row_req[t]``).  DeepGEMM's
  ``fp8_fp4_paged_mqa_logits`` computes the same in fp32; this is float64.
* **Top-k.**  Each row's ``topk`` entries of highest score, written as request-local
  positions; a row with fewer valid entries lists them all, then -1.  Equal scores are
  taken lowest position first (vLLM's top-k kernels break ties in an order of their
  own; where a tie straddles the k-th place the selected sets may differ by the tied
  entries only, which have the same score).

* **Shards** (issue 40).  A key shard ``r`` of ``S`` scores only the entries
  ``[n * r // S, n * (r + 1) // S)`` of a row of ``n`` and lists its top-k with their
  float32 scores (:func:`shard_topk`); :func:`merge_topk` takes each row's top-k of all
  shards' lists, equal scores lowest position first: the whole row's top-k.

Everything here is vectorised torch; it runs on any device.
"""

from __future__ import annotations

import torch

from ..geometry import AMAX_FLOOR, FP8_MAX, INDEX_DIM, INDEX_ENTRY_BYTES, INDEX_SCALE_BYTES
from .kv_cache import _pow2, ue8m0_exponents

__all__ = [
    "dequantize_index_k",
    "index_scores",
    "indexer_decode_topk",
    "insert_index_k",
    "merge_topk",
    "quantize_index_k",
    "shard_topk",
]


def quantize_index_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 128]`` keys (bf16 values, as vLLM rounds them before quantising) to
    (codes ``[n, 128]`` uint8 E4M3, scales ``[n]`` float32 powers of two), as vLLM's
    fused compressor writes the index cache."""
    if k.dim() != 2 or k.shape[1] != INDEX_DIM:
        raise ValueError(f"k must be [n, {INDEX_DIM}], got {tuple(k.shape)}")
    x = k.to(torch.bfloat16).to(torch.float32)
    amax = x.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    e = ue8m0_exponents(amax)
    scaled = (x * _pow2(-e)[:, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, _pow2(e)


def _page_bytes(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A flat uint8 view of the pages, the page stride and the entries per page."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != INDEX_ENTRY_BYTES:
        raise ValueError(
            f"index cache must be a [num_pages, entries, {INDEX_ENTRY_BYTES}] uint8 view, got "
            f"{cache.dtype} {tuple(cache.shape)}"
        )
    entries = int(cache.shape[1])
    stride = int(cache.stride(0)) if cache.shape[0] > 1 else entries * INDEX_ENTRY_BYTES
    extent = (cache.shape[0] - 1) * stride + entries * INDEX_ENTRY_BYTES
    flat = torch.as_strided(cache, (extent,), (1,), cache.storage_offset())
    return flat, stride, entries


def _offsets(slots: torch.Tensor, stride: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets of each slot's codes and of its scale."""
    s = slots.to(torch.int64)
    page, e = s // entries, s % entries
    base = page * stride
    return base + e * INDEX_DIM, base + entries * INDEX_DIM + e * INDEX_SCALE_BYTES


def insert_index_k(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``[n, 128]`` keys and write them at cache ``slots`` (``[n]``; -1 writes
    nothing), in vLLM's page layout."""
    flat, stride, entries = _page_bytes(cache)
    keep = slots >= 0
    codes, scales = quantize_index_k(k[keep])
    code_at, scale_at = _offsets(slots[keep].to(cache.device), stride, entries)
    cols = torch.arange(INDEX_DIM, device=cache.device)
    flat[code_at[:, None] + cols[None, :]] = codes.to(cache.device)
    sb = torch.arange(INDEX_SCALE_BYTES, device=cache.device)
    flat[scale_at[:, None] + sb[None, :]] = scales.to(cache.device).view(torch.uint8).view(-1, 4)


def dequantize_index_k(
    cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the E4M3 codes of ``slots`` as float32 ``[n, 128]``, their float32 scales ``[n]``)."""
    flat, stride, entries = _page_bytes(cache)
    code_at, scale_at = _offsets(slots.to(cache.device), stride, entries)
    cols = torch.arange(INDEX_DIM, device=cache.device)
    codes = flat[code_at[:, None] + cols[None, :]].view(torch.float8_e4m3fn).to(torch.float32)
    sb = torch.arange(INDEX_SCALE_BYTES, device=cache.device)
    scales = flat[scale_at[:, None] + sb[None, :]].contiguous().view(torch.float32).view(-1)
    return codes, scales


def _row_slots(
    lens: torch.Tensor, row_req: torch.Tensor, block_table: torch.Tensor, entries: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, width]`` cache slots of each row's entries and the mask of valid ones."""
    j = torch.arange(width, device=lens.device)
    valid = j[None, :] < lens.to(torch.int64)[:, None]
    pages = (j // entries).clamp(max=max(block_table.shape[1] - 1, 0))
    table = block_table.to(torch.int64)[row_req.to(torch.int64)]
    slots = table[:, pages] * entries + (j % entries)[None, :]
    return torch.where(valid, slots, 0), valid


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    row_req: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """``[T, max(lens)]`` float64 scores of every row's valid entries (-inf past a row's
    length).  ``q``: ``[T, H, 128]`` (E4M3 or any float); ``weights``: ``[T, H]``;
    ``lens``: ``[T]`` valid entries per row; ``row_req``: ``[T]`` the request of each row;
    ``block_table``: ``[B, pages]`` index-cache pages per request."""
    T = int(q.shape[0])
    width = int(lens.max()) if T else 0
    _, _, entries = _page_bytes(cache)
    slots, valid = _row_slots(lens, row_req, block_table, entries, width)
    codes, scales = dequantize_index_k(cache, slots.reshape(-1))
    k = codes.to(torch.float64).view(T, width, INDEX_DIM)
    dots = torch.einsum("thd,tjd->thj", q.to(torch.float64), k).clamp_min(0)
    s = torch.einsum("th,thj->tj", weights.to(torch.float64), dots)
    s = s * scales.to(torch.float64).view(T, width)
    return torch.where(valid, s, float("-inf"))


def indexer_decode_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    row_req: torch.Tensor,
    block_table: torch.Tensor,
    topk: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's ``topk`` highest-scoring request-local entries (module docstring), as
    ``[T, topk]`` int32 (into ``out[:, :topk]`` when given): by score, highest first,
    equal scores lowest position first; -1 past a row's valid entries."""
    T = int(q.shape[0])
    if out is None:
        out = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    result = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    if T:
        s = index_scores(q, weights, cache, lens, row_req, block_table)
        width = s.shape[1]
        # descending score, then ascending position (a stable sort of the negated scores)
        order = torch.sort(-s, dim=1, stable=True).indices
        n = min(topk, width)
        picked = order[:, :n].to(torch.int32)
        taken = torch.arange(n, device=s.device)[None, :] < lens.to(torch.int64)[:, None]
        result[:, :n] = torch.where(taken, picked, -1)
    out[:, :topk] = result
    return out[:, :topk]


def _share(lens: torch.Tensor, shard: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key share ``[lo, hi)`` of shard ``shard`` of ``shards``."""
    n = lens.to(torch.int64)
    return n * shard // shards, n * (shard + 1) // shards


def shard_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    row_req: torch.Tensor,
    block_table: torch.Tensor,
    topk: int,
    shard: int,
    shards: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Key shard ``shard`` of ``shards``'s candidates (module docstring) as ``[T, 2 * topk]``
    int32: positions (by score, highest first, equal scores lowest position first; -1
    past the share's entries), then their float32 scores' bits (-inf beside a -1)."""
    T = int(q.shape[0])
    if out is None:
        out = torch.empty((T, 2 * topk), dtype=torch.int32, device=q.device)
    idx = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    val = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=q.device)
    if T:
        s = index_scores(q, weights, cache, lens, row_req, block_table)
        lo, hi = _share(lens, shard, shards)
        j = torch.arange(s.shape[1], device=s.device)[None, :]
        inside = (j >= lo[:, None]) & (j < hi[:, None])
        s = torch.where(inside, s, float("-inf"))
        order = torch.sort(-s, dim=1, stable=True).indices
        n = min(topk, s.shape[1])
        taken = torch.arange(n, device=s.device)[None, :] < (hi - lo)[:, None]
        idx[:, :n] = torch.where(taken, order[:, :n], -1).to(torch.int32)
        picked = torch.gather(s, 1, order[:, :n]).to(torch.float32)
        val[:, :n] = torch.where(taken, picked, float("-inf"))
    out[:, :topk] = idx
    out[:, topk : 2 * topk] = val.view(torch.int32)
    return out[:, : 2 * topk]


def merge_topk(
    candidates: torch.Tensor, topk: int, shards: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's ``topk`` highest of the shards' candidates (``[shards * T, >= 2 * topk]``
    int32, :func:`shard_topk`'s outputs stacked shard by shard) as ``[T, topk]`` int32: by
    score, highest first, equal scores lowest position first; -1 when fewer."""
    T = int(candidates.shape[0]) // shards
    if out is None:
        out = torch.empty((T, topk), dtype=torch.int32, device=candidates.device)
    c = candidates[:, : 2 * topk].reshape(shards, T, 2 * topk).transpose(0, 1)
    idx = c[:, :, :topk].reshape(T, shards * topk).to(torch.int64)
    val = c[:, :, topk:].contiguous().view(torch.float32).reshape(T, shards * topk)
    val = torch.where(idx >= 0, val.to(torch.float64), float("-inf"))
    by_pos = torch.sort(torch.where(idx >= 0, idx, 1 << 40), dim=1, stable=True).indices
    val, idx = torch.gather(val, 1, by_pos), torch.gather(idx, 1, by_pos)
    order = torch.sort(-val, dim=1, stable=True).indices[:, :topk]
    picked = torch.gather(idx, 1, order)
    n = order.shape[1]
    result = torch.full((T, topk), -1, dtype=torch.int32, device=candidates.device)
    result[:, :n] = torch.where(picked < (1 << 40), picked, -1).to(torch.int32)
    out[:, :topk] = result
    return out[:, :topk]
