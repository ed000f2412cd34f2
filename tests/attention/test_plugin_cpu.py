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
