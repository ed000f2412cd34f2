"""The head-exact sparse-MLA prefill as a subclass of vLLM's FlashMLA attention layer.

vLLM 0.32 pads DSV4's query heads to 64 for FlashMLA (8 real ones per GPU for
V4-Flash at TP8, 16 for V4-Pro) and feeds its sparse prefill from a bf16
workspace gathered out of the FP8 pages.  The subclass made here keeps
everything of vLLM's class (backends, metadata builders, KV-cache specs,
decode) and overrides only ``_forward_prefill``: where it is measured faster
(``use_head_exact``) it builds the step's global-slot index rows in one launch
per layer type (:func:`dsv4_kernels.build_prefill_indices`) and runs
:func:`dsv4_kernels.sparse_mla_paged` on the real heads straight from the FP8
pages; otherwise it calls vLLM's own ``_forward_prefill``.

The subclass is created from the class vLLM defines at run time (the plugin
checks that class's ``_forward_prefill`` signature first), so this module
imports nothing of vLLM itself.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

ENV_MAX_HEADS = "DSV4_PREFILL_MAX_HEADS"
# Head-exact prefill is used up to this many local query heads.  FlashMLA
# pads to 64, so below 64 it computes 64/H times the useful work; at 64 heads
# nothing is padded and the benchmark decides (docs/attention.md).
DEFAULT_MAX_HEADS = 32

_ROW_CACHE: dict[str, Any] = {"meta": None, "rows": {}}


def max_heads() -> int:
    """Largest local head count that takes the head-exact prefill (``DSV4_PREFILL_MAX_HEADS``)."""
    raw = os.environ.get(ENV_MAX_HEADS, "")
    if not raw.strip():
        return DEFAULT_MAX_HEADS
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_MAX_HEADS} must be an integer, got {raw!r}") from exc
    return value


def use_head_exact(layer: Any, swa_metadata: Any) -> bool:
    """Whether this layer's prefill in this step takes the head-exact path."""
    return (
        int(layer.n_local_heads) <= max_heads()
        and int(layer.compress_ratio) in (1, 4, 128)
        and getattr(swa_metadata, "prefill_left_visible", None) is None
        and getattr(swa_metadata, "prefill_right_visible", None) is None
    )


def _step_rows(swa_metadata: Any, key: tuple[Any, ...], build: Any) -> Any:
    """Rows that depend only on the step's metadata, built once per step and layer type."""
    held = _ROW_CACHE["meta"]
    if held is None or held() is not swa_metadata:
        _ROW_CACHE["meta"] = weakref.ref(swa_metadata)
        _ROW_CACHE["rows"] = {}
    rows = _ROW_CACHE["rows"]
    if key not in rows:
        rows[key] = build()
    return rows[key]


def head_exact_prefill(
    layer: Any,
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor | None,
    swa_k_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: Any,
    swa_metadata: Any,
) -> None:
    """vLLM's ``_forward_prefill`` inputs -> index rows -> attention on the real heads.

    ``q`` and ``output`` are the prefill tokens' ``[T, padded_heads, 512]``
    slices; only the first ``layer.n_local_heads`` heads are computed and
    written (vLLM drops the padded ones after attention).
    """
    import dsv4_kernels as dk

    num_decodes = int(swa_metadata.num_decodes)
    num_decode_tokens = int(swa_metadata.num_decode_tokens)
    num_tokens = int(swa_metadata.num_prefill_tokens)
    num_prefills = int(swa_metadata.num_prefills)
    query_start_loc = swa_metadata.query_start_loc[num_decodes : num_decodes + num_prefills + 1]
    seq_lens = swa_metadata.prefill_seq_lens
    window_table = swa_metadata.block_table[num_decodes:]
    window_block_size = int(swa_metadata.block_size)
    window_size = int(layer.window_size)
    ratio = int(layer.compress_ratio)

    window = _step_rows(
        swa_metadata,
        ("window", window_size, window_block_size),
        lambda: dk.build_prefill_indices(
            query_start_loc,
            seq_lens,
            num_tokens=num_tokens,
            window_block_table=window_table,
            window_block_size=window_block_size,
            window_size=window_size,
        ),
    )
    comp_cache = comp_rows = comp_lens = comp_block_size = None
    if ratio > 1:
        comp_block_size = int(attn_metadata.block_size) // ratio
        comp_table = attn_metadata.block_table[num_decodes:]
        if ratio == 4:
            topk_indices = layer.topk_indices_buffer[num_decode_tokens:][:num_tokens]
            comp = dk.build_prefill_indices(
                query_start_loc,
                seq_lens,
                num_tokens=num_tokens,
                compress_ratio=4,
                comp_block_table=comp_table,
                comp_block_size=comp_block_size,
                topk_indices=topk_indices,
            )
        else:
            topk = int(attn_metadata.c128a_prefill_topk_indices.shape[-1])
            comp = _step_rows(
                swa_metadata,
                ("c128a", topk, comp_block_size),
                lambda: dk.build_prefill_indices(
                    query_start_loc,
                    seq_lens,
                    num_tokens=num_tokens,
                    compress_ratio=128,
                    comp_block_table=comp_table,
                    comp_block_size=comp_block_size,
                    topk=topk,
                ),
            )
        comp_cache, comp_rows, comp_lens = compressed_k_cache, comp.comp, comp.comp_lens

    heads = int(layer.n_local_heads)
    out, _ = dk.sparse_mla_paged(
        q[:, :heads],
        swa_k_cache,
        window.window,
        window.window_lens,
        float(layer.scale),
        swa_block_size=window_block_size,
        attn_sink=layer.attn_sink[:heads],
        comp_cache=comp_cache,
        comp_indices=comp_rows,
        comp_lens=comp_lens,
        comp_block_size=comp_block_size,
    )
    output[:, :heads].copy_(out)


def make_head_exact_attention_cls(base: type) -> type:
    """A subclass of vLLM's ``DeepseekV4FlashMLAAttention`` with the head-exact prefill."""

    def _forward_prefill(
        self: Any,
        q: torch.Tensor,
        positions: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        swa_metadata: Any,
    ) -> None:
        if not use_head_exact(self, swa_metadata):
            base._forward_prefill(  # type: ignore[attr-defined]
                self,
                q=q,
                positions=positions,
                compressed_k_cache=compressed_k_cache,
                swa_k_cache=swa_k_cache,
                output=output,
                attn_metadata=attn_metadata,
                swa_metadata=swa_metadata,
            )
            return
        head_exact_prefill(
            self, q, compressed_k_cache, swa_k_cache, output, attn_metadata, swa_metadata
        )

    _forward_prefill.__doc__ = (
        "Head-exact sparse-MLA prefill from the FP8 pages where measured faster, else vLLM's own."
    )
    return type(
        "Dsv4HeadExactFlashMLAAttention",
        (base,),
        {
            "__doc__": "vLLM's FlashMLA DSV4 attention with dsv4-attention's head-exact prefill.",
            "__module__": __name__,
            "_forward_prefill": _forward_prefill,
        },
    )
