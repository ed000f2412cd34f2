"""Slow, loop-per-token references written straight from docs/design.md's kernel contracts.

Independent of ``dsv4_kernels.reference`` (which is vectorised): the tests
compare both the Triton kernels and the vectorised reference against these.
"""

from __future__ import annotations

import math

import torch


def combined_width(topk: int, window: int, max_image_tokens: int) -> int:
    return math.ceil((topk + window + max_image_tokens) / 128) * 128


def spec_combine(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window: int,
    ratio: int,
    topk: int,
    M: int,
    N: int,
    num_tokens: int,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    max_image_tokens: int = 0,
) -> tuple[list[list[int]], list[int]]:
    qsl = [int(v) - int(query_start_loc[0]) for v in query_start_loc.tolist()]
    width = combined_width(topk, window, max_image_tokens)
    rows: list[list[int]] = []
    lens: list[int] = []
    for t in range(num_tokens):
        b = next(i for i in range(len(qsl) - 1) if qsl[i] <= t < qsl[i + 1])
        seq_len = int(seq_lens[b])
        q_len = qsl[b + 1] - qsl[b]
        pos = seq_len - q_len + (t - qsl[b])
        gather_start = seq_len - int(gather_lens[b])
        topk_len = min(max((pos + 1) // ratio, 0), topk) if ratio > 1 or topk else 0
        if left is None:
            swa_start = max(pos - (window - 1), 0)
            swa_len = max(min(pos + 1, window), 0)
        else:
            lv, rv = int(left[t]), int(right[t])  # type: ignore[index]
            swa_start = max(pos - (window - 1) - max(lv - (window - 1), 0), 0)
            swa_len = max(pos + rv - swa_start + 1, 0)
        row = [-1] * width
        for j in range(width):
            if j < topk_len:
                local = int(topk_indices[t, j]) if topk_indices is not None else j
                row[j] = b * M + local if local >= 0 else -1
            elif j < topk_len + swa_len:
                row[j] = b * M + N + swa_start - gather_start + (j - topk_len)
        rows.append(row)
        lens.append(topk_len + swa_len)
    return rows, lens


def spec_global(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid: torch.Tensor,
) -> tuple[list[list[int]], list[int]]:
    rows: list[list[int]] = []
    lens: list[int] = []
    pages = block_table.shape[1]
    for t in range(topk_indices.shape[0]):
        row = []
        for local in topk_indices[t].tolist():
            if bool(is_valid[t]) and local >= 0 and local // block_size < pages:
                req = int(token_to_req[t])
                row.append(
                    int(block_table[req, local // block_size]) * block_size + local % block_size
                )
            else:
                row.append(-1)
        rows.append(row)
        lens.append(sum(v != -1 for v in row))
    return rows, lens
