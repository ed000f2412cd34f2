"""Pure-torch reference for sparse MLA with sink (float32 math).

Same signatures and semantics as :mod:`dsv4_kernels.sparse_mla` (which
validates the arguments, then calls these for CPU tensors).  Vectorised over
tokens in chunks (no Python loop per token); runs on any device.

Per query token ``t`` and head ``h``, over the valid keys of its index rows
(the window / workspace row, then the compressed row, as one key set):
``s_j = scale * q_h . k_j``, ``lse = log sum_j exp(s_j)`` (natural log,
without the sink), ``o = sum_j softmax(s)_j k_j``, then ``o *= exp(lse) /
(exp(lse) + exp(sink_h))``.  K = V = the key's 512 values.  A key is valid
when its column is below the row's length, its index is not negative and it
addresses a slot (row) inside the cache (workspace); a row with no valid key
gives ``o = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._validation import page_bytes_view, page_stride_of
from ..geometry import (
    HEAD_DIM,
    NOPE_DIM,
    NUM_QUANT_BLOCKS,
    QUANT_BLOCK,
    TOKEN_DATA_BYTES,
    TOKEN_SCALE_BYTES,
)

__all__ = ["dequantize_slots", "sparse_mla_paged", "sparse_mla_workspace"]

# Tokens per vectorised chunk: bounds the gathered [tokens, keys, 512] float32 keys.
_CHUNK_ELEMS = 1 << 25


def _flat_pages(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """(1-D uint8 view of every byte the pages address, page stride in bytes)."""
    stride = page_stride_of(cache, block_size)
    return page_bytes_view(cache, block_size, stride), stride


def dequantize_slots(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[*slots.shape, 512]`` float32 values of cache slots (every slot must be in range).

    ``cache`` is ``[num_pages, page_bytes]`` or ``[num_pages, block_size, 584]``
    uint8 with any page stride ``cache.stride(0)``.
    """
    flat, stride = _flat_pages(cache, block_size)
    s = slots.reshape(-1).to(torch.int64)
    page, in_page = s // block_size, s % block_size
    base = page * stride
    dev = cache.device
    data = flat[
        (base + in_page * TOKEN_DATA_BYTES).unsqueeze(1)
        + torch.arange(TOKEN_DATA_BYTES, device=dev)
    ]
    sbytes = flat[
        (base + block_size * TOKEN_DATA_BYTES + in_page * TOKEN_SCALE_BYTES).unsqueeze(1)
        + torch.arange(NUM_QUANT_BLOCKS, device=dev)
    ]
    n = s.shape[0]
    codes = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = (sbytes.to(torch.int32) << 23).view(torch.float32)  # 2**(byte - 127)
    nope = (codes.reshape(n, NUM_QUANT_BLOCKS, QUANT_BLOCK) * scale.unsqueeze(-1)).reshape(
        n, NOPE_DIM
    )
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope], dim=1).reshape(*slots.shape, HEAD_DIM)


# A key source: (index rows [T, K] int32, lengths [T] or None, number of valid
# slots / rows, function turning in-range indices into float32 keys).
_Source = tuple[torch.Tensor, torch.Tensor | None, int, Callable[[torch.Tensor], torch.Tensor]]


def _valid(indices: torch.Tensor, lens: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < num_rows)
    if lens is not None:
        col = torch.arange(indices.shape[1], device=indices.device)
        ok &= col.unsqueeze(0) < lens.to(indices.device, torch.int64).unsqueeze(1)
    return ok


def _attend(
    q: torch.Tensor,
    sources: list[_Source],
    scale: float,
    attn_sink: torch.Tensor | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    width = max(1, sum(src[0].shape[1] for src in sources))
    chunk = max(1, _CHUNK_ELEMS // (width * HEAD_DIM))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        keys, masks = [], []
        for indices, lens, num_rows, decode in sources:
            rows = indices[t0:t1]
            ok = _valid(rows, None if lens is None else lens[t0:t1], num_rows)
            keys.append(decode(torch.where(ok, rows.to(torch.int64), 0)))
            masks.append(ok)
        k = torch.cat(keys, dim=1)  # [t, K, 512] float32
        ok = torch.cat(masks, dim=1)  # [t, K]
        k = torch.where(ok.unsqueeze(-1), k, 0.0)
        s = torch.einsum("thd,tkd->thk", q[t0:t1].to(torch.float32), k) * scale
        s = s.masked_fill(~ok.unsqueeze(1), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [t, H]; -inf where no key
        has_key = row_lse > float("-inf")
        p = torch.exp(s - torch.where(has_key, row_lse, 0.0).unsqueeze(-1))
        o = torch.einsum("thk,tkd->thd", p, k)
        if attn_sink is not None:
            sink = attn_sink.to(q.device, torch.float32).unsqueeze(0)
            o = o * torch.sigmoid(row_lse - sink).unsqueeze(-1)
        o = torch.where(has_key.unsqueeze(-1), o, 0.0)
        out[t0:t1] = o.to(torch.bfloat16)
        lse[t0:t1] = row_lse
    return out, lse


def sparse_mla_paged(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    scale: float,
    *,
    swa_block_size: int,
    attn_sink: torch.Tensor | None = None,
    comp_cache: torch.Tensor | None = None,
    comp_indices: torch.Tensor | None = None,
    comp_lens: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv4_kernels.sparse_mla_paged` (same arguments)."""

    def decoder(cache: torch.Tensor, bs: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda slots: dequantize_slots(cache, slots, bs)

    sources: list[_Source] = [
        (
            swa_indices,
            swa_lens,
            swa_cache.shape[0] * swa_block_size,
            decoder(swa_cache, swa_block_size),
        )
    ]
    if comp_cache is not None:
        assert comp_indices is not None and comp_block_size is not None
        sources.append(
            (
                comp_indices,
                comp_lens,
                comp_cache.shape[0] * comp_block_size,
                decoder(comp_cache, comp_block_size),
            )
        )
    return _attend(q, sources, scale, attn_sink, out, lse)


def sparse_mla_workspace(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None,
    scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv4_kernels.sparse_mla_workspace` (same arguments)."""
    rows = kv.reshape(kv.shape[0], HEAD_DIM)

    def decode(idx: torch.Tensor) -> torch.Tensor:
        return rows[idx].to(torch.float32)

    return _attend(q, [(indices, lens, rows.shape[0], decode)], scale, attn_sink, out, lse)
