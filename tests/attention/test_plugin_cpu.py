"""Plugin logic that needs no vLLM: version gate parsing and never raising without vLLM.

Everything the plugin does to vLLM is tested against vLLM's own code in
``test_vllm_plugin.py`` (the ``vllm`` nox session).
"""

from __future__ import annotations

import sys

import pytest
import torch

from dsv4_attention import plugin, vllm_targets


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.7", True),
        ("0.32.1+cpu", True),
        ("0.32", True),
        ("0.31.9", False),
        ("0.33.0", True),
        ("0.33.2+cu130", True),
        ("0.34.0", False),
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
    for facts in vllm_targets.RELEASES.values():
        for name in (*vllm_targets.CUDA_OPS, "dequantize_and_gather_k_cache"):
            assert name in facts.signatures
            assert vllm_targets.OPS_PACKAGE in facts.consumers[name]
        for name in ("_select_dsv4_attn_cls", "_forward_prefill", "forward_mqa"):
            assert name in facts.signatures


def test_release_facts_are_one_table() -> None:
    """Each supported release has its facts; the text lists both; others have none."""
    assert vllm_targets.supported_text() == "0.32.x, 0.33.x"
    assert vllm_targets.facts_for("0.32.0").kv_cache_grouping_module.endswith("kv_cache_utils")  # type: ignore[union-attr]
    facts33 = vllm_targets.facts_for("0.33.0")
    assert facts33 is not None
    assert facts33.kv_cache_grouping_module.endswith("kv_cache_planning")
    for facts in vllm_targets.RELEASES.values():  # both ship V4.1 (0.32.0 already)
        assert "vllm.models.deepseek_v41" in facts.untouched_models
    assert vllm_targets.facts_for("0.34.0") is None


def _fake_device(monkeypatch: pytest.MonkeyPatch, major: int | None, wgmma: bool) -> None:
    """vLLM's platform as reporting compute capability ``major`` (None: no device), and
    the Gluon wgmma kernel as available or not; the cached capability cleared."""
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
    vllm_backend._device_major.cache_clear()


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from dsv4_attention import vllm_backend

    yield lambda major, wgmma=True: _fake_device(monkeypatch, major, wgmma)
    vllm_backend._device_major.cache_clear()


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
    fake_device,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hopper with the wgmma kernel: up to 8 local heads on C4A layers (16 in steps with
    short rows), 16 on SWA-only and C128A layers (measured faster than FlashMLA there);
    Blackwell: off (FlashMLA); GPUs without FlashMLA: every head count."""
    from dsv4_attention import vllm_backend

    fake_device(major, wgmma)
    assert vllm_backend.max_heads() == heads
    assert vllm_backend.max_heads(4) == heads
    assert vllm_backend.max_heads(1) == vllm_backend.max_heads(128) == shared_heads
    assert vllm_backend.short_rows_max_heads() == (16 if (major, wgmma) == (9, True) else 0)
    monkeypatch.setenv(vllm_backend.ENV_MAX_HEADS, "12")
    # the switch overrides the default for every layer type, short rows included
    assert [vllm_backend.max_heads(r) for r in (1, 4, 128)] == [12, 12, 12]
    assert vllm_backend.short_rows_max_heads() == 0


def test_hopper_limit_drops_when_the_wgmma_kernel_fails_to_build(
    fake_device,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Triton that cannot build the wgmma kernel is known only after the first build
    fails (the launcher then runs the Triton kernel, slower than vLLM's FlashMLA
    prefill): the next layer's decision must see that and keep vLLM's prefill."""
    from dsv4_attention import vllm_backend
    from dsv4_kernels import sparse_mla

    real = sparse_mla.wgmma_available
    fake_device(9, True)
    monkeypatch.setattr(sparse_mla, "wgmma_available", real)  # the launcher's own record
    monkeypatch.setattr(sparse_mla, "_gluon_importable", lambda: True)
    monkeypatch.setattr(sparse_mla, "_WGMMA_BROKEN", [])
    assert vllm_backend.max_heads(4) == 8 and vllm_backend.short_rows_max_heads() == 16
    # what _launch_wgmma records when the build fails
    sparse_mla._WGMMA_BROKEN.append("CompilationError: (a Triton whose Gluon API moved)")
    assert vllm_backend.max_heads(4) == vllm_backend.max_heads(1) == 0
    assert vllm_backend.short_rows_max_heads() == 0


def _brute_mean_keys(seq: list[int], qlen: list[int], window: int, topk: int) -> float:
    keys = [
        min(p + 1, window) + min((p + 1) // 4, topk)
        for s, q in zip(seq, qlen, strict=True)
        for p in range(s - q, s)
    ]
    return sum(keys) / len(keys) if keys else 0.0


def test_c4a_mean_keys_counts_every_token() -> None:
    """The closed form against a count over every token, on fresh random batches (chunks
    at any depth, empty chunks, windows and top-k widths from 1 up)."""
    from dsv4_attention.vllm_backend import c4a_mean_keys
    from dsv4_kernels.testing.common import fresh_seed, generator

    seed = fresh_seed()
    g = generator(seed)
    for _ in range(200):
        n = int(torch.randint(1, 6, (1,), generator=g))
        seq = torch.randint(0, 9000, (n,), generator=g).tolist()
        qlen = [int(torch.randint(0, s + 1, (1,), generator=g)) if s else 0 for s in seq]
        window = int(torch.randint(1, 300, (1,), generator=g))
        topk = int(torch.randint(1, 1100, (1,), generator=g))
        got = c4a_mean_keys(seq, qlen, window, topk)
        assert got == pytest.approx(_brute_mean_keys(seq, qlen, window, topk), abs=1e-9), (
            f"seed {seed}: {seq} {qlen} {window} {topk}"
        )
    # run 17's shapes (benchmarks.experiments.exp_context records the same means)
    assert c4a_mean_keys([1024] * 16, [1024] * 16, 128, 1024) == pytest.approx(247.8125)
    assert c4a_mean_keys([4096], [4096], 128, 1024) == pytest.approx(637.765625)
    assert c4a_mean_keys([131072], [16384], 128, 1024) == 1152.0


class _StepMetadata:
    """The host-side lengths of vLLM's ``DeepseekSparseSWAMetadata`` (weakly referable,
    as vLLM's dataclass is)."""

    def __init__(self, seq: list[int], qlen: list[int]) -> None:
        self.prefill_seq_lens_cpu = torch.tensor(seq, dtype=torch.int32)
        self.prefill_query_lens_cpu = torch.tensor(qlen, dtype=torch.int32)


def _step(seq: list[int], qlen: list[int]) -> object:
    return _StepMetadata(seq, qlen)


def _layer(heads: int, ratio: int) -> object:
    import types

    return types.SimpleNamespace(
        n_local_heads=heads,
        compress_ratio=ratio,
        window_size=128,
        topk_indices_buffer=torch.empty(4, 1024, dtype=torch.int32),
    )


def test_c4a_layers_above_8_heads_follow_the_steps_rows(
    fake_device,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Hopper, C4A layers with 9-16 local heads take the head-exact prefill in steps
    whose rows average at most ``C4A_SHORT_ROWS_MEAN_KEYS`` valid keys per token (run
    17) and vLLM's elsewhere; other layer types and head counts are unaffected."""
    from dsv4_attention import vllm_backend as vb

    fake_device(9)
    short = _step([1024] * 16, [1024] * 16)  # 247.8 keys per token
    edge = _step([2048] * 4, [2048] * 4)  # 379.8
    long = _step([131072], [16384])  # 1152
    deep = _step([8192], [4096])  # a chunk deep into a request: every row full
    assert vb.use_head_exact(_layer(16, 4), short)
    assert vb.use_head_exact(_layer(16, 4), edge)
    assert not vb.use_head_exact(_layer(16, 4), long)
    assert not vb.use_head_exact(_layer(16, 4), deep)
    assert not vb.use_head_exact(_layer(16, 4), object())  # no host lengths: vLLM's
    no_buffer = _layer(16, 4)
    no_buffer.topk_indices_buffer = None  # type: ignore[attr-defined]
    assert not vb.use_head_exact(no_buffer, short)
    assert not vb.use_head_exact(_layer(17, 4), short)
    assert vb.use_head_exact(_layer(12, 4), short)
    for ratio in (1, 128):  # shared-key layers: the head limit alone
        assert vb.use_head_exact(_layer(16, ratio), long)
        assert not vb.use_head_exact(_layer(17, ratio), short)
    assert vb.use_head_exact(_layer(8, 4), long)  # V4-Flash TP8: always
    # the threshold itself decides (a step at 379.8 keys on either side of it)
    monkeypatch.setattr(vb, "C4A_SHORT_ROWS_MEAN_KEYS", 379)
    assert not vb.use_head_exact(_layer(16, 4), _step([2048] * 4, [2048] * 4))
    monkeypatch.setattr(vb, "C4A_SHORT_ROWS_MEAN_KEYS", 380)
    assert vb.use_head_exact(_layer(16, 4), _step([2048] * 4, [2048] * 4))
    # the switch sets one limit and turns the row rule off
    monkeypatch.setenv(vb.ENV_MAX_HEADS, "8")
    assert not vb.use_head_exact(_layer(16, 4), short)
    monkeypatch.setenv(vb.ENV_MAX_HEADS, "16")
    assert vb.use_head_exact(_layer(16, 4), long)
    monkeypatch.delenv(vb.ENV_MAX_HEADS)
    fake_device(10)  # Blackwell: vLLM's everywhere
    assert not vb.use_head_exact(_layer(16, 4), short)
