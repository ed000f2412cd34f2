"""combine_topk_swa_indices and compute_global_topk_indices_and_lens.

Both the Triton kernels (through the interpreter on CPU, compiled on CUDA)
and the vectorised torch reference are compared, element by element, with
the slow spec references in ``spec.py`` on fresh random inputs; outputs are
poisoned before every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_kernels as dk
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import POISON, fresh_seed
from dsv4_kernels.testing.metadata import Batch, make_batch, random_global_case

from ._prefill_indices_cases import over_query_lens
from .spec import combined_width, spec_combine, spec_global

Combine = Callable[..., tuple[torch.Tensor, torch.Tensor]]
IMPLS = {"triton": dk.combine_topk_swa_indices, "reference": ref.combine_topk_swa_indices}


def run_and_check(impl: Combine, batch: Batch, device: torch.device) -> None:
    """Poison ``out``, run ``impl`` into it, compare every element with the spec."""
    b = batch.to(device)
    width = combined_width(b.topk, b.window, b.max_image_tokens)
    out = torch.full((b.num_tokens, width), POISON, dtype=torch.int32, device=device)
    combined, lens = impl(*b.args(), out=out, **b.kwargs())
    assert combined.data_ptr() == out.data_ptr(), "out= was not used"
    rows, want_lens = spec_combine(
        batch.topk_indices,
        batch.query_start_loc,
        batch.seq_lens,
        batch.gather_lens,
        batch.window,
        batch.ratio,
        batch.topk,
        batch.M,
        batch.N,
        batch.num_tokens,
        batch.left,
        batch.right,
        batch.max_image_tokens,
    )
    got = combined.cpu()
    assert not (got == POISON).any(), f"seed {batch.seed}: unwritten output elements"
    want = torch.tensor(rows, dtype=torch.int32).reshape(b.num_tokens, width)
    mismatch = (got != want).nonzero()
    assert mismatch.numel() == 0, (
        f"seed {batch.seed}: {mismatch.shape[0]} mismatches, first at {mismatch[0].tolist()}: "
        f"got {got[tuple(mismatch[0])]}, want {want[tuple(mismatch[0])]}"
    )
    assert lens.dtype == torch.int32
    assert lens.cpu().tolist() == want_lens, f"seed {batch.seed}: lens differ"
    # Without out=, the same result in a fresh allocation.
    again, lens2 = impl(*b.args(), **b.kwargs())
    assert torch.equal(again.cpu(), want) and torch.equal(lens2.cpu(), lens.cpu())


LAYERS = {
    # name: (ratio, topk, generate_topk)
    "c4a": (4, 64, False),
    "c128a": (128, 8, False),
    "c128a-generated": (128, 8, True),
    "swa": (1, 0, False),
    # DeepSeek-V4.1's top-k layers (full-length ratio 1, ratio 2), as its combine reads them
    "c1a": (1, 64, False),
    "c2a": (2, 64, False),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("layer", list(LAYERS))
@over_query_lens
def test_combine_matches_spec(
    impl: str, layer: str, query_lens: list[int], kernel_device: torch.device
) -> None:
    ratio, topk, generate = LAYERS[layer]
    device = kernel_device if impl == "triton" else torch.device("cpu")
    batch = make_batch(
        fresh_seed(),
        query_lens=query_lens,
        ratio=ratio,
        topk=topk,
        extra_topk_cols=5,
        generate_topk=generate,
        context=(0, 600),
    )
    run_and_check(IMPLS[impl], batch, device)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("slice_offset", [1, 4])
def test_combine_query_start_loc_slice(
    impl: str, slice_offset: int, kernel_device: torch.device
) -> None:
    device = kernel_device if impl == "triton" else torch.device("cpu")
    batch = make_batch(
        fresh_seed(), query_lens=[7, 0, 12], ratio=4, topk=32, slice_offset=slice_offset
    )
    assert batch.query_start_loc.storage_offset() > 0 and int(batch.query_start_loc[0]) > 0
    run_and_check(IMPLS[impl], batch, device)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("layer", ["c4a", "swa"])
def test_combine_images(impl: str, layer: str, kernel_device: torch.device) -> None:
    ratio, topk, _ = LAYERS[layer]
    device = kernel_device if impl == "triton" else torch.device("cpu")
    batch = make_batch(
        fresh_seed(), query_lens=[9, 14], ratio=ratio, topk=topk, images=True, max_image_tokens=96
    )
    run_and_check(IMPLS[impl], batch, device)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_combine_negative_positions(impl: str, kernel_device: torch.device) -> None:
    device = kernel_device if impl == "triton" else torch.device("cpu")
    batch = make_batch(
        fresh_seed(),
        query_lens=[6, 4, 8],
        ratio=4,
        topk=16,
        negative_positions=True,
        context=(0, 0),
    )
    run_and_check(IMPLS[impl], batch, device)
    # A request shorter than its query: its first rows are all -1 with length 0.
    b = make_batch(1, query_lens=[4], ratio=4, topk=16)
    b.seq_lens = torch.tensor([2], dtype=torch.int32)
    b.gather_lens = torch.tensor([2], dtype=torch.int32)
    combined, lens = IMPLS[impl](*b.to(device).args())
    assert lens.cpu().tolist() == [0, 0, 1, 2]
    assert (combined[:2].cpu() == -1).all()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_combine_no_tokens(impl: str, kernel_device: torch.device) -> None:
    device = kernel_device if impl == "triton" else torch.device("cpu")
    batch = make_batch(fresh_seed(), query_lens=[0, 0], ratio=4, topk=16)
    combined, lens = IMPLS[impl](*batch.to(device).args())
    assert combined.shape == (0, 256) and lens.shape == (0,)


@settings(max_examples=60, deadline=None)
@given(
    query_lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    layer=st.sampled_from(list(LAYERS)),
    images=st.booleans(),
    negative=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_combine_properties(
    query_lens: list[int], layer: str, images: bool, negative: bool, seed: int
) -> None:
    """docs/design.md invariants on the reference, for any batch hypothesis can build."""
    ratio, topk, generate = LAYERS[layer]
    b = make_batch(
        seed,
        query_lens=query_lens,
        ratio=ratio,
        topk=topk,
        generate_topk=generate,
        images=images,
        max_image_tokens=64 if images else 0,
        negative_positions=negative,
        entries_past_n=0,  # so a row's top-k part and window part can be told apart
    )
    combined, lens = ref.combine_topk_swa_indices(*b.args(), **b.kwargs())
    width = combined_width(b.topk, b.window, b.max_image_tokens)
    assert combined.shape == (b.num_tokens, width)
    cols = torch.arange(width)
    # every column at or past lens is -1
    assert (combined[cols[None, :] >= lens[:, None].long()] == -1).all()
    assert (lens >= 0).all() and (lens <= width).all()
    qsl = b.query_start_loc.long() - int(b.query_start_loc[0])
    req = torch.searchsorted(qsl[1:], torch.arange(b.num_tokens), right=True)
    live = combined != -1
    # every live entry lies inside its request's workspace rows
    lo, hi = (req * b.M)[:, None], ((req + 1) * b.M)[:, None]
    assert ((combined >= lo) & (combined < hi) | ~live).all()
    # top-k entries come before the window; the window is consecutive rows from N
    topk_part = live & (combined < lo + b.N)
    swa = (combined >= lo + b.N) & live
    last_topk = torch.where(topk_part, cols, -1).amax(dim=1)
    first_swa = torch.where(swa, cols, width).amin(dim=1)
    assert (last_topk < first_swa).all()
    diffs = combined[:, 1:] - combined[:, :-1]
    assert ((diffs == 1) | ~(swa[:, 1:] & swa[:, :-1])).all()
    # the result is the same for the sliced view of a longer query_start_loc
    longer = torch.cat([torch.tensor([0], dtype=torch.int32), b.query_start_loc + 17])
    shifted, lens2 = ref.combine_topk_swa_indices(
        b.topk_indices, longer[1:], *b.args()[2:], **b.kwargs()
    )
    assert torch.equal(shifted, combined) and torch.equal(lens2, lens)


# --- compute_global_topk_indices_and_lens -----------------------------------------------

GLOBAL_IMPLS = {
    "triton": dk.compute_global_topk_indices_and_lens,
    "reference": ref.compute_global_topk_indices_and_lens,
}


@pytest.mark.parametrize("impl", list(GLOBAL_IMPLS))
@pytest.mark.parametrize("block_size", [64, 2])
@pytest.mark.parametrize("num_tokens,width", [(1, 16), (29, 96), (64, 512)])
def test_global_matches_spec(
    impl: str, block_size: int, num_tokens: int, width: int, kernel_device: torch.device
) -> None:
    device = kernel_device if impl == "triton" else torch.device("cpu")
    seed = fresh_seed()
    topk, req, table, valid = random_global_case(seed, num_tokens, width, block_size, 3, 5)
    for valid_t in (valid, valid.to(torch.int32)):
        out = torch.full((num_tokens, width), POISON, dtype=torch.int32, device=device)
        lens_out = torch.full((num_tokens,), POISON, dtype=torch.int32, device=device)
        got, lens = GLOBAL_IMPLS[impl](
            topk.to(device),
            req.to(device),
            table.to(device),
            block_size,
            valid_t.to(device),
            out=out,
            lens_out=lens_out,
        )
        assert got.data_ptr() == out.data_ptr() and lens.data_ptr() == lens_out.data_ptr()
        rows, want_lens = spec_global(topk, req, table, block_size, valid)
        assert got.cpu().tolist() == rows, f"seed {seed}"
        assert lens.cpu().tolist() == want_lens, f"seed {seed}"
    fresh, fresh_lens = GLOBAL_IMPLS[impl](
        topk.to(device), req.to(device), table.to(device), block_size, valid.to(device)
    )
    assert fresh.cpu().tolist() == rows and fresh_lens.cpu().tolist() == want_lens


def test_global_empty_table_reads_nothing(kernel_device: torch.device) -> None:
    """A table with zero pages: every entry is past the table, nothing is read."""
    topk = torch.randint(-1, 50, (7, 16), dtype=torch.int32, device=kernel_device)
    req = torch.zeros(7, dtype=torch.int32, device=kernel_device)
    table = torch.empty((1, 0), dtype=torch.int32, device=kernel_device)
    valid = torch.ones(7, dtype=torch.bool, device=kernel_device)
    out, lens = dk.compute_global_topk_indices_and_lens(topk, req, table, 64, valid)
    assert (out == -1).all() and (lens == 0).all()


# --- bad input --------------------------------------------------------------------------


def good_combine_args() -> dict[str, object]:
    b = make_batch(3, query_lens=[4, 2], ratio=4, topk=16)
    return dict(
        topk_indices=b.topk_indices,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        gather_lens=b.gather_lens,
        window_size=128,
        compress_ratio=4,
        topk=16,
        M=b.M,
        N=b.N,
    )


def _meta_like(t: object) -> torch.Tensor:
    assert isinstance(t, torch.Tensor)
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must have dtype torch.int32"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc must"),
        (lambda a: a.update(topk_indices=a["topk_indices"].long()), "topk_indices must have dtype"),
        (lambda a: a.update(gather_lens=a["gather_lens"][:1]), "gather_lens must have 2 entries"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "query_start_loc must have"),
        (lambda a: a.update(seq_lens=a["seq_lens"][None]), "seq_lens must be 1-dimensional"),
        (lambda a: a.update(topk_indices=a["topk_indices"][0]), "topk_indices must be 2-dim"),
        (lambda a: a.update(seq_lens=_meta_like(a["seq_lens"])), "seq_lens must be on cpu"),
        (lambda a: a.update(compress_ratio=3), "compress_ratio must be one of"),
        (lambda a: a.update(topk=17), r"topk \(17\) is wider than topk_indices"),
        (lambda a: a.update(M=-1), "M must be >= 0"),
        (lambda a: a.update(N=-5), "N must be >= 0"),
        (lambda a: a.update(window_size=0), "window_size must be > 0"),
        (
            lambda a: a.update(compress_ratio=1, topk_indices=None),
            "topk must be 0 for SWA-only",
        ),
        (lambda a: a.update(topk_indices=None), "topk_indices may be None only"),
        (
            lambda a: a.update(out=torch.empty((6, 128), dtype=torch.int32)),
            r"out must have shape \(>= 6, 256\)",
        ),
        (lambda a: a.update(out=torch.empty((6, 256), dtype=torch.int64)), "out must have dtype"),
        (lambda a: a.update(left_visible=torch.zeros(6, dtype=torch.int32)), "given together"),
        (
            lambda a: a.update(
                left_visible=torch.zeros(5, dtype=torch.int32),
                right_visible=torch.zeros(5, dtype=torch.int32),
            ),
            "left_visible must have 6",
        ),
    ],
)
def test_combine_bad_input(change: Callable[[dict[str, object]], None], match: str) -> None:
    args = good_combine_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        dk.combine_topk_swa_indices(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(topk_indices=a["topk_indices"].long()), "topk_indices must have dtype"),
        (
            lambda a: a.update(token_to_req_indices=a["token_to_req_indices"][:3]),
            "token_to_req_indices must have at least 8",
        ),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table must have dtype"),
        (lambda a: a.update(block_table=a["block_table"][0]), "block_table must be 2-dim"),
        (lambda a: a.update(block_size=0), "block_size must be > 0"),
        (
            lambda a: a.update(is_valid_token=a["is_valid_token"].float()),
            "is_valid_token must have dtype",
        ),
        (
            lambda a: a.update(is_valid_token=_meta_like(a["is_valid_token"])),
            "is_valid_token must be on cpu",
        ),
        (
            lambda a: a.update(out=torch.empty((8, 15), dtype=torch.int32)),
            r"out must have shape \(8, 16\)",
        ),
    ],
)
def test_global_bad_input(change: Callable[[dict[str, object]], None], match: str) -> None:
    topk, req, table, valid = random_global_case(5, 8, 16, 64, 2, 3)
    args: dict[str, object] = dict(
        topk_indices=topk,
        token_to_req_indices=req,
        block_table=table,
        block_size=64,
        is_valid_token=valid,
    )
    change(args)
    with pytest.raises(ValueError, match=match):
        dk.compute_global_topk_indices_and_lens(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_combine_num_tokens_for_generated_topk(impl: str, kernel_device: torch.device) -> None:
    """C128A without topk_indices: num_tokens= gives the count without a device read."""
    device = kernel_device if impl == "triton" else torch.device("cpu")
    b = make_batch(
        fresh_seed(),
        query_lens=[11, 0, 6],
        ratio=128,
        topk=8,
        generate_topk=True,
        context=(0, 2000),
    ).to(device)
    want = IMPLS[impl](*b.args())  # count read back from query_start_loc
    got = IMPLS[impl](*b.args(), num_tokens=b.num_tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape[0] == 17


def test_combine_num_tokens_must_match_topk_rows() -> None:
    b = make_batch(2, query_lens=[5], ratio=4, topk=16)
    with pytest.raises(ValueError, match="topk_indices must have 4 entries"):
        dk.combine_topk_swa_indices(*b.args(), num_tokens=4)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        dk.combine_topk_swa_indices(*b.args(), num_tokens=-1)


def test_cpu_tensors_use_the_reference_without_the_interpreter() -> None:
    """Without TRITON_INTERPRET, CPU tensors take the torch reference, not Triton."""
    import subprocess
    import sys

    code = (
        "import torch, dsv4_kernels as dk, dsv4_kernels.reference.metadata as r\n"
        "calls = []\n"
        "orig = r.combine_topk_swa_indices\n"
        "r.combine_topk_swa_indices = lambda *a, **k: calls.append(1) or orig(*a, **k)\n"
        "q = torch.tensor([0, 3], dtype=torch.int32); s = torch.tensor([3], dtype=torch.int32)\n"
        "out, lens = dk.combine_topk_swa_indices(torch.zeros((3, 0), dtype=torch.int32), q, s, s,"
        " 128, 1, 0, 200, 8)\n"
        "assert calls == [1], calls\n"
        "assert lens.tolist() == [1, 2, 3], lens\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("extra_cols", [0, 3], ids=["aligned-rows", "unaligned-rows"])
def test_combine_topk_row_alignment(extra_cols: int, kernel_device: torch.device) -> None:
    """16-byte top-k loads (width % 4 == 0) and the scalar fallback give the same rows."""
    batch = make_batch(
        fresh_seed(),
        query_lens=[19, 0, 33],
        ratio=4,
        topk=61,
        extra_topk_cols=extra_cols,
        slice_offset=2,
    )
    run_and_check(dk.combine_topk_swa_indices, batch, kernel_device)
    # a view whose rows start at an odd element (not 16-byte aligned)
    assert batch.topk_indices is not None
    wide = torch.cat([batch.topk_indices[:, :1], batch.topk_indices], dim=1)
    view = dataclasses.replace(batch, topk_indices=wide[:, 1:])
    run_and_check(dk.combine_topk_swa_indices, view, kernel_device)


@pytest.mark.parametrize("impl", ["triton"])
def test_combine_accepts_vllm_out_pair(impl: str, kernel_device: torch.device) -> None:
    """vLLM 0.32 passes ``out=(combined, lens)``: both are filled in place."""
    b = make_batch(fresh_seed(), query_lens=[9, 4], ratio=4, topk=16).to(kernel_device)
    combined = torch.full((13, 256), POISON, dtype=torch.int32, device=kernel_device)
    lens = torch.full((13,), POISON, dtype=torch.int32, device=kernel_device)
    got = dk.combine_topk_swa_indices(*b.args(), out=(combined, lens))
    assert got[0].data_ptr() == combined.data_ptr() and got[1].data_ptr() == lens.data_ptr()
    want = ref.combine_topk_swa_indices(*b.to(torch.device("cpu")).args())
    assert torch.equal(combined.cpu(), want[0]) and torch.equal(lens.cpu(), want[1])
    with pytest.raises(ValueError, match="out must be a tensor or a"):
        dk.combine_topk_swa_indices(*b.args(), out=(combined,))  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_combine_writes_the_first_rows_of_a_larger_workspace(
    impl: str, kernel_device: torch.device
) -> None:
    """vLLM passes workspaces sized for max_num_batched_tokens: only the first rows change."""
    device = kernel_device if impl == "triton" else torch.device("cpu")
    b = make_batch(fresh_seed(), query_lens=[9, 0, 4], ratio=4, topk=16).to(device)
    combined = torch.full((40, 256), POISON, dtype=torch.int32, device=device)
    lens = torch.full((40,), POISON, dtype=torch.int32, device=device)
    got = IMPLS[impl](*b.args(), out=(combined, lens))
    want = ref.combine_topk_swa_indices(*b.to(torch.device("cpu")).args())
    assert got[0].shape == (13, 256) and got[0].data_ptr() == combined.data_ptr()
    assert torch.equal(combined[:13].cpu(), want[0]) and torch.equal(lens[:13].cpu(), want[1])
    assert (combined[13:] == POISON).all() and (lens[13:] == POISON).all()
    with pytest.raises(ValueError, match=r"out must have shape \(>= 13, 256\), got \(12, 256\)"):
        dk.combine_topk_swa_indices(*b.args(), out=combined[:12])


@pytest.mark.parametrize("impl", list(GLOBAL_IMPLS))
def test_global_uses_the_first_entries_of_longer_token_arrays(
    impl: str, kernel_device: torch.device
) -> None:
    """vLLM passes the whole batch's token_to_req_indices with a decode-only slice of top-k."""
    device = kernel_device if impl == "triton" else torch.device("cpu")
    topk, req, table, valid = random_global_case(fresh_seed(), 12, 32, 64, 3, 4)
    got = GLOBAL_IMPLS[impl](
        topk[:5].to(device), req.to(device), table.to(device), 64, valid.to(device)
    )
    rows, lens = spec_global(topk[:5], req[:5], table, 64, valid[:5])
    assert got[0].cpu().tolist() == rows and got[1].cpu().tolist() == lens
