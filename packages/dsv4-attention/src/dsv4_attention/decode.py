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

from dsv4_kernels import DecodeScratch, DecodeScratchSizes, decode_scratch_sizes, sparse_mla_decode
from dsv4_kernels import make_decode_scratch as _make

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


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``[T, 1, K]`` index rows as ``[T, K]`` (a view)."""
    if x.dim() == 3:
        if x.shape[1] != 1:
            raise ValueError(f"{name} must be [T, K] or [T, 1, K], got shape {tuple(x.shape)}")
        return x[:, 0]
    return x


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
    defaults).  Raises ``ValueError`` (naming the argument) for bad input."""
    for name, cache in (("swa_cache", swa_cache), ("comp_cache", comp_cache)):
        if cache is not None and (not isinstance(cache, torch.Tensor) or cache.dim() != 3):
            raise ValueError(f"{name} must be a [num_blocks, block_size, 584] view")
    comp_kw = {}
    if comp_cache is not None or comp_indices is not None:
        if comp_cache is None or comp_indices is None:
            raise ValueError("comp_cache and comp_indices must be given together")
        comp_kw = dict(
            comp_cache=comp_cache,
            comp_indices=_rows("comp_indices", comp_indices),
            comp_lens=comp_lens,
            comp_block_size=comp_cache.shape[1],
        )
    sparse_mla_decode(
        q,
        swa_cache,
        _rows("swa_indices", swa_indices),
        swa_lens,
        scale,
        swa_block_size=swa_cache.shape[1],
        scratch=scratch,
        attn_sink=attn_sink,
        out=out,
        policy=policy,
        **comp_kw,  # type: ignore[arg-type]
    )
    return out
