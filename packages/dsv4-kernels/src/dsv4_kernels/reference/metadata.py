"""Pure-torch references for the sparse-attention metadata kernels.

Same signatures and results as :mod:`dsv4_kernels.metadata`, vectorised over
tokens (no Python loop per token).  They run on any device and are what CPU
tensors use unless Triton's interpreter is on.  Validation is the public
wrappers' job: call these through ``dsv4_kernels`` for checked inputs.
"""

from __future__ import annotations

import torch

from ..geometry import combined_width


def _token_requests(
    query_start_loc: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(request of each token, rebased query_start_loc, token ids) as int64."""
    qsl = query_start_loc.long() - query_start_loc[:1].long()
    t = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    return req.clamp_(max=max(qsl.shape[0] - 2, 0)), qsl, t


def combine_topk_swa_indices(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
    *,
    lens_out: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`dsv4_kernels.combine_topk_swa_indices` (same contract)."""
    if isinstance(out, (tuple, list)):
        out, lens_out = out
    device = query_start_loc.device
    width = combined_width(topk, window_size, max_image_tokens)
    if num_tokens is None and topk_indices is not None:
        num_tokens = topk_indices.shape[0]
    elif num_tokens is None and left_visible is not None:
        num_tokens = left_visible.shape[0]
    elif num_tokens is None and out is not None:
        num_tokens = out.shape[0]
    elif num_tokens is None:
        num_tokens = int(query_start_loc[-1].item() - query_start_loc[0].item())
    if out is None:
        out = torch.empty((num_tokens, width), dtype=torch.int32, device=device)
    out = out[:num_tokens]
    if lens_out is not None:
        lens_out = lens_out[:num_tokens]
    if lens_out is None:
        lens_out = torch.empty((num_tokens,), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return out, lens_out

    req, qsl, t = _token_requests(query_start_loc, num_tokens)
    seq = seq_lens.long()[req]
    q_start, q_end = qsl[req], qsl[req + 1]
    pos = seq - (q_end - q_start) + (t - q_start)
    if compress_ratio > 1 or topk_indices is not None:  # V4.1's full-length rows at ratio 1
        topk_len = torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp(0, topk)
    else:
        topk_len = torch.zeros_like(pos)
    w = window_size
    if left_visible is not None and right_visible is not None:
        left, right = left_visible.long(), right_visible.long()
        swa_start = (pos - (w - 1) - (left - (w - 1)).clamp(min=0)).clamp(min=0)
        swa_len = (pos + right - swa_start + 1).clamp(min=0)
    else:
        swa_start = (pos - (w - 1)).clamp(min=0)
        swa_len = torch.minimum(pos + 1, torch.full_like(pos, w)).clamp(min=0)
    total = topk_len + swa_len

    base = req * M
    j = torch.arange(width, device=device)[None, :]
    if topk_indices is not None and topk > 0:
        local = torch.full((num_tokens, width), -1, dtype=torch.long, device=device)
        k = min(topk, width)
        local[:, :k] = topk_indices[:, :k].long()
    else:
        local = j.expand(num_tokens, width)
    top = torch.where(local >= 0, base[:, None] + local, -1)
    swa = (base + N + swa_start - (seq - gather_lens.long()[req]))[:, None] + (
        j - topk_len[:, None]
    )
    value = torch.where(
        j < topk_len[:, None], top, torch.where(j < total[:, None], swa, torch.full_like(swa, -1))
    )
    out.copy_(value)
    return out, lens_out.copy_(total)


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`dsv4_kernels.compute_global_topk_indices_and_lens`."""
    local = topk_indices.long()
    num_tokens = local.shape[0]
    valid_tok = (is_valid_token[:num_tokens] != 0)[:, None]
    page = torch.div(local, block_size, rounding_mode="floor")
    num_pages = block_table.shape[1]
    live = valid_tok & (local >= 0) & (page < num_pages)
    req = token_to_req_indices[:num_tokens].long()
    # Gather only where live: dead entries read page 0 of row 0 (if any) and are masked.
    safe_req = torch.where(valid_tok, req[:, None], 0).expand_as(local)
    safe_page = torch.where(live, page, 0)
    if block_table.numel() > 0:
        blocks = block_table.long()[safe_req, safe_page]
    else:
        blocks = torch.zeros_like(local)
    slot = blocks * block_size + (local - page * block_size)
    result = torch.where(live, slot, -1)
    lens = live.sum(dim=1)
    if out is None:
        out = torch.empty(result.shape, dtype=torch.int32, device=result.device)
    if lens_out is None:
        lens_out = torch.empty(lens.shape, dtype=torch.int32, device=lens.device)
    return out.copy_(result), lens_out.copy_(lens)
