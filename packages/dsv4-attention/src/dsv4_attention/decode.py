"""The decode forward of one DeepSeek-V4 attention layer on the real heads, from plain tensors.

What vLLM's ``_forward_decode(q, kv_cache, swa_metadata, attn_metadata, swa_only,
output)`` has, mapped to :func:`dsv4_kernels.sparse_mla_decode` (split over keys
for small steps, the per-token kernel for large ones; nothing is padded to 64
heads).  Nothing here imports vLLM; the vLLM subclass passes:

* ``q``: ``q[:num_decode_tokens, :num_local_heads]`` (a slice of vLLM's padded
  buffer: any token and head strides);
* ``swa_cache``: the window layer's ``kv_cache`` view ``[num_blocks, 64, 584]``
  (any ``stride(0)``); ``swa_indices``: ``swa_metadata.decode_swa_indices``
  (``[T, 128]`` or vLLM's ``[T, 1, 128]``) and ``swa_lens``:
  ``swa_metadata.decode_swa_lens``;
* for C4A / C128A layers ``comp_cache``: the layer's ``kv_cache`` view
  ``[num_blocks, 256 // ratio, 584]``, ``comp_indices``: the global top-k slots
  (C4A: from ``compute_global_topk_indices_and_lens``; C128A:
  ``attn_metadata.c128a_global_decode_topk_indices``) and ``comp_lens``;
* ``attn_sink``: the layer's sink for the local heads (``[H]`` float32), ``scale``;
* ``out``: ``output[:num_decode_tokens, :num_local_heads]``, written in place;
* ``scratch``: made once at start-up from :func:`decode_scratch_sizes` (or carved
  from vLLM's workspace with :func:`make_decode_scratch`'s ``buffer``).

Block sizes come from the cache views' shapes.  The call makes no host
synchronisation and allocates nothing: it can be captured in vLLM's FULL CUDA
graphs (compile it before capture: run it once per layer type and head count,
e.g. in the profile run).  Whether to call it at all for a step is
:func:`dsv4_attention.decode_table.use_head_exact_decode`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsv4_kernels import DecodeScratch, DecodeScratchSizes, decode_scratch_sizes
from dsv4_kernels import make_decode_scratch as _make
from dsv4_kernels.geometry import WINDOW_SIZE, RowKind

from .binding import DecodeRows, LayerBinding, check_sink

__all__ = ["DecodeScratch", "decode_scratch_sizes", "forward_decode", "make_decode_scratch"]


def make_decode_scratch(
    max_tokens: int,
    max_heads: int,
    max_keys: int,
    device: torch.device | str,
    buffer: torch.Tensor | None = None,
) -> DecodeScratch:
    """Scratch for decode steps of up to ``max_tokens`` tokens (vLLM's largest decode
    batch: ``max_num_seqs * (1 + num_speculative_tokens)``), ``max_heads`` local
    heads and ``max_keys`` columns per token (``128 + max(index_topk, C128A width)``).
    ``buffer``: a flat float32 tensor of at least
    ``decode_scratch_sizes(...).total`` elements to carve it from."""
    sizes: DecodeScratchSizes = decode_scratch_sizes(max_tokens, max_heads, max_keys, device)
    return _make(sizes, device, buffer)


def forward_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    attn_sink: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    scratch: DecodeScratch,
    *,
    comp_cache: torch.Tensor | None = None,
    comp_indices: torch.Tensor | None = None,
    comp_lens: torch.Tensor | None = None,
    policy: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention of one layer for ``q``'s tokens and heads into ``out``
    (returned), with the measured table's launch entries ``policy`` for this head count
    (:meth:`dsv4_attention.tables.DecodeTable.kernel_policy`; None: the kernels'
    defaults).  Raises ``ValueError`` (naming the argument) for bad input.

    A :class:`~dsv4_attention.binding.LayerBinding` made for this call: the plugin
    keeps one per layer and passes only the step's rows."""
    for name, cache in (("swa_cache", swa_cache), ("comp_cache", comp_cache)):
        if cache is not None and (not isinstance(cache, torch.Tensor) or cache.dim() != 3):
            raise ValueError(f"{name} must be a [num_blocks, block_size, 584] view")
    if (comp_cache is None) != (comp_indices is None):
        raise ValueError("comp_cache and comp_indices must be given together")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [T, H, 512] tensor, got {getattr(q, 'shape', type(q))}")
    rows = DecodeRows(swa_indices, swa_lens, comp_indices, comp_lens)
    for name, x in (("swa_indices", swa_indices), ("comp_indices", comp_indices)):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] != q.shape[0]:
            raise ValueError(
                f"{name} must have {q.shape[0]} rows (one per query token, like q), "
                f"got {x.shape[0]}"
            )
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(
            f"out must be {tuple(q.shape)} like q, got {tuple(getattr(out, 'shape', ()))}"
        )
    check_sink(attn_sink, q.shape[1])
    binding = LayerBinding.bind(
        name="forward_decode",
        rows=RowKind.WINDOW if comp_cache is None else RowKind.TOPK,
        ratio=1 if comp_cache is None else 4,
        heads=q.shape[1],
        window_size=WINDOW_SIZE,
        swa_cache=swa_cache,
        swa_block_size=swa_cache.shape[1],
        comp_cache=comp_cache,
        comp_block_size=None if comp_cache is None else comp_cache.shape[1],
        scale=scale,
        q=q,
        group_size=1,
    )
    binding.decode(q, out, rows, scratch, attn_sink, swa_cache, comp_cache, policy)
    return out
