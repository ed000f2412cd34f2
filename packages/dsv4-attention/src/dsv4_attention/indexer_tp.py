"""The decode indexer split across vLLM's tensor-parallel group (issue 40).

Under TP, vLLM replicates DSV4's lightning indexer: every rank scores every compressed
entry of every row with the same inputs (the index query and weights come from the
all-reduced hidden states, the index cache is written alike on every rank).  Rows are
independent, and the top-k of a union is the top-k of its parts' top-ks, so each rank
can do a share and the ranks exchange results through vLLM's own TP group:

* **rows**: with at least as many rows as ranks, rank ``r`` computes rows ``[r * c,
  min((r + 1) * c, R))`` (``c = ceil(R / P)``; ``dsv4_kernels.indexer_decode_topk``
  with ``row_offset``) into a ``[c, topk]`` slice; an all-gather of the slices is the
  step's ``[R, topk]`` (later ranks' unused rows land past row ``R``), copied into
  vLLM's top-k buffer;
* **keys**: every rank scores its contiguous share of every row's entries and lists
  its top-k with scores (``indexer_shard_topk``, ``[R, 2 * topk]`` int32); after the
  all-gather each rank selects the top-k of all ranks' candidates
  (``indexer_merge_topk``): exactly the unsharded top-k, ties lowest position first.

The exchange is ``GroupCoordinator.all_gather`` of vLLM's TP group (the int32 results'
bits as float32), the call vLLM's own layers make (its PyNCCL communicator on CUDA,
captured in decode CUDA graphs as vLLM's collectives are; its CPU communicator on CPU).
What a step runs depends on host facts only (the row count, the measured table, the
engine's longest context), identical on every rank, so every rank joins the same
exchange.  Whether a kind may split is
decided at start-up, on every rank at the same first call (vLLM's profile run), and
agreed over vLLM's CPU group: if one rank cannot split, none does.

An exception of ours raised before the exchange is raised on every rank alike (same
shapes, same code), and each then runs vLLM's replicated op.  A fault on one rank only
(a device fault) leaves the others in the collective, as it would vLLM's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .facts import IndexerFacts, ServingConfig

__all__ = [
    "SPLITS",
    "TpShare",
    "agree",
    "read_tp",
    "row_share",
    "run_split",
    "split_elements",
]

SPLITS = ("rows", "keys")


@dataclass(frozen=True)
class TpShare:
    """This rank's place in vLLM's TP group (``group``: its ``GroupCoordinator``)."""

    size: int
    rank: int
    group: Any

    @property
    def text(self) -> str:
        return f"TP{self.size}"


def capturable(group: Any) -> bool:
    """Whether vLLM's TP collectives can be captured in a CUDA graph: its CUDA
    communicator's PyNCCL is there and enabled (what vLLM's all-gather then runs)."""
    comm = getattr(group, "device_communicator", None)
    pynccl = getattr(comm, "pynccl_comm", None)
    return pynccl is not None and not bool(getattr(pynccl, "disabled", True))


def read_tp(group: Any, serving: ServingConfig, device: torch.device) -> tuple[TpShare | None, str]:
    """This rank's share of the indexer, or None with the reason it keeps the whole.

    vLLM's TP group is the ranks that replicate this rank's indexer: under data
    parallelism each DP rank has its own (its own batch), under pipeline parallelism
    each stage (its own layers), so neither changes what is split; DCP (vLLM's decode
    context parallelism shards the keys itself) and DBO (``IndexerPart.run`` declines
    dual-batch steps) keep vLLM's indexer."""
    if group is None:
        return None, "no tensor-parallel group"
    size = int(getattr(group, "world_size", 1))
    if size <= 1:
        return None, "TP1"
    if serving.dcp > 1:
        return None, f"decode context parallelism (DCP {serving.dcp}) is vLLM's own"
    if device.type == "cuda" and serving.cudagraph_mode != "NONE" and not capturable(group):
        return None, "vLLM's TP group has no PyNCCL communicator to capture the exchange"
    if getattr(group, "cpu_group", None) is None:
        return None, "vLLM's TP group has no CPU group to agree at start-up"
    return TpShare(size, int(group.rank_in_group), group), f"TP{size}"


def agree(share: TpShare, ok: bool) -> bool:
    """Whether every rank of the group is ``ok`` (start-up only: a host collective over
    vLLM's CPU group, which every rank reaches at the same first call)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(
        flag, op=torch.distributed.ReduceOp.MIN, group=share.group.cpu_group
    )
    return bool(flag.item())


def row_share(rows: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first row, end row, slice rows ``c``) of ``rank``'s rows of a step of ``rows``."""
    c = -(-rows // size)
    first = min(rank * c, rows)
    return first, min(first + c, rows), c


def split_elements(facts: IndexerFacts, size: int) -> dict[str, tuple[int, int]]:
    """Per split: (float32 scores, int32 candidate elements) of the largest step."""
    rows, width = facts.max_rows, max(facts.max_entries, 1)
    return {
        "rows": (-(-rows // size) * width, -(-rows // size) * facts.topk),
        "keys": (rows * -(-width // size), rows * 2 * facts.topk),
    }


def _all_gather(share: TpShare, part: torch.Tensor) -> torch.Tensor:
    """vLLM's TP all-gather of an int32 ``part`` along rows, its bits carried as float32
    (a gather copies bytes; vLLM's CPU shared-memory communicator gathers no int32)."""
    return share.group.all_gather(part.view(torch.float32), dim=0).view(torch.int32)


def run_split(
    split: str,
    share: TpShare,
    facts: IndexerFacts,
    *,
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    lens: torch.Tensor,
    block_table: torch.Tensor,
    rows: int,
    rows_per_request: int,
    out: torch.Tensor,
    padded_rows: int,
    scores: torch.Tensor,
    local: torch.Tensor,
) -> None:
    """One decode step's top-k, ``split`` across the group (module docstring), into
    ``out`` (vLLM's top-k buffer: rows ``rows .. padded_rows - 1`` set to -1).
    ``scores`` (float32) and ``local`` (int32) are flat scratch of
    :func:`split_elements`' sizes."""
    from dsv4_kernels import indexer_decode_topk, indexer_merge_topk, indexer_shard_topk

    topk, size = facts.topk, share.size
    if split == "rows":
        first, end, c = row_share(rows, size, share.rank)
        part = local[: c * topk].view(c, topk)
        if end > first:
            n = end - first
            width = max(facts.max_entries, 1)
            indexer_decode_topk(
                q[first:end], weights[first:end], cache, lens[first:end], None, block_table,
                topk, part, max_entries=facts.max_entries,
                scores=scores[: n * width].view(n, width),
                rows_per_request=rows_per_request, row_offset=first,
            )  # fmt: skip
        gathered = _all_gather(share, part)  # [size * c, topk]: rows in order
        out[:rows, :topk].copy_(gathered[:rows])
        if padded_rows > rows:
            out[rows:padded_rows, :topk].fill_(-1)
        return
    if split != "keys":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    width = -(-max(facts.max_entries, 1) // size)
    part = local[: rows * 2 * topk].view(rows, 2 * topk)
    indexer_shard_topk(
        q[:rows], weights, cache, lens, None, block_table, topk, part,
        shard=share.rank, shards=size, max_entries=facts.max_entries,
        scores=scores[: rows * width].view(rows, width), rows_per_request=rows_per_request,
    )  # fmt: skip
    gathered = _all_gather(share, part)  # [size * rows, 2 * topk], rank-major
    indexer_merge_topk(gathered, topk, out, shards=size, clear_rows=padded_rows)
