"""Which sparse MLA kernel a CUDA call runs, and the fallback when Gluon cannot build the
wgmma kernel: launcher logic, checked on CPU with the device parts stubbed.

The kernels themselves are checked against references elsewhere (the wgmma kernel
only on a Hopper GPU: ``test_sparse_mla_gpu.py``; Gluon has no interpreter).
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable

import pytest
import torch

from dsv4_kernels import _paged_keys as pk
from dsv4_kernels import sparse_mla as sm

WGMMA = {**sm.TILES["small"], "KERNEL": 2}
# the launch arguments' q and out (the fake kernel reads nothing else)
_ARGS = (torch.empty(4, 8, 512, dtype=torch.bfloat16), torch.empty(4, 8, 512, dtype=torch.bfloat16))


class _CudaLike:
    """What ``wgmma_runs`` reads of ``q``: its shape and its device."""

    def __init__(self, heads: int) -> None:
        self.shape = (4, heads, 512)
        self.device = types.SimpleNamespace(type="cuda", index=0)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(sm, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(sm, "wgmma_available", lambda: True)
    return monkeypatch


@pytest.mark.parametrize("heads", [1, 8, 9, 16])
def test_wgmma_runs_on_hopper_up_to_16_heads_with_aligned_pages(
    heads: int, hopper: pytest.MonkeyPatch
) -> None:
    assert pk.wgmma_runs(_CudaLike(heads), WGMMA, True, True)


@pytest.mark.parametrize(
    ("why", "heads", "tiles", "paged", "aligned", "capability", "available"),
    [
        ("17 heads", 17, WGMMA, True, True, (9, 0), True),
        ("tiles without KERNEL=2", 8, {**WGMMA, "KERNEL": 0}, True, True, (9, 0), True),
        ("the bf16 workspace", 8, WGMMA, False, True, (9, 0), True),
        ("unaligned pages", 8, WGMMA, True, False, (9, 0), True),
        ("Ampere", 8, WGMMA, True, True, (8, 0), True),
        ("Blackwell", 8, WGMMA, True, True, (10, 0), True),
        ("no Gluon", 8, WGMMA, True, True, (9, 0), False),
    ],
)
def test_triton_kernel_runs_everywhere_else(
    why: str,
    heads: int,
    tiles: dict,
    paged: bool,
    aligned: bool,
    capability: tuple[int, int],
    available: bool,
    hopper: pytest.MonkeyPatch,
) -> None:
    hopper.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    hopper.setattr(sm, "wgmma_available", lambda: available)
    assert not pk.wgmma_runs(_CudaLike(heads), tiles, paged, aligned), why


def test_cpu_tensors_never_take_the_wgmma_kernel(hopper: pytest.MonkeyPatch) -> None:
    assert not pk.wgmma_runs(torch.zeros(2, 8, 512, dtype=torch.bfloat16), WGMMA, True, True)


class _FailingKernel:
    """A kernel whose first launch fails to compile (as with a Triton whose Gluon differs)."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches += 1
            raise RuntimeError("PassManager::run failed")

        return launch


def _fake_gluon(monkeypatch: pytest.MonkeyPatch, compiled: int) -> _FailingKernel:
    """Stand a fake ``dsv4_kernels._gluon_sparse_mla`` in for the real one (which needs
    a Triton with Gluon's Hopper API) so the launcher's import finds it."""
    import dsv4_kernels

    kernel = _FailingKernel()
    fake = types.ModuleType("dsv4_kernels._gluon_sparse_mla")
    fake._sparse_mla_wgmma_kernel = kernel  # type: ignore[attr-defined]
    fake.compiled_variants = lambda: compiled  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4_kernels._gluon_sparse_mla", fake)
    monkeypatch.setattr(dsv4_kernels, "_gluon_sparse_mla", fake, raising=False)
    monkeypatch.setattr(sm, "_WGMMA_BROKEN", [])
    return kernel


def test_a_kernel_that_does_not_build_falls_back_once_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = _fake_gluon(monkeypatch, compiled=0)
    with pytest.warns(RuntimeWarning, match="the Triton kernel runs instead"):
        assert not pk.launch_wgmma(4, 8, _ARGS, {}, WGMMA)
    assert kernel.launches == 1
    assert "PassManager::run failed" in sm._WGMMA_BROKEN[0]
    assert not sm.wgmma_available()  # later calls go straight to the Triton kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hopper_q = _CudaLike(8)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(sm, "interpreter_enabled", lambda: False)
        assert not pk.wgmma_runs(hopper_q, WGMMA, True, True)


def test_an_error_after_the_kernel_has_built_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gluon(monkeypatch, compiled=1)
    with pytest.raises(RuntimeError, match="PassManager"):
        pk.launch_wgmma(4, 8, _ARGS, {}, WGMMA)
    assert sm._WGMMA_BROKEN == []


@pytest.mark.parametrize("heads", [1, 8, 16])
def test_the_decode_split_kernel_takes_wgmma_wherever_it_runs(
    heads: int, hopper: pytest.MonkeyPatch
) -> None:
    """The split kernel's tiles name no kernel: the choice is the device, the heads and
    the alignment (and its own build record)."""
    assert pk.wgmma_runs(_CudaLike(heads), {**WGMMA, "KERNEL": 0}, True, True, split=True)
    assert not pk.wgmma_runs(_CudaLike(heads), WGMMA, True, False, split=True)
    assert not pk.wgmma_runs(_CudaLike(17), WGMMA, True, True, split=True)
    hopper.setattr(pk, "SPLIT_BROKEN", ["CompilationError"])
    assert not pk.wgmma_runs(_CudaLike(heads), WGMMA, True, True, split=True)
    assert pk.wgmma_runs(_CudaLike(heads), WGMMA, True, True)  # not the per-token kernel


class _Recording:
    """A Triton kernel whose launches are counted, not run."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches += 1

        return launch


def test_a_split_kernel_that_does_not_build_falls_back_once_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode's wgmma split kernel fails to build: one warning, the Triton split kernel
    then and from then on; the failure goes to the split kernel's own record, not to the
    per-token kernel's (which :func:`wgmma_available` publishes)."""
    import dsv4_kernels
    from dsv4_kernels import _triton_decode
    from dsv4_kernels.geometry import page_stride_bytes

    kernel = _FailingKernel()
    fake = types.ModuleType("dsv4_kernels._gluon_decode")
    fake._decode_split_wgmma_kernel = kernel  # type: ignore[attr-defined]
    fake.compiled_variants = lambda: 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4_kernels._gluon_decode", fake)
    monkeypatch.setattr(dsv4_kernels, "_gluon_decode", fake, raising=False)
    split = _Recording()
    monkeypatch.setattr(_triton_decode, "_decode_split_kernel", split)
    monkeypatch.setattr(sm, "_hopper_runs_wgmma", lambda device: True)
    monkeypatch.setattr(sm, "_WGMMA_BROKEN", [])
    monkeypatch.setattr(pk, "SPLIT_BROKEN", [])
    cache = torch.zeros(2, page_stride_bytes(64), dtype=torch.uint8)
    rows = torch.zeros(2, 64, dtype=torch.int32)
    keys = pk.check_paged_keys(cache, rows, None, 64, None, None, None, None, 2, cache.device)
    q = torch.zeros(2, 8, 512, dtype=torch.bfloat16)
    po, plse = torch.empty(6, 8, 512), torch.empty(6, 8)
    with pytest.warns(RuntimeWarning, match="wgmma decode kernel did not build"):
        pk.launch_split(q, po, plse, keys, scale=0.04, splits=3, chunk=64)
    assert (kernel.launches, split.launches) == (1, 1)
    assert "PassManager::run failed" in pk.SPLIT_BROKEN[0]
    assert sm._WGMMA_BROKEN == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pk.launch_split(q, po, plse, keys, scale=0.04, splits=3, chunk=64)
    assert (kernel.launches, split.launches) == (1, 2)


def test_whole_vectors_of_q_and_out() -> None:
    """16-byte accesses to q and out only where every token and head row starts on a
    16-byte boundary."""
    x = torch.empty(4, 8, 512, dtype=torch.bfloat16)
    assert pk.whole_vectors(x, x[1:], x[:, 2:])
    wide = torch.empty(4, 8, 520, dtype=torch.bfloat16)
    assert pk.whole_vectors(wide[..., :512])  # head stride 520: whole vectors
    odd = torch.empty(4, 8, 517, dtype=torch.bfloat16)
    assert not pk.whole_vectors(odd[..., :512])  # head stride 517
    assert not pk.whole_vectors(x, wide[..., 1:513])  # base 2 bytes past a vector
    one_head = torch.empty(4, 1, 512, dtype=torch.bfloat16).expand(4, 1, 512)
    assert pk.whole_vectors(one_head)


class _Capturing:
    """A Gluon kernel whose launches record their grid and keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.calls.append((grid, kwargs))

        return launch


def test_wide_head_blocks_only_where_the_tiles_name_them(
    hopper: pytest.MonkeyPatch,
) -> None:
    """More than 16 heads take the per-token wgmma kernel only with ``WIDE_HT`` tiles
    (issue 41; the shipped large tiles keep the Triton kernel): one program per (token,
    block of WIDE_HT heads), two warpgroups, K from shared memory; a block size the kernel
    has no layout for is refused by name before anything launches."""
    wide = {**sm.TILES["large"], "KERNEL": 2, "WIDE_HT": 64}
    for heads in (17, 64, 128):
        assert pk.wgmma_runs(_CudaLike(heads), wide, True, True)
        assert not pk.wgmma_runs(_CudaLike(heads), {**wide, "WIDE_HT": 0}, True, True)
        assert not pk.wgmma_runs(_CudaLike(heads), sm.TILES["large"], True, True)
        assert not pk.wgmma_runs(_CudaLike(heads), wide, True, False)  # unaligned rows
    kernel = _Capturing()
    fake = types.ModuleType("dsv4_kernels._gluon_sparse_mla")
    fake._sparse_mla_wgmma_kernel = kernel  # type: ignore[attr-defined]
    fake.compiled_variants = lambda: 1  # type: ignore[attr-defined]
    hopper.setitem(sys.modules, "dsv4_kernels._gluon_sparse_mla", fake)
    import dsv4_kernels

    hopper.setattr(dsv4_kernels, "_gluon_sparse_mla", fake, raising=False)
    q = torch.empty(4, 128, 512, dtype=torch.bfloat16)
    assert pk.launch_wgmma(4, 128, (q, q), {}, {**wide, "REG_A": 1})
    (grid, kw), = kernel.calls  # fmt: skip
    assert grid == (8,)
    assert (kw["HT"], kw["WG"], kw["HBLOCKS"], kw["num_warps"], kw["REG_A"]) == (64, 2, 2, 8, False)
    assert pk.launch_wgmma(4, 8, (q[:, :8], q[:, :8]), {}, WGMMA)  # TP8: one block, one group
    assert (kernel.calls[-1][1]["WG"], kernel.calls[-1][1]["HBLOCKS"]) == (1, 1)
    with pytest.raises(ValueError, match=r"tiles\['large'\]\['WIDE_HT'\] must be 32 or 64"):
        pk.launch_wgmma(4, 128, (q, q), {}, {**wide, "WIDE_HT": 48})
    assert len(kernel.calls) == 2


def test_the_decode_split_kernel_in_wide_blocks(hopper: pytest.MonkeyPatch) -> None:
    """The decode's ``WIDE_HT`` policy: one program per (token, chunk, block of WIDE_HT
    heads) on two warpgroups, also when ``HEAD_BLOCKS`` is off; 16-head blocks without it."""
    import dsv4_kernels
    from dsv4_kernels import _triton_decode
    from dsv4_kernels.geometry import page_stride_bytes

    kernel = _Capturing()
    fake = types.ModuleType("dsv4_kernels._gluon_decode")
    fake._decode_split_wgmma_kernel = kernel  # type: ignore[attr-defined]
    fake.compiled_variants = lambda: 1  # type: ignore[attr-defined]
    hopper.setitem(sys.modules, "dsv4_kernels._gluon_decode", fake)
    hopper.setattr(dsv4_kernels, "_gluon_decode", fake, raising=False)
    hopper.setattr(pk, "SPLIT_BROKEN", [])
    hopper.setattr(sm, "_hopper_runs_wgmma", lambda device: True)
    triton_split = _Recording()
    hopper.setattr(_triton_decode, "_decode_split_kernel", triton_split)
    cache = torch.zeros(2, page_stride_bytes(64), dtype=torch.uint8)
    rows = torch.zeros(2, 64, dtype=torch.int32)
    keys = pk.check_paged_keys(cache, rows, None, 64, None, None, None, None, 2, cache.device)
    q = torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    po, plse = torch.empty(6, 128, 512), torch.empty(6, 128)
    pk.launch_split(q, po, plse, keys, scale=0.04, splits=3, chunk=64, wide=64)
    pk.launch_split(q, po, plse, keys, scale=0.04, splits=3, chunk=64, head_blocks=True)
    (g1, k1), (g2, k2) = kernel.calls
    assert (g1, k1["HT"], k1["WG"], k1["num_warps"]) == ((2 * 3 * 2,), 64, 2, 8)
    assert (g2, k2["HT"], k2["WG"], k2["num_warps"]) == ((2 * 3 * 8,), 16, 1, 4)
    assert triton_split.launches == 0
