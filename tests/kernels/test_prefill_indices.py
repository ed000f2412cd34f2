"""build_prefill_indices: window and compressed rows of global cache slots.

The Triton kernel (through the interpreter on CPU, compiled on CUDA) and the
vectorised torch reference are compared, element by element, with the slow
per-token spec in ``_prefill_indices_cases.py`` on fresh random inputs:
query_start_loc slices with a nonzero first element, seq_lens and block
tables with more rows and columns than needed (garbage past the used pages),
-1 holes and entries past the block table in the top-k, negative page ids.
Outputs are poisoned before every call and must be fully written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import reference as ref
from dsv4_kernels.testing import POISON, fresh_seed
from dsv4_kernels.testing.prefill_indices import make_prefill_index_case

from ._prefill_indices_cases import WINDOW, Case, make_case, over_query_lens, spec_rows

IMPLS: dict[str, Callable[..., dk.PrefillIndices]] = {
    "triton": dk.build_prefill_indices,
    "reference": ref.build_prefill_indices,
}

# (window row, compressed ratio or None)
PARTS = {
    "window": (True, None),
    "c4a": (False, 4),
    "window+c4a": (True, 4),
    "c128a": (False, 128),
    "window+c128a": (True, 128),
}


def _device(impl: str, kernel_device: torch.device) -> torch.device:
    return kernel_device if impl == "triton" else torch.device("cpu")


def run_and_check(
    impl: str, case: Case, device: torch.device, *, window: bool, compressed: bool
) -> dk.PrefillIndices:
    """Poison outputs (with spare rows), run, compare every element with the spec."""
    c = case.to(device)
    T = case.num_tokens
    comp = compressed and case.ratio > 1
    spare = 3
    outs: dict[str, torch.Tensor] = {}
    if window:
        outs["window_out"] = torch.full((T + spare, WINDOW), POISON, dtype=torch.int32)
        outs["window_lens_out"] = torch.full((T + spare,), POISON, dtype=torch.int32)
    if comp:
        outs["comp_out"] = torch.full((T + spare, case.topk), POISON, dtype=torch.int32)
        outs["comp_lens_out"] = torch.full((T + spare,), POISON, dtype=torch.int32)
    outs = {k: v.to(device) for k, v in outs.items()}
    got = IMPLS[impl](
        c.query_start_loc, c.seq_lens, **c.kwargs(window=window, compressed=compressed), **outs
    )
    w_rows, w_lens, c_rows, c_lens = spec_rows(case, window=window, compressed=compressed)
    parts = [
        ("window", got.window, "window_out", w_rows, (T, WINDOW)),
        ("window_lens", got.window_lens, "window_lens_out", w_lens, (T,)),
        ("comp", got.comp, "comp_out", c_rows, (T, case.topk)),
        ("comp_lens", got.comp_lens, "comp_lens_out", c_lens, (T,)),
    ]
    for name, tensor, out_name, want, shape in parts:
        if out_name not in outs:
            assert tensor is None, f"{name} built but not asked for"
            continue
        assert tensor is not None and tensor.dtype == torch.int32
        assert tensor.shape == shape and tensor.data_ptr() == outs[out_name].data_ptr()
        buf = outs[out_name].cpu()
        assert not (buf[:T] == POISON).any(), f"seed {case.seed}: {name} has unwritten elements"
        assert (buf[T:] == POISON).all(), f"seed {case.seed}: {name} wrote past the chunk's rows"
        want_t = torch.tensor(want, dtype=torch.int32).reshape(shape)
        bad = (buf[:T] != want_t).nonzero()
        assert bad.numel() == 0, (
            f"seed {case.seed}: {name}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}: "
            f"got {int(buf[tuple(bad[0])])}, want {int(want_t[tuple(bad[0])])}"
        )
    # Without outputs: fresh allocations, same values.
    again = IMPLS[impl](c.query_start_loc, c.seq_lens, **c.kwargs(window=window, compressed=comp))
    for a, b in zip(again, got, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a.cpu(), b.cpu())
    return got


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("parts", list(PARTS))
@over_query_lens
def test_rows_match_spec(
    impl: str, parts: str, query_lens: list[int], kernel_device: torch.device
) -> None:
    window, ratio = PARTS[parts]
    case = make_case(
        fresh_seed(),
        query_lens=query_lens,
        ratio=ratio or 1,
        topk={None: 0, 4: 40, 128: 6}[ratio],
        context=(0, 900),
    )
    run_and_check(
        impl, case, _device(impl, kernel_device), window=window, compressed=ratio is not None
    )


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("ratio", [4, 128])
def test_past_2048_compressed_entries(impl: str, ratio: int, kernel_device: torch.device) -> None:
    """A request with more than 4 x 512 compressed entries (C4A), C128A clamped to topk."""
    case = make_case(
        fresh_seed(),
        query_lens=[3, 6],
        ratio=ratio,
        topk=24 if ratio == 4 else 40,  # C128A: 65+ entries, rows clamped to 40
        long_context=8400,
        hole_fraction=0.05,
        beyond_table_fraction=0.0,
    )
    if ratio == 4:
        # force entries past 2048 into the long request's rows
        assert case.topk_indices is not None
        case.topk_indices[3:9, 0] = torch.arange(2090, 2096, dtype=torch.int32)
    got = run_and_check(impl, case, _device(impl, kernel_device), window=True, compressed=True)
    assert got.comp_lens is not None
    if ratio == 128:
        assert got.comp_lens[3:].cpu().tolist() == [40] * 6


@pytest.mark.parametrize("impl", list(IMPLS))
def test_negative_page_ids_give_holes(impl: str, kernel_device: torch.device) -> None:
    case = make_case(
        fresh_seed(), query_lens=[20, 9], ratio=4, topk=32, negative_pages=0.3, context=(100, 900)
    )
    # and for certain: request 0's last page, which its last token's window reaches
    case.window_table[0, (int(case.seq_lens[0]) - 1) // 64] = -1
    got = run_and_check(impl, case, _device(impl, kernel_device), window=True, compressed=True)
    assert got.window is not None and int(got.window[19, int(got.window_lens[19]) - 1]) == -1


@pytest.mark.parametrize("impl", list(IMPLS))
def test_no_tokens(impl: str, kernel_device: torch.device) -> None:
    case = make_case(fresh_seed(), query_lens=[0, 0], ratio=4, topk=16)
    device = _device(impl, kernel_device)
    got = IMPLS[impl](
        case.to(device).query_start_loc, case.to(device).seq_lens, **case.to(device).kwargs()
    )
    assert got.window is not None and got.window.shape == (0, WINDOW)
    assert got.comp is not None and got.comp.shape == (0, 16)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_qsl_base_zero_and_topk_narrower_than_its_tensor(
    impl: str, kernel_device: torch.device
) -> None:
    """``topk`` below ``topk_indices.shape[1]``: only the first ``topk`` columns are used."""
    case = make_case(fresh_seed(), query_lens=[11, 4], ratio=4, topk=20, qsl_base=0)
    assert int(case.query_start_loc[0]) == 0
    assert case.topk_indices is not None and case.topk_indices.shape[1] > 20
    run_and_check(impl, case, _device(impl, kernel_device), window=True, compressed=True)


def test_benchmark_case_factory_rows(kernel_device: torch.device) -> None:
    """make_prefill_index_case gives distinct live entries per row and rows the spec agrees with."""
    seed = fresh_seed()
    case = make_prefill_index_case(
        [9, 0, 14], [300, 5, 1100], compress_ratio=4, topk=48, seed=seed, hole_fraction=0.1
    )
    assert case.topk_indices is not None
    for row in case.topk_indices.tolist():
        live = [v for v in row if v >= 0]
        assert len(live) == len(set(live)), f"seed {seed}: duplicate top-k entries"
    got = make_prefill_index_case(
        [9, 0, 14],
        [300, 5, 1100],
        compress_ratio=4,
        topk=48,
        seed=seed,
        hole_fraction=0.1,
        device=kernel_device,
    ).build()
    spec_case = Case(
        seed,
        case.query_start_loc,
        case.seq_lens,
        case.num_tokens,
        case.window_block_table,
        4,
        case.comp_block_table,
        case.comp_block_size,
        case.topk_indices,
        case.topk,
    )
    w_rows, w_lens, c_rows, c_lens = spec_rows(spec_case)
    assert got.window is not None and got.comp is not None
    assert got.window.cpu().tolist() == w_rows and got.comp.cpu().tolist() == c_rows
    assert got.window_lens.cpu().tolist() == w_lens  # type: ignore[union-attr]
    assert got.comp_lens.cpu().tolist() == c_lens  # type: ignore[union-attr]
    # every live window slot and compressed slot is inside the caches the case sizes
    assert int(got.window.max()) < case.window_num_pages * 64
    assert int(got.comp.max()) < case.comp_num_pages * case.comp_block_size


# --- bad input --------------------------------------------------------------------------


def _good() -> dict[str, Any]:
    case = make_case(3, query_lens=[4, 2], ratio=4, topk=16)
    return dict(query_start_loc=case.query_start_loc, seq_lens=case.seq_lens, **case.kwargs())


def _meta_like(t: object) -> torch.Tensor:
    assert isinstance(t, torch.Tensor)
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must have dtype torch.int32"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc must"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:0]), "at least 1 entry"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens must have at least 2"),
        (lambda a: a.update(seq_lens=_meta_like(a["seq_lens"])), "seq_lens must be on cpu"),
        (lambda a: a.update(num_tokens=-1), "num_tokens must be >= 0"),
        (lambda a: a.update(num_tokens=5), r"num_tokens \(5\) must equal"),
        (
            lambda a: a.update(window_block_table=a["window_block_table"].long()),
            "window_block_table must have dtype",
        ),
        (
            lambda a: a.update(window_block_table=a["window_block_table"][:1]),
            "window_block_table must have at least 2",
        ),
        (
            lambda a: a.update(window_block_table=a["window_block_table"][:, :1]),
            "window_block_table has 1 columns, narrower",
        ),
        (
            lambda a: a.update(window_block_table=a["window_block_table"].t().contiguous().t()),
            "window_block_table must be contiguous",
        ),
        (lambda a: a.update(window_block_size=0), "window_block_size must be > 0"),
        (lambda a: a.update(window_size=0), "window_size must be > 0"),
        (lambda a: a.update(compress_ratio=3), "compress_ratio must be None, 1 .SWA-only"),
        (lambda a: a.update(comp_block_table=None), "comp_block_table is needed"),
        (lambda a: a.update(topk_indices=None), "topk_indices .* is needed for C4A"),
        (lambda a: a.update(topk=99), r"topk \(99\) is wider than topk_indices"),
        (
            lambda a: a.update(topk_indices=a["topk_indices"][:3]),
            "topk_indices must have at least 6",
        ),
        (
            lambda a: a.update(topk_indices=a["topk_indices"].long()),
            "topk_indices must have dtype",
        ),
        (
            lambda a: a.update(compress_ratio=128, topk_indices=None, topk=None),
            "topk .* is needed for compress_ratio 128",
        ),
        (
            lambda a: a.update(compress_ratio=128, topk=8),
            "topk_indices must be None for C128A",
        ),
        (
            lambda a: a.update(compress_ratio=None),
            "comp_block_table must be None without a compressed row",
        ),
        (
            lambda a: a.update(
                compress_ratio=None,
                window_block_table=None,
                comp_block_table=None,
                topk_indices=None,
                topk=None,
            ),
            "nothing to build",
        ),
        (
            lambda a: a.update(window_out=torch.empty((6, 64), dtype=torch.int32)),
            r"window_out must have shape \(>= 6, 128\)",
        ),
        (
            lambda a: a.update(comp_out=torch.empty((6, 16), dtype=torch.int64)),
            "comp_out must have dtype",
        ),
        (
            lambda a: a.update(comp_lens_out=torch.empty((5,), dtype=torch.int32)),
            r"comp_lens_out must have shape \(>= 6\)",
        ),
    ],
)
def test_bad_input(change: Callable[[dict[str, Any]], None], match: str) -> None:
    args = _good()
    change(args)
    with pytest.raises(ValueError, match=match):
        dk.build_prefill_indices(**args)


def test_query_longer_than_sequence_is_refused() -> None:
    args = _good()
    args["seq_lens"] = args["seq_lens"].clone()
    args["seq_lens"][0] = 1
    with pytest.raises(ValueError, match="seq_lens must be >= each request's query length"):
        dk.build_prefill_indices(**args)


def test_cpu_tensors_use_the_reference_without_the_interpreter() -> None:
    """Without TRITON_INTERPRET, CPU tensors take the torch reference (no Triton launch)."""
    code = (
        "import torch, dsv4_kernels as dk\n"
        "from dsv4_kernels import _triton_prefill_indices as k\n"
        "from dsv4_kernels.testing.prefill_indices import make_prefill_index_case\n"
        "def boom(*a, **kw): raise AssertionError('Triton kernel launched')\n"
        "class Boom:\n"
        "    def __getitem__(self, grid): return boom\n"
        "k._prefill_indices_kernel = Boom()\n"
        "c = make_prefill_index_case([5, 3], [200, 9000], compress_ratio=4, topk=32, seed=1)\n"
        "r = c.build()\n"
        "assert r.window.shape == (8, 128) and r.comp.shape == (8, 32)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("group", [1, 2, 4])
def test_window_floor_bounds_the_window_rows(group: int, kernel_device: torch.device) -> None:
    check_window_floor(group, kernel_device)


def check_window_floor(group: int, kernel_device: torch.device) -> None:
    """vLLM's SWA bounded replay: after a prefix hit a request holds window KV only from
    its replay start (``seq_lens - prefill_gather_lens``).  With ``window_floor`` every
    token's window row is the unbounded row's positions at or above the floor (the same
    slots, the first ones dropped), per-token and grouped, kernel equal to the reference;
    a floor at 0 changes nothing."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    case = make_prefill_index_case(
        [7, 1, 12, 5], [300, 0, 40, 129], compress_ratio=1, device=kernel_device, seed=seed
    )
    seq = case.seq_lens.cpu().long()
    qsl = case.query_start_loc.cpu().long()
    qlen = qsl[1:] - qsl[:-1]
    prefix = seq - qlen
    # a floor anywhere from below the window's reach up to the chunk's first position
    floor = (prefix - torch.randint(0, 160, (4,), generator=g)).clamp(min=0).to(torch.int32)
    common = dict(num_tokens=case.num_tokens, window_block_table=case.window_block_table)
    build = dk.build_grouped_prefill_indices if group > 1 else dk.build_prefill_indices
    build_ref = ref.build_grouped_prefill_indices if group > 1 else ref.build_prefill_indices
    extra: dict[str, Any] = {"group_size": group} if group > 1 else {}
    got = build(case.query_start_loc, case.seq_lens, window_floor=floor.to(kernel_device),
                **common, **extra)  # fmt: skip
    want = build_ref(case.query_start_loc.cpu(), case.seq_lens.cpu(), window_floor=floor,
                     **{**common, "window_block_table": case.window_block_table.cpu()},
                     **extra)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), f"seed {seed}: kernel != reference"
    zero = torch.zeros(4, dtype=torch.int32)
    free = build(case.query_start_loc, case.seq_lens, window_floor=zero.to(kernel_device),
                 **common, **extra)  # fmt: skip
    plain = build(case.query_start_loc, case.seq_lens, **common, **extra)
    for a, b in zip(free, plain, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), f"seed {seed}: a zero floor changed the rows"
    if group > 1:
        return
    # per token: the bounded row is the unbounded row's tail from the floor on
    req = torch.repeat_interleave(torch.arange(4), qlen)
    pos = prefix[req] + (torch.arange(case.num_tokens) - qsl[req] + qsl[0])
    lens_u, lens_b = plain.window_lens.cpu().long(), got.window_lens.cpu().long()
    assert torch.equal(lens_b, (pos + 1 - torch.maximum(pos - (WINDOW - 1), floor.long()[req])))
    for t in range(case.num_tokens):
        u, b = int(lens_u[t]), int(lens_b[t])
        row_u, row_b = plain.window[t].cpu(), got.window[t].cpu()
        assert torch.equal(row_b[:b], row_u[u - b : u]), f"seed {seed}, token {t}"
