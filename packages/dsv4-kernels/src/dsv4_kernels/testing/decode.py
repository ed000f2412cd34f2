"""Input factories for the sparse MLA decode: decode steps over shared FP8 page pools.

A decode step has ``R`` requests of ``tokens_per_request`` query tokens each (1
for plain decode, 2-4 for MTP / DSpark verification), at the end of each
request's context.  Token ``t`` of request ``r`` at position ``p`` reads:

* its window: positions ``max(p - 127, 0) .. p`` through the request's window
  block table (a ring of :data:`WINDOW_RING` pages of 64 slots), so the tokens of
  one request share all but a few window keys;
* C4A: ``min((p + 1) // 4, topk)`` compressed entries drawn at random among the
  request's ``(p + 1) // 4`` (the indexer's top-k differs per token);
  C128A: every compressed entry so far, ``0 .. (p + 1) // 128 - 1``, in order
  (the tokens of a request share them);
* compressed entries map through the request's compressed block table
  (``256 / ratio`` entries per page) to global slots.

Columns past a row's length hold ``-1`` (or, with ``junk_tail``, random slots
that must be ignored); ``hole_fraction`` of the valid columns are ``-1``;
``empty_tokens`` tokens get length 0 in both rows.  Block tables draw pages at
random from the pools (requests may share pages), so the pools can be far
smaller than the requests' contexts while every row stays a valid set of slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..geometry import SWA_BLOCK_SIZE, WINDOW_SIZE, slots_per_page
from .sparse_mla import PagedCache, paged_cache, random_q, random_sink

__all__ = [
    "WINDOW_RING",
    "DecodeCase",
    "DecodePools",
    "DecodeRows",
    "decode_rows",
    "make_decode_case",
    "make_pools",
]

WINDOW_RING = 4  # window pages per request: 128 + 3 positions never reuse a slot
RATIOS = {"swa": 1, "c4a": 4, "c128a": 128, "c1a": 1, "c2a": 2}
# layers whose compressed rows are the indexer's top-k: C4A, and DeepSeek-V4.1's
# full-length (ratio 1) and ratio-2 layers
TOPK_LAYERS = ("c4a", "c1a", "c2a")


@dataclasses.dataclass
class DecodePools:
    """The FP8 caches a decode step reads: the window pool and the compressed pool."""

    layer: str  # swa | c4a | c128a | c1a | c2a (V4.1)
    swa: PagedCache
    comp: PagedCache | None

    @property
    def comp_block_size(self) -> int | None:
        return None if self.comp is None else self.comp.block_size


@dataclasses.dataclass
class DecodeRows:
    """One step's index rows (int32 global slots) and lengths."""

    swa_indices: torch.Tensor  # [T, 128]
    swa_lens: torch.Tensor  # [T]
    comp_indices: torch.Tensor | None  # [T, width]
    comp_lens: torch.Tensor | None  # [T]


@dataclasses.dataclass
class DecodeCase:
    """Queries, sinks, pools and rows of one decode step of one layer."""

    q: torch.Tensor  # [T, H, 512] bf16
    sink: torch.Tensor  # [H] float32
    pools: DecodePools
    rows: DecodeRows
    tokens_per_request: int

    def kwargs(self, rows: DecodeRows | None = None) -> dict[str, Any]:
        """Keyword arguments of :func:`dsv4_kernels.sparse_mla_decode` /
        ``sparse_mla_paged`` after ``(q, swa_cache, swa_indices, swa_lens, scale)``."""
        r = self.rows if rows is None else rows
        kw: dict[str, Any] = dict(swa_block_size=SWA_BLOCK_SIZE, attn_sink=self.sink)
        if self.pools.comp is not None:
            kw.update(
                comp_cache=self.pools.comp.cache,
                comp_indices=r.comp_indices,
                comp_lens=r.comp_lens,
                comp_block_size=self.pools.comp.block_size,
            )
        return kw

    def sources(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(values, indices, lens) per key source, for a float64 oracle."""
        r = self.rows
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = [
            (self.pools.swa.values, r.swa_indices, r.swa_lens)
        ]
        if self.pools.comp is not None and r.comp_indices is not None:
            out.append((self.pools.comp.values, r.comp_indices, r.comp_lens))
        return out


def make_pools(
    layer: str,
    *,
    swa_pages: int,
    comp_pages: int,
    generator: torch.Generator,
    device: torch.device | str,
    layers_per_block: int = 1,
) -> DecodePools:
    """Filled FP8 pools: ``swa_pages`` window pages of 64 slots and, for C4A/C128A,
    ``comp_pages`` compressed pages of ``256 / ratio`` entries (block-outer views of
    ``layers_per_block`` layers when more than 1, as vLLM allocates them)."""
    if layer not in RATIOS:
        raise ValueError(f"layer must be one of {sorted(RATIOS)}, got {layer!r}")
    swa = paged_cache(swa_pages, SWA_BLOCK_SIZE, generator=generator, device=device,
                      layers_per_block=layers_per_block)  # fmt: skip
    comp = None
    if layer != "swa":
        comp = paged_cache(comp_pages, slots_per_page(RATIOS[layer]), generator=generator,
                           device=device, layers_per_block=layers_per_block)  # fmt: skip
    return DecodePools(layer, swa, comp)


def _randint(high: torch.Tensor, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Uniform integers in ``[0, high)`` per row (``high`` [T] >= 1)."""
    u = torch.rand(shape, generator=g, device=high.device)
    return (u * high.unsqueeze(1).to(torch.float32)).long().clamp(max=high.max().item() - 1)


def decode_rows(
    pools: DecodePools,
    contexts: list[int],
    tokens_per_request: int,
    *,
    generator: torch.Generator,
    topk: int = 512,
    comp_width: int | None = None,
    hole_fraction: float = 0.0,
    empty_tokens: int = 0,
    junk_tail: bool = False,
) -> DecodeRows:
    """Index rows of a decode step: ``len(contexts)`` requests whose last
    ``tokens_per_request`` positions are queried (module docstring).  ``topk`` is the
    C4A row width, ``comp_width`` the C128A one (default: the longest row)."""
    g = generator
    dev = pools.swa.cache.device
    R, G = len(contexts), tokens_per_request
    ctx = torch.tensor(contexts, dtype=torch.int64, device=dev)
    if R and int(ctx.min()) < G:
        raise ValueError(f"every context must hold the {G} queried tokens")
    T = R * G
    req = torch.arange(R, device=dev).repeat_interleave(G)
    pos = ctx[req] - G + torch.arange(T, device=dev) % G
    W, bs = WINDOW_SIZE, SWA_BLOCK_SIZE
    wtable = torch.randint(0, pools.swa.cache.shape[0], (R, WINDOW_RING), generator=g, device=dev)
    wlen = torch.clamp(pos + 1, max=W)
    j = torch.arange(W, device=dev)
    wpos = (pos.unsqueeze(1) - wlen.unsqueeze(1) + 1 + j).clamp(min=0)
    wslot = wtable[req.unsqueeze(1), (wpos // bs) % WINDOW_RING] * bs + wpos % bs
    rows = [(wslot, wlen, W, pools.swa.num_slots)]
    ratio = RATIOS[pools.layer]
    if pools.comp is not None:
        cbs = pools.comp.block_size
        n_c = (pos + 1) // ratio
        top = pools.layer in TOPK_LAYERS
        width = topk if top else (comp_width or max(1, int(n_c.max()) if T else 1))
        comp_len = torch.clamp(n_c, max=width)
        jc = torch.arange(width, device=dev)
        if top:
            entry = _randint(n_c.clamp(min=1), (T, width), g)
        else:
            entry = jc.unsqueeze(0).expand(T, width)
        table_w = max(1, (int(ctx.max()) // ratio) // cbs + 1) if R else 1
        ctable = torch.randint(0, pools.comp.cache.shape[0], (R, table_w), generator=g, device=dev)
        cslot = ctable[req.unsqueeze(1), (entry // cbs).clamp(max=table_w - 1)] * cbs + entry % cbs
        rows.append((cslot, comp_len, width, pools.comp.num_slots))
    built = []
    for slot, length, width, num_slots in rows:
        col = torch.arange(width, device=dev).unsqueeze(0)
        inside = col < length.unsqueeze(1)
        tail = torch.randint(0, max(num_slots, 1), slot.shape, generator=g, device=dev)
        slot = torch.where(inside, slot, tail if junk_tail else torch.full_like(slot, -1))
        if hole_fraction > 0:
            holes = torch.rand(slot.shape, generator=g, device=dev) < hole_fraction
            slot = torch.where(holes & inside, -1, slot)
        length = length.clone()
        length[:empty_tokens] = 0
        built.append((slot.to(torch.int32).contiguous(), length.to(torch.int32)))
    comp = built[1] if len(built) > 1 else (None, None)
    return DecodeRows(built[0][0], built[0][1], comp[0], comp[1])


def make_decode_case(
    layer: str,
    num_requests: int,
    tokens_per_request: int,
    heads: int,
    *,
    context: int | list[int],
    generator: torch.Generator,
    device: torch.device | str,
    pools: DecodePools | None = None,
    swa_pages: int = 0,
    comp_pages: int = 0,
    topk: int = 512,
    comp_width: int | None = None,
    **row_options: Any,
) -> DecodeCase:
    """A decode step of ``num_requests`` requests (each ``context`` tokens long, or a
    list of contexts) and ``heads`` query heads, on ``pools`` (made here when None:
    by default enough pages that no two requests share one)."""
    contexts = [context] * num_requests if isinstance(context, int) else list(context)
    if pools is None:
        longest = max(contexts) if contexts else 1
        ratio = RATIOS[layer]
        per_page = slots_per_page(ratio) if layer != "swa" else 1
        pools = make_pools(
            layer,
            swa_pages=swa_pages or max(1, num_requests) * WINDOW_RING,
            comp_pages=comp_pages or max(1, num_requests) * (longest // ratio // per_page + 1),
            generator=generator,
            device=device,
        )
    rows = decode_rows(pools, contexts, tokens_per_request, generator=generator, topk=topk,
                       comp_width=comp_width, **row_options)  # fmt: skip
    T = num_requests * tokens_per_request
    q = random_q(T, heads, generator=generator, device=device)
    sink = random_sink(heads, generator=generator, device=device)
    return DecodeCase(q, sink, pools, rows, tokens_per_request)
