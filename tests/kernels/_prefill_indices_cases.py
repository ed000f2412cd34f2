"""Random prefill chunks for ``build_prefill_indices`` and the slow per-token spec it must match.

The spec is written straight from the contract in ``dsv4_kernels.prefill_indices``
(module docstring), one token and one column at a time, independent of the
vectorised reference and of the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from dsv4_kernels.testing import generator

WINDOW = 128
WINDOW_BS = 64

# Per-request query lengths of the chunks every prefill row builder (combine, index
# rows, grouped rows) is tested on: one request, empty requests among others, empty
# requests first, a long and a short one.
QUERY_LENS = {
    "single": [37],
    "mixed-with-empty": [5, 0, 17, 1, 0, 9],
    "leading-empty": [0, 0, 23],
    "long-short": [130, 3],
}
over_query_lens = pytest.mark.parametrize(
    "query_lens", list(QUERY_LENS.values()), ids=list(QUERY_LENS)
)


@dataclasses.dataclass
class Case:
    seed: int
    query_start_loc: torch.Tensor  # a slice of a longer tensor, first element > 0
    seq_lens: torch.Tensor  # longer than the batch
    num_tokens: int
    window_table: torch.Tensor  # more rows and columns than needed
    ratio: int  # 1, 4 or 128
    comp_table: torch.Tensor | None
    comp_bs: int
    topk_indices: torch.Tensor | None  # C4A: more rows and columns than used
    topk: int

    def to(self, device: torch.device) -> Case:
        def mv(t: torch.Tensor | None) -> Any:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            query_start_loc=mv(self.query_start_loc),
            seq_lens=mv(self.seq_lens),
            window_table=mv(self.window_table),
            comp_table=mv(self.comp_table),
            topk_indices=mv(self.topk_indices),
        )

    def kwargs(self, *, window: bool = True, compressed: bool = True) -> dict[str, Any]:
        comp = compressed and self.ratio > 1
        return dict(
            num_tokens=self.num_tokens,
            window_block_table=self.window_table if window else None,
            window_block_size=WINDOW_BS,
            window_size=WINDOW,
            compress_ratio=self.ratio if comp else None,
            comp_block_table=self.comp_table if comp else None,
            comp_block_size=self.comp_bs if comp else None,
            topk_indices=self.topk_indices if comp else None,
            topk=self.topk if comp else None,
        )


def _table(
    pages: list[int], extra_cols: int, g: torch.Generator, negative_fraction: float
) -> torch.Tensor:
    """A block table: distinct random page ids in each request's used columns (a few
    negative ones if asked), garbage after them, one leading row (a decode request the
    slice skips) and one trailing row (more rows than requests)."""
    width = max(pages, default=0) + extra_cols
    rows = len(pages) + 2
    table = torch.randint(-3, 50_000, (rows, width), generator=g, dtype=torch.int32)
    perm = torch.randperm(max(sum(pages), 1), generator=g).to(torch.int32) + 1
    at = 0
    for b, n in enumerate(pages):
        ids = perm[at : at + n].clone()
        at += n
        neg = torch.rand(n, generator=g) < negative_fraction
        ids[neg] = -1
        table[b + 1, :n] = ids
    return table[1:]


def make_case(
    seed: int,
    *,
    query_lens: list[int],
    context: tuple[int, int] = (0, 400),
    ratio: int = 4,
    topk: int = 64,
    long_context: int | None = None,
    extra_cols: int = 3,
    extra_topk_cols: int = 5,
    qsl_base: int = 7,
    negative_pages: float = 0.0,
    hole_fraction: float = 0.1,
    beyond_table_fraction: float = 0.05,
) -> Case:
    """A random chunk of ``len(query_lens)`` requests (``long_context`` makes the last one long)."""
    g = generator(seed)
    num_reqs = len(query_lens)
    q = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.randint(context[0], context[1] + 1, (num_reqs,), generator=g)
    if long_context is not None and num_reqs:
        ctx[-1] = long_context
    seq = q + ctx
    T = int(q.sum())
    full_qsl = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.tensor([qsl_base]), qsl_base + q.cumsum(0)]
    ).to(torch.int32)
    seq_lens = torch.cat([seq, torch.randint(0, 9, (2,), generator=g)]).to(torch.int32)
    w_pages = [-(-int(s) // WINDOW_BS) for s in seq]
    window_table = _table(w_pages, extra_cols, g, negative_pages)
    comp_table = topk_indices = None
    comp_bs = 256 // ratio if ratio > 1 else 1
    width = topk if ratio > 1 else 0
    if ratio > 1:
        entries = seq // ratio
        c_pages = [-(-int(e) // comp_bs) for e in entries]
        comp_table = _table(c_pages, extra_cols, g, negative_pages)
    if ratio == 4:
        req = torch.repeat_interleave(torch.arange(num_reqs), q)
        # entries up to 2 past the request's count; 3 extra rows past the chunk's tokens
        n = torch.cat([(entries + 2)[req], torch.full((3,), 9)]).double()[:, None]
        cols = topk + extra_topk_cols
        local = (torch.rand((T + 3, cols), generator=g, dtype=torch.float64) * n).long()
        u = torch.rand((T + 3, cols), generator=g)
        local = torch.where(u < hole_fraction, -1, local)
        beyond = (comp_table.shape[1] + 1) * comp_bs + 5  # type: ignore[union-attr]
        local = torch.where(
            (u >= hole_fraction) & (u < hole_fraction + beyond_table_fraction), beyond, local
        )
        topk_indices = local.to(torch.int32)
    return Case(
        seed,
        full_qsl[1:],
        seq_lens,
        T,
        window_table,
        ratio,
        comp_table,
        comp_bs,
        topk_indices,
        width,
    )


def _slot(table: torch.Tensor, b: int, entry: int, bs: int) -> int:
    page = entry // bs
    if entry < 0 or page >= table.shape[1]:
        return -1
    block = int(table[b, page])
    return -1 if block < 0 else block * bs + entry % bs


def spec_rows(
    case: Case, *, window: bool = True, compressed: bool = True
) -> tuple[list[list[int]], list[int], list[list[int]], list[int]]:
    """(window rows, window lens, compressed rows, compressed lens), one token at a time."""
    qsl = [int(v) - int(case.query_start_loc[0]) for v in case.query_start_loc.tolist()]
    w_rows: list[list[int]] = []
    w_lens: list[int] = []
    c_rows: list[list[int]] = []
    c_lens: list[int] = []
    for t in range(case.num_tokens):
        b = next(i for i in range(len(qsl) - 1) if qsl[i] <= t < qsl[i + 1])
        pos = int(case.seq_lens[b]) - (qsl[b + 1] - qsl[b]) + (t - qsl[b])
        if window:
            start = max(pos - (WINDOW - 1), 0)
            n = max(min(pos + 1, WINDOW), 0)
            w_rows.append(
                [
                    _slot(case.window_table, b, start + j, WINDOW_BS) if j < n else -1
                    for j in range(WINDOW)
                ]
            )
            w_lens.append(n)
        if compressed and case.ratio > 1:
            assert case.comp_table is not None
            n = min(max((pos + 1) // case.ratio, 0), case.topk)
            row = []
            for j in range(case.topk):
                if j >= n:
                    row.append(-1)
                    continue
                entry = int(case.topk_indices[t, j]) if case.topk_indices is not None else j
                row.append(_slot(case.comp_table, b, entry, case.comp_bs))
            c_rows.append(row)
            c_lens.append(n)
    return w_rows, w_lens, c_rows, c_lens
