"""FP8 K cache on the views vLLM 0.32 gives (block-outer groups), and bad input.

vLLM allocates each KV-cache group block-outer, so a layer's pages are a
whole block apart and start at a nonzero offset (``dsv4_kernels.testing.k_cache``
builds those views as vLLM does).  Inserting into one layer must leave the
other layers' bytes in the same blocks untouched; every bad argument raises a
``ValueError`` that names it.
"""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels.kv_cache as kvc
from dsv4_kernels.reference import kv_cache as ref
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing import generator as gen
from dsv4_kernels.testing.k_cache import (
    block_outer_k_cache_group,
    block_outer_k_cache_views,
)

from . import _kv_cache_spec as spec
from ._kv_cache_common import (
    GATHERS,
    INSERTS,
    bits_equal,
    first_diff,
    make_keys,
    poisoned_cache,
    poisoned_out,
)

# ------------------------------------------------------------------------ vLLM block-outer views

# (slots per page, layers) runs of one cache group, as vLLM packs DSV4's groups
# (dsv4_kernels.testing.k_cache): three window caches, or the compressed group
# with its C4A pages then its C128A pages, in a block sized by a wider group.
BLOCK_OUTER_GROUPS = {
    "window-3-layers": ([(64, 3)], None),
    "c4a-c128a-group": ([(64, 2), (2, 3)], 4 * 37440),
}


def _block_outer_case(
    group_name: str, run: int, layer: int, seed: int, rank: int
) -> tuple[torch.Tensor, object, torch.Tensor, int]:
    """A random-filled block-outer group; returns (raw, group, the layer's view, block_size)."""
    pages, block_bytes = BLOCK_OUTER_GROUPS[group_name]
    group = block_outer_k_cache_group(5, pages, block_bytes=block_bytes, generator=gen(seed))
    view = group.views[run][layer]
    block_size = view.shape[1]
    if rank == 2:  # the same pages as [num_blocks, page] rows, still a block apart
        page = kvc.k_cache_page_stride(block_size)
        view = torch.as_strided(group.raw, (5, page), (group.block_bytes, 1), view.storage_offset())
    return group.raw, group, view, block_size


def _pages_of(raw: torch.Tensor, group: object, run: int, layer: int) -> torch.Tensor:
    """A page-contiguous copy ``[num_blocks, page]`` of one layer's pages."""
    view = group.views[run][layer]  # type: ignore[attr-defined]
    page = kvc.k_cache_page_stride(view.shape[1])
    start = view.storage_offset()
    return raw.reshape(-1, group.block_bytes)[:, start : start + page].clone()  # type: ignore[attr-defined]


@pytest.mark.parametrize("rank", [3, 2])
@pytest.mark.parametrize(("group_name", "run", "layer"), [
    ("window-3-layers", 0, 1), ("window-3-layers", 0, 2),
    ("c4a-c128a-group", 0, 1), ("c4a-c128a-group", 1, 0), ("c4a-c128a-group", 1, 2),
])  # fmt: skip
@pytest.mark.parametrize("impl", list(INSERTS))
def test_block_outer_views_round_trip(
    impl: str, group_name: str, run: int, layer: int, rank: int
) -> None:
    """Insert into, then gather from, one layer of a block-outer group (vLLM's allocation).

    The layer's pages must hold exactly the spec's bytes, every other byte of
    the allocation (the other layers' pages in the same blocks, the block's
    padding) must be untouched, and the gather must read the spec's values
    (within the FP8 bound of the keys, rope exact) from pages a block apart.
    """
    seed = fresh_seed()
    raw, group, view, block_size = _block_outer_case(group_name, run, layer, seed, rank)
    before = raw.clone()
    mask = group.layer_bytes(run, layer)  # type: ignore[attr-defined]
    n = 5 * block_size  # every slot of the layer's pages, in random order
    slots = torch.randperm(n, generator=gen(seed + 1))
    k = make_keys(n, seed + 2)
    want_pages = spec.spec_insert(_pages_of(raw, group, run, layer), k, slots.tolist(), block_size)
    INSERTS[impl](k, view, slots, block_size)
    got_pages = _pages_of(raw, group, run, layer)
    assert torch.equal(got_pages, want_pages), f"seed {seed}: {first_diff(got_pages, want_pages)}"
    assert torch.equal(raw[~mask], before[~mask]), f"seed {seed}: other layers' bytes changed"

    # gather every slot back, in slot order, through a block table of all pages
    after_insert = raw.clone()
    seq = [5 * block_size]
    table = torch.randperm(5, generator=gen(seed + 3)).to(torch.int32).reshape(1, 5)
    out = poisoned_out((1, seq[0] + 2, 512), seed)
    want = spec.spec_gather(out, want_pages, seq, None, table.tolist(), block_size, 2)
    GATHERS[impl](out, view, torch.tensor(seq, dtype=torch.int32), None, table, block_size, 2)
    assert bits_equal(out, want), f"seed {seed}: gather differs from the spec"
    assert torch.equal(raw, after_insert), f"seed {seed}: the gather wrote to the cache"
    pos_of_slot = {}  # slot -> row of out: the table maps position p to page table[p // bs]
    for p in range(seq[0]):
        pos_of_slot[int(table[0, p // block_size]) * block_size + p % block_size] = p
    rows = torch.tensor([pos_of_slot[int(s)] for s in slots]) + 2
    y, x = out[0, rows].double(), k.double()
    assert torch.equal(y[:, 448:], x[:, 448:]), f"seed {seed}: rope not exact"
    amax = x[:, :448].reshape(n, 7, 64).abs().amax(-1)
    # half an E4M3 unit at the amax's binade, plus the subnormal unit 2**(e - 10)
    e = ref.ue8m0_exponents(amax.float()).double()
    bound = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 4) + torch.exp2(e - 10)
    err = (y[:, :448] - x[:, :448]).reshape(n, 7, 64).abs()
    assert (err <= bound.unsqueeze(-1)).all(), f"seed {seed}: round trip outside the FP8 bound"


def test_block_outer_views_match_the_documented_layout() -> None:
    """The issue's example and the compressed group's offsets (see testing.k_cache)."""
    views = block_outer_k_cache_views(569, 64, 3)
    assert [(tuple(v.shape), v.stride(), v.storage_offset()) for v in views] == [
        ((569, 64, 584), (112320, 584, 1), layer * 37440) for layer in range(3)
    ]
    group = block_outer_k_cache_group(2, [(64, 3), (2, 3)], block_bytes=149760)
    assert group.offsets == ((0, 37440, 74880), (112320, 114048, 115776))
    assert all(v.stride() == (149760, 584, 1) for run in group.views for v in run)


def test_page_stride_is_taken_from_the_view() -> None:
    """Pages any stride >= the page size apart, at any storage offset, like the 2-D cache."""
    seed = fresh_seed()
    block_size = 2
    page = kvc.k_cache_page_stride(block_size)
    k = make_keys(7, seed)
    slots = torch.tensor([0, 5, 3, -1, 8, 9, 1])
    base = poisoned_cache(5, block_size, seed)
    want = spec.spec_insert(base, k, slots.tolist(), block_size)
    for stride, offset in ((page, 0), (page + 576, 0), (3 * page + 16, 40)):
        raw = torch.zeros(offset + 4 * stride + page, dtype=torch.uint8)
        view = torch.as_strided(raw, (5, block_size, 584), (stride, 584, 1), offset)
        for p in range(5):
            raw[offset + p * stride : offset + p * stride + page] = base[p]
        kvc.quantize_and_insert_k_cache(k, view, slots, block_size)
        got = torch.stack([raw[offset + p * stride : offset + p * stride + page] for p in range(5)])
        assert torch.equal(got, want), f"seed {seed} stride {stride} offset {offset}"


# --------------------------------------------------------------------------- bad input


def _insert_args() -> dict[str, object]:
    return {
        "k": make_keys(4, 1),
        "k_cache": kvc.empty_k_cache(2, 64),
        "slot_mapping": torch.arange(4),
        "block_size": 64,
    }


INSERT_ERRORS = [
    ({"k": make_keys(4, 1).float()}, "k must have dtype"),
    ({"k": make_keys(4, 1)[:, :448]}, r"k must be \[num_tokens, 512\]"),
    ({"k": make_keys(4, 1)[:, None]}, "k must be 2-dimensional"),
    ({"k": make_keys(2, 1)}, "k must have at least 4 rows"),
    ({"k_cache": kvc.empty_k_cache(2, 64).view(torch.int8)}, "k_cache must have dtype"),
    ({"k_cache": kvc.empty_k_cache(2, 2)}, r"k_cache must be \[num_pages, >= 37440\]"),
    ({"k_cache": torch.empty(37440, 2, dtype=torch.uint8).t()}, "contiguous in its last dim"),
    ({"k_cache": torch.empty(2, 64, 584, dtype=torch.uint8)}, "at least 37440 bytes apart"),
    (
        {
            "k_cache": torch.as_strided(
                torch.empty(80000, dtype=torch.uint8), (2, 37440), (36864, 1)
            )
        },
        r"at least 37440 bytes apart .*stride\(0\) = 36864",
    ),
    ({"k_cache": torch.empty(2, 64, 600, dtype=torch.uint8)[:, :, :584]}, "3-D k_cache"),
    ({"k_cache": torch.empty(2, 584, 64, dtype=torch.uint8).transpose(1, 2)}, "3-D k_cache"),
    ({"k_cache": torch.empty(2, 32, 584, dtype=torch.uint8)}, r"\[num_pages, 64, 584\] view"),
    ({"slot_mapping": torch.arange(4.0)}, "slot_mapping must have dtype"),
    ({"slot_mapping": torch.arange(8)[::2]}, "slot_mapping must be contiguous"),
    ({"block_size": 0}, "block_size must be > 0"),
    ({"block_size": 64.0}, "block_size must be an int"),
]


@pytest.mark.parametrize(("change", "match"), INSERT_ERRORS)
def test_insert_rejects_bad_input(change: dict[str, object], match: str) -> None:
    args = _insert_args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        kvc.quantize_and_insert_k_cache(**args)  # type: ignore[arg-type]


def _gather_args() -> dict[str, object]:
    return {
        "out": torch.empty(2, 20, 512, dtype=torch.bfloat16),
        "k_cache": kvc.empty_k_cache(3, 2),
        "seq_lens": torch.tensor([6, 3], dtype=torch.int32),
        "gather_lens": torch.tensor([4, 3], dtype=torch.int32),
        "block_table": torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32),
        "block_size": 2,
        "offset": 16,
    }


GATHER_ERRORS = [
    ({"out": torch.empty(2, 20, 512)}, "out must have dtype"),
    ({"out": torch.empty(2, 20, 448, dtype=torch.bfloat16)}, r"out must be \[num_reqs"),
    ({"out": torch.empty(1, 20, 512, dtype=torch.bfloat16)}, r"out must be \[num_reqs"),
    ({"out": torch.empty(2, 512, 20, dtype=torch.bfloat16).transpose(1, 2)}, "out must be contig"),
    ({"out": torch.empty(2, 19, 512, dtype=torch.bfloat16)}, "out has 19 rows.*too short"),
    ({"offset": 17}, "out has 20 rows.*too short"),
    ({"offset": -1}, "offset must be >= 0"),
    ({"k_cache": kvc.empty_k_cache(3, 64)[:, :1000]}, r"k_cache must be \[num_pages, >= 1728\]"),
    (
        {"k_cache": torch.as_strided(torch.empty(5000, dtype=torch.uint8), (3, 1728), (1152, 1))},
        r"at least 1728 bytes apart",
    ),
    ({"k_cache": torch.empty(3, 1728, dtype=torch.int32)}, "k_cache must have dtype"),
    ({"seq_lens": torch.tensor([6.0, 3.0])}, "seq_lens must have dtype"),
    ({"seq_lens": torch.tensor([-1, 3], dtype=torch.int32)}, "seq_lens must be >= 0"),
    ({"gather_lens": torch.tensor([4], dtype=torch.int32)}, "gather_lens must have 2 entries"),
    ({"gather_lens": torch.tensor([7, 3], dtype=torch.int32)}, "gather_lens must be <= seq_lens"),
    ({"gather_lens": torch.tensor([4, -1], dtype=torch.int32)}, "gather_lens must be >= 0"),
    ({"gather_lens": torch.tensor([4.0, 3.0])}, "gather_lens must have dtype"),
    ({"block_table": torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)}, "block_table has 2 col"),
    ({"block_table": torch.tensor([[0, 1, 2]], dtype=torch.int32)}, "block_table must have a row"),
    ({"block_table": torch.zeros(2, 3)}, "block_table must have dtype"),
    ({"block_size": 3}, r"k_cache must be \[num_pages, >= 2304\]"),
]


@pytest.mark.parametrize(("change", "match"), GATHER_ERRORS)
def test_gather_rejects_bad_input(change: dict[str, object], match: str) -> None:
    args = _gather_args()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        kvc.dequantize_and_gather_k_cache(**args)  # type: ignore[arg-type]


def test_gather_accepts_the_good_arguments() -> None:
    """The base arguments of the error table are valid (so each error comes from its change)."""
    args = _gather_args()
    kvc.dequantize_and_gather_k_cache(**args)  # type: ignore[arg-type]
    kvc.quantize_and_insert_k_cache(**_insert_args())  # type: ignore[arg-type]
