"""The prefill forward of one DeepSeek-V4 attention layer, straight from the FP8 pages.

vLLM 0.32 runs DSV4's sparse prefill as gather (FP8 pages -> bf16 workspace),
combine (workspace rows) and FlashMLA on query heads padded to 64.  Here a
layer's prefill is two steps on the heads it really has:

1. index rows as global cache slots (:func:`dsv4_kernels.build_prefill_indices`):
   the window rows and the C128A rows depend only on the step's metadata, so
   a :class:`PrefillPlan` builds them once (in one launch when both are
   missing) and every later layer of that type reuses them; C4A rows map the
   layer's own indexer top-k (one launch per layer);
2. sparse MLA with sink over those slots (:func:`dsv4_kernels.sparse_mla_paged`),
   writing into the caller's output for the real heads only.

SWA-only and C128A layers take grouped rows where the Hopper kernel consumes
them (:func:`dsv4_kernels.build_grouped_prefill_indices`: neighbouring tokens
share their keys, which are then loaded and dequantised once per group).

Everything is plain tensors: nothing here imports vLLM.  The vLLM layer maps
its metadata to these arguments (``swa_metadata``: ``query_start_loc`` sliced
to the prefill requests, ``prefill_seq_lens``, ``num_prefill_tokens``,
``block_table[num_decodes:]`` and ``block_size`` of the window cache; the
layer's ``attn_metadata``: ``block_table[num_decodes:]`` and ``block_size //
compress_ratio`` of the compressed cache; the indexer's top-k buffer rows of
the prefill tokens; vLLM's C128A row width).

SWA bounded replay (DeepSeek-V4.1: a request's window starts no earlier than a
per-request position, which differs per layer in vLLM's decoder-side replay) is
the ``window_floor`` of each layer.  Not covered; such batches must take vLLM's
own prefill: in-image bidirectional visibility (vLLM's vision variant, whose
window reaches past W and ahead of the token; :class:`PrefillPlan` refuses
``left_visible`` / ``right_visible`` with a ``ValueError``).

:func:`reference_forward_prefill` is the same forward in pure torch: the
reference index rows, then the reference attention, which gathers and
dequantises exactly those slots and computes in float32.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dsv4_kernels import reference as dk_ref
from dsv4_kernels.geometry import SWA_BLOCK_SIZE
from dsv4_kernels.reference import sparse_mla as ref_attention

from .binding import LayerBinding, check_sink
from .prefill_plan import (
    PrefillPlan,
    _check_comp_args,
    _check_ratio,
    has_compressed_rows,
    topk_rows,
)

__all__ = ["PrefillPlan", "forward_prefill", "reference_forward_prefill"]


def _check_layer_args(
    q: torch.Tensor,
    plan: PrefillPlan,
    compress_ratio: int,
    comp_cache: torch.Tensor | None,
    out: torch.Tensor | None,
    topk_indices: torch.Tensor | None = None,
) -> None:
    _check_ratio(compress_ratio)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [T, H, 512] tensor, got {getattr(q, 'shape', type(q))}")
    if q.shape[0] < plan.num_tokens:
        raise ValueError(
            f"q must have at least plan.num_tokens ({plan.num_tokens}) rows, got {q.shape[0]}"
        )
    if has_compressed_rows(compress_ratio, topk_indices) != (comp_cache is not None):
        raise ValueError(
            "comp_cache must be given for compressed (C4A, C128A, V4.1 top-k) layers and None "
            "for SWA-only layers, "
            f"got compress_ratio {compress_ratio} with comp_cache "
            f"{'given' if comp_cache is not None else 'None'}"
        )
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            raise ValueError("out must be a [T, H, 512] tensor")
        if out.shape[0] < plan.num_tokens or tuple(out.shape[1:]) != tuple(q.shape[1:]):
            raise ValueError(
                f"out must be [>= {plan.num_tokens}, {q.shape[1]}, {q.shape[2]}] like q's real "
                f"heads, got {tuple(out.shape)}"
            )


def _prologue(
    q: torch.Tensor,
    plan: PrefillPlan,
    compress_ratio: int,
    comp_cache: torch.Tensor | None,
    out: torch.Tensor | None,
    comp_block_table: torch.Tensor | None,
    comp_block_size: int | None,
    topk_indices: torch.Tensor | None,
    c128a_topk: int | None,
) -> int | None:
    """The checks :func:`forward_prefill` and its reference share; the compressed page size."""
    _check_layer_args(q, plan, compress_ratio, comp_cache, out, topk_indices)
    return _check_comp_args(
        compress_ratio, comp_block_table, comp_block_size, topk_indices, c128a_topk
    )


def _attend(
    attention: Any,
    q: torch.Tensor,
    rows: Any,
    *,
    swa_cache: torch.Tensor,
    scale: float,
    comp_cache: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """Sparse MLA (``attention``: the kernel or its reference) over a layer's rows; the
    rest of ``attention``'s keywords (block sizes, sink, out, lse, grouping) pass through."""
    assert rows.window is not None
    result, _ = attention(
        q, swa_cache, rows.window, rows.window_lens, scale,
        comp_cache=comp_cache, comp_indices=rows.comp, comp_lens=rows.comp_lens, **kwargs,
    )  # fmt: skip
    return result


def forward_prefill(
    q: torch.Tensor,
    plan: PrefillPlan,
    *,
    compress_ratio: int,
    scale: float,
    swa_cache: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_block_size: int = SWA_BLOCK_SIZE,
    comp_cache: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    topk_indices: torch.Tensor | None = None,
    c128a_topk: int | None = None,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    group_size: int | None = None,
    window_floor: torch.Tensor | None = None,
    window_size: int | None = None,
    tiles: dict[str, dict[str, int]] | None = None,
) -> torch.Tensor:
    """Prefill attention of one DSV4 layer on its real heads, reading the FP8 pages.

    Args:
        q: ``[>= T, H, 512]`` bf16 queries of the plan's ``T`` prefill tokens
            (rows past ``T``, e.g. vLLM's padding, are ignored), ``H`` the real
            heads (pass ``q[:, :n_local_heads]`` of vLLM's padded buffer; any
            strides with a unit last one).
        plan: the step's :class:`PrefillPlan`.
        compress_ratio: 1 (SWA-only), 4 (C4A) or 128 (C128A); DeepSeek-V4.1's
            compressed layers pass their own ratio (1 or 2) with ``topk_indices``
            (top-k rows, as C4A's: ``topk_indices`` makes a ratio-1 layer compressed).
        scale: softmax scale (``512 ** -0.5``).
        swa_cache: the layer's window cache, ``[num_pages, 64, 584]`` uint8
            view (any page stride, e.g. vLLM's block-outer views).
        swa_block_table: ``[>= num_reqs, pages]`` int32 window-cache page ids.
        swa_block_size: tokens per window page (64).
        comp_cache: the compressed cache (C4A, C128A), else None.
        comp_block_table: ``[>= num_reqs, pages]`` int32 compressed page ids.
        comp_block_size: entries per compressed page (default ``256 //
            compress_ratio``).
        topk_indices: top-k rows (C4A, V4.1): ``[>= T, index_topk]`` int32
            request-local top-k (token ``t`` at position ``p`` reads its first
            ``min((p + 1) // compress_ratio, index_topk)`` columns).
        c128a_topk: C128A row width (vLLM's ``c128a_prefill_topk_indices.shape[-1]``;
            at least the longest request's ``seq_len // 128``).
        attn_sink: ``[H]`` float32 per-head sink or None.
        out: ``[>= T, H, 512]`` bf16 output for the real heads (e.g.
            ``output[:, :n_local_heads]`` of vLLM's padded buffer); its first
            ``T`` rows are written, nothing else.  Allocated when None.
        lse: optional ``[T, H]`` float32 buffer for the lse (without the sink).
        group_size: SWA-only and C128A layers: tokens per group of grouped rows
            (neighbouring tokens share keys, which the Hopper kernel then loads
            and dequantises once per group); None picks
            :func:`dsv4_kernels.sparse_mla.prefill_group_size` (4 at up to 8
            heads and 2 at 16 on Hopper, else 1: per-token rows).  Top-k rows
            are always per token.
        window_floor: ``[>= num_reqs]`` int32, this layer's first position with window
            KV per request (vLLM's ``prefill_seq_lens - prefill_gather_lens`` of the
            layer's own window metadata); None: the plan's.
        window_size: this layer's sliding window (its ``window_size``); None: the
            plan's.
        tiles: the kernels' tiles (:func:`dsv4_kernels.sparse_mla_paged`'s; a measured
            table's wide head blocks above 16 heads); None: the kernels' defaults.  The
            reference ignores it (tiles never change the result's keys).

    Returns:
        The ``[T, H, 512]`` output (the first ``T`` rows of ``out``).

    Raises:
        ValueError: naming the argument, for a ratio other than 1/2/4/128,
            compressed arguments that do not match the ratio, q/out shapes,
            and everything :func:`dsv4_kernels.build_prefill_indices` and
            :func:`dsv4_kernels.sparse_mla_paged` refuse.
    """
    comp_block_size = _prologue(q, plan, compress_ratio, comp_cache, out, comp_block_table,
                                comp_block_size, topk_indices, c128a_topk)  # fmt: skip
    check_sink(attn_sink, q.shape[1])
    binding = LayerBinding.of_ratio(
        compress_ratio,
        topk_indices is not None,
        name="forward_prefill",
        heads=q.shape[1],
        window_size=plan.window_size if window_size is None else window_size,
        swa_cache=swa_cache,
        swa_block_size=swa_block_size,
        comp_cache=comp_cache,
        comp_block_size=comp_block_size,
        scale=scale,
        q=q,
        group_size=group_size,
        tiles=tiles,
    )
    rows = binding.prefill_rows(
        plan,
        window_block_table=swa_block_table,
        comp_block_table=comp_block_table,
        topk_indices=topk_indices,
        c128a_topk=c128a_topk,
        window_floor=window_floor,
    )
    return binding.prefill(q, out, rows, plan, attn_sink, swa_cache, comp_cache, lse)


_FORWARD = inspect.signature(forward_prefill)


def reference_forward_prefill(q: torch.Tensor, plan: PrefillPlan, **layer: Any) -> torch.Tensor:
    """:func:`forward_prefill` in pure torch (the plan's cached rows unused).

    Takes :func:`forward_prefill`'s keyword arguments, bound by its signature (the
    same defaults; an unknown keyword is a ``TypeError`` naming it), except
    ``group_size``: the reference builds per-token rows.  The reference index
    rows, then the reference attention: the slots are gathered and dequantised
    and the attention is computed in float32, on any device, whatever
    ``TRITON_INTERPRET`` says.
    """
    if "group_size" in layer:
        raise ValueError("group_size: reference_forward_prefill builds per-token rows; omit it")
    a = _FORWARD.bind(q, plan, **layer)
    a.apply_defaults()
    b = a.arguments
    ratio, topk_indices, c128a_topk = b["compress_ratio"], b["topk_indices"], b["c128a_topk"]
    comp_block_size = _prologue(q, plan, ratio, b["comp_cache"], b["out"], b["comp_block_table"],
                                b["comp_block_size"], topk_indices, c128a_topk)  # fmt: skip
    T = plan.num_tokens
    topk = c128a_topk if ratio == 128 else None
    is_topk = topk_rows(ratio, topk_indices)
    if is_topk and topk_indices is not None:
        topk = topk_indices.shape[1]
    floor = plan.window_floor if b["window_floor"] is None else b["window_floor"]
    rows = dk_ref.build_prefill_indices(
        plan.query_start_loc,
        plan.seq_lens,
        num_tokens=T,
        window_block_table=b["swa_block_table"],
        window_block_size=b["swa_block_size"],
        window_size=plan.window_size if b["window_size"] is None else b["window_size"],
        window_floor=floor,
        compress_ratio=ratio,
        comp_block_table=b["comp_block_table"]
        if has_compressed_rows(ratio, topk_indices)
        else None,
        comp_block_size=comp_block_size,
        topk_indices=topk_indices if is_topk else None,
        topk=topk,
    )
    out = b["out"]
    if out is None:
        out = torch.empty((T, *q.shape[1:]), dtype=torch.bfloat16, device=q.device)
    return _attend(
        ref_attention.sparse_mla_paged, q[:T], rows, scale=b["scale"], swa_cache=b["swa_cache"],
        swa_block_size=b["swa_block_size"], attn_sink=b["attn_sink"], comp_cache=b["comp_cache"],
        comp_block_size=comp_block_size, out=out[:T], lse=b["lse"],
    )  # fmt: skip
