"""Random prefill batches for the metadata tests (fresh inputs on every run)."""

from __future__ import annotations

import dataclasses
import os

import torch


def fresh_seed() -> int:
    """A new seed per call; tests put it in their failure messages."""
    return int.from_bytes(os.urandom(4), "little")


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
    if ratio > 1 and not generate_topk:
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
