"""Host-side checks of the sparse MLA wrappers' arguments (:mod:`.sparse_mla`, and the
decode's :mod:`.decode`; the paged keys' checks, built on these, are
:func:`._paged_keys.check_paged_keys`): shapes, dtypes, devices and Python ints only,
never a GPU synchronisation; each failure is a ``ValueError`` naming the argument."""

from __future__ import annotations

import math

import torch

from ._validation import check_out, check_positive_int, check_tensor
from .geometry import HEAD_DIM, NOPE_DIM
from .reference.prefill_indices import BlockRows

MAX_HEADS = 128

# Grouped rows as the launchers take them: (leads, group size, window starts, comp starts).
_Grouping = tuple[torch.Tensor, int, "torch.Tensor | None", "torch.Tensor | None"]


def _check_q(q: object) -> torch.Tensor:
    q = check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    if q.shape[2] != HEAD_DIM:
        raise ValueError(
            f"q must be [num_tokens, num_heads, {HEAD_DIM}] (head size {HEAD_DIM}: "
            f"{NOPE_DIM} nope + {HEAD_DIM - NOPE_DIM} rope), got shape {tuple(q.shape)}"
        )
    if not 1 <= q.shape[1] <= MAX_HEADS:
        raise ValueError(f"q must have 1 to {MAX_HEADS} heads, got {q.shape[1]}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    return q


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return float(scale)


def _check_rows(
    name: str,
    indices: object,
    lens_name: str,
    lens: object,
    num_tokens: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = check_tensor(name, indices, dtype=torch.int32, ndim=2, device=device)
    if idx.shape[0] != num_tokens:
        raise ValueError(
            f"{name} must have {num_tokens} rows (one per query token, like q), got {idx.shape[0]}"
        )
    if idx.shape[1] > 1 and idx.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if lens is None:
        return idx, None
    return idx, _check_lens(lens_name, lens, num_tokens, device)


def _check_lens(
    lens_name: str, lens: object, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """A row source's ``[T]`` int32 lengths."""
    ln = check_tensor(lens_name, lens, dtype=torch.int32, ndim=1, device=device)
    if ln.shape[0] != num_tokens:
        raise ValueError(
            f"{lens_name} must have {num_tokens} entries (one per query token), got {ln.shape[0]}"
        )
    return ln


def _check_block_rows(
    name: str,
    rows: BlockRows,
    lens_name: str,
    lens: object,
    num_tokens: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A :class:`~dsv4_kernels.BlockRows` argument: (block table, requests, lengths)."""
    table = check_tensor(f"{name}.block_table", rows.block_table, dtype=torch.int32, ndim=2,
                         device=device)  # fmt: skip
    if table.shape[1] > 1 and table.stride(1) != 1:
        raise ValueError(f"{name}.block_table must be contiguous in its last dimension")
    req = check_tensor(f"{name}.req", rows.req, dtype=torch.int32, ndim=1, device=device)
    if req.shape[0] < num_tokens:
        raise ValueError(
            f"{name}.req must have >= {num_tokens} entries (one per query token), got "
            f"{req.shape[0]}"
        )
    if lens is None:
        raise ValueError(
            f"{lens_name} is needed with BlockRows (how many entries each token reads)"
        )
    return table, req[:num_tokens], _check_lens(lens_name, lens, num_tokens, device)


def _check_sink_and_outputs(
    q: torch.Tensor,
    attn_sink: object,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    sink = None
    if attn_sink is not None:
        sink = check_tensor("attn_sink", attn_sink, dtype=torch.float32, ndim=1, device=q.device)
        if sink.shape[0] != H:
            raise ValueError(f"attn_sink must have {H} entries (one per head), got {sink.shape[0]}")
    check_out("out", out, (T, H, HEAD_DIM), torch.bfloat16, q.device)
    check_out("lse", lse, (T, H), torch.float32, q.device)
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return sink, out, lse


def _check_groups(
    leads: object,
    group_size: object,
    swa_starts: object,
    comp_starts: object,
    has_comp: bool,
    num_tokens: int,
    device: torch.device,
) -> _Grouping | None:
    """Validate the grouped-rows arguments (no synchronisation); None without leads."""
    if leads is None:
        for name, v in (("swa_starts", swa_starts), ("comp_starts", comp_starts)):
            if v is not None:
                raise ValueError(f"{name} is only meaningful with leads (grouped rows)")
        return None
    size = check_positive_int("group_size", group_size)
    g = check_tensor("leads", leads, dtype=torch.int32, ndim=1, device=device)
    if g.shape[0] != num_tokens:
        raise ValueError(
            f"leads must have {num_tokens} entries (one per query token), got {g.shape[0]}"
        )
    if comp_starts is not None and not has_comp:
        raise ValueError("comp_starts given without comp_cache / comp_indices")
    starts = []
    for name, v in (("swa_starts", swa_starts), ("comp_starts", comp_starts)):
        if v is not None:
            v = check_tensor(name, v, dtype=torch.int32, ndim=1, device=device)
            if v.shape[0] != num_tokens:
                raise ValueError(
                    f"{name} must have {num_tokens} entries (one per query token), got {v.shape[0]}"
                )
        starts.append(v)
    return (g, size, starts[0], starts[1])
