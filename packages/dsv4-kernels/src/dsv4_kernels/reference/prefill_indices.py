"""Pure-torch reference for the prefill index rows as global cache slots.

Same signature and results as :func:`dsv4_kernels.build_prefill_indices`,
vectorised over tokens (no Python loop per token).  It runs on any device and
is what CPU tensors use unless Triton's interpreter is on.  Validation is the
public wrapper's job: call this through ``dsv4_kernels`` for checked inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = [
    "BlockRows",
    "GroupedPrefillIndices",
    "PrefillIndices",
    "build_grouped_prefill_indices",
    "build_prefill_indices",
    "expand_grouped_rows",
]


class BlockRows(NamedTuple):
    """Compressed rows named by a block table instead of slots, as C128A's rows are
    (every entry of the request so far, in order): token ``t``'s row is request
    ``req[t]``'s entries ``0, 1, ..`` with entry ``e`` at slot ``block_table[req[t], e //
    page] * page + e % page`` (``page``: the compressed cache's entries per page); a
    negative page id is a hole, and the row is ``block_table.shape[1] * page`` entries
    wide.  Its lengths are the call's ``comp_lens``.  Nothing of size tokens x entries is
    built: :func:`dsv4_kernels.sparse_mla_paged` reads the block table itself.

    ``block_table``: ``[R, P]`` int32, contiguous in its last dimension (vLLM's
    compressed block table); ``req``: ``[>= T]`` int32, each token's row of it.
    """

    block_table: torch.Tensor
    req: torch.Tensor

    def slots(self, page_size: int, num_tokens: int) -> torch.Tensor:
        """The same rows as ``[T, P * page_size]`` int32 global slots (-1: a hole)."""
        width = self.block_table.shape[1] * page_size
        entry = torch.arange(width, device=self.block_table.device).expand(num_tokens, width)
        req = self.req[:num_tokens].long()
        live = torch.ones_like(entry, dtype=torch.bool)
        return _slots(req, entry, live, self.block_table, page_size).to(torch.int32)


class PrefillIndices(NamedTuple):
    """Index rows of one prefill chunk, as :func:`dsv4_kernels.sparse_mla_paged` takes them.

    ``window``/``window_lens``: ``[T, W]`` window-cache slots and their
    counts; ``comp``/``comp_lens``: ``[T, topk]`` compressed-cache slots (or, for
    C128A rows built with ``comp_blocks``, :class:`BlockRows`) and their counts.
    A part that was not asked for is None.
    """

    window: torch.Tensor | None
    window_lens: torch.Tensor | None
    comp: torch.Tensor | BlockRows | None
    comp_lens: torch.Tensor | None


def _positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each token, position of each token in its request), int64."""
    qsl = query_start_loc.long() - query_start_loc[:1].long()
    num_reqs = qsl.shape[0] - 1
    t = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True).clamp_(max=max(num_reqs - 1, 0))
    if num_reqs == 0:
        return req, torch.zeros_like(t)
    q_start, q_end = qsl[req], qsl[req + 1]
    pos = seq_lens[:num_reqs].long().to(qsl.device)[req] - (q_end - q_start) + (t - q_start)
    return req, pos


def _slots(
    req: torch.Tensor,
    entry: torch.Tensor,
    live: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``block_table[req, entry // bs] * bs + entry % bs`` where live and the page exists, else -1.

    Pages past the table's width and negative page ids give -1; the table is
    read only where the entry is live.
    """
    page = torch.div(entry, block_size, rounding_mode="floor")
    width = block_table.shape[1]
    live = live & (entry >= 0) & (page < width)
    if width == 0:
        return torch.full_like(entry, -1)
    table = block_table.long()
    safe_req = torch.where(live, req[:, None], 0)
    safe_page = torch.where(live, page, 0)
    block = table[safe_req, safe_page]
    live = live & (block >= 0)
    return torch.where(live, block * block_size + (entry - page * block_size), -1)


def _floor(window_floor: torch.Tensor | None, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Each token's lowest window position: its request's ``window_floor`` (vLLM's SWA
    bounded replay: the request holds window KV from there on), else 0."""
    if window_floor is None or req.numel() == 0:
        return torch.zeros_like(pos)
    return window_floor.long().to(pos.device)[req].clamp(min=0)


def _block_rows(
    table: torch.Tensor, req: torch.Tensor, req_out: torch.Tensor | None, num_tokens: int
) -> BlockRows:
    """C128A rows as :class:`BlockRows`: the compressed block table and each token's
    request (written into ``req_out`` when given)."""
    if req_out is None:
        req_out = torch.empty((num_tokens,), dtype=torch.int32, device=req.device)
    return BlockRows(table, req_out[:num_tokens].copy_(req))


def build_prefill_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    window_block_table: torch.Tensor | None = None,
    window_block_size: int = 64,
    window_size: int = 128,
    compress_ratio: int = 1,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    topk_indices: torch.Tensor | None = None,
    topk: int | None = None,
    window_out: torch.Tensor | None = None,
    window_lens_out: torch.Tensor | None = None,
    comp_out: torch.Tensor | None = None,
    comp_lens_out: torch.Tensor | None = None,
    window_floor: torch.Tensor | None = None,
    comp_blocks: bool = False,
    req_out: torch.Tensor | None = None,
) -> PrefillIndices:
    """Reference of :func:`dsv4_kernels.build_prefill_indices` (same contract)."""
    device = query_start_loc.device
    req, pos = _positions(query_start_loc, seq_lens, num_tokens)
    window = window_lens = comp_lens = None
    comp: torch.Tensor | BlockRows | None = None

    if window_block_table is not None:
        w = window_size
        lo = _floor(window_floor, req, pos)
        swa_start = torch.maximum(pos - (w - 1), lo)
        swa_len = torch.minimum(pos + 1 - swa_start, torch.full_like(pos, w)).clamp(min=0)
        c = torch.arange(w, device=device)[None, :]
        p = swa_start[:, None] + c
        rows = _slots(req, p, c < swa_len[:, None], window_block_table, window_block_size)
        if window_out is None:
            window_out = torch.empty((num_tokens, w), dtype=torch.int32, device=device)
        if window_lens_out is None:
            window_lens_out = torch.empty((num_tokens,), dtype=torch.int32, device=device)
        window = window_out[:num_tokens].copy_(rows)
        window_lens = window_lens_out[:num_tokens].copy_(swa_len)

    if comp_block_table is not None:
        assert topk is not None and comp_block_size is not None
        topk_len = torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp(0, topk)
        if comp_lens_out is None:
            comp_lens_out = torch.empty((num_tokens,), dtype=torch.int32, device=device)
        comp_lens = comp_lens_out[:num_tokens].copy_(topk_len)
        if comp_blocks:
            comp = _block_rows(comp_block_table, req, req_out, num_tokens)
            return PrefillIndices(window, window_lens, comp, comp_lens)
        c = torch.arange(topk, device=device)[None, :]
        in_len = c < topk_len[:, None]
        if topk_indices is not None:
            local = torch.where(in_len, topk_indices[:num_tokens, :topk].long(), -1)
        else:
            local = c.expand(num_tokens, topk)
        rows = _slots(req, local, in_len, comp_block_table, comp_block_size)
        if comp_out is None:
            comp_out = torch.empty((num_tokens, topk), dtype=torch.int32, device=device)
        comp = comp_out[:num_tokens].copy_(rows)

    return PrefillIndices(window, window_lens, comp, comp_lens)


class GroupedPrefillIndices(NamedTuple):
    """Index rows of one prefill chunk whose tokens share their keys in groups.

    The chunk's tokens ``G k .. G k + G - 1`` (``G = group_size``) form a group;
    within it each request's first token is its *leader* (``leads[t]``, the
    group's first token or the first token of a request starting inside it).
    Each source's rows are ``[T, width]`` as in :class:`PrefillIndices`, but
    token ``t`` reads the row of its leader, columns ``starts[t] .. starts[t] +
    lens[t] - 1`` (``comp_starts``: 0).  The window rows are ``W + G - 1``
    wide and every row is filled past its own length with its request's later
    slots, so a leader's row holds every key of the tokens it leads.
    """

    leads: torch.Tensor
    group_size: int
    window: torch.Tensor | None
    window_starts: torch.Tensor | None
    window_lens: torch.Tensor | None
    comp: torch.Tensor | BlockRows | None
    comp_lens: torch.Tensor | None

    def grouping(self) -> dict[str, Any]:
        """The keywords :func:`dsv4_kernels.sparse_mla_paged` takes for these rows'
        groups: ``leads``, ``group_size`` and ``swa_starts`` (``comp_starts`` are 0)."""
        return dict(leads=self.leads, group_size=self.group_size, swa_starts=self.window_starts)


def build_grouped_prefill_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    group_size: int,
    window_block_table: torch.Tensor | None = None,
    window_block_size: int = 64,
    window_size: int = 128,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    compress_ratio: int = 128,
    topk: int | None = None,
    window_floor: torch.Tensor | None = None,
    comp_blocks: bool = False,
    req_out: torch.Tensor | None = None,
) -> GroupedPrefillIndices:
    """Reference of :func:`dsv4_kernels.build_grouped_prefill_indices` (same contract)."""
    device = query_start_loc.device
    req, pos = _positions(query_start_loc, seq_lens, num_tokens)
    qsl = query_start_loc.long() - query_start_loc[:1].long()
    t = torch.arange(num_tokens, device=device)
    num_reqs = qsl.shape[0] - 1
    seq = seq_lens[:num_reqs].long().to(device)[req] if num_reqs else pos + 1
    g = group_size
    q_first = qsl[req] if num_reqs else t
    leads = torch.maximum(torch.div(t, g, rounding_mode="floor") * g, q_first)
    window = window_starts = window_lens = comp_lens = None
    comp: torch.Tensor | BlockRows | None = None
    if window_block_table is not None:
        w = window_size
        lo = _floor(window_floor, req, pos)
        start = torch.maximum(pos - (w - 1), lo)
        lead_start = torch.maximum(pos - (t - leads) - (w - 1), lo)
        window_starts = (start - lead_start).to(torch.int32)
        window_lens = torch.minimum(pos + 1 - start, torch.full_like(pos, w)).clamp(min=0)
        window_lens = window_lens.to(torch.int32)
        c = torch.arange(w + g - 1, device=device)[None, :]
        p = start[:, None] + c
        live = (p < seq[:, None]) & (pos[:, None] >= 0)
        window = _slots(req, p, live, window_block_table, window_block_size).to(torch.int32)
    if comp_block_table is not None:
        assert topk is not None and comp_block_size is not None
        comp_lens = torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp(0, topk)
        comp_lens = comp_lens.to(torch.int32)
        if comp_blocks:
            comp = _block_rows(comp_block_table, req, req_out, num_tokens)
        else:
            entries = torch.div(seq, compress_ratio, rounding_mode="floor").clamp(0, topk)
            c = torch.arange(topk, device=device)[None, :]
            live = c < entries[:, None]
            slots = _slots(req, c.expand(num_tokens, topk), live, comp_block_table, comp_block_size)
            comp = slots.to(torch.int32)
    return GroupedPrefillIndices(
        leads.to(torch.int32), g, window, window_starts, window_lens, comp, comp_lens
    )


def expand_grouped_rows(
    leads: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor | None,
    starts: torch.Tensor | None,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows (``[T, width]``, -1 past each length) and lengths equivalent to
    grouped rows: token ``t``'s columns ``starts[t] ..`` of its leader's row."""
    device = rows.device
    width = rows.shape[1]
    t = torch.arange(num_tokens, device=device)
    first = leads[:num_tokens].long().clamp(0, max(rows.shape[0] - 1, 0))
    st = starts[:num_tokens].long() if starts is not None else torch.zeros_like(t)
    ln = lens[:num_tokens].long() if lens is not None else torch.full_like(t, width)
    ln = torch.minimum(ln.clamp(min=0), (width - st).clamp(min=0))
    c = torch.arange(width, device=device)[None, :]
    src = st[:, None] + c
    valid = c < ln[:, None]
    picked = rows[first[:, None], src.clamp(0, max(width - 1, 0))] if width else rows[first]
    return torch.where(valid, picked, -1).to(torch.int32), ln.to(torch.int32)
