"""Inputs for the sparse-attention metadata kernels: prefill batches and top-k rows.

``make_batch`` draws random prefill chunks with every edge the contract has
(empty requests, negative positions, query_start_loc slices, image spans,
top-k entries of -1 and past N); ``combine_bench_inputs`` and
``global_bench_inputs`` build the benchmark's regular shapes (the indexer's
rows as it leaves them); ``random_global_case`` draws global-index inputs
with invalid tokens and entries past the block table.
"""

from __future__ import annotations

import dataclasses

import torch

from ..geometry import TOPK_FLASH, WINDOW_SIZE

__all__ = [
    "Batch",
    "CombineInputs",
    "GlobalInputs",
    "combine_bench_inputs",
    "global_bench_inputs",
    "make_batch",
    "random_global_case",
]


@dataclasses.dataclass
class Batch:
    seed: int
    topk_indices: torch.Tensor | None
    query_start_loc: torch.Tensor  # possibly a slice with a nonzero first element
    seq_lens: torch.Tensor
    gather_lens: torch.Tensor
    window: int
    ratio: int
    topk: int
    M: int
    N: int
    num_tokens: int
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    max_image_tokens: int = 0

    def to(self, device: torch.device) -> Batch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            topk_indices=mv(self.topk_indices),
            query_start_loc=mv(self.query_start_loc),  # type: ignore[arg-type]
            seq_lens=mv(self.seq_lens),  # type: ignore[arg-type]
            gather_lens=mv(self.gather_lens),  # type: ignore[arg-type]
            left=mv(self.left),
            right=mv(self.right),
        )

    def args(self) -> tuple[object, ...]:
        return (
            self.topk_indices,
            self.query_start_loc,
            self.seq_lens,
            self.gather_lens,
            self.window,
            self.ratio,
            self.topk,
            self.M,
            self.N,
        )

    def kwargs(self) -> dict[str, object]:
        if self.left is None:
            return {}
        return {
            "left_visible": self.left,
            "right_visible": self.right,
            "max_image_tokens": self.max_image_tokens,
        }


def make_batch(
    seed: int,
    *,
    query_lens: list[int],
    ratio: int,
    topk: int,
    window: int = 128,
    context: tuple[int, int] = (0, 300),
    extra_topk_cols: int = 0,
    slice_offset: int = 0,
    images: bool = False,
    max_image_tokens: int = 0,
    negative_positions: bool = False,
    generate_topk: bool = False,
    entries_past_n: int = 8,
) -> Batch:
    """A batch of ``len(query_lens)`` requests with random histories and top-k entries.

    ``context`` bounds the tokens each request had before this chunk;
    ``negative_positions`` makes some requests shorter than their query (so
    the first positions are negative); ``slice_offset`` prefixes
    ``query_start_loc`` with that many extra entries and returns a slice.
    """
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int, shape: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)

    num_reqs = len(query_lens)
    q = torch.tensor(query_lens, dtype=torch.int32)
    prior = randint(context[0], context[1] + 1, (num_reqs,))
    seq = q + prior
    if negative_positions and num_reqs:
        shrink = randint(0, 2, (num_reqs,)).bool()
        seq = torch.where(shrink, (q - randint(1, 5, (num_reqs,))).clamp(min=0), seq)
    # the chunk's windows need its q + W - 1 last tokens; gather at least that
    need = torch.minimum(seq, q + window - 1)
    gather = torch.minimum(seq, torch.maximum(randint(0, 400, (num_reqs,)), need))
    if images:  # image windows reach further back than W: gather the whole sequence
        gather = seq.clone()
    num_tokens = int(q.sum())
    # With slice_offset, query_start_loc is a view into a longer tensor (nonzero
    # storage offset) whose first element is the end of earlier requests.
    lead = randint(1, 50, (slice_offset,)).cumsum(0).to(torch.int32)
    start = int(lead[-1]) if slice_offset else 0
    qsl = torch.cat([torch.tensor([start], dtype=torch.int32), start + q.cumsum(0).to(torch.int32)])
    if slice_offset:
        full = torch.cat([torch.zeros(1, dtype=torch.int32), lead[:-1], qsl])
        qsl = full[slice_offset:]
        assert qsl.storage_offset() == slice_offset and int(qsl[0]) == start > 0
    M = int(randint(topk + 600, topk + 5000))
    N = int(randint(max(topk, 1), M - 450))
    topk_indices = None
    if (ratio > 1 or topk > 0) and not generate_topk:  # ratio 1 with a top-k: V4.1
        width = topk + extra_topk_cols
        # includes -1 and, unless entries_past_n is 0, entries >= N
        topk_indices = randint(-1, N + entries_past_n, (num_tokens, width))
    left = right = None
    if images:
        left = randint(0, window + max_image_tokens // 2, (num_tokens,))
        right = randint(0, max_image_tokens // 2 + 1, (num_tokens,))
    return Batch(
        seed,
        topk_indices,
        qsl,
        seq.to(torch.int32),
        gather.to(torch.int32),
        window,
        ratio,
        topk,
        M,
        N,
        num_tokens,
        left,
        right,
        max_image_tokens,
    )


@dataclasses.dataclass
class CombineInputs:
    """Positional arguments of ``combine_topk_swa_indices`` plus what a benchmark needs."""

    args: list[object]  # topk_indices .. N, in the signature's order
    num_tokens: int
    topk: int
    topk_read: int  # top-k entries a kernel must read (the valid prefixes)


def combine_bench_inputs(
    layer: str,
    num_reqs: int,
    query_len: int,
    context: int,
    device: torch.device | str,
    generator: torch.Generator,
    *,
    topk: int = TOPK_FLASH,
    window: int = WINDOW_SIZE,
) -> CombineInputs:
    """``num_reqs`` requests of ``query_len`` new tokens ending at ``context`` tokens.

    ``layer`` is ``c4a`` (the indexer's rows: ``min(topk, (pos+1)//4)``
    random entries of the compressed history, then -1), ``c128a`` (no
    top-k rows, width ``context // 128``) or ``swa``.  The workspace
    gathers each request's last ``query_len + W - 1`` tokens.
    """
    ratio = {"c4a": 4, "c128a": 128, "swa": 1}[layer]
    width = {"c4a": topk, "c128a": context // 128, "swa": 0}[layer]
    b, q = num_reqs, query_len
    T = b * q
    qsl = torch.arange(0, T + 1, q, dtype=torch.int32)
    seq = torch.full((b,), context, dtype=torch.int32)
    gather = torch.full((b,), min(context, q + window - 1), dtype=torch.int32)
    N = -(-context // ratio) if ratio > 1 else 0
    M = N + int(gather.max())
    pos = (context - q) + torch.arange(q).repeat(b)
    topk_len = ((pos + 1) // ratio).clamp(0, width) if ratio > 1 else torch.zeros_like(pos)
    topk_indices = None
    if layer == "c4a":
        vals = torch.randint(0, max(N, 1), (T, width), generator=generator, dtype=torch.int32)
        cols = torch.arange(width)[None, :]
        topk_indices = torch.where(cols < topk_len[:, None], vals, -1).to(device)
    args: list[object] = [
        topk_indices,
        qsl.to(device),
        seq.to(device),
        gather.to(device),
        window,
        ratio,
        width,
        M,
        N,
    ]
    read = int(topk_len.sum()) if topk_indices is not None else 0
    return CombineInputs(args, T, width, read)


@dataclasses.dataclass
class GlobalInputs:
    """Positional arguments of ``compute_global_topk_indices_and_lens`` and the live entries."""

    args: list[object]  # topk_indices, token_to_req_indices, block_table, block_size, is_valid
    num_tokens: int
    live: int  # entries >= 0


def global_bench_inputs(
    num_reqs: int,
    query_len: int,
    context: int,
    device: torch.device | str,
    generator: torch.Generator,
    *,
    topk: int = TOPK_FLASH,
    block_size: int = 64,
) -> GlobalInputs:
    """The C4A indexer's top-k rows of prefill chunks, to map to compressed-cache slots.

    Each token's row holds ``min(topk, (pos + 1) // 4)`` random entries of its
    request's compressed history, then -1 (as the indexer leaves them); each
    request's pages are a random set of twice as many pages as it needs.
    """
    T = num_reqs * query_len
    pos = (context - query_len) + torch.arange(query_len).repeat(num_reqs)
    avail = (pos + 1) // 4  # compressed entries visible to each token
    topk_len = avail.clamp(max=topk)
    entries = torch.floor(torch.rand((T, topk), generator=generator) * avail[:, None])
    rows = torch.where(torch.arange(topk)[None, :] < topk_len[:, None], entries.int(), -1)
    req = torch.arange(num_reqs, dtype=torch.int32).repeat_interleave(query_len)
    pages = -(-context // 4 // block_size)
    table = torch.stack(
        [torch.randperm(pages * num_reqs * 2, generator=generator)[:pages] for _ in range(num_reqs)]
    ).to(torch.int32)
    valid = torch.ones(T, dtype=torch.bool)
    args: list[object] = [
        rows.to(torch.int32).to(device),
        req.to(device),
        table.to(device),
        block_size,
        valid.to(device),
    ]
    return GlobalInputs(args, T, int(topk_len.sum()))


def random_global_case(
    seed: int, num_tokens: int, width: int, block_size: int, num_reqs: int, pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_indices, token_to_req, block_table, is_valid) with every edge of the contract.

    Entries are -1, valid, or on a page past the table; about a quarter of the
    tokens are invalid (padding) and carry request ids that must never be read.
    """
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(
        -1, pages * block_size + 3 * block_size, (num_tokens, width), generator=g, dtype=torch.int32
    )
    req = torch.randint(0, max(num_reqs, 1), (num_tokens,), generator=g, dtype=torch.int32)
    valid = torch.rand(num_tokens, generator=g) > 0.25
    req = torch.where(valid, req, torch.full_like(req, 10**6))
    table = torch.randint(0, 100_000, (num_reqs, pages), generator=g, dtype=torch.int32)
    return topk, req, table, valid
