"""The keys of a sparse MLA call and the kernel that reads them: what the prefill
(:mod:`.sparse_mla`) and the decode (:mod:`.decode`) share.

* :class:`PageView` (public): one FP8 page view with its page size and stride, checked
  once (:meth:`PageView.check`); a caller that holds one for the run (the plugin's
  layer binding) passes it in place of a cache tensor and its block size, and no call
  checks the view again.
* :class:`PagedKeys`: the window source and the optional compressed source (cache, index
  rows, lengths, page size), checked once by :func:`check_paged_keys` (the arguments of
  :func:`.sparse_mla_paged` and :func:`.sparse_mla_decode`, same checks and messages).
* The kernel choice: :func:`wgmma_runs` says whether a Gluon wgmma kernel runs a call
  (else the Triton kernel), and :func:`launch_gluon` is the one fallback when Gluon cannot
  build a kernel with the installed Triton (recorded, one warning, the Triton kernel
  instead, from then on).
* The launches: :func:`launch`, one program per token (the prefill, the workspace, the
  decode with one split), and :func:`launch_split`, the decode's (token, chunk) programs.

The wgmma kernels' process-wide state, the device check ``_hopper_runs_wgmma`` and the
per-token kernel's build record ``_WGMMA_BROKEN`` (published by
:func:`.sparse_mla.wgmma_available`), stays in :mod:`.sparse_mla`, where the tests of
both packages and benchmarks/support replace it, and is read there at each call.

One module past 500 lines on purpose: the key sources, their one check and the three
launches (per token, split, wgmma) all build the kernels' arguments from the same
``KeySource`` fields; kept together, a new source field (``req``: block rows) is added
in one place for every kernel.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton

from . import _triton_decode as _kd
from . import _triton_sparse_mla as _k
from ._sparse_mla_checks import _check_block_rows, _check_rows, _Grouping
from ._sparse_mla_tiles import MAX_GROUP_ROWS, TILES, TileTable, block_h, group_rows, head_class
from ._validation import check_page_cache, check_positive_int, interpreter_enabled
from .reference.prefill_indices import BlockRows, expand_grouped_rows

LOG2E = 1.4426950408889634
WGMMA_MAX_HEADS = 16  # the wgmma kernels pad the heads to wgmma's N, 8 or 16
# heads per wide block (two warpgroups; issue 41): ``WIDE_HT`` of the decode's policy and
# of the large tiles takes one of these (0: off)
WIDE_BLOCK_HEADS = (32, 64)

# Why the decode's wgmma split kernel failed to build here, if it did (the per-token
# kernel's record is ``.sparse_mla._WGMMA_BROKEN``).
SPLIT_BROKEN: list[str] = []


@dataclasses.dataclass(frozen=True)
class PageView:
    """One FP8 (UE8M0) page view as the kernels read it, checked once: the view
    (``[num_pages, page_size, 584]`` uint8 or ``[num_pages, >= page]``, any page stride,
    e.g. vLLM's block-outer per-layer views), its slots per page, its page stride in
    bytes and its number of slots (larger indices are holes).

    Build it with :meth:`check`; pass it as ``swa_cache`` / ``comp_cache`` of
    :func:`dsv4_kernels.sparse_mla_paged` and :func:`dsv4_kernels.sparse_mla_decode`
    (the block size argument then may be omitted; given, it must equal ``page_size``).
    It describes the view at the time of the check: a view whose storage vLLM
    re-binds (a new KV cache) needs a new one."""

    cache: torch.Tensor
    page_size: int
    page_stride: int
    num_slots: int

    @classmethod
    def check(
        cls,
        cache: object,
        page_size: int,
        name: str = "cache",
        device: torch.device | None = None,
        page_size_name: str | None = None,
    ) -> PageView:
        """``cache`` checked as a page view of ``page_size`` slots per page (on
        ``device`` when given); a ``ValueError`` naming ``name`` (or ``page_size_name``,
        default ``"<name> page_size"``, for the page size) otherwise.  Never
        synchronises."""
        slots = check_positive_int(page_size_name or f"{name} page_size", page_size)
        c, stride = check_page_cache(name, cache, slots, device)
        return cls(c, slots, stride, c.shape[0] * slots)


def _page_view(
    name: str, cache: object, size_name: str, block_size: object, device: torch.device
) -> PageView:
    """A cache argument as a :class:`PageView`: checked here when it is a tensor (with
    ``block_size``), taken as it is when it already is one (on ``device``; a given
    ``block_size`` must be its page size)."""
    if isinstance(cache, PageView):
        if block_size is not None and block_size != cache.page_size:
            raise ValueError(
                f"{size_name} must be None or the PageView's page size {cache.page_size}, "
                f"got {block_size!r}"
            )
        if cache.cache.device != device:
            raise ValueError(f"{name} must be on {device}, got {cache.cache.device}")
        return cache
    return PageView.check(cache, block_size, name, device, size_name)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class KeySource:
    """One source of keys as the kernels read it (validated; never synchronises)."""

    cache: torch.Tensor  # FP8 pages (uint8 view); for sparse_mla_workspace bf16 rows [N, 512]
    # [T, K] int32 slots (workspace: row numbers); negative: a hole.  With ``req``: a block
    # table [R, P] (token t's row: request req[t]'s entries 0.., BlockRows)
    rows: torch.Tensor
    lens: torch.Tensor | None  # [T] int32 columns that count; None: all K
    page_size: int  # slots per page (workspace: 1)
    page_stride: int  # bytes between two pages (workspace: elements between two rows)
    num_slots: int  # slots in the cache (workspace: rows); larger indices are holes
    req: torch.Tensor | None = None  # [T] int32: each token's block-table row (BlockRows)

    @property
    def width(self) -> int:
        """Columns of a row: its slots, or a block table's pages times their entries."""
        cols = int(self.rows.shape[1])
        return cols * self.page_size if self.req is not None else cols

    def slot_rows(self, num_tokens: int) -> torch.Tensor:
        """The rows as ``[T, width]`` slots (block rows expanded; for the references)."""
        if self.req is None:
            return self.rows
        return BlockRows(self.rows, self.req).slots(self.page_size, num_tokens)

    def per_token(
        self, leads: torch.Tensor, starts: torch.Tensor | None, num_tokens: int
    ) -> KeySource:
        """Grouped rows (token ``t`` reads its leader's row from ``starts[t]``) expanded
        to the equivalent per-token rows and lengths.  Block rows from column 0 stay block
        rows (the leader's request; each token keeps its own length)."""
        if self.req is not None and starts is None:
            req = self.req[leads[:num_tokens].long()]
            return dataclasses.replace(self, req=req)
        rows = self.slot_rows(num_tokens)
        rows, lens = expand_grouped_rows(leads, rows, self.lens, starts, num_tokens)
        return dataclasses.replace(self, rows=rows, lens=lens, req=None)


@dataclasses.dataclass(frozen=True)
class PagedKeys:
    """A call's keys: the window source, then (a token's columns after its window's)
    the compressed source, None for SWA-only layers.  ``paged=False``: the window source
    is sparse_mla_workspace's bf16 rows (same kernel, no compressed source)."""

    window: KeySource
    comp: KeySource | None = None
    paged: bool = True

    @property
    def aligned(self) -> bool:
        """FP8 pages whose base and page stride are 16-byte aligned in every source (the
        wgmma kernels and the Triton kernel's int32 words need it); host metadata only."""
        sources = [self.window] if self.comp is None else [self.window, self.comp]
        return self.paged and all(
            s.cache.data_ptr() % 16 == 0 and s.page_stride % 16 == 0 for s in sources
        )

    def per_token(self, grouping: _Grouping, num_tokens: int) -> PagedKeys:
        """Both sources' grouped rows expanded to the equivalent per-token rows."""
        leads, _, a_starts, b_starts = grouping
        comp = self.comp
        return dataclasses.replace(
            self,
            window=self.window.per_token(leads, a_starts, num_tokens),
            comp=None if comp is None else comp.per_token(leads, b_starts, num_tokens),
        )

    def arguments(self) -> dict[str, Any]:
        """The keys as the keyword arguments of the public functions (and of their
        references in :mod:`dsv4_kernels.reference`)."""
        a, b = self.window, self.comp
        T = a.rows.shape[0]
        return dict(
            swa_cache=a.cache,
            swa_indices=a.rows,
            swa_lens=a.lens,
            swa_block_size=a.page_size,
            comp_cache=None if b is None else b.cache,
            comp_indices=None if b is None else b.slot_rows(T),
            comp_lens=None if b is None else b.lens,
            comp_block_size=None if b is None else b.page_size,
        )


def check_paged_keys(
    swa_cache: torch.Tensor | PageView,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    swa_block_size: int | None,
    comp_cache: torch.Tensor | PageView | None,
    comp_indices: torch.Tensor | BlockRows | None,
    comp_lens: torch.Tensor | None,
    comp_block_size: int | None,
    num_tokens: int,
    device: torch.device,
    block_rows: bool = False,
) -> PagedKeys:
    """The key arguments of :func:`.sparse_mla_paged` and :func:`.sparse_mla_decode`,
    checked: each failure is a ``ValueError`` naming the argument and what was expected
    (shapes, dtypes, devices and Python ints only, never a GPU synchronisation).  A
    cache given as a :class:`PageView` was checked when it was made and is not
    checked again.  ``block_rows``: ``comp_indices`` may be a
    :class:`~dsv4_kernels.BlockRows` (the prefill's C128A rows; not the decode's)."""
    a = _page_view("swa_cache", swa_cache, "swa_block_size", swa_block_size, device)
    a_idx, a_lens = _check_rows(
        "swa_indices", swa_indices, "swa_lens", swa_lens, num_tokens, device
    )
    window = KeySource(a.cache, a_idx, a_lens, a.page_size, a.page_stride, a.num_slots)
    comp_given = [comp_cache is not None, comp_indices is not None]
    if comp_block_size is not None or not isinstance(comp_cache, PageView):
        comp_given.append(comp_block_size is not None)
    if any(comp_given) and not all(comp_given):
        raise ValueError(
            "comp_cache, comp_indices and comp_block_size must be given together "
            "(all None for SWA-only layers; comp_block_size may be left out with a "
            "PageView)"
        )
    if comp_lens is not None and comp_cache is None:
        raise ValueError("comp_lens given without comp_cache / comp_indices")
    if comp_cache is None:
        return PagedKeys(window)
    b = _page_view("comp_cache", comp_cache, "comp_block_size", comp_block_size, device)
    if isinstance(comp_indices, BlockRows):
        if not block_rows:
            raise ValueError(
                "comp_indices must be a [T, K] int32 tensor of global slots here (BlockRows "
                "are taken by sparse_mla_paged's prefill only)"
            )
        table, req, lens = _check_block_rows(
            "comp_indices", comp_indices, "comp_lens", comp_lens, num_tokens, device
        )
        comp = KeySource(b.cache, table, lens, b.page_size, b.page_stride, b.num_slots, req)
        return PagedKeys(window, comp)
    b_idx, b_lens = _check_rows(
        "comp_indices", comp_indices, "comp_lens", comp_lens, num_tokens, device
    )
    comp = KeySource(b.cache, b_idx, b_lens, b.page_size, b.page_stride, b.num_slots)
    return PagedKeys(window, comp)


def tiles_for(num_heads: int, tiles: TileTable | None = None) -> Mapping[str, int]:
    """One launch's tile constants: the head class's entry of ``tiles``, else the measured
    default (:data:`TILES`)."""
    cls = head_class(num_heads)
    if tiles is not None and cls in tiles:
        return tiles[cls]
    return TILES[cls]


def whole_vectors(*tensors: torch.Tensor) -> bool:
    """Whether each tensor's base is 16-byte aligned and its token and head strides are
    whole 16-byte vectors (8 bf16 elements): the kernel may then move q and out in
    16-byte accesses.  Host-side metadata only, no synchronisation."""
    return all(
        x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0 for x in tensors
    )


# --- the kernel choice ----------------------------------------------------------------


def _wgmma_state() -> types.ModuleType:
    """:mod:`.sparse_mla`, which holds the wgmma kernels' process-wide state (module
    docstring); imported here at the call, since :mod:`.sparse_mla` imports this module."""
    from . import sparse_mla

    return sparse_mla


def wgmma_runs(
    q: torch.Tensor,
    tiles: Mapping[str, int],
    paged: bool,
    aligned: bool,
    *,
    split: bool = False,
    head_blocks: bool = False,
) -> bool:
    """Whether a Gluon wgmma kernel runs this call, else the Triton kernel: the one kernel
    choice, of the per-token launch (:mod:`._gluon_sparse_mla`, where ``tiles`` name it
    with ``KERNEL=2``) and of the decode's split launch (``split``: :mod:`._gluon_decode`,
    unless it failed to build here).  Both need FP8 pages with 16-byte aligned rows, a
    CUDA device of compute capability 9.x and a Triton with Gluon's Hopper API that has
    not failed to build the per-token kernel, and up to 16 heads, except the split launch
    with ``head_blocks`` (more heads in blocks of 16, or of its ``wide`` heads) and the
    per-token launch whose ``tiles`` give ``WIDE_HT`` (more heads in blocks of that many
    on two warpgroups)."""
    if split:
        if SPLIT_BROKEN:
            return False
    elif tiles.get("KERNEL", 0) != 2:
        return False
    blocks = head_blocks if split else bool(tiles.get("WIDE_HT", 0))
    if not paged or not aligned or (q.shape[1] > WGMMA_MAX_HEADS and not blocks):
        return False
    return bool(_wgmma_state()._hopper_runs_wgmma(q.device))


def launch_gluon(
    launch: Callable[[], object],
    compiled_variants: Callable[[], int],
    record: list[str],
    what: str,
    stacklevel: int,
) -> bool:
    """Run ``launch``, a Gluon kernel's launch; False (after one warning, ``stacklevel``
    frames above this one's caller) when the kernel does not build with this Triton: why
    is appended to ``record``, so that the choice takes the Triton kernel from then on."""
    try:
        launch()
    except Exception as exc:
        # A failed build leaves no compiled variant: once one exists, Gluon can build the
        # kernel here and this is a real error, not a fallback case.
        if compiled_variants():
            raise
        record.append(f"{type(exc).__name__}: {exc}"[:400])
        warnings.warn(
            f"dsv4_kernels: the Gluon wgmma {what} kernel did not build with Triton "
            f"{triton.__version__} ({record[0]}); the Triton kernel runs instead",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
        return False
    return True


# --- the launches ---------------------------------------------------------------------


def _sources(keys: PagedKeys) -> tuple[KeySource, KeySource]:
    """The window source and the compressed one; without one, a stand-in (the window's
    rows, no slots) for the kernels' unused arguments."""
    a = keys.window
    return a, keys.comp if keys.comp is not None else KeySource(a.cache, a.rows, None, 1, 0, 0)


def _pointers(a: KeySource, b: KeySource) -> tuple[torch.Tensor, ...]:
    """Both kernels' six source pointers (an absent length: any tensor, never read)."""
    a_lens = a.lens if a.lens is not None else a.rows
    return (a.cache, a.rows, a_lens, b.cache, b.rows, b.lens if b.lens is not None else b.rows)


def _source_meta(keys: PagedKeys) -> dict[str, Any]:
    """What both kernels specialise on about the sources."""
    a, b = keys.window, keys.comp
    return dict(
        A_SLOTS=a.page_size,
        A_HAS_LENS=a.lens is not None,
        HAS_B=b is not None,
        B_SLOTS=b.page_size if b is not None else 1,
        B_HAS_LENS=b is not None and b.lens is not None,
    )


def _block_meta(keys: PagedKeys) -> dict[str, Any]:
    """The per-token kernels' block-rows arguments: only when the compressed source is
    given as a block table (the other calls compile and launch exactly as before)."""
    b = keys.comp
    if b is None or b.req is None:
        return {}
    return dict(b_req_ptr=b.req, B_BLOCKS=True)


def launch(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor | None,
    keys: PagedKeys,
    *,
    scale: float,
    grouping: _Grouping | None = None,
    tiles: TileTable | None = None,
) -> None:
    """One program per token (inputs already validated), with the tile constants of
    ``tiles`` (:func:`.sparse_mla_paged`'s argument; None: :data:`TILES`): the wgmma
    kernel where :func:`wgmma_runs`, else the Triton kernel (grouped rows, which only the
    wgmma kernel takes, expanded per token)."""
    T, H, _ = q.shape
    if T == 0:
        return
    cfg = tiles_for(H, tiles)
    bh = block_h(H, cfg["MAX_BLOCK_H"])
    head_blocks = triton.cdiv(H, bh)
    a, b = _sources(keys)
    grid = (T * head_blocks,)
    args = (
        q,
        out,
        lse,
        sink if sink is not None else lse,
        *_pointers(a, b),
        T,
        H,
        a.rows.stride(0),
        a.width,
        a.page_stride,
        a.num_slots,
        b.rows.stride(0),
        b.width,
        b.page_stride,
        b.num_slots,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        scale * LOG2E,
    )
    sources = dict(**_source_meta(keys), HAS_SINK=sink is not None, **_block_meta(keys))
    aligned = keys.aligned
    fits = grouping is None or (
        grouping[1] > 1 and H <= WGMMA_MAX_HEADS and group_rows(H, grouping[1]) <= MAX_GROUP_ROWS
    )
    if (
        fits
        and wgmma_runs(q, cfg, keys.paged, aligned)
        and launch_wgmma(T, H, args, sources, cfg, grouping)
    ):
        return
    if grouping is not None:  # the wgmma kernel did not take them: per-token rows
        launch(q, out, lse, sink, keys.per_token(grouping, T), scale=scale, tiles=tiles)
        return
    meta = dict(
        **sources,
        A_PAGED=keys.paged,
        ALIGNED=aligned,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=bh,
        BLOCK_N=cfg["BLOCK_N"],
        DOT_FP32=interpreter_enabled(),
    )
    # ASM (absent: off): the FP8 codes as int32 words through inline PTX (CUDA only).
    words = bool(cfg.get("ASM", 0)) and aligned and not interpreter_enabled()
    extra: dict[str, Any] = {}
    if words:
        extra.update(A_WORDS=keys.paged, B_WORDS=True)
    if cfg.get("MAXNREG") and not interpreter_enabled():
        extra["maxnreg"] = cfg["MAXNREG"]
    _k._sparse_mla_kernel[grid](
        *args,
        **meta,
        **extra,
        PREFETCH=bool(cfg["PREFETCH"]) and keys.paged,
        BF16_DEQUANT=bool(cfg["BF16_DEQUANT"]) and not interpreter_enabled(),
        num_warps=cfg["NUM_WARPS"],
        num_stages=cfg["NUM_STAGES"],
    )


def launch_wgmma(
    T: int,
    H: int,
    args: tuple[Any, ...],
    meta: dict[str, Any],
    tiles: Mapping[str, int],
    grouping: _Grouping | None = None,
) -> bool:
    """Launch the per-token wgmma kernel; False (after one warning) when it does not
    compile with this Triton, so the caller runs the Triton kernel instead."""
    from . import _gluon_sparse_mla as g

    q, out = args[0], args[1]

    hp = 8 if H <= 8 else 16
    nreg = tiles.get("MAXNREG") or (tiles.get("MAXNREG_H8") if hp == 8 else None)
    wg, blocks = 1, 1
    if H > WGMMA_MAX_HEADS:  # wide blocks (wgmma_runs checked WIDE_HT), one token a row
        hp, wg, nreg = tiles["WIDE_HT"], 2, None
        if hp not in WIDE_BLOCK_HEADS:
            sizes = " or ".join(map(str, WIDE_BLOCK_HEADS))
            raise ValueError(f"tiles['large']['WIDE_HT'] must be {sizes} heads, got {hp}")
        blocks = triton.cdiv(H, hp)
    grid = T * blocks
    unused = args[5] if len(args) > 5 else q  # any tensor for the unused pointers
    extra: tuple[Any, ...] = (unused, unused, unused)
    group_meta: dict[str, Any] = {}
    if grouping is not None:
        leads, size, a_st, b_st = grouping
        grid = triton.cdiv(T, size)
        extra = (leads, a_st if a_st is not None else leads, b_st if b_st is not None else leads)
        group_meta = dict(G=size, A_HAS_STARTS=a_st is not None, B_HAS_STARTS=b_st is not None)
        nreg = None  # more rows than the cap was measured for

    def wgmma() -> None:
        g._sparse_mla_wgmma_kernel[(grid,)](
            *args,
            *extra,
            **meta,
            **group_meta,
            HT=hp,
            ASYNC_PV=bool(tiles.get("ASYNC_PV", 0)),
            REG_A=wg == 1
            and bool(
                tiles.get("REG_A_G", 0)
                if grouping is not None
                else tiles.get("REG_A", tiles.get("REG_A_H8", 0) if hp == 8 else 0)
            ),
            IO_VEC=bool(tiles.get("IO_VEC", 1)) and whole_vectors(q, out),
            WG=wg,
            HBLOCKS=blocks,
            num_warps=4 * wg,
            **({"maxnreg": nreg} if nreg else {}),
        )

    record = _wgmma_state()._WGMMA_BROKEN
    return launch_gluon(wgmma, g.compiled_variants, record, "sparse MLA", stacklevel=4)


def launch_split(
    q: torch.Tensor,
    po: torch.Tensor,
    plse: torch.Tensor,
    keys: PagedKeys,
    *,
    scale: float,
    splits: int,
    chunk: int,
    head_blocks: bool = False,
    pdl: bool = False,
    wide: int = 0,
) -> None:
    """The decode's split kernels (inputs already validated): one program per (token,
    chunk, head block) writing the chunk's partial output ``po`` and base-2 lse
    ``plse``; the wgmma kernel where :func:`wgmma_runs` (``split``; ``head_blocks``:
    more than 16 heads in blocks of 16, or of ``wide`` heads (32 or 64) on two
    warpgroups that dequantise each key tile once for the whole block), else the
    Triton kernel.  ``pdl``: each program signals, once its partial is stored, that a
    programmatic dependent launch (the combine) may start."""
    T, H, _ = q.shape
    a, b = _sources(keys)
    args = (
        q, po, plse, *_pointers(a, b), T, H, splits, chunk, a.rows.stride(0), a.width,
        a.page_stride, a.num_slots, b.rows.stride(0), b.width if keys.comp is not None else 0,
        b.page_stride, b.num_slots, q.stride(0), q.stride(1), scale * LOG2E,
    )  # fmt: skip
    sources = _source_meta(keys)
    tiles = tiles_for(H)
    aligned = keys.aligned
    if wgmma_runs(q, tiles, True, aligned, split=True, head_blocks=head_blocks or bool(wide)):
        from . import _gluon_decode as g

        hp = 8 if H <= 8 else 16
        wg = 1
        if H > WGMMA_MAX_HEADS and wide:
            hp, wg = wide, 2
        wt = tiles_for(min(H, WGMMA_MAX_HEADS))  # a head block's tiles
        nreg = wt.get("MAXNREG_H8") if hp == 8 else None
        blocks = triton.cdiv(H, hp)

        def wgmma() -> None:
            g._decode_split_wgmma_kernel[(T * splits * blocks,)](
                *args, blocks, **sources, HT=hp, ASYNC_PV=bool(wt.get("ASYNC_PV", 0)),
                REG_A=bool(wt.get("REG_A_H8", 0)) and hp == 8, IO_VEC=whole_vectors(q, q),
                PDL=pdl, WG=wg, num_warps=4 * wg,
                **({"maxnreg": nreg} if nreg else {}),
            )  # fmt: skip

        if launch_gluon(wgmma, g.compiled_variants, SPLIT_BROKEN, "decode", stacklevel=3):
            return
    bh = block_h(H, tiles["MAX_BLOCK_H"])
    head_count = triton.cdiv(H, bh)
    _kd._decode_split_kernel[(T * splits * head_count,)](
        *args, **sources, ALIGNED=aligned, HEAD_BLOCKS=head_count,
        BLOCK_H=bh, BLOCK_N=tiles["BLOCK_N"], DOT_FP32=interpreter_enabled(),
        PREFETCH=bool(tiles["PREFETCH"]), BF16_DEQUANT=bool(tiles["BF16_DEQUANT"])
        and not interpreter_enabled(), PDL=pdl, num_warps=tiles["NUM_WARPS"],
        num_stages=tiles["NUM_STAGES"],
    )  # fmt: skip
