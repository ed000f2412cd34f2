"""Pure-torch reference of :func:`dsv4_kernels.sparse_mla_decode` (same signature).

The decode computes exactly what :func:`dsv4_kernels.reference.sparse_mla_paged`
computes (float32 math over the indexed keys); the split over keys and the
combine are how the kernels schedule it, not part of the result.  The scratch
and the split count are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import torch

from .sparse_mla import sparse_mla_paged

__all__ = ["sparse_mla_decode"]


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    scale: float,
    *,
    swa_block_size: int,
    scratch: Any = None,
    attn_sink: torch.Tensor | None = None,
    comp_cache: torch.Tensor | None = None,
    comp_indices: torch.Tensor | None = None,
    comp_lens: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv4_kernels.sparse_mla_decode` (``scratch`` and
    ``num_splits`` unused)."""
    del scratch, num_splits
    return sparse_mla_paged(
        q,
        swa_cache,
        swa_indices,
        swa_lens,
        scale,
        swa_block_size=swa_block_size,
        attn_sink=attn_sink,
        comp_cache=comp_cache,
        comp_indices=comp_indices,
        comp_lens=comp_lens,
        comp_block_size=comp_block_size,
        out=out,
        lse=lse,
    )
