"""Random prefill chunks (vLLM's metadata with random page assignments) for the prefill
index rows: :func:`make_prefill_index_case` and the :class:`PrefillIndexCase` it returns,
shared by tests, benchmarks and docs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..geometry import SWA_BLOCK_SIZE, WINDOW_SIZE, slots_per_page
from ..prefill_indices import PrefillIndices, build_prefill_indices

__all__ = ["PrefillIndexCase", "make_prefill_index_case"]


@dataclasses.dataclass
class PrefillIndexCase:
    """A prefill chunk's metadata as vLLM holds it, with random page assignments.

    Made by :func:`make_prefill_index_case`; :meth:`build` times or checks
    :func:`build_prefill_indices` on it.  Caches for it need
    ``window_num_pages`` window pages and ``comp_num_pages`` compressed pages.
    """

    query_start_loc: torch.Tensor  # a slice with a nonzero first element
    seq_lens: torch.Tensor
    num_tokens: int
    window_block_table: torch.Tensor
    window_num_pages: int
    compress_ratio: int  # 1, 4 or 128; V4.1's 1 or 2 with top-k rows
    comp_block_table: torch.Tensor | None
    comp_num_pages: int
    topk_indices: torch.Tensor | None  # top-k rows only (C4A, V4.1)
    topk: int  # compressed row width (0 for SWA-only)
    window_block_size: int = SWA_BLOCK_SIZE
    window_size: int = WINDOW_SIZE

    @property
    def compressed(self) -> bool:
        """Whether the chunk's layer reads a compressed cache."""
        return self.comp_block_table is not None

    @property
    def comp_block_size(self) -> int:
        return slots_per_page(self.compress_ratio) if self.compressed else 1

    def build(
        self,
        *,
        window: bool = True,
        compressed: bool = True,
        window_out: torch.Tensor | None = None,
        window_lens_out: torch.Tensor | None = None,
        comp_out: torch.Tensor | None = None,
        comp_lens_out: torch.Tensor | None = None,
        comp_blocks: bool = False,
    ) -> PrefillIndices:
        """The rows (window and/or compressed) through :func:`build_prefill_indices`
        (``comp_blocks``: C128A's as ``BlockRows``)."""
        comp = compressed and self.compressed
        return build_prefill_indices(
            self.query_start_loc,
            self.seq_lens,
            num_tokens=self.num_tokens,
            window_block_table=self.window_block_table if window else None,
            window_block_size=self.window_block_size,
            window_size=self.window_size,
            compress_ratio=self.compress_ratio if comp else None,
            comp_block_table=self.comp_block_table if comp else None,
            topk_indices=self.topk_indices if comp else None,
            topk=self.topk if comp else None,
            window_out=window_out,
            window_lens_out=window_lens_out,
            comp_out=comp_out,
            comp_lens_out=comp_lens_out,
            comp_blocks=comp_blocks,
        )


def _random_tables(
    pages_per_req: list[int], extra_cols: int, g: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Distinct random page ids per request; ``extra_cols`` unused columns of garbage."""
    total = sum(pages_per_req)
    perm = torch.randperm(max(total, 1), generator=g).to(torch.int32)
    width = max(pages_per_req, default=0) + extra_cols
    table = torch.randint(-5, 10**6, (len(pages_per_req), width), generator=g, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[at : at + n]
        at += n
    return table, max(total, 1)


def make_prefill_index_case(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    compress_ratio: int,
    topk: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    extra_table_cols: int = 3,
    qsl_base: int = 5,
    hole_fraction: float = 0.0,
    topk_rows: bool | None = None,
) -> PrefillIndexCase:
    """A random prefill chunk: request ``b`` has ``context_lens[b]`` cached tokens, then its query.

    Block tables map every page a request uses to distinct random pages (plus
    ``extra_table_cols`` columns of garbage past them); ``query_start_loc``
    is a slice of a longer tensor whose first element is ``qsl_base``.  C4A
    top-k rows pick ``min(topk, entries)`` distinct request-local entries
    (stratified over the token's entries, in random order; -1 after them),
    then turn ``hole_fraction`` of them into -1.  ``topk`` defaults to 512
    for C4A and to the longest request's entry count for C128A.  ``topk_rows``
    (default: ratio 4) gives top-k rows at any ratio: DeepSeek-V4.1's
    full-length (1) and ratio-2 layers.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens must have the same length")
    if topk_rows is None:
        topk_rows = compress_ratio == 4
    if compress_ratio not in (1, 2, 4, 128) or (topk_rows and compress_ratio == 128):
        raise ValueError(
            f"compress_ratio must be 1, 4 or 128, or 1, 2 or 4 with top-k rows, got "
            f"{compress_ratio} (topk_rows={topk_rows})"
        )
    g = torch.Generator().manual_seed(seed)
    q = torch.tensor(list(query_lens), dtype=torch.int64)
    seq = q + torch.tensor(list(context_lens), dtype=torch.int64)
    num_tokens = int(q.sum())
    qsl_full = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.full((1,), qsl_base), qsl_base + q.cumsum(0)]
    ).to(torch.int32)
    w_pages = [-(-int(s) // SWA_BLOCK_SIZE) for s in seq]
    w_table, w_num = _random_tables(w_pages, extra_table_cols, g)
    comp_table = None
    comp_num = 0
    topk_indices = None
    width = 0
    if compress_ratio > 1 or topk_rows:
        bs = slots_per_page(compress_ratio)
        entries = seq // compress_ratio
        comp_table, comp_num = _random_tables(
            [-(-int(e) // bs) for e in entries], extra_table_cols, g
        )
        if topk_rows:
            width = 512 if topk is None else topk
            req = torch.repeat_interleave(torch.arange(len(q)), q)
            t = torch.arange(num_tokens)
            start = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)[:-1]])
            pos = seq[req] - q[req] + (t - start[req])
            n = ((pos + 1) // compress_ratio)[:, None]
            j = torch.arange(width)[None, :]
            # n >= width: one entry from each of `width` integer strata of [0, n)
            lo = j * n // width
            hi = (j + 1) * n // width
            u = torch.rand((num_tokens, width), generator=g, dtype=torch.float64)
            pick = lo + (u * (hi - lo).double()).floor().long()
            local = torch.where(n >= width, pick, torch.where(j < n, j, -1))
            # shuffle each row's live prefix; the -1 tail stays at the end
            keys = torch.rand((num_tokens, width), generator=g)
            keys = torch.where(j < n, keys, 2.0)
            local = torch.gather(local, 1, keys.argsort(dim=1))
            if hole_fraction > 0:
                holes = torch.rand((num_tokens, width), generator=g) < hole_fraction
                local = torch.where(holes, -1, local)
            topk_indices = local.to(torch.int32)
        else:
            width = max(int(entries.max()) if len(q) else 0, 1) if topk is None else topk
    dev = torch.device(device)

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return PrefillIndexCase(
        query_start_loc=qsl_full.to(dev)[1:],
        seq_lens=seq.to(torch.int32).to(dev),
        num_tokens=num_tokens,
        window_block_table=w_table.to(dev),
        window_num_pages=w_num,
        compress_ratio=compress_ratio,
        comp_block_table=mv(comp_table),
        comp_num_pages=comp_num,
        topk_indices=mv(topk_indices),
        topk=width,
    )
