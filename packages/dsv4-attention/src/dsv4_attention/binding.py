"""One layer's binding: what is fixed for the run, checked once; each step passes rows.

A :class:`LayerBinding` is made when a layer's caches are first seen (the plugin:
at the layer's first step with metadata, again only if vLLM binds other cache
views) and holds what does not change from step to step:

* the window cache's and the compressed cache's page layouts, checked once as the
  kernels' typed page views (:class:`dsv4_kernels.PageView`); each call hands the
  kernels a view of the caches vLLM passes with that layout, which no kernel checks
  again (the binding holds no tensor, so no KV cache is kept alive by it);
* the layer's rows (:class:`dsv4_kernels.geometry.RowKind`: window only, the
  indexer's top-k, or every compressed entry), the ratio its kernels take, its
  real heads, its own window and the prefill's rows grouping on this GPU;
* its softmax scale.

Each step then builds the layer's rows from that layer's own metadata
(:meth:`LayerBinding.prefill_rows` through the step's
:class:`~dsv4_attention.prefill_plan.PrefillPlan`, which caches them by everything
that makes rows differ; :class:`DecodeRows` for a decode), and the binding runs
with ``q``, ``out``, the rows and the layer's sink.  The sink is read from the
layer per call (a weight: vLLM may load new weights into the layer), and the
scratch is the engine's (one for every layer, released as one), so neither is
held here.

Nothing here imports vLLM: :mod:`dsv4_attention.vllm_calls` maps vLLM's metadata
to rows, :func:`dsv4_attention.prefill.forward_prefill` and
:func:`dsv4_attention.decode.forward_decode` make a binding from plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import dsv4_kernels as dk
from dsv4_kernels import PageView
from dsv4_kernels.geometry import RowKind, row_kind

from .prefill_plan import PrefillPlan

__all__ = ["DecodeRows", "LayerBinding", "Pages", "check_sink"]


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's rows of a layer: the window slots and lengths (vLLM's
    ``decode_swa_indices`` / ``decode_swa_lens``; ``[T, K]`` or vLLM's ``[T, 1, K]``),
    and for a compressed layer its global compressed slots and lengths."""

    window: torch.Tensor
    window_lens: torch.Tensor
    comp: torch.Tensor | None = None
    comp_lens: torch.Tensor | None = None


def _rows(name: str, x: torch.Tensor | None) -> torch.Tensor | None:
    """vLLM's ``[T, 1, K]`` index rows as ``[T, K]`` (a view)."""
    if x is not None and x.dim() == 3:
        if x.shape[1] != 1:
            raise ValueError(f"{name} must be [T, K] or [T, 1, K], got shape {tuple(x.shape)}")
        return x[:, 0]
    return x


def check_sink(attn_sink: object, heads: int) -> None:
    """A sink given to the plain-tensor forwards must have one entry per head of ``q``
    (the binding takes the first ``heads`` of vLLM's layer sink)."""
    shape = getattr(attn_sink, "shape", None)
    if attn_sink is not None and (shape is None or len(shape) != 1 or shape[0] != heads):
        raise ValueError(
            f"attn_sink must have {heads} entries (one per head), got "
            f"{tuple(shape) if shape is not None else type(attn_sink).__name__}"
        )


@dataclass(frozen=True)
class Pages:
    """A cache's checked page layout (:class:`dsv4_kernels.PageView`'s numbers, without
    the tensor): slots per page, bytes between pages, slots in the cache."""

    page_size: int
    page_stride: int
    num_slots: int

    @classmethod
    def of(cls, view: PageView) -> Pages:
        return cls(view.page_size, view.page_stride, view.num_slots)

    def over(self, cache: torch.Tensor) -> PageView:
        """The kernels' page view of ``cache``, the tensor this layout was checked on (or
        one of the same memory, shape and strides), without checking it again."""
        return PageView(cache, self.page_size, self.page_stride, self.num_slots)


@dataclass(frozen=True)
class LayerBinding:
    """What one layer runs with for the whole run (module docstring); make it with
    :meth:`bind`.  It holds no tensor: the caches are passed with each call (vLLM passes
    them to the layer's methods), so a KV cache vLLM frees or re-allocates is never
    kept alive here; the runtime finds a layer's binding by its caches' memory, shape
    and strides, so the caches passed are the ones it was made for."""

    name: str
    rows: RowKind
    ratio: int  # the compress_ratio the kernels take (1 for window-only layers)
    heads: int
    window_size: int
    window: Pages
    comp: Pages | None
    scale: float
    group_size: int  # prefill tokens per group of grouped rows (1: per-token rows)
    # the prefill's tiles (``sparse_mla_paged(tiles=...)``: a measured table's wide head
    # blocks above 16 heads); None: the kernels' defaults
    tiles: Mapping[str, Mapping[str, int]] | None = None

    @classmethod
    def bind(
        cls,
        *,
        name: str,
        rows: RowKind,
        ratio: int,
        heads: int,
        window_size: int,
        swa_cache: torch.Tensor,
        swa_block_size: int,
        comp_cache: torch.Tensor | None,
        comp_block_size: int | None,
        scale: float,
        q: torch.Tensor,
        group_size: int | None = None,
        tiles: Mapping[str, Mapping[str, int]] | None = None,
    ) -> LayerBinding:
        """The binding of one layer's caches; a ``ValueError`` naming the argument when
        a cache is not a DSV4 FP8 page view of its block size on ``q``'s device, or the
        caches do not match the rows (a compressed cache for window-only rows, or none
        for compressed ones).  ``q``: a query of the layer (its device is the caches'
        and the kernels'; it is only looked at).  ``group_size``: None picks the
        kernels' prefill grouping for ``heads`` there
        (:func:`dsv4_kernels.sparse_mla.prefill_group_size`; top-k rows are always per
        token).  ``tiles``: the prefill's tiles (a measured table's wide head blocks;
        None: the kernels' defaults)."""
        if rows.compressed != (comp_cache is not None):
            raise ValueError(
                f"comp_cache must be given for compressed rows and None for window-only "
                f"rows: {name} has {rows.name} rows and comp_cache "
                f"{'given' if comp_cache is not None else 'None'}"
            )
        if not 1 <= heads <= 128:
            raise ValueError(f"heads must be 1 to 128, got {heads}")
        window = PageView.check(swa_cache, swa_block_size, "swa_cache", q.device, "swa_block_size")
        comp = None
        if comp_cache is not None:
            if comp_block_size is None:
                raise ValueError(f"comp_block_size is needed with comp_cache ({name})")
            comp = PageView.check(
                comp_cache, comp_block_size, "comp_cache", q.device, "comp_block_size"
            )
        if group_size is None:
            group_size = 1
            if rows is not RowKind.TOPK:
                group_size = dk.sparse_mla.prefill_group_size(q[:1, :heads], tiles)
        return cls(
            name,
            rows,
            ratio,
            heads,
            int(window_size),
            Pages.of(window),
            None if comp is None else Pages.of(comp),
            float(scale),
            group_size,
            None if tiles is None else {k: dict(v) for k, v in tiles.items()},
        )

    @classmethod
    def of_ratio(cls, compress_ratio: int, has_topk: bool, **kwargs: Any) -> LayerBinding:
        """:meth:`bind` for a layer known by the kernels' ``compress_ratio`` (1, 2, 4 or
        128; ``has_topk``: its compressed rows are the indexer's top-k)."""
        rows = row_kind(compress_ratio, has_topk)
        ratio = 1 if rows is RowKind.WINDOW else compress_ratio
        return cls.bind(rows=rows, ratio=ratio, **kwargs)

    def _comp_view(self, comp_cache: torch.Tensor | None) -> PageView | None:
        if self.comp is None:
            return None
        if comp_cache is None:
            raise ValueError(f"comp_cache must be given: {self.name} has {self.rows.name} rows")
        return self.comp.over(comp_cache)

    # --- prefill ------------------------------------------------------------------------

    def prefill_rows(
        self,
        plan: PrefillPlan,
        *,
        window_block_table: torch.Tensor,
        comp_block_table: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
        c128a_topk: int | None = None,
        window_floor: torch.Tensor | None = None,
    ) -> dk.PrefillIndices | dk.GroupedPrefillIndices:
        """This layer's rows of the step ``plan`` from its own metadata: its window
        and compressed block tables, its top-k rows (top-k layers) or the C128A row
        width, its window floor (None: the plan's)."""
        comp = self.comp
        return plan.layer_rows(
            self.ratio,
            window_block_table=window_block_table,
            window_block_size=self.window.page_size,
            comp_block_table=comp_block_table,
            comp_block_size=None if comp is None else comp.page_size,
            topk_indices=topk_indices,
            c128a_topk=c128a_topk,
            group_size=1 if self.rows is RowKind.TOPK else self.group_size,
            window_floor=window_floor,
            window_size=self.window_size,
        )

    def prefill(
        self,
        q: torch.Tensor,
        out: torch.Tensor | None,
        rows: dk.PrefillIndices | dk.GroupedPrefillIndices,
        plan: PrefillPlan,
        attn_sink: torch.Tensor | None,
        swa_cache: torch.Tensor,
        comp_cache: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill attention of the plan's tokens on this layer's real heads: ``q`` and
        ``out`` ``[>= T, >= heads, 512]`` (vLLM's padded buffers, or exactly the real
        heads), ``out``'s first ``T`` rows of the real heads written (allocated when
        None); ``attn_sink``: the layer's sink (its first ``heads`` entries are used);
        the caches this binding was made for.  Returns the ``[T, heads, 512]`` output."""
        T, H = plan.num_tokens, self.heads
        grouped: dict[str, Any] = {}
        if isinstance(rows, dk.GroupedPrefillIndices):
            grouped = rows.grouping()
        if lse is None and plan.scratch is not None:
            lse = plan.scratch.take("lse", (T, H))
        result, _ = dk.sparse_mla_paged(
            q[:T, :H],
            self.window.over(swa_cache),
            rows.window,  # type: ignore[arg-type]
            rows.window_lens,
            self.scale,
            attn_sink=None if attn_sink is None else attn_sink[:H],
            comp_cache=self._comp_view(comp_cache),
            comp_indices=rows.comp,
            comp_lens=rows.comp_lens,
            out=None if out is None else out[:T, :H],
            lse=lse,
            tiles=self.tiles,
            **grouped,
        )
        return result

    # --- decode -------------------------------------------------------------------------

    def decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        rows: DecodeRows,
        scratch: dk.DecodeScratch,
        attn_sink: torch.Tensor | None,
        swa_cache: torch.Tensor,
        comp_cache: torch.Tensor | None,
        policy: Mapping[str, int] | None = None,
    ) -> torch.Tensor:
        """Decode attention of the rows' ``T`` tokens on this layer's real heads into
        ``out`` (``[>= T, >= heads, 512]``, written in place; the padded heads are left
        as they are) from the caches this binding was made for, with the measured
        table's launch entries ``policy`` for this head count (None: the kernels'
        defaults).  Returns ``out[:T, :heads]``."""
        if (rows.comp is None) != (self.comp is None):
            raise ValueError(
                f"{self.name}: {self.rows.name} rows "
                f"{'need' if self.comp is not None else 'take no'} compressed rows"
            )
        window = _rows("swa_indices", rows.window)
        assert window is not None
        T, H = window.shape[0], self.heads
        dst = out[:T, :H]
        dk.sparse_mla_decode(
            q[:T, :H],
            self.window.over(swa_cache),
            window,
            rows.window_lens,
            self.scale,
            scratch=scratch,
            attn_sink=None if attn_sink is None else attn_sink[:H],
            comp_cache=self._comp_view(comp_cache),
            comp_indices=_rows("comp_indices", rows.comp),
            comp_lens=rows.comp_lens,
            out=dst,
            policy=policy,
        )
        return dst
