"""Plugin logic that needs no vLLM: version gate parsing and never raising without vLLM.

Everything the plugin does to vLLM is tested against vLLM's own code in
``test_vllm_plugin.py`` (the ``vllm`` nox session).
"""

from __future__ import annotations

import sys

import pytest

from dsv4_attention import plugin, vllm_targets


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.7", True),
        ("0.32.1+cpu", True),
        ("0.32", True),
        ("0.31.9", False),
        ("0.33.0", False),
        ("1.32.0", False),
        ("0.320.0", False),
        ("dev", False),
        ("", False),
    ],
)
def test_version_gate(version: str, supported: bool) -> None:
    assert vllm_targets.is_supported(version) is supported


def test_register_without_vllm_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.delenv("DSV4_KERNELS_DISABLE", raising=False)
    plugin.unregister()
    try:
        with caplog.at_level("WARNING"):
            plugin.register()
        assert plugin.patched() == []
        assert not any(isinstance(f, plugin._Dsv4ImportHook) for f in sys.meta_path)
        assert "inactive" in caplog.text
    finally:
        plugin.unregister()


def test_every_replaced_name_has_a_signature_and_consumers() -> None:
    for name in (*vllm_targets.CUDA_OPS, "dequantize_and_gather_k_cache"):
        assert name in vllm_targets.SIGNATURES
        assert vllm_targets.OPS_PACKAGE in vllm_targets.CONSUMERS[name]


@pytest.mark.parametrize(
    ("major", "wgmma", "heads", "shared_heads"),
    [
        (9, True, 8, 16),
        (9, False, 0, 0),
        (10, True, 0, 0),
        (8, True, 128, 128),
        (12, True, 128, 128),
        (None, True, 128, 128),
    ],
    ids=["hopper", "hopper-without-gluon", "blackwell", "ampere", "sm120", "no-device"],
)
def test_default_head_limit_follows_the_measurements(
    major: int | None,
    wgmma: bool,
    heads: int,
    shared_heads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hopper with the wgmma kernel: up to 8 local heads on C4A layers, 16 on SWA-only and
    C128A layers (measured faster than FlashMLA there); Blackwell: off (FlashMLA); GPUs
    without FlashMLA: every head count."""
    import types

    from dsv4_attention import vllm_backend
    from dsv4_kernels import sparse_mla

    capability = None if major is None else types.SimpleNamespace(major=major, minor=0)
    platform = types.SimpleNamespace(get_device_capability=lambda: capability)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(sparse_mla, "wgmma_available", lambda: wgmma)
    monkeypatch.delenv(vllm_backend.ENV_MAX_HEADS, raising=False)
    vllm_backend._default_max_heads.cache_clear()
    try:
        assert vllm_backend.max_heads() == heads
        assert vllm_backend.max_heads(4) == heads
        assert vllm_backend.max_heads(1) == vllm_backend.max_heads(128) == shared_heads
        monkeypatch.setenv(vllm_backend.ENV_MAX_HEADS, "12")
        # the switch overrides the default for every layer type
        assert [vllm_backend.max_heads(r) for r in (1, 4, 128)] == [12, 12, 12]
    finally:
        vllm_backend._default_max_heads.cache_clear()
