"""The vLLM plugin swaps vLLM's DSV4 functions for ours, and only when it should.

The CPU tests build a stand-in for vLLM's module layout (the defining module,
the package that re-exports it, and a model module that imported a function
by name), so they run without vLLM; the ``vllm`` test runs against the real
vLLM build in the ``vllm`` nox session.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

import dsv4_attention
import dsv4_kernels as dk
from dsv4_attention import plugin

NAMES = (
    "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens",
    "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache",
)


def _install_fake_vllm(monkeypatch: pytest.MonkeyPatch, is_cuda: bool) -> dict[str, object]:
    calls: dict[str, object] = {}

    def make(name: str) -> object:
        def original(*args: object, **kwargs: object) -> str:
            calls[name] = (args, kwargs)
            return f"vllm {name}"

        original.__name__ = name
        return original

    originals = {name: make(name) for name in NAMES}
    mods = {}
    for name in (
        "vllm",
        "vllm.platforms",
        "vllm.models",
        "vllm.models.deepseek_v4",
        "vllm.models.deepseek_v4.common",
        "vllm.models.deepseek_v4.common.ops",
        "vllm.models.deepseek_v4.common.ops.cache_utils",
        "vllm.models.deepseek_v4.attention",
    ):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    platform = types.SimpleNamespace(is_cuda=lambda: is_cuda)
    mods["vllm.platforms"].current_platform = platform  # type: ignore[attr-defined]
    for name, fn in originals.items():
        setattr(mods["vllm.models.deepseek_v4.common.ops.cache_utils"], name, fn)
        setattr(mods["vllm.models.deepseek_v4.common.ops"], name, fn)
    # the attention backend imported one function by name at import time
    mods["vllm.models.deepseek_v4.attention"].combine_topk_swa_indices = originals[  # type: ignore[attr-defined]
        "combine_topk_swa_indices"
    ]
    return {"calls": calls, "originals": originals, "mods": mods}


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DSV4_KERNELS_DISABLE", raising=False)
    monkeypatch.delenv("DSV4_KERNELS_FORCE", raising=False)
    plugin.unregister()
    yield
    plugin.unregister()


def test_register_patches_every_place_that_holds_a_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _install_fake_vllm(monkeypatch, is_cuda=True)
    mods = fake["mods"]
    dsv4_attention.register()
    assert len(plugin.patched()) == 2 * len(NAMES) + 1
    attention = mods["vllm.models.deepseek_v4.attention"]  # type: ignore[index]
    ops = mods["vllm.models.deepseek_v4.common.ops"]  # type: ignore[index]
    assert attention.combine_topk_swa_indices is dk.combine_topk_swa_indices
    assert ops.compute_global_topk_indices_and_lens is dk.compute_global_topk_indices_and_lens
    # the patched function really runs our kernel (here on CPU tensors)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    combined, lens = attention.combine_topk_swa_indices(
        torch.zeros((3, 0), dtype=torch.int32), qsl, seq, seq, 128, 1, 0, 200, 8
    )
    assert lens.tolist() == [1, 2, 3] and combined[2, :3].tolist() == [8, 9, 10]
    register_twice = len(plugin.patched())
    dsv4_attention.register()
    assert len(plugin.patched()) == register_twice
    dsv4_attention.unregister()
    assert attention.combine_topk_swa_indices is fake["originals"]["combine_topk_swa_indices"]  # type: ignore[index]
    assert plugin.patched() == []


def test_disable_switch_keeps_vllm_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install_fake_vllm(monkeypatch, is_cuda=True)
    monkeypatch.setenv("DSV4_KERNELS_DISABLE", "1")
    dsv4_attention.register()
    assert plugin.patched() == []
    ops = fake["mods"]["vllm.models.deepseek_v4.common.ops"]  # type: ignore[index]
    assert ops.combine_topk_swa_indices is fake["originals"]["combine_topk_swa_indices"]  # type: ignore[index]


def test_non_cuda_platform_is_left_alone_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_vllm(monkeypatch, is_cuda=False)
    dsv4_attention.register()
    assert plugin.patched() == []
    monkeypatch.setenv("DSV4_KERNELS_FORCE", "1")
    dsv4_attention.register()
    assert len(plugin.patched()) == 2 * len(NAMES) + 1


def test_layouts_we_do_not_implement_go_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install_fake_vllm(monkeypatch, is_cuda=True)
    dsv4_attention.register()
    ops = fake["mods"]["vllm.models.deepseek_v4.common.ops"]  # type: ignore[index]
    assert ops.quantize_and_insert_k_cache("k", "cache", "slots", 64, True, True) is None
    assert "quantize_and_insert_k_cache" in fake["calls"]  # type: ignore[operator]
    ops.dequantize_and_gather_k_cache("o", "c", "s", None, "t", 64, 0, use_fnuz=True)
    assert "dequantize_and_gather_k_cache" in fake["calls"]  # type: ignore[operator]


def test_vllm_without_dsv4_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("vllm", "vllm.platforms"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.platforms"].current_platform = types.SimpleNamespace(is_cuda=lambda: True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.models", None)  # import fails
    dsv4_attention.register()
    assert plugin.patched() == []


@pytest.mark.vllm
def test_real_vllm_loads_the_plugin_and_routes_dsv4_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "dsv4_attention.plugin:register" in names
    monkeypatch.setenv("DSV4_KERNELS_FORCE", "1")  # this machine's vLLM is the CPU build
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.models.deepseek_v4.common.ops as ops

    assert ops.combine_topk_swa_indices is dk.combine_topk_swa_indices
    assert "vllm.models.deepseek_v4.common.ops.combine_topk_swa_indices" in plugin.patched()
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    seq = torch.tensor([10, 3], dtype=torch.int32)
    topk = torch.randint(-1, 40, (5, 512), dtype=torch.int32)
    got = ops.combine_topk_swa_indices(topk, qsl, seq, seq, 128, 4, 512, 1000, 600)
    want = dk.reference.combine_topk_swa_indices(topk, qsl, seq, seq, 128, 4, 512, 1000, 600)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_modules_imported_after_register_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install_fake_vllm(monkeypatch, is_cuda=True)
    dsv4_attention.register()
    ops = fake["mods"]["vllm.models.deepseek_v4.common.ops"]  # type: ignore[index]
    # vLLM imports its backends after plugins load: they take the patched names
    late = types.ModuleType("vllm.models.deepseek_v4.nvidia.flashmla")
    late.combine_topk_swa_indices = ops.combine_topk_swa_indices  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, late.__name__, late)
    # DeepSeek-V4.1 has its own ops: a same-prefix module that must not count
    v41 = types.ModuleType("vllm.models.deepseek_v41.common.ops")
    v41.combine_topk_swa_indices = dk.combine_topk_swa_indices  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, v41.__name__, v41)
    assert "vllm.models.deepseek_v4.nvidia.flashmla.combine_topk_swa_indices" in plugin.patched()
    assert not any("deepseek_v41" in p for p in plugin.patched())
    dsv4_attention.unregister()
    assert late.combine_topk_swa_indices is fake["originals"]["combine_topk_swa_indices"]  # type: ignore[attr-defined,index]
    assert v41.combine_topk_swa_indices is dk.combine_topk_swa_indices  # type: ignore[attr-defined]


def test_adapters_take_vllms_real_argument_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's call sites: a padded 3-D cache view, an oversized out pair, longer token arrays."""
    fake = _install_fake_vllm(monkeypatch, is_cuda=True)
    dsv4_attention.register()
    ops = fake["mods"]["vllm.models.deepseek_v4.common.ops"]  # type: ignore[index]
    g = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))

    # K cache: vLLM views each padded page as [block_size, 584] rows
    pages, slots = 3, 64
    flat = dk.empty_k_cache(pages, slots)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    expected = flat.clone()
    view = flat.as_strided((pages, slots, 584), (flat.stride(0), 584, 1))
    k = torch.randn((10, 512), generator=g).to(torch.bfloat16)
    slot_mapping = torch.randperm(pages * slots, generator=g)[:10].to(torch.int64)
    slot_mapping[3] = -1
    ops.quantize_and_insert_k_cache(k, view, slot_mapping, slots)
    dk.quantize_and_insert_k_cache(k, expected, slot_mapping, slots)
    assert torch.equal(flat, expected)
    out = torch.full((2, 200, 512), float("nan"), dtype=torch.bfloat16)
    seq = torch.tensor([100, 37], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    ops.dequantize_and_gather_k_cache(out, view, seq, None, table, slots, 5)
    want = torch.full_like(out, float("nan"))
    dk.dequantize_and_gather_k_cache(want, expected, seq, None, table, slots, 5)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(
        out.nan_to_num(), want.nan_to_num()
    )

    # combine with a workspace pair sized for more tokens than this chunk
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    seq = torch.tensor([20, 4], dtype=torch.int32)
    topk = torch.randint(-1, 5, (7, 512), generator=g, dtype=torch.int32)
    combined = torch.full((64, 640), -7, dtype=torch.int32)
    lens = torch.full((64,), -7, dtype=torch.int32)
    ops.combine_topk_swa_indices(topk, qsl, seq, seq, 128, 4, 512, 1000, 600, out=(combined, lens))
    want_rows, want_lens = dk.reference.combine_topk_swa_indices(
        topk, qsl, seq, seq, 128, 4, 512, 1000, 600
    )
    assert torch.equal(combined[:7], want_rows) and torch.equal(lens[:7], want_lens)
    assert (combined[7:] == -7).all()

    # global indices: a decode-only slice of top-k with the whole batch's token arrays
    req = torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32)
    valid = torch.ones(5, dtype=torch.bool)
    table = torch.randint(0, 99, (2, 4), generator=g, dtype=torch.int32)
    local = torch.randint(-1, 256, (2, 16), generator=g, dtype=torch.int32)
    got = ops.compute_global_topk_indices_and_lens(local, req, table, 64, valid)
    ref = dk.reference.compute_global_topk_indices_and_lens(local, req[:2], table, 64, valid[:2])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
