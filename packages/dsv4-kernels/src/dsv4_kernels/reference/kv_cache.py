"""Pure-torch references for the FP8 (UE8M0) paged K cache.

Same signatures and semantics as :mod:`dsv4_kernels.kv_cache` (which
validates the arguments, then calls these for CPU tensors).  Vectorised over
tokens; they run on any device.  FP8 codes come from torch's
``.to(torch.float8_e4m3fn)`` (round to nearest, ties to even, as the
hardware), so the kernels' bytes can be compared with these exactly.
"""

from __future__ import annotations

import torch

from .._validation import page_bytes_view, page_stride_of
from ..geometry import (
    AMAX_FLOOR,
    FP8_MAX,
    FP8_MAX_EXP,
    FP8_MAX_MANTISSA,
    NOPE_DIM,
    NUM_QUANT_BLOCKS,
    QUANT_BLOCK,
    SWA_BLOCK_SIZE,
    TOKEN_DATA_BYTES,
    TOKEN_SCALE_BYTES,
    UE8M0_BIAS,
)

__all__ = [
    "dequantize_and_gather_k_cache",
    "quantize_and_insert_k_cache",
    "quantize_k",
    "ue8m0_exponents",
]

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1


def ue8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(max(amax, 1e-4) / 448))`` for float32 ``amax >= 0``, exactly.

    The smallest ``e`` with ``amax <= 448 * 2**e``, read off the float32
    exponent and mantissa (no log2, no division).  Returns int32.
    """
    a = amax.to(torch.float32).clamp_min(AMAX_FLOOR)
    bits = a.view(torch.int32)
    exp = (bits >> _F32_MANTISSA_BITS) - (UE8M0_BIAS + FP8_MAX_EXP)
    return exp + ((bits & _F32_MANTISSA_MASK) > FP8_MAX_MANTISSA).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for int32 ``e`` in [-126, 127], built from its bits."""
    return ((e + UE8M0_BIAS) << _F32_MANTISSA_BITS).view(torch.float32)


def quantize_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[n, 512]`` bf16 keys: returns (codes ``[n, 448]`` uint8, scales ``[n, 8]`` uint8).

    ``scales[:, j] = e_j + 127`` for the 7 blocks and ``scales[:, 7] = 0``.
    """
    n = k.shape[0]
    x = k[:, :NOPE_DIM].to(torch.float32).reshape(n, NUM_QUANT_BLOCKS, QUANT_BLOCK)
    e = ue8m0_exponents(x.abs().amax(dim=-1))  # [n, 7]
    v = (x * _pow2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE_DIM)
    scales = torch.zeros((n, TOKEN_SCALE_BYTES), dtype=torch.uint8, device=k.device)
    scales[:, :NUM_QUANT_BLOCKS] = (e + UE8M0_BIAS).to(torch.uint8)
    return codes, scales


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = SWA_BLOCK_SIZE,
) -> None:
    """Reference of :func:`dsv4_kernels.quantize_and_insert_k_cache` (same arguments)."""
    num_tokens = slot_mapping.shape[0]
    num_pages = k_cache.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0) & (slots < num_pages * block_size)
    rows = keep.nonzero().flatten()
    if rows.numel() == 0:
        return
    slots = slots[rows]
    kk = k[:num_tokens][rows]
    codes, scales = quantize_k(kk)
    rope = kk[:, NOPE_DIM:].contiguous().view(torch.uint8)  # [n, 128]
    data = torch.cat([codes, rope], dim=1)  # [n, 576]

    stride = page_stride_of(k_cache, block_size)
    page, in_page = slots // block_size, slots % block_size
    base = page * stride  # int64
    flat = page_bytes_view(k_cache, block_size, stride)
    data_at = (base + in_page * TOKEN_DATA_BYTES).unsqueeze(1) + torch.arange(
        TOKEN_DATA_BYTES, device=k.device
    )
    scale_at = (base + block_size * TOKEN_DATA_BYTES + in_page * TOKEN_SCALE_BYTES).unsqueeze(
        1
    ) + torch.arange(TOKEN_SCALE_BYTES, device=k.device)
    flat[data_at.flatten()] = data.flatten().to(flat.device)
    flat[scale_at.flatten()] = scales.flatten().to(flat.device)


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """Reference of :func:`dsv4_kernels.dequantize_and_gather_k_cache` (same arguments).

    Like the kernel, skips rows past ``out``, pages past the block table's
    width or the cache, and negative page ids.
    """
    num_reqs = seq_lens.shape[0]
    rows = out.shape[1] - offset
    if num_reqs == 0 or rows <= 0 or k_cache.shape[0] == 0:
        return
    dev = k_cache.device
    seq = seq_lens.to(dev, torch.int64)
    glen = seq if gather_lens is None else gather_lens.to(dev, torch.int64)
    glen = torch.minimum(glen, seq).clamp_min(0)
    i = torch.arange(rows, device=dev).unsqueeze(0)  # [1, rows]
    pos = (seq - glen).unsqueeze(1) + i  # [B, rows]
    width = block_table.shape[1]
    page_idx = pos // block_size
    ok = (i < glen.unsqueeze(1)) & (page_idx < width)
    table = block_table[:num_reqs].to(dev, torch.int64)
    page = torch.gather(table, 1, page_idx.clamp(0, max(width - 1, 0))) if width else page_idx
    ok &= (page >= 0) & (page < k_cache.shape[0])
    b_idx, i_idx = ok.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    page = page[b_idx, i_idx]
    in_page = pos[b_idx, i_idx] % block_size

    stride = page_stride_of(k_cache, block_size)
    base = page * stride  # int64
    flat = page_bytes_view(k_cache, block_size, stride)
    data = flat[
        (base + in_page * TOKEN_DATA_BYTES).unsqueeze(1)
        + torch.arange(TOKEN_DATA_BYTES, device=dev)
    ]  # [n, 576]
    sbytes = flat[
        (base + block_size * TOKEN_DATA_BYTES + in_page * TOKEN_SCALE_BYTES).unsqueeze(1)
        + torch.arange(NUM_QUANT_BLOCKS, device=dev)
    ]  # [n, 7]
    n = data.shape[0]
    codes = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = (sbytes.to(torch.int32) << 23).view(torch.float32)  # 2**(byte - 127)
    nope = (codes.reshape(n, NUM_QUANT_BLOCKS, QUANT_BLOCK) * scale.unsqueeze(-1)).reshape(
        n, NOPE_DIM
    )
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16)  # [n, 64]
    vals = torch.cat([nope.to(torch.bfloat16), rope], dim=1).to(out.device)
    out[b_idx.to(out.device), (offset + i_idx).to(out.device)] = vals
