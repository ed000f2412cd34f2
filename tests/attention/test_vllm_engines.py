"""Two engines in one process: each gets its own runtime, scratch and decisions (``vllm``).

An ``LLM()`` created again, RL frameworks that keep engines in-process, or
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM then initialises a new workspace manager
(its ``init_workspace_manager`` at device initialisation, before the model is built)
and builds the model again through the same selector.  Each engine here is built as
vLLM builds one, on this CPU: vLLM's own workspace manager (a fresh one per engine),
vLLM's ``VllmConfig`` with the engine's token budget, vLLM's V4.1 selector wrapped by
the plugin (its call while the engine builds its first layer is that engine's start-up
decision), vLLM's own layer ``__init__`` and KV-cache allocation (``_vllm_v41``), the
profile run through vLLM's ``forward_mqa`` without metadata, the workspace locked, then
a decode step as large as the engine allows, run as under CUDA-graph capture (an error
of ours raises instead of falling back), and a prefill step; every layer equals the
reference.  Engine 1's runtime and scratch are freed once its model is gone, while
engine 2 keeps serving.

Before, the runtime was one per process: an engine with budget 8192 after one with 64
got the first engine's runtime (scratch for 64 tokens), reserved nothing, and a
128-token decode under capture raised ``ValueError: scratch holds 64 tokens``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_v41 import (
    PADDED,
    FakeHopper,
    FlashMLACalls,
    build_stack,
    fill_topk,
    make_step,
    reference_attention,
    v41_config,
)
from .conftest import PoolRecorder
from .test_vllm_v41 import staged, v41_table, vllm_v41  # noqa: F401  (fixtures)

pytestmark = pytest.mark.vllm

RATIOS, SOURCES = (0, 1), (1,)  # a window-only layer, a ratio-1 kv + index source
HEADS = 8


@pytest.fixture(autouse=True)
def no_workspace_left_behind() -> Iterator[None]:
    """Each test's engines make vLLM workspace managers (and lock them): none is left as
    the process's current one for the tests after these (they would see it locked)."""
    from vllm.v1.worker import workspace as ws

    try:
        yield
    finally:
        ws.reset_workspace_manager()


@contextlib.contextmanager
def plugin_registered(config: Any) -> Iterator[None]:
    """The plugin registered once for the process (``DSV4_KERNELS_FORCE=1``: this CPU
    decides as on the H200), V4.1's package imported (its selector trigger installed);
    unregistered at the end."""
    import vllm.models.deepseek_v41  # noqa: F401
    from vllm.config import set_current_vllm_config

    from dsv4_attention import plugin

    plugin.unregister()
    saved = os.environ.get("DSV4_KERNELS_FORCE")
    os.environ["DSV4_KERNELS_FORCE"] = "1"
    try:
        with set_current_vllm_config(config):
            plugin.register()
        yield
    finally:
        plugin.unregister()
        if saved is None:
            os.environ.pop("DSV4_KERNELS_FORCE", None)
        else:
            os.environ["DSV4_KERNELS_FORCE"] = saved


@dataclasses.dataclass
class Engine:
    config: Any
    cls: type
    stack: Any
    manager: Any


def start_engine(budget: int, g: torch.Generator) -> Engine:
    """What vLLM does to start an engine, as far as attention is concerned: a new
    workspace manager, the model's layers through the (wrapped) selector, the KV cache,
    the profile run, the workspace locked."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v41.nvidia import model
    from vllm.v1.worker import workspace as ws

    ws.init_workspace_manager(torch.device("cpu"))
    manager = ws.current_workspace_manager()
    config = v41_config(HEADS, RATIOS, SOURCES, budget=budget, max_num_seqs=min(budget, 256))
    saved = model.current_platform
    model.current_platform = FakeHopper(saved)
    try:
        with set_current_vllm_config(config):
            cls = model._select_dsv4_attn_cls(config)
    finally:
        model.current_platform = saved
    cls.dsv4_runtime.table = v41_table()  # V4.1 decode rows (as the step tests give)
    stack = build_stack(cls, HEADS, RATIOS, SOURCES, g=g, config=config, available_bytes=96 << 20)
    tokens = min(8, budget)
    with set_forward_context(None, config):  # vLLM's profile run
        for layer in stack.layers:
            q = torch.zeros(tokens, PADDED, 512, dtype=torch.bfloat16)
            layer.forward_mqa(q, None, torch.zeros(tokens, dtype=torch.int64), torch.empty_like(q))
    manager.lock()
    return Engine(config, cls, stack, manager)


def serve(engine: Engine, g: torch.Generator, decode_tokens: int) -> None:
    """A decode step of ``decode_tokens`` one-token requests, run as under capture (our
    errors raise), then a prefill step within the budget: every layer's real heads equal
    the reference."""
    from vllm.forward_context import set_forward_context

    rt = engine.cls.dsv4_runtime
    budget = int(engine.config.scheduler_config.max_num_batched_tokens)
    steps = [
        ("decode", [1] * decode_tokens, [40 + (i % 50) for i in range(decode_tokens)], True),
        ("prefill", [min(budget, 20) - 4, 4], [300, 4], False),
    ]
    for name, qlens, seqs, capture in steps:
        step = make_step(engine.stack, g, qlens, seqs, len(qlens) if capture else 0)
        q = torch.randn(step.total, PADDED, 512, generator=g).to(torch.bfloat16)
        q[:, HEADS:] = 0
        saved = rt.access
        if capture:  # as inside vLLM's CUDA-graph capture: an error of ours is raised
            rt.access = dataclasses.replace(saved, capturing=lambda: True)
        try:
            with set_forward_context(step.metadata, engine.config):
                for layer in engine.stack.layers:
                    if layer.is_index_source:
                        fill_topk(engine.stack, step, layer.compress_ratio, g)
                    out = torch.full_like(q, float("nan"))
                    layer.forward_mqa(q, None, step.positions, out)
                    topk = engine.stack.topk_buffer.clone()
                    want = reference_attention(layer, step, q, HEADS, topk)
                    torch.testing.assert_close(
                        out[:, :HEADS].float(), want.float(), atol=2e-2, rtol=2e-2,
                        msg=lambda m, n=name, p=layer.prefix: f"budget {budget}, {n}, {p}: {m}",
                    )  # fmt: skip
        finally:
            rt.access = saved


@pytest.mark.parametrize("budgets", [(64, 8192), (8192, 64)], ids=["64-then-8192", "8192-then-64"])
def test_two_engines_in_one_process_each_have_their_own_runtime(
    budgets: tuple[int, int],
    vllm_v41: FlashMLACalls,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dsv4_attention import plugin

    # vLLM's manager releases cached memory before it grows: nothing to release on a CPU
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    seed = fresh_seed()
    g = generator(seed)
    first, second = budgets
    with plugin_registered(v41_config(HEADS, RATIOS, SOURCES)), caplog.at_level("INFO"):
        one = start_engine(first, g)
        rt1 = one.cls.dsv4_runtime
        assert plugin.runtime() is rt1
        assert rt1.decode_scratch is not None and rt1.prefill_scratch is not None
        assert rt1.decode_scratch.sizes.max_tokens == first
        assert rt1.prefill_scratch.spec.max_tokens == first
        serve(one, g, min(first, 128))
        freed = [
            weakref.ref(rt1.decode_scratch.partial_out),
            *(weakref.ref(b) for b in rt1.prefill_scratch.buffers.values()),
        ]
        two = start_engine(second, g)
        rt2 = two.cls.dsv4_runtime
        assert two.cls is not one.cls and rt2 is not rt1 and plugin.runtime() is rt2
        assert rt2.decode_scratch.sizes.max_tokens == second, "engine 2 reserved its own"
        assert rt2.prefill_scratch.spec.max_tokens == second
        assert sorted(rt2.kinds) == [(0, HEADS), (1, HEADS)]
        for rt in (rt1, rt2):
            for state in rt.kinds.values():
                assert state.prefill.ours and state.decode.ours, state
        serve(two, g, min(second, 128))
        serve(one, g, min(first, 128))  # engine 1 still serves beside engine 2
        assert vllm_v41.decode == [] and vllm_v41.prefill == [], "vLLM's FlashMLA ran"
        del one, rt1, rt
        gc.collect()
        assert all(ref() is None for ref in freed), "engine 1's scratch is still held"
        serve(two, g, 4)  # engine 2 unaffected
        lines = [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()]
        assert len(lines) == 2, lines  # one memory line per engine
        assert f"budget {first} tokens" in lines[0] and f"budget {second} tokens" in lines[1]
        # engine 2 shut down too (its workspace manager and model gone): the plugin
        # holds nothing of it, its scratch is freed
        from vllm.v1.worker import workspace as ws

        freed = [weakref.ref(rt2.decode_scratch.partial_out)]
        ws.reset_workspace_manager()
        del two, rt2
        gc.collect()
        assert plugin.runtime() is None and all(ref() is None for ref in freed)
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "dsv4" in r.name]


def test_scratch_lives_in_vllms_workspace_pool_and_survives_sleep(
    vllm_v41: FlashMLACalls,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    pool_recorder: PoolRecorder,
) -> None:
    """Sleep mode: vLLM allocates its workspace inside the manager's allocation context
    (``_maybe_get_memory_pool_context("workspace")``: the CuMem pool that ``sleep()``
    discards and ``wake_up()`` maps back at the same addresses, contents lost).  Every
    buffer of our scratch is allocated inside that context (recorded here through the
    context vLLM's manager is given), and after the scratch's contents are destroyed as
    a sleep destroys them, the next decode and prefill steps are still right."""
    from vllm.v1.worker import workspace as ws

    real_init = ws.init_workspace_manager
    monkeypatch.setattr(
        ws,
        "init_workspace_manager",
        lambda device, **kw: real_init(device, alloc_context=pool_recorder.pool),
    )
    made = pool_recorder.made
    g = generator(fresh_seed())
    with plugin_registered(v41_config(HEADS, RATIOS, SOURCES)), caplog.at_level("INFO"):
        engine = start_engine(24, g)
        monkeypatch.setattr(torch, "empty", pool_recorder.real_empty)
        rt = engine.cls.dsv4_runtime
        buffers = [rt.decode_scratch.partial_out, *rt.prefill_scratch.buffers.values()]
        assert all(b.data_ptr() in made for b in buffers), "scratch allocated outside the pool"
        assert "in its workspace memory pool" in caplog.text
        serve(engine, g, 8)
        # sleep(): the pool's memory is discarded; wake_up(): mapped again, contents lost
        for b in buffers:
            b.view(torch.uint8).random_(0, 256, generator=g)
        serve(engine, g, 8)
    assert vllm_v41.decode == [] and vllm_v41.prefill == []


def test_a_scratch_no_kind_takes_is_released(
    vllm_v41: FlashMLACalls,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every kind turned down at start-up (its decode warm-up fails here, which declines
    the kind's prefill and decode): once every kind of the model is decided, both
    scratches are released, one line each; steps run vLLM's own path and stay right.
    With ``--kv-cache-memory-bytes`` the memory line says how much to leave free."""
    from dsv4_attention import warmup

    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)

    def broken(*args: Any, **kwargs: Any) -> float:
        raise RuntimeError("no decode kernel here")

    monkeypatch.setattr(warmup, "warm_up_decode", broken)
    g = generator(fresh_seed())
    real_config = v41_config

    def config_with_kv_bytes(*args: Any, **kwargs: Any) -> Any:
        config = real_config(*args, **kwargs)
        config.cache_config.kv_cache_memory_bytes = 8 << 30
        return config

    monkeypatch.setattr(sys.modules[__name__], "v41_config", config_with_kv_bytes)
    with plugin_registered(v41_config(HEADS, RATIOS, SOURCES)), caplog.at_level("INFO"):
        engine = start_engine(24, g)
        rt = engine.cls.dsv4_runtime
        assert sorted(rt.kinds) == [(0, HEADS), (1, HEADS)]
        for state in rt.kinds.values():
            assert not state.decode.ours and not state.prefill.ours, state
        memory = [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()]
        assert len(memory) == 1 and "--kv-cache-memory-bytes is set" in memory[0], memory
        assert "leave " in memory[0] and "MiB per GPU free" in memory[0]
        assert rt.decode_scratch is not None  # held until vLLM's profile run is over
        from vllm.forward_context import set_forward_context

        step = make_step(engine.stack, g, [1, 1], [70, 200], 2)
        q = torch.randn(step.total, PADDED, 512, generator=g).to(torch.bfloat16)
        with set_forward_context(step.metadata, engine.config):
            for layer in engine.stack.layers:
                if layer.is_index_source:
                    fill_topk(engine.stack, step, layer.compress_ratio, g)
                out = torch.full_like(q, float("nan"))
                layer.forward_mqa(q, None, step.positions, out)
                want = reference_attention(layer, step, q, HEADS, engine.stack.topk_buffer)
                torch.testing.assert_close(
                    out[:, :HEADS].float(), want.float(), atol=2e-2, rtol=2e-2
                )
        # the first step with metadata: the profile run is over, nothing takes the scratch
        assert rt.decode_scratch is None and rt.prefill_scratch is None and rt.reserved == {}
        released = [r.getMessage() for r in caplog.records if "released" in r.getMessage()]
        assert len(released) == 2, released
        assert "prefill scratch" in released[0] and "decode scratch" in released[1], released
    assert len(vllm_v41.decode) == len(RATIOS)  # vLLM's decode, every layer
