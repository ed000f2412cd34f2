"""vLLM's ``_forward_prefill`` / ``_forward_decode`` / indexer arguments mapped to our forwards.

Pure argument mapping, no decisions and no state: the runtime
(``dsv4_attention.runtime``) decides whether to call these and owns the plan,
the scratch and each layer's :class:`~dsv4_attention.binding.LayerBinding` (its
caches checked against vLLM's metadata once, its page sizes, rows, heads and
window).  Here vLLM's metadata becomes the layer's rows for a step, and the
binding runs with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_kernels.geometry import WINDOW_SIZE, RowKind

from .binding import DecodeRows, LayerBinding
from .facts import IndexerFacts, LayerFacts
from .prefill_plan import PrefillPlan

__all__ = [
    "IndexerStep",
    "cache_layout_problem",
    "decode_rows",
    "indexer_step",
    "prefill_batch",
    "prefill_plan",
    "run_decode",
    "run_indexer",
    "run_prefill",
    "window_floor",
]

# vLLM's names of the cache dtype whose pages are the UE8M0 layout our kernels read
DSV4_CACHE_DTYPES = ("fp8_ds_mla", "fp8")


def cache_layout_problem(facts: LayerFacts, cache: Any, slots: int | None, what: str) -> str | None:
    """Why ``cache`` is not a DSV4 FP8 (UE8M0, 584 bytes a token) page view of ``slots``
    entries per page (vLLM's metadata block size), or None when it is."""
    from dsv4_kernels.geometry import TOKEN_BYTES, page_stride_bytes

    if not isinstance(cache, torch.Tensor):
        return f"the {what} cache is {type(cache).__name__}, not a tensor"
    if cache.dtype != torch.uint8 or cache.dim() != 3:
        return f"the {what} cache is {cache.dtype} {tuple(cache.shape)}, not a uint8 page view"
    if slots is None or cache.shape[1] != slots or cache.shape[2] != TOKEN_BYTES:
        return (
            f"the {what} cache pages are {tuple(cache.shape[1:])}, expected ({slots}, "
            f"{TOKEN_BYTES}) (DSV4's UE8M0 layout, {TOKEN_BYTES} bytes a token)"
        )
    if cache.stride(2) != 1 or cache.stride(1) != TOKEN_BYTES:
        return f"the {what} cache has strides {cache.stride()}, not packed {TOKEN_BYTES}-byte rows"
    if cache.shape[0] > 1 and cache.stride(0) < page_stride_bytes(slots):
        return (
            f"the {what} cache's page stride {cache.stride(0)} is smaller than a page "
            f"({page_stride_bytes(slots)} bytes)"
        )
    if facts.kv_cache_dtype is not None and facts.kv_cache_dtype not in DSV4_CACHE_DTYPES:
        return f"kv_cache_dtype {facts.kv_cache_dtype!r} is not one of {DSV4_CACHE_DTYPES}"
    return None


def prefill_batch(swa_metadata: Any) -> tuple[int, int, int]:
    """The prefill batch a window metadata object describes, from its host fields:
    (decode requests, prefill requests, prefill tokens).  Every metadata object of one
    forward context is built from the same batch; a plan is reused only for these."""
    return (
        int(swa_metadata.num_decodes),
        int(swa_metadata.num_prefills),
        int(swa_metadata.num_prefill_tokens),
    )


def prefill_plan(swa_metadata: Any, scratch: Any) -> PrefillPlan:
    """The step's plan from vLLM's window metadata (any group's: they share the batch).
    Each layer passes its own window floor (:func:`window_floor`) and window to
    :meth:`PrefillPlan.layer_rows`; the plan's window is the widest the scratch holds."""
    num_decodes, num_prefills, num_tokens = prefill_batch(swa_metadata)
    return PrefillPlan(
        swa_metadata.query_start_loc[num_decodes : num_decodes + num_prefills + 1],
        swa_metadata.prefill_seq_lens,
        num_tokens=num_tokens,
        scratch=scratch,
        window_size=WINDOW_SIZE if scratch is None else int(scratch.spec.window_size),
    )


def window_floor(swa_metadata: Any) -> torch.Tensor | None:
    """The first position of each prefill request holding window KV, as this window
    metadata object bounds it: vLLM's window region is a request's last
    ``prefill_gather_lens`` tokens, so ``prefill_seq_lens - prefill_gather_lens``.
    With SWA bounded replay (V4.1) that is the request's replay start, and in vLLM's
    decoder-side replay each replay layer's own (the first layer's from the batch's
    replay start, every later one's from ``max(replay_start, seq - window)``); without
    it the floor is below every token's window.  None where vLLM gives no gather
    lengths.  One small device op; the runtime computes it once per metadata object."""
    gather = getattr(swa_metadata, "prefill_gather_lens", None)
    if gather is None:
        return None
    n = int(swa_metadata.num_prefills)
    return (swa_metadata.prefill_seq_lens[:n] - gather[:n]).to(torch.int32)


def run_prefill(
    layer: Any,
    binding: LayerBinding,
    plan: PrefillPlan,
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor | None,
    swa_k_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: Any,
    swa_metadata: Any,
    floor: torch.Tensor | None = None,
) -> None:
    """vLLM's ``_forward_prefill`` step -> this layer's rows -> its binding's attention.

    The rows come from the layer's own metadata: its window block table and window
    floor (``floor``, :func:`window_floor` of its own ``swa_metadata``), its compressed
    block table and its top-k rows (the layer's slice of the indexer's buffer) or
    vLLM's C128A row width.  ``q`` and ``output`` are vLLM's padded
    ``[T, padded_heads, 512]`` prefill slices; only the real heads are computed and
    written (vLLM drops the padded ones after attention)."""
    num_decodes = int(swa_metadata.num_decodes)
    comp: dict[str, Any] = {}
    if binding.rows is RowKind.TOPK:  # C4A, V4.1's ratio-1 and ratio-2 layers
        num_decode_tokens = int(swa_metadata.num_decode_tokens)
        comp["comp_block_table"] = attn_metadata.block_table[num_decodes:]
        comp["topk_indices"] = layer.topk_indices_buffer[num_decode_tokens:]
    elif binding.rows is RowKind.ALL:  # C128A
        comp["comp_block_table"] = attn_metadata.block_table[num_decodes:]
        comp["c128a_topk"] = int(attn_metadata.c128a_prefill_topk_indices.shape[-1])
    rows = binding.prefill_rows(
        plan,
        window_block_table=swa_metadata.block_table[num_decodes:],
        window_floor=floor,
        **comp,
    )
    binding.prefill(q, output, rows, plan, layer.attn_sink, swa_k_cache, compressed_k_cache)


def decode_rows(
    layer: Any,
    binding: LayerBinding,
    swa_metadata: Any,
    attn_metadata: Any,
    swa_only: bool,
    global_topk: Any,
) -> DecodeRows:
    """This layer's rows of vLLM's decode step: the window rows of its own window
    metadata and, for a compressed layer, its top-k mapped to cache slots as vLLM maps
    them (``global_topk``: vLLM's ``compute_global_topk_indices_and_lens`` as its method
    looks it up) or vLLM's C128A rows.  ``ValueError`` where vLLM's ``swa_only`` and the
    layer's rows disagree."""
    if swa_only != (binding.comp is None):
        raise ValueError(
            f"{binding.name}: vLLM calls its decode with swa_only={swa_only}, but its rows "
            f"are {binding.rows.name}"
        )
    num_tokens = int(swa_metadata.num_decode_tokens)
    indices = lens = None
    if binding.comp is not None and binding.rows is RowKind.TOPK:
        indices, lens = global_topk(
            layer.topk_indices_buffer[:num_tokens],
            swa_metadata.token_to_req_indices,
            attn_metadata.block_table[: int(swa_metadata.num_decodes)],
            binding.comp.page_size,
            swa_metadata.is_valid_token[:num_tokens],
        )
    elif binding.comp is not None:
        indices = attn_metadata.c128a_global_decode_topk_indices[:num_tokens]
        lens = attn_metadata.c128a_decode_topk_lens[:num_tokens]
    return DecodeRows(
        swa_metadata.decode_swa_indices[:num_tokens],
        swa_metadata.decode_swa_lens[:num_tokens],
        indices,
        lens,
    )


def run_decode(
    layer: Any,
    binding: LayerBinding,
    q: torch.Tensor,
    kv_cache: torch.Tensor | None,
    swa_metadata: Any,
    attn_metadata: Any,
    swa_only: bool,
    output: torch.Tensor,
    scratch: Any,
    global_topk: Any,
    kernel_policy: Mapping[str, int] | None = None,
) -> None:
    """vLLM's ``_forward_decode`` step -> this layer's rows (:func:`decode_rows`) -> its
    binding's decode on the real heads, into ``output`` in place (the padded heads are
    left as they are); ``kernel_policy``: the measured table's launch entries for this
    head count."""
    rows = decode_rows(layer, binding, swa_metadata, attn_metadata, swa_only, global_topk)
    binding.decode(q, output, rows, scratch, layer.attn_sink, layer.swa_cache_layer.kv_cache,
                   kv_cache, kernel_policy)  # fmt: skip


@dataclass(frozen=True)
class IndexerStep:
    """A decode-only step of one indexer as vLLM's indexer metadata describes it: ``rows``
    query rows, ``rows_per_request`` of each request in order (vLLM's uniform batches;
    1 where it flattened MTP rows, each with its own block-table row), each row's valid
    compressed entries (``lens``, a view of vLLM's ``seq_lens``) and the block table."""

    rows: int
    rows_per_request: int
    lens: torch.Tensor
    block_table: torch.Tensor


def indexer_step(indexer_op: Any, attn_metadata: Any) -> IndexerStep | None:
    """The decode step ``indexer_op`` (vLLM's ``SparseAttnIndexer``) is called for, read from
    its own metadata in the step's dict; None where the step is not one ours runs (a
    prefill in it, vLLM's padded/varlen/DCP decode layouts), so vLLM's op runs.  Host
    facts only: no device read."""
    if not isinstance(attn_metadata, dict):
        return None
    meta: Any = attn_metadata.get(indexer_op.k_cache.prefix)
    decode = getattr(meta, "decode", None)
    if (
        meta is None
        or decode is None
        or int(getattr(meta, "num_prefills", 1))
        or not int(meta.num_decodes)
    ):
        return None
    if bool(getattr(decode, "requires_padding", True)):
        return None  # vLLM packs the rows and unpacks its top-k
    if getattr(decode, "indices", None) is not None:
        return None  # the varlen layout (SM100)
    if getattr(decode, "global_seq_lens", None) is not None:
        return None  # DCP
    rows = int(meta.num_decode_tokens)
    requests = int(decode.decode_lens.shape[0])
    if rows <= 0 or requests <= 0 or rows % requests:
        return None
    seq_lens = decode.seq_lens[:requests]
    if seq_lens.numel() != rows or not seq_lens.is_contiguous():
        return None
    if decode.block_table.shape[0] < requests:
        return None
    return IndexerStep(rows, rows // requests, seq_lens.view(-1), decode.block_table)


def run_indexer(
    facts: IndexerFacts,
    step: IndexerStep,
    indexer_op: Any,
    q: torch.Tensor,
    weights: torch.Tensor,
    padded_rows: int,
    scores: torch.Tensor,
) -> None:
    """Our decode indexer for ``step`` into vLLM's top-k buffer: its first ``step.rows``
    rows get their top-k (request-local positions, -1 after a row's entries), rows up to
    ``padded_rows`` (the step's padded tokens, which vLLM clears) get -1."""
    from dsv4_kernels import indexer_decode_topk

    indexer_decode_topk(
        q[: step.rows],
        weights,
        indexer_op.k_cache.kv_cache,
        step.lens,
        None,
        step.block_table,
        facts.topk,
        indexer_op.topk_indices_buffer,
        max_entries=facts.max_entries,
        scores=scores,
        rows_per_request=step.rows_per_request,
        clear_rows=padded_rows,
    )
