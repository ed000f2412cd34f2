"""The step's :class:`PrefillPlan`: a prefill chunk and the index rows its layers share.

Split from :mod:`dsv4_attention.prefill` (which re-exports it): the plan builds
each layer type's rows once per step (window and C128A rows per block table,
C4A rows per layer), into the preallocated scratch when it has one.
"""

from __future__ import annotations

from typing import Any

import torch

import dsv4_kernels as dk
from dsv4_kernels.geometry import (
    LAYER_RATIOS,
    SWA_BLOCK_SIZE,
    WINDOW_SIZE,
    RowKind,
    row_kind,
    slots_per_page,
)

from .scratch import PrefillScratch

__all__ = ["LAYER_RATIOS", "PrefillPlan", "has_compressed_rows", "topk_rows"]


def _kind(compress_ratio: int, topk_indices: object) -> RowKind | None:
    """The rows of a layer (``geometry.row_kind``), None for a ratio of no layer."""
    if compress_ratio not in LAYER_RATIOS:
        return None
    return row_kind(compress_ratio, topk_indices is not None)


def topk_rows(compress_ratio: int, topk_indices: object) -> bool:
    """Whether a layer's compressed rows are the indexer's top-k (C4A; V4.1's ratio-2
    layers; V4.1's full-length layers, ratio 1 with ``topk_indices``)."""
    return _kind(compress_ratio, topk_indices) is RowKind.TOPK


def has_compressed_rows(compress_ratio: int, topk_indices: object) -> bool:
    """Whether a layer reads a compressed cache (top-k rows or C128A's every entry)."""
    kind = _kind(compress_ratio, topk_indices)
    return kind is not None and kind.compressed


def _table_key(kind: str, table: torch.Tensor, *extra: Any) -> tuple[Any, ...]:
    return (kind, table.data_ptr(), tuple(table.shape), tuple(table.stride()), *extra)


def _floor_key(floor: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What identifies a window floor among the step's (held alive by the plan, so its
    address is not another tensor's within the step)."""
    if floor is None:
        return None
    return (floor.data_ptr(), tuple(floor.shape), tuple(floor.stride()))


class PrefillPlan:
    """One step's prefill chunk and the index rows every layer of a type shares.

    Build one per step (per forward pass) from the step's metadata; the first
    layer of each type builds the shared rows, the others reuse them.  Rows
    are cached per everything that makes them differ: the block table (window
    cache group, C128A cache group), the page size, the layer's window and the
    layer's window floor (:meth:`layer_rows` takes the layer's own), so layers
    whose caches sit in different KV-cache groups, or whose metadata bound the
    window differently (DeepSeek-V4.1's decoder-side replay: its first replay
    layer's window floor is the batch's replay start, every later one's
    ``max(replay_start, seq - window)``), each get their own rows.  A plan must
    not outlive its step: it holds the block tables and window floors it has
    seen (so their memory cannot be reused for another within the step) and
    assumes their contents do not change.

    Args:
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths of
            the prefill requests (a slice of vLLM's, nonzero first element fine).
        seq_lens: ``[>= num_reqs]`` int32 tokens of each request including
            this chunk.
        num_tokens: prefill query tokens, ``query_start_loc[-1] -
            query_start_loc[0]`` (a host int).
        window_size: sliding window W (128).
        left_visible, right_visible: vLLM's in-image visibility; must be None
            (batches with images take vLLM's own prefill).
        check_values: check value-dependent facts on CUDA tensors too (reads
            them back; CPU tensors are always checked).
        scratch: preallocated buffers (:class:`~dsv4_attention.scratch.PrefillScratch`)
            that every row of the step is built into, so the step allocates nothing
            (more distinct row sets than slots reuse the oldest set's slot); None:
            the rows are allocated by torch.
        window_floor: ``[>= num_reqs]`` int32, the first position each request holds
            window KV from (vLLM's SWA bounded replay: ``prefill_seq_lens -
            prefill_gather_lens``); window rows start no lower.  None: position 0.
            The default of :meth:`layer_rows`, which takes each layer's own.
        c128a_blocks: build C128A rows as :class:`dsv4_kernels.BlockRows` (each
            token's length and request; the attention reads the compressed block table,
            so no ``[tokens, entries]`` row is built).  None: the scratch's
            ``spec.c128a_blocks`` (False without a scratch).
    """

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        num_tokens: int,
        window_size: int = WINDOW_SIZE,
        left_visible: torch.Tensor | None = None,
        right_visible: torch.Tensor | None = None,
        check_values: bool = False,
        scratch: PrefillScratch | None = None,
        window_floor: torch.Tensor | None = None,
        c128a_blocks: bool | None = None,
    ) -> None:
        if left_visible is not None or right_visible is not None:
            raise ValueError(
                "left_visible/right_visible given: in-image bidirectional visibility is not "
                "supported by the head-exact prefill; batches with images must take vLLM's own "
                "prefill path"
            )
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.num_tokens = num_tokens
        self.window_size = window_size
        self.check_values = check_values
        self.window_floor = window_floor
        self._rows: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # every window floor a layer passed: held so that its address identifies it
        self._floors: list[torch.Tensor] = []
        # grouped rows: (the block table, to keep it alive; the rows built with it)
        self._grouped: dict[tuple[Any, ...], tuple[torch.Tensor, Any]] = {}
        self.launches = 0  # index-build launches so far (for tests and logs)
        self.scratch = scratch
        if c128a_blocks is None:
            c128a_blocks = scratch is not None and bool(scratch.spec.c128a_blocks)
        elif scratch is not None and c128a_blocks != bool(scratch.spec.c128a_blocks):
            raise ValueError(
                f"c128a_blocks={c128a_blocks} but the scratch was reserved with "
                f"c128a_blocks={scratch.spec.c128a_blocks}"
            )
        self.c128a_blocks = bool(c128a_blocks)
        self._slots: dict[tuple[Any, ...], int] = {}
        self.evictions = 0  # row sets whose slot a later set took (for tests and logs)

    def _slot(self, kind: str, key: tuple[Any, ...], available: int) -> int:
        """The scratch slot of rows ``key`` (one per distinct table and row shape).  A step
        with more distinct row sets than slots (DeepSeek-V4.1's window caches form many
        KV-cache groups, each with its own block table) reuses the slot of the set of that
        kind built first, and forgets those rows: a later layer of that table builds them
        again (one more launch; the layers run in stream order, so a slot is rewritten
        only after the attention that read it)."""
        if key not in self._slots:
            mine = [k for k in self._slots if k[0].endswith(kind)]
            if len(mine) >= available:
                oldest = mine[0]  # insertion order: the first built of this kind
                slot = self._slots.pop(oldest)
                self._rows.pop(oldest, None)
                self._grouped.pop(oldest, None)
                self.evictions += 1
            else:
                slot = len(mine)
            self._slots[key] = slot
        return self._slots[key]

    def _window_outs(
        self, key: tuple[Any, ...], group: int, window_size: int
    ) -> dict[str, torch.Tensor]:
        if self.scratch is None:
            return {}
        slot = self._slot("window", key, self.scratch.spec.window_slots)
        T, take = self.num_tokens, self.scratch.take
        outs = {
            "window_out": take(f"window{slot}", (T, window_size + group - 1)),
            "window_lens_out": take(f"window{slot}_lens", (T,)),
        }
        if group > 1:
            outs["leads_out"] = take(f"window{slot}_leads", (T,))
            outs["starts_out"] = take(f"window{slot}_starts", (T,))
        return outs

    def _comp_outs(
        self, ratio: int, key: tuple[Any, ...] | None, width: int, group: int = 1
    ) -> dict[str, torch.Tensor]:
        if self.scratch is None:
            return {}
        T, take = self.num_tokens, self.scratch.take
        if ratio != 128:  # top-k rows, built fresh by every layer
            return {"comp_out": take("c4a", (T, width)), "comp_lens_out": take("c4a_lens", (T,))}
        assert key is not None
        slot = self._slot("c128a", key, self.scratch.spec.c128a_slots)
        outs = {"comp_lens_out": take(f"c128a{slot}_lens", (T,))}
        if self.c128a_blocks:
            outs["req_out"] = take(f"c128a{slot}_req", (T,))
        else:
            outs["comp_out"] = take(f"c128a{slot}", (T, width))
        if group > 1:  # a grouped build writes each token's leader too
            outs["leads_out"] = take(f"c128a{slot}_leads", (T,))
        return outs

    def _build(
        self, floor: torch.Tensor | None, window_size: int, **kwargs: Any
    ) -> dk.PrefillIndices:
        self.launches += 1
        return dk.build_prefill_indices(
            self.query_start_loc,
            self.seq_lens,
            num_tokens=self.num_tokens,
            window_size=window_size,
            check_values=self.check_values,
            window_floor=floor,
            **kwargs,
        )

    def _layer_window(
        self, window_floor: torch.Tensor | None, window_size: int | None
    ) -> tuple[torch.Tensor | None, int, tuple[Any, ...]]:
        """The layer's window floor and size (the plan's where not given) and their key."""
        floor = self.window_floor if window_floor is None else window_floor
        size = self.window_size if window_size is None else int(window_size)
        if size > self.window_size and self.scratch is not None:
            raise ValueError(
                f"window_size {size} is wider than the plan's scratch rows "
                f"({self.window_size}); build the plan with the widest layer window"
            )
        if floor is not None and not any(f is floor for f in self._floors):
            self._floors.append(floor)
        return floor, size, (size, _floor_key(floor))

    def layer_rows(
        self,
        compress_ratio: int,
        *,
        window_block_table: torch.Tensor,
        window_block_size: int = SWA_BLOCK_SIZE,
        comp_block_table: torch.Tensor | None = None,
        comp_block_size: int | None = None,
        topk_indices: torch.Tensor | None = None,
        c128a_topk: int | None = None,
        group_size: int = 1,
        window_floor: torch.Tensor | None = None,
        window_size: int | None = None,
    ) -> dk.PrefillIndices | dk.GroupedPrefillIndices:
        """The index rows of one layer: cached window / C128A rows, fresh top-k rows.

        ``window_floor`` and ``window_size`` are the layer's own (its metadata's
        floor, its ``window_size``); None takes the plan's.  Window rows are cached
        per block table, page size, window and floor.

        At most one launch: a C128A layer whose window and C128A rows are both
        missing builds them together; a C4A layer builds its top-k rows (and
        the window rows with them when they are missing).  With ``group_size >
        1`` an SWA-only or C128A layer gets grouped rows
        (:func:`dsv4_kernels.build_grouped_prefill_indices`, cached per group
        size like the others); C4A rows are always per token.
        """
        comp_block_size = _check_comp_args(
            compress_ratio, comp_block_table, comp_block_size, topk_indices, c128a_topk
        )
        topk = topk_rows(compress_ratio, topk_indices)
        floor, size, wextra = self._layer_window(window_floor, window_size)
        if group_size > 1 and not topk:
            return self._grouped_rows(
                compress_ratio,
                group_size,
                window_block_table,
                window_block_size,
                comp_block_table,
                comp_block_size,
                c128a_topk,
                floor,
                size,
                wextra,
            )
        wkey = _table_key("window", window_block_table, window_block_size, *wextra)
        window = self._rows.get(wkey)
        comp: torch.Tensor | dk.BlockRows | None = None
        comp_lens = None
        ckey = None
        if compress_ratio == 128:
            assert comp_block_table is not None and comp_block_size is not None
            assert c128a_topk is not None
            ckey = _table_key("c128a", comp_block_table, comp_block_size, c128a_topk)
            cached = self._rows.get(ckey)
            if cached is not None:
                comp, comp_lens = cached[1], cached[2]

        need_comp = topk or (compress_ratio == 128 and comp is None)
        if window is None or need_comp:
            outs = self._window_outs(wkey, 1, size) if window is None else {}
            if need_comp:
                width = c128a_topk if compress_ratio == 128 else None
                if width is None:
                    assert topk_indices is not None
                    width = int(topk_indices.shape[1])
                outs.update(self._comp_outs(compress_ratio, ckey, width))
            built = self._build(
                floor,
                size,
                **outs,
                window_block_table=window_block_table if window is None else None,
                window_block_size=window_block_size,
                compress_ratio=compress_ratio if need_comp else None,
                comp_block_table=comp_block_table if need_comp else None,
                comp_block_size=comp_block_size if need_comp else None,
                topk_indices=topk_indices if need_comp else None,
                topk=c128a_topk if need_comp and compress_ratio == 128 else None,
                comp_blocks=self.c128a_blocks and need_comp and compress_ratio == 128,
            )
            if window is None:
                assert built.window is not None and built.window_lens is not None
                window = (window_block_table, built.window, built.window_lens)
                self._rows[wkey] = window
            if need_comp:
                comp, comp_lens = built.comp, built.comp_lens
                if ckey is not None:
                    assert comp is not None and comp_lens is not None
                    self._rows[ckey] = (comp_block_table, comp, comp_lens)  # type: ignore[assignment]
        return dk.PrefillIndices(window[1], window[2], comp, comp_lens)

    def _grouped_rows(
        self,
        compress_ratio: int,
        group_size: int,
        window_block_table: torch.Tensor,
        window_block_size: int,
        comp_block_table: torch.Tensor | None,
        comp_block_size: int | None,
        c128a_topk: int | None,
        floor: torch.Tensor | None,
        window_size: int,
        wextra: tuple[Any, ...],
    ) -> dk.GroupedPrefillIndices:
        """Grouped rows of an SWA-only or C128A layer: the window part is cached per
        window table and group size, the C128A part per compressed table too; one
        launch builds whatever is missing."""
        wkey = _table_key(
            "grouped-window", window_block_table, window_block_size, group_size, *wextra
        )
        ckey = None
        if compress_ratio == 128:
            assert comp_block_table is not None and comp_block_size is not None
            assert c128a_topk is not None
            ckey = _table_key(
                "grouped-c128a", comp_block_table, comp_block_size, c128a_topk, group_size
            )
        window = self._grouped.get(wkey)
        comp = self._grouped.get(ckey) if ckey is not None else None
        if window is None or (ckey is not None and comp is None):
            outs = self._window_outs(wkey, group_size, window_size) if window is None else {}
            if ckey is not None and comp is None:
                assert c128a_topk is not None
                outs.update(self._comp_outs(128, ckey, c128a_topk, group_size))
            self.launches += 1
            built = dk.build_grouped_prefill_indices(
                self.query_start_loc,
                self.seq_lens,
                **outs,
                num_tokens=self.num_tokens,
                group_size=group_size,
                window_block_table=window_block_table if window is None else None,
                window_block_size=window_block_size,
                window_size=window_size,
                comp_block_table=comp_block_table if ckey is not None and comp is None else None,
                comp_block_size=comp_block_size,
                topk=c128a_topk if ckey is not None and comp is None else None,
                check_values=self.check_values,
                window_floor=floor,
                comp_blocks=self.c128a_blocks and ckey is not None and comp is None,
            )
            if window is None:
                window = (window_block_table, built)
                self._grouped[wkey] = window
            if ckey is not None and comp is None:
                assert comp_block_table is not None
                comp = (comp_block_table, built)
                self._grouped[ckey] = comp
        w = window[1]
        c = comp[1] if comp is not None else None
        return dk.GroupedPrefillIndices(
            w.leads,
            group_size,
            w.window,
            w.window_starts,
            w.window_lens,
            None if c is None else c.comp,
            None if c is None else c.comp_lens,
        )


def _check_ratio(compress_ratio: object) -> None:
    if compress_ratio not in LAYER_RATIOS:
        raise ValueError(
            f"compress_ratio must be one of {LAYER_RATIOS} (SWA-only or V4.1's full-length "
            f"top-k rows, V4.1's ratio 2, C4A, C128A), got {compress_ratio!r}"
        )


def _check_comp_args(
    compress_ratio: int,
    comp_block_table: torch.Tensor | None,
    comp_block_size: int | None,
    topk_indices: torch.Tensor | None,
    c128a_topk: int | None,
) -> int | None:
    """Check that the compressed-cache arguments match the ratio; return the page size."""
    _check_ratio(compress_ratio)
    if not has_compressed_rows(compress_ratio, topk_indices):
        for name, value in (
            ("comp_block_table", comp_block_table),
            ("topk_indices", topk_indices),
            ("c128a_topk", c128a_topk),
        ):
            if value is not None:
                raise ValueError(f"{name} must be None for SWA-only layers (compress_ratio 1)")
        return None
    if comp_block_table is None:
        raise ValueError(f"comp_block_table is needed for compress_ratio {compress_ratio}")
    if compress_ratio != 128:
        if topk_indices is None:
            raise ValueError(
                "topk_indices (the indexer's top-k) is needed for C4A layers (top-k rows at "
                f"compress_ratio {compress_ratio})"
            )
        if c128a_topk is not None:
            raise ValueError("c128a_topk must be None for C4A layers (their width is the top-k's)")
    else:
        if c128a_topk is None:
            raise ValueError("c128a_topk (the C128A row width) is needed for compress_ratio 128")
        if topk_indices is not None:
            raise ValueError(
                "topk_indices must be None for C128A layers (their rows are generated)"
            )
    return slots_per_page(compress_ratio) if comp_block_size is None else comp_block_size
