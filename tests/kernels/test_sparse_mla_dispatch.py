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

from dsv4_kernels import sparse_mla as sm

WGMMA = {**sm.TILES["small"], "KERNEL": 2}
# the launch arguments' q and out (the fake kernel reads nothing else)
_ARGS = (torch.empty(4, 8, 512, dtype=torch.bfloat16), torch.empty(4, 8, 512, dtype=torch.bfloat16))


class _CudaLike:
    """What ``_wgmma_ok`` reads of ``q``: its shape and its device."""

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
    assert sm._wgmma_ok(_CudaLike(heads), WGMMA, True, True)


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
    assert not sm._wgmma_ok(_CudaLike(heads), tiles, paged, aligned), why


def test_cpu_tensors_never_take_the_wgmma_kernel(hopper: pytest.MonkeyPatch) -> None:
    assert not sm._wgmma_ok(torch.zeros(2, 8, 512, dtype=torch.bfloat16), WGMMA, True, True)


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
        assert not sm._launch_wgmma(4, 8, _ARGS, {}, WGMMA)
    assert kernel.launches == 1
    assert "PassManager::run failed" in sm._WGMMA_BROKEN[0]
    assert not sm.wgmma_available()  # later calls go straight to the Triton kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hopper_q = _CudaLike(8)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(sm, "interpreter_enabled", lambda: False)
        assert not sm._wgmma_ok(hopper_q, WGMMA, True, True)


def test_an_error_after_the_kernel_has_built_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gluon(monkeypatch, compiled=1)
    with pytest.raises(RuntimeError, match="PassManager"):
        sm._launch_wgmma(4, 8, _ARGS, {}, WGMMA)
    assert sm._WGMMA_BROKEN == []


def test_whole_vectors_of_q_and_out() -> None:
    """16-byte accesses to q and out only where every token and head row starts on a
    16-byte boundary."""
    x = torch.empty(4, 8, 512, dtype=torch.bfloat16)
    assert sm._whole_vectors(x, x[1:], x[:, 2:])
    wide = torch.empty(4, 8, 520, dtype=torch.bfloat16)
    assert sm._whole_vectors(wide[..., :512])  # head stride 520: whole vectors
    odd = torch.empty(4, 8, 517, dtype=torch.bfloat16)
    assert not sm._whole_vectors(odd[..., :512])  # head stride 517
    assert not sm._whole_vectors(x, wide[..., 1:513])  # base 2 bytes past a vector
    one_head = torch.empty(4, 1, 512, dtype=torch.bfloat16).expand(4, 1, 512)
    assert sm._whole_vectors(one_head)
