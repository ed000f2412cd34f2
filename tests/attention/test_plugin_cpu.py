"""Plugin logic that needs no vLLM: the version gate, never raising without vLLM, the
policy's decisions per device and measured table, and the runtime's start-up and step
decisions on hand-built layers.

Everything the plugin does to vLLM is tested against vLLM's own code in
``test_vllm_plugin.py`` (the ``vllm`` nox session).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch

from dsv4_attention import plugin, policy, tables, vllm_calls, vllm_targets
from dsv4_attention.facts import LayerFacts, ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess
from dsv4_kernels.geometry import TOKEN_BYTES, page_stride_bytes

DEFAULT_SWITCHES = Switches()  # no switch set


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
        ("0.34.0", True),
        ("0.35.0", False),
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
        assert not plugin.is_active() and plugin.runtime() is None and not plugin.waiting()
        assert "inactive" in caplog.text
    finally:
        plugin.unregister()


def test_every_replaced_name_has_a_signature_and_consumers() -> None:
    for facts in vllm_targets.RELEASES.values():
        for name in (*vllm_targets.CUDA_OPS, "dequantize_and_gather_k_cache"):
            assert name in facts.signatures
            assert vllm_targets.OPS_PACKAGE in facts.consumers[name]
        for name in ("_select_dsv4_attn_cls", "_forward_prefill", "forward_mqa", "_forward_decode"):
            assert name in facts.signatures


def test_release_facts_are_one_table() -> None:
    """Each supported release has its facts; the text lists both; others have none."""
    assert vllm_targets.supported_text() == "0.32.x, 0.33.x, 0.34.x"
    assert vllm_targets.facts_for("0.32.0").kv_cache_grouping_module.endswith("kv_cache_utils")  # type: ignore[union-attr]
    facts33 = vllm_targets.facts_for("0.33.0")
    assert facts33 is not None
    assert facts33.kv_cache_grouping_module.endswith("kv_cache_planning")
    for facts in vllm_targets.RELEASES.values():  # both ship V4.1 (0.32.0 already)
        assert "vllm.models.deepseek_v41" in facts.untouched_models
    assert vllm_targets.facts_for("0.35.0") is None


# --- the policy, per device and measured table ----------------------------------------


def _h200() -> tables.MeasuredTable:
    table = tables.table_for("NVIDIA H200", (9, 0))
    assert table is not None
    return table


H200 = _h200()
HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)
SERVING = ServingConfig(
    architectures=("DeepseekV4ForCausalLM",), max_num_batched_tokens=256, max_model_len=4096
)
DEVICES = {
    "hopper": Device("NVIDIA H200", (9, 0), wgmma=True),
    "h100": Device("NVIDIA H100 80GB HBM3", (9, 0), wgmma=True),  # no table of its own
    "hopper-without-gluon": Device("NVIDIA H200", (9, 0), wgmma=False),
    "blackwell": Device("NVIDIA B200", (10, 0), wgmma=False),
    "ampere": Device("NVIDIA A100-SXM4-80GB", (8, 0)),
    "sm120": Device("NVIDIA RTX PRO 6000 Blackwell", (12, 0)),
    "no-device": Device(None, None),
}


def _layer(heads: int, ratio: int, topk: int | None = 1024) -> Any:
    """A DSV4 attention layer's attributes as vLLM's ``DeepseekV4Attention`` holds them."""
    return types.SimpleNamespace(
        prefix=f"layers.{ratio}.{heads}.attn",
        n_local_heads=heads,
        compress_ratio=ratio,
        window_size=128,
        topk_indices_buffer=None if topk is None else torch.empty(4, topk, dtype=torch.int32),
        scale=512**-0.5,
    )


def _facts(heads: int, ratio: int) -> LayerFacts:
    return LayerFacts.read(_layer(heads, ratio), SERVING)


def _most_heads(device: Device, ratio: int, switches: Switches = DEFAULT_SWITCHES) -> int:
    """Most local heads whose prefill the policy hands to ours (in some steps)."""
    table = tables.table_for(device.name, device.capability)
    ours = [
        h
        for h in range(1, 129)
        if policy.prefill_choice(_facts(h, ratio), device, table, switches).ours
    ]
    assert ours == list(range(1, len(ours) + 1)), "not every head count below the limit"
    return len(ours)


@pytest.mark.parametrize(
    ("device", "c4a_heads", "c4a_short_rows_heads", "shared_heads"),
    [
        ("hopper", 8, 16, 16),
        ("h100", 0, 0, 0),
        ("hopper-without-gluon", 0, 0, 0),
        ("blackwell", 0, 0, 0),
        ("ampere", 0, 0, 0),
        ("sm120", 0, 0, 0),
        ("no-device", 0, 0, 0),
    ],
)
def test_head_limits_follow_the_measured_table(
    device: str, c4a_heads: int, c4a_short_rows_heads: int, shared_heads: int
) -> None:
    """Hopper with the wgmma kernel (the H200's table, or its family's): up to 8 local
    heads on C4A layers in every step, 16 in steps with short rows, 16 on SWA-only and
    C128A layers; a GPU without a measured table, or Hopper without the Gluon kernel,
    keeps vLLM's prefill at every head count.  ``DSV4_PREFILL_MAX_HEADS`` sets one limit
    for every layer kind, short rows included, where the table allows ours at all."""
    dev = DEVICES[device]
    table = tables.table_for(dev.name, dev.capability)
    assert _most_heads(dev, 4) == c4a_short_rows_heads
    assert _most_heads(dev, 1) == _most_heads(dev, 128) == shared_heads
    if table is not None:
        limits = table.prefill
        assert policy.prefill_heads_limit(_facts(16, 4), limits, Switches()) == 8
        assert policy.prefill_heads_limit(_facts(16, 4), limits, Switches(), short_rows=True) == 16
        c4a = policy.prefill_choice(_facts(c4a_heads or 8, 4), dev, table, Switches())
        assert c4a.ours is bool(c4a_heads) and (not c4a.ours or c4a.reason == "every step")
        if c4a_short_rows_heads:
            short = policy.prefill_choice(_facts(c4a_short_rows_heads, 4), dev, table, Switches())
            assert short.ours and "512 valid keys per token" in short.reason
    else:
        reason = policy.prefill_choice(_facts(8, 1), dev, table, Switches()).reason
        assert reason == f"no measured table for {dev.name or 'this device'}"
    switches = Switches.read({"DSV4_PREFILL_MAX_HEADS": "12"})
    assert switches.max_heads == 12
    on = 12 if shared_heads else 0
    assert [_most_heads(dev, r, switches) for r in (1, 4, 128)] == [on, on, on]
    zero = Switches.read({"DSV4_PREFILL_MAX_HEADS": "0"})
    assert [_most_heads(dev, r, zero) for r in (1, 4, 128)] == [0, 0, 0]


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_decode_follows_the_measured_table(device: str) -> None:
    """The decode is ours at up to 16 local heads where the table has the GPU and the
    Gluon kernel builds, and at 17-64 (DP attention) at the small steps measured faster
    there; more than 64 never; the switch keeps vLLM's; unknown layer kinds are never
    ours."""
    dev = DEVICES[device]
    table = tables.table_for(dev.name, dev.capability)
    measured = device == "hopper"
    for ratio in (1, 4, 128):
        for heads in (1, 8, 9, 16):
            choice = policy.decode_choice(_facts(heads, ratio), dev, table, Switches())
            assert choice.ours is measured, (ratio, heads, choice)
            if measured:
                assert choice.reason == "at the step sizes measured faster (11 of 11)"
        for heads in (17, 64):  # the 64-head row: its first steps measured faster
            dp = policy.decode_choice(_facts(heads, ratio), dev, table, Switches())
            assert dp.ours is measured, (ratio, heads, dp)
            if measured:
                assert dp.reason.startswith("at the step sizes measured faster (")
                assert not dp.reason.endswith("(9 of 9)"), dp.reason  # not all of them
        wide = policy.decode_choice(_facts(65, ratio), dev, table, Switches())
        assert not wide.ours
        off = policy.decode_choice(_facts(8, ratio), dev, table, Switches(decode_disable=True))
        assert not off.ours and off.reason == "DSV4_DECODE_DISABLE=1"
    odd = policy.decode_choice(_facts(8, 2), dev, table, Switches())
    assert not odd.ours and odd.reason == "compress ratio 2 is not a DSV4 layer kind"
    if device == "hopper-without-gluon":
        assert policy.decode_choice(_facts(8, 1), dev, table, Switches()).reason == (
            "the Gluon wgmma kernel does not build here"
        )


def test_switches_are_read_from_the_environment() -> None:
    assert Switches.read({}) == Switches()
    got = Switches.read(
        {
            "DSV4_KERNELS_DISABLE": "1",
            "DSV4_KERNELS_FORCE": "true",
            "DSV4_PREFILL_DISABLE": "yes",
            "DSV4_DECODE_DISABLE": " ON ",
            "DSV4_PREFILL_MAX_HEADS": " 4 ",
            "DSV4_INDEXER_DISABLE": "1",
        }
    )
    assert got == Switches(True, True, True, True, 4, indexer_disable=True)
    assert Switches.read({"DSV4_DECODE_DISABLE": "0", "DSV4_PREFILL_DISABLE": "no"}) == Switches()
    for bad in ("-1", "eight", "1.5"):
        with pytest.raises(ValueError, match="DSV4_PREFILL_MAX_HEADS must be an integer >= 0"):
            Switches.read({"DSV4_PREFILL_MAX_HEADS": bad})


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
    from dsv4_attention.policy import c4a_mean_keys
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
    assert c4a_mean_keys([], [], 128, 1024) == 0.0


# --- the runtime on hand-built layers ---------------------------------------------------


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """The Gluon wgmma kernel as built, and the warm-ups recorded instead of run (they
    compile the kernels on a GPU): ``(what, compress_ratio, heads)`` per warm-up."""
    from dsv4_attention import warmup
    from dsv4_kernels import sparse_mla

    built: list[tuple[str, int, int]] = []
    monkeypatch.setattr(sparse_mla, "_gluon_importable", lambda: True)
    monkeypatch.setattr(sparse_mla, "_WGMMA_BROKEN", [])

    def prefill(device: Any, heads: int, ratio: int, *args: Any, **kwargs: Any) -> None:
        built.append(("prefill", ratio, heads))

    def decode(device: Any, heads: int, ratio: int, *args: Any, **kwargs: Any) -> None:
        built.append(("decode", ratio, heads))

    monkeypatch.setattr(warmup, "warm_up_prefill", prefill)
    monkeypatch.setattr(warmup, "warm_up_decode", decode)
    return built


class _Log:
    def __init__(self) -> None:
        self.info: list[str] = []
        self.warning: list[str] = []

    def access(self) -> VllmAccess:
        return VllmAccess(info=self.info.append, warning=self.warning.append)


def _runtime(
    log: _Log,
    device: Device = HOPPER,
    table: tables.MeasuredTable | None = H200,
    switches: Switches = DEFAULT_SWITCHES,
) -> HeadExactRuntime:
    return HeadExactRuntime(SERVING, device, table, switches, log.access())


Q = torch.zeros((1, 64, 512), dtype=torch.bfloat16)


def test_hopper_declines_when_the_wgmma_kernel_fails_to_build(
    kernels: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Triton that cannot build the wgmma kernel is known only after the first build
    fails (the launcher then runs the Triton kernel, slower than vLLM's FlashMLA): the
    kind whose warm-up failed and every later kind keep vLLM's prefill and decode."""
    from dsv4_kernels import sparse_mla

    log = _Log()
    rt = _runtime(log)
    for ratio in (1, 4, 128):  # the wgmma kernel builds: every kind is ours
        rt.prepare(_layer(8, ratio), Q)
        state = rt.kinds[(ratio, 8)]
        assert state.prefill.ours and state.decode.ours, state
    assert [k[:2] for k in kernels] == [(w, r) for r in (1, 4, 128) for w in ("prefill", "decode")]

    log = _Log()
    rt = _runtime(log)

    def broken(device: Any, heads: int, ratio: int, *args: Any, **kwargs: Any) -> None:
        # what _launch_wgmma records when the build fails
        sparse_mla._WGMMA_BROKEN.append("CompilationError: (a Triton whose Gluon API moved)")

    from dsv4_attention import warmup

    monkeypatch.setattr(warmup, "warm_up_prefill", broken)
    for ratio in (1, 4, 128):
        rt.prepare(_layer(8, ratio), Q)
    failed = "its warm-up failed: RuntimeError: the Gluon wgmma kernel failed to build"
    for ratio in (1, 4, 128):
        state = rt.kinds[(ratio, 8)]
        assert state.prefill == state.decode == policy.Choice(False, failed), state
    kinds = [line for line in log.info if "local heads" in line]
    assert len(kinds) == 3 and all(line.count(failed) == 2 for line in kinds), log.info
    assert log.warning == []
    # a process that knew it at start-up (the device's record) never takes ours
    no_gluon = _runtime(_Log(), Device("NVIDIA H200", (9, 0), wgmma=False))
    no_gluon.prepare(_layer(8, 4), Q)
    assert not no_gluon.kinds[(4, 8)].prefill.ours and not no_gluon.kinds[(4, 8)].decode.ours


def test_each_kind_is_decided_once_and_logged_once(kernels: list[tuple[str, int, int]]) -> None:
    """One decision, one warm-up and one line per (layer kind, heads); both scratches
    reserved once, at the first layer, with one memory line."""
    log = _Log()
    rt = _runtime(log)
    for _ in range(3):
        for ratio in (1, 4, 128):
            rt.prepare(_layer(16, ratio), Q)
    assert sorted(rt.kinds) == [(1, 16), (4, 16), (128, 16)]
    assert sorted(kernels) == sorted((w, r, 16) for r in (1, 4, 128) for w in ("prefill", "decode"))
    memory = [line for line in log.info if "reserved" in line]
    assert len(memory) == 1 and "budget 256 tokens, max_model_len 4096" in memory[0]
    assert set(rt.reserved) == {"prefill", "decode"} and all(rt.reserved.values())
    assert rt.decode_scratch is not None and rt.prefill_scratch is not None
    lines = [line for line in log.info if "local heads" in line]
    assert len(lines) == 3
    assert lines[1] == (
        "dsv4-attention: C4A layers, 16 local heads, DeepseekV4ForCausalLM: prefill ours (in "
        "steps whose rows average at most 512 valid keys per token); decode ours (at the step "
        "sizes measured faster (11 of 11))"
    )
    # a GPU without a table: nothing reserved, nothing warmed up, vLLM's everywhere
    log = _Log()
    kernels.clear()
    rt = _runtime(log, Device("NVIDIA B200", (10, 0)), None)
    rt.prepare(_layer(8, 4), Q)
    assert kernels == [] and rt.reserved == {} and rt.decode_scratch is None
    assert log.info == [
        "dsv4-attention: C4A layers, 8 local heads, DeepseekV4ForCausalLM: prefill vLLM's "
        "(no measured table for NVIDIA B200); decode vLLM's (no measured table for NVIDIA B200)"
    ]


class _StepMetadata:
    """The host-side lengths of vLLM's ``DeepseekSparseSWAMetadata`` (weakly referable,
    as vLLM's dataclass is)."""

    block_size = 64
    num_decodes = 0

    def __init__(self, seq: list[int], qlen: list[int]) -> None:
        self.prefill_seq_lens_cpu = torch.tensor(seq, dtype=torch.int32)
        self.prefill_query_lens_cpu = torch.tensor(qlen, dtype=torch.int32)
        self.num_prefills = len(seq)
        self.num_prefill_tokens = sum(qlen)


def _step(seq: list[int], qlen: list[int]) -> object:
    return _StepMetadata(seq, qlen)


def _pages(slots: int, pages: int = 2) -> torch.Tensor:
    """A DSV4 FP8 page view (``[pages, slots, 584]`` uint8 at the layout's page stride)."""
    stride = page_stride_bytes(slots)
    flat = torch.zeros(pages * stride, dtype=torch.uint8)
    return flat.as_strided((pages, slots, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))


@pytest.fixture
def prefill_runs(
    kernels: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, object]]:
    """Our prefill recorded instead of run: ``(layer prefix, step plan)`` per call."""
    ran: list[tuple[str, object]] = []
    monkeypatch.setattr(vllm_calls, "prefill_plan", lambda swa, scratch: object())
    monkeypatch.setattr(
        vllm_calls, "run_prefill", lambda layer, facts, plan, *a: ran.append((layer.prefix, plan))
    )
    return ran


def test_c4a_layers_above_8_heads_follow_the_steps_rows(
    prefill_runs: list[tuple[str, object]],
) -> None:
    """On Hopper, C4A layers with 9-16 local heads take the head-exact prefill in steps
    whose rows average at most the table's ``c4a_short_rows_mean_keys`` valid keys per
    token (run 17) and vLLM's elsewhere; other layer types and head counts are
    unaffected."""
    short = ([1024] * 16, [1024] * 16)  # 247.8 keys per token
    edge = ([2048] * 4, [2048] * 4)  # 379.8
    long = ([131072], [16384])  # 1152
    deep = ([8192], [4096])  # a chunk deep into a request: every row full

    def takes(
        layer: Any,
        rows: tuple[list[int], list[int]] | None,
        table: tables.MeasuredTable | None = H200,
        switches: Switches = DEFAULT_SWITCHES,
        device: Device = HOPPER,
    ) -> bool:
        """Whether a fresh runtime's prefill of this layer in this step is ours."""
        log = _Log()
        rt = _runtime(log, device, table, switches)
        # no host lengths: vLLM's metadata without them (its batch counts only)
        swa = (
            types.SimpleNamespace(
                block_size=64, num_decodes=0, num_prefills=1, num_prefill_tokens=1
            )
            if rows is None
            else _step(*rows)
        )
        ratio = layer.compress_ratio
        comp = None if ratio == 1 else _pages(256 // ratio)
        attn = types.SimpleNamespace(block_size=256)
        before = len(prefill_runs)
        got = rt.prefill(layer, Q, comp, _pages(64), torch.empty_like(Q), attn, swa)
        assert got is (len(prefill_runs) == before + 1)
        assert log.warning == [], log.warning  # a decision, not a failure
        return got

    assert takes(_layer(16, 4), short)
    assert takes(_layer(16, 4), edge)
    assert not takes(_layer(16, 4), long)
    assert not takes(_layer(16, 4), deep)
    assert not takes(_layer(16, 4), None)  # no host lengths: vLLM's
    assert not takes(_layer(16, 4, topk=None), short)  # no top-k buffer: vLLM's
    assert not takes(_layer(17, 4), short)
    assert takes(_layer(12, 4), short)
    for ratio in (1, 128):  # shared-key layers: the head limit alone
        assert takes(_layer(16, ratio), long)
        assert not takes(_layer(17, ratio), short)
    assert takes(_layer(8, 4), long)  # V4-Flash TP8: always
    # the table's threshold itself decides (a step at 379.8 keys on either side of it)
    for threshold, ours in ((379, False), (380, True)):
        limits = dataclasses.replace(H200.prefill, c4a_short_rows_mean_keys=threshold)
        table = dataclasses.replace(H200, prefill=limits)
        assert takes(_layer(16, 4), edge, table) is ours
    # the switch sets one limit and turns the row rule off
    assert not takes(_layer(16, 4), short, switches=Switches(max_heads=8))
    assert takes(_layer(16, 4), long, switches=Switches(max_heads=16))
    assert not takes(_layer(8, 4), short, switches=Switches(prefill_disable=True))
    # Blackwell (no measured table), Hopper without the Gluon kernel: vLLM's everywhere
    assert not takes(_layer(16, 4), short, None, device=Device("NVIDIA B200", (10, 0)))
    assert not takes(_layer(8, 1), short, device=Device("NVIDIA H200", (9, 0), wgmma=False))


def test_one_plan_and_one_mean_per_step(
    prefill_runs: list[tuple[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers of one step share its plan and its C4A row mean (computed once from the
    host lengths); the next step gets its own."""
    means: list[int] = []
    real = policy.c4a_mean_keys

    def counted(*args: Any) -> float:
        means.append(1)
        return real(*args)

    monkeypatch.setattr(policy, "c4a_mean_keys", counted)
    rt = _runtime(_Log())
    layers = [_layer(16, r) for r in (1, 4, 128, 4, 128)]
    for i, layer in enumerate(layers):
        layer.prefix = f"layers.{i}.attn"
    attn = types.SimpleNamespace(block_size=256)
    for step_no, rows in enumerate([([1024] * 16, [1024] * 16), ([2048] * 4, [2048] * 4)]):
        swa = _step(*rows)
        for layer in layers:
            r = layer.compress_ratio
            comp = None if r == 1 else _pages(256 // r)
            assert rt.prefill(layer, Q, comp, _pages(64), torch.empty_like(Q), attn, swa)
        assert len(means) == step_no + 1
    assert [p for p, _ in prefill_runs] == [layer.prefix for layer in layers] * 2
    plans = [plan for _, plan in prefill_runs]
    assert len({id(p) for p in plans[:5]}) == 1 and len({id(p) for p in plans[5:]}) == 1
    assert plans[0] is not plans[5]


def test_a_raising_step_goes_back_to_vllm_once_warned(
    prefill_runs: list[tuple[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from our prefill outside capture: False (vLLM's method runs), one
    warning, and that kind's prefill is vLLM's for the rest of the run; under capture it
    propagates."""
    log = _Log()
    rt = _runtime(log)

    def boom(*args: Any) -> None:
        raise RuntimeError("boom in a kernel")

    monkeypatch.setattr(vllm_calls, "run_prefill", boom)
    attn = types.SimpleNamespace(block_size=256)
    layer = _layer(8, 1)
    for _ in range(3):
        assert not rt.prefill(
            layer, Q, None, _pages(64), torch.empty_like(Q), attn, _step([9], [9])
        )
    assert len(log.warning) == 1 and "RuntimeError: boom in a kernel" in log.warning[0]
    assert rt.kinds[(1, 8)].prefill == policy.Choice(False, "prefill raised RuntimeError")
    assert rt.kinds[(1, 8)].decode.ours  # the decode is another path
    captured = HeadExactRuntime(
        SERVING,
        HOPPER,
        H200,
        Switches(),
        VllmAccess(info=lambda s: None, warning=lambda s: None, capturing=lambda: True),
    )
    with pytest.raises(RuntimeError, match="boom in a kernel"):
        captured.prefill(
            _layer(8, 1), Q, None, _pages(64), torch.empty_like(Q), attn, _step([9], [9])
        )


@pytest.mark.parametrize(
    ("family", "ratio", "rows"),
    [
        ("v4", 1, "WINDOW"),
        ("v4", 4, "TOPK"),
        ("v4", 128, "ALL"),
        ("v41", 0, "WINDOW"),
        ("v41", 1, "TOPK"),
        ("v41", 2, "TOPK"),
    ],
)
def test_one_rule_from_ratio_to_rows(family: str, ratio: int, rows: str) -> None:
    """vLLM's ratio of each family gives one row kind (``geometry.FAMILY_ROW_KINDS``),
    and the layer's facts, the plan's helpers and the index kernels' rule
    (``geometry.row_kind`` of the ratio the kernels are given) all say the same."""
    from dsv4_attention import prefill_plan
    from dsv4_kernels.geometry import FAMILY_ROW_KINDS, RowKind, row_kind

    kind = RowKind[rows]
    assert FAMILY_ROW_KINDS[family][ratio] is kind
    facts = LayerFacts("l", ratio, 8, 128, 512, 1024, 64, 128, family=family)
    assert facts.rows is kind and facts.topk_rows == (kind is RowKind.TOPK)
    assert facts.compressed == kind.compressed
    topk = object() if facts.topk_rows else None
    assert row_kind(facts.kernel_ratio, topk is not None) is kind
    assert prefill_plan.topk_rows(facts.kernel_ratio, topk) == facts.topk_rows
    assert prefill_plan.has_compressed_rows(facts.kernel_ratio, topk) == kind.compressed
    assert (facts.comp_page_slots is None) == (not kind.compressed)
    unknown = LayerFacts("l", 3, 8, 128, 512, 1024, 64, 128, family=family)
    assert unknown.rows is None and unknown.kind is None and not unknown.compressed
    with pytest.raises(ValueError, match="compress_ratio must be None, 1"):
        row_kind(3, False)


def test_a_table_row_names_the_kernels_it_was_measured_with(
    kernels: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table with a 128-head row (V4-Pro under DP attention) whose kernels are issue 41's
    wide blocks: 65-128 local heads take that row, and the warm-up compiles the decode
    with the row's launch entries (what serving then passes); rows without entries keep
    the kernels' defaults."""
    from dsv4_attention import warmup

    policies: list[tuple[int, object]] = []

    def decode(device: Any, heads: int, ratio: int, *args: Any, **kwargs: Any) -> None:
        policies.append((heads, kwargs.get("policy")))

    monkeypatch.setattr(warmup, "warm_up_decode", decode)
    steps = {1: 1.2, 1024: 1.1}
    ratios = {k: {8: steps, 64: steps, 128: steps} for k in ("swa", "c4a", "c128a")}
    dp = tables.DecodeTable(True, 128, 1.0, ratios, kernels={128: {"WIDE_HT": 64}})
    table = dataclasses.replace(H200, decode=dp)
    assert dp.row("c4a", 65) is dp.ratios["c4a"][128] and dp.row("c4a", 129) is None
    assert dp.kernel_policy(100) == {"WIDE_HT": 64} and dp.kernel_policy(64) is None
    log = _Log()
    rt = _runtime(log, table=table)
    for heads in (128, 64):
        rt.prepare(_layer(heads, 4), torch.zeros((1, heads, 512), dtype=torch.bfloat16))
        assert rt.kinds[(4, heads)].decode.ours
    assert policies == [(128, {"WIDE_HT": 64}), (64, None)]


def test_the_vllm_extra_installs_exactly_the_supported_releases() -> None:
    """``pip install "./packages/dsv4-attention[vllm]"`` takes a release the plugin knows."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "packages/dsv4-attention/pyproject.toml").read_text())
    oldest, newest = min(vllm_targets.RELEASES), max(vllm_targets.RELEASES)
    assert project["project"]["optional-dependencies"]["vllm"] == [
        f"vllm>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"
    ]
