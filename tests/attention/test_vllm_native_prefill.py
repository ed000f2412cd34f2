"""vLLM's own DeepSeek-V4 prefill at the real heads (``dsv4_attention.native``; ``vllm`` session).

vLLM 0.33 bundles a FlashMLA whose sparse prefill runs 8, 16 or 32 query heads on
SM90; its V4.1 class calls it so, its V4 class still pads to 64.  Where the measured
table lists the local head count as faster at the real heads
(``versus_native.faster_than_padded_heads``) and our prefill is not taken, the plugin
wraps the ``flash_mla_sparse_fwd`` of vLLM's V4 FlashMLA module and runs vLLM's own V4
``_forward_prefill`` inside ``native.real_heads``.

The shipped H200 table lists no head count (measured in ``docs/results/h200-issue30``:
at 32 heads the real-heads call is slower than padded): with it the plugin installs
no wrapper (tested).  The mechanism is tested with that table listing 32 heads (the
case it was built for: V4-Pro at TP4), given to the plugin's activation.

On this CPU: FlashMLA cannot run, so the bundled function is replaced (before the
plugin activates, so the plugin checks and wraps it) by a recorder with the bundled
interface's signature ``(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
topk_length=None, out=None)`` that writes the pure-torch attention of what it is
given.  vLLM's ``_forward_prefill`` runs for real: its chunk plan, vLLM's workspace
manager, and its gather and combine as they run with the plugin active (the plugin's
replacements, our Triton kernels through the interpreter).  The V4 layer is the
stand-in of ``test_vllm_step.Model`` (caches from vLLM's allocator, vLLM's metadata
classes) at 8 or 32 local heads.  The plugin decides as on the H200
(``DSV4_KERNELS_FORCE``), where ``plugin._native_prefill`` would say no (no SM90
GPU, no bundled FlashMLA): it is made to say yes.

vLLM 0.32's FlashMLA documents no small-heads prefill: there the release facts list
no native heads and the plugin installs no wrapper, even on an SM90 GPU whose
FlashMLA reports sparse support (tested on both releases); the rest is skipped there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import types
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
import torch

from dsv4_attention import tables
from dsv4_attention.runtime import HeadExactRuntime, make_attention_cls
from dsv4_attention.vllm_targets import installed_facts
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_hopper import hopper_attention_class
from ._vllm_v41 import FakeHopper, FlashMLACalls, flashmla_recorders
from .test_vllm_step import PADDED, Model, _reference, _run_layer

pytestmark = pytest.mark.vllm


def _facts() -> Any:
    """The installed vLLM's release facts (read when a test runs: collection imports no
    vLLM, so the CPU suites that deselect these tests still collect this module)."""
    return installed_facts()


# evaluated when a test is set up, not at collection
ONLY_033 = pytest.mark.skipif(
    "not _facts().native_prefill_heads",
    reason=(
        "this vLLM's bundled FlashMLA has no small-heads sparse prefill (the release's "
        "native_prefill_heads is empty); the native-heads V4 prefill is vLLM 0.33's"
    ),
)
WRAPPED = "vllm.models.deepseek_v4.nvidia.flashmla.flash_mla_sparse_fwd"
SHIPPED = json.loads(
    resources.files("dsv4_attention").joinpath("tables/NVIDIA_H200.json").read_text()
)


def _table(native_heads: list[int] | None) -> tables.MeasuredTable:
    """The shipped H200 table (``None``), or it listing ``native_heads`` as the local
    head counts where vLLM's V4 prefill at the real heads is faster than padded."""
    data = json.loads(json.dumps(SHIPPED))
    if native_heads is not None:
        data["prefill"]["versus_native"]["faster_than_padded_heads"] = native_heads
    return tables.parse_table(data, f"NVIDIA_H200.json, native heads {native_heads}")


@dataclasses.dataclass
class SparseFwd(FlashMLACalls):
    """The bundled ``flash_mla_sparse_fwd`` stand-in: the V4.1 tests' recorder (records
    every call's arguments and writes the reference attention of what it was given into
    ``out``), raising instead for a call at ``raise_at`` query heads (read at each call)."""

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.prefill

    def function(self) -> Any:
        return flashmla_recorders(self)["flash_mla_sparse_fwd"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


@contextlib.contextmanager
def _logged() -> Iterator[_Lines]:
    """The plugin's log records (through vLLM's logger) while the block runs."""
    handler = _Lines()
    logger = logging.getLogger("vllm.dsv4_attention")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def native() -> Iterator[types.SimpleNamespace]:
    """The plugin activated for DeepSeek-V4 (forced: as on the H200, its table listing 32
    native heads) where vLLM's bundled FlashMLA would run the real heads
    (``_native_prefill`` says so), the bundled ``flash_mla_sparse_fwd`` a recorder, in
    place in vLLM's V4 FlashMLA module before the activation."""
    if not _facts().native_prefill_heads:
        pytest.skip(ONLY_033.kwargs["reason"])
    from vllm.models.deepseek_v4.nvidia import flashmla

    from dsv4_attention import plugin

    recorder = SparseFwd()
    bundled = recorder.function()
    table = _table([32])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plugin, "_native_prefill", lambda device: True)
        mp.setattr(flashmla, "flash_mla_sparse_fwd", bundled)
        mp.setattr(tables, "table_for", lambda name, capability=None, folder=None: table)
        with _logged() as log, hopper_attention_class() as cls:
            wrapper = flashmla.flash_mla_sparse_fwd
            yield types.SimpleNamespace(
                cls=cls,
                recorder=recorder,
                bundled=bundled,
                wrapper=wrapper,
                patched=plugin.patched(),
                lines=list(log.lines),
                flashmla=flashmla,
            )


def _fresh(native: types.SimpleNamespace) -> type:
    """The plugin's class over a fresh runtime (the plugin's serving config, device,
    table, switches and access to vLLM; nothing decided yet)."""
    built: HeadExactRuntime = native.cls.dsv4_runtime
    rt = HeadExactRuntime(built.serving, built.device, built.table, built.switches, built.access)
    return make_attention_cls(native.cls.__mro__[1], rt)


@pytest.fixture
def no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4_attention import warmup

    monkeypatch.setattr(warmup, "warm_up_prefill", lambda *a, **k: 0.0)
    monkeypatch.setattr(warmup, "warm_up_decode", lambda *a, **k: 0.0)


def _c4a_layer(g: torch.Generator, heads: int, cls: type) -> tuple[Model, Any]:
    """A C4A layer of ``test_vllm_step.Model`` (vLLM's allocator, vLLM's metadata) at
    ``heads`` local heads, as far as vLLM's ``_forward_prefill`` reads it."""
    model = Model(g, ratios=(4,))
    layer = model.layers[0]
    layer.n_local_heads = heads
    layer.attn_sink.fill_(float("-inf"))
    layer.attn_sink[:heads] = torch.randn(heads, generator=g)
    layer.PREFILL_CHUNK_SIZE = cls.PREFILL_CHUNK_SIZE
    return model, layer


def _q(total: int, heads: int, g: torch.Generator) -> torch.Tensor:
    q = torch.randn(total, PADDED, 512, generator=g).to(torch.bfloat16)
    q[:, heads:] = 0  # vLLM's padded heads
    return q


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(
        got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{where}: {m}"
    )


@pytest.mark.parametrize("native_heads", [None, [32]], ids=["shipped-table", "table-lists-32"])
def test_only_0_33_and_later_with_a_listed_head_count_install_the_wrapper(
    native_heads: list[int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release facts: 0.33's and 0.34's bundled FlashMLA runs 8, 16 or 32 heads,
    0.32's none.
    With the plugin's own ``_native_prefill`` (not forced: vLLM's platform reports a
    CUDA H200 and its FlashMLA reports sparse support), activation wraps vLLM's V4
    ``flash_mla_sparse_fwd`` only from 0.33 on and only where the table lists a head count
    (the shipped one lists none); otherwise the function stays as it was."""
    import vllm.platforms
    import vllm.v1.attention.ops.flashmla as ops
    from vllm.models.deepseek_v4.nvidia import flashmla

    from dsv4_attention import plugin
    from dsv4_kernels import sparse_mla

    # 0.33 and 0.34 bundle the FlashMLA whose SM90 prefill takes 8, 16 or 32 heads; 0.32 not
    assert _facts().native_prefill_heads == ((8, 16, 32) if _facts().release >= (0, 33) else ())
    table = _table(native_heads)
    assert table.prefill.native_faster_heads == tuple(native_heads or ())
    if native_heads is None:
        assert table == tables.table_for("NVIDIA H200", (9, 0))
    bundled = SparseFwd().function()
    monkeypatch.setattr(flashmla, "flash_mla_sparse_fwd", bundled)
    monkeypatch.setattr(ops, "is_flashmla_sparse_supported", lambda: (True, None))
    monkeypatch.setattr(sparse_mla, "wgmma_available", lambda: True)
    monkeypatch.setattr(tables, "table_for", lambda name, capability=None, folder=None: table)

    class H200(FakeHopper):
        def get_device_name(self, device_id: int = 0) -> str:
            return "NVIDIA H200"

    monkeypatch.setattr(vllm.platforms, "current_platform", H200(vllm.platforms.current_platform))
    with _logged() as log, hopper_attention_class() as cls:
        rt: HeadExactRuntime = cls.dsv4_runtime
        assert not rt.device.forced and rt.device.capability == (9, 0)
        patched = plugin.patched()
        current = flashmla.flash_mla_sparse_fwd
    active = [msg for _, msg in log.lines if ": active for " in msg]
    assert len(active) == 1, log.lines
    assert rt.serving.native_prefill == (_facts().release >= (0, 33))
    if _facts().release >= (0, 33) and native_heads:
        assert WRAPPED in patched and current is not bundled and current.__wrapped__ is bundled
        assert "flash_mla_sparse_fwd (vLLM's own, at the real heads at 32 heads)" in active[0]
    else:
        assert WRAPPED not in patched and current is bundled, patched
        assert "flash_mla_sparse_fwd" not in active[0]
    assert flashmla.flash_mla_sparse_fwd is bundled  # unregistered: put back


@ONLY_033
def test_activation_wraps_the_bundled_function(native: types.SimpleNamespace) -> None:
    """The plugin checked the bundled signature and wrapped it (reversibly), and says
    so in its one ``active`` line."""
    assert WRAPPED in native.patched
    assert native.wrapper is not native.bundled and native.wrapper.__wrapped__ is native.bundled
    assert native.flashmla.flash_mla_sparse_fwd is native.wrapper
    active = [msg for _, msg in native.lines if ": active for " in msg]
    assert len(active) == 1 and "at the real heads at 32 heads" in active[0], native.lines
    assert native.cls.dsv4_runtime.serving.native_prefill


@ONLY_033
def test_32_heads_run_vllms_prefill_at_the_real_heads(
    native: types.SimpleNamespace, workspace: Any, no_warmup: None
) -> None:
    """A V4 C4A layer at 32 local heads (V4-Pro at TP4): our prefill is not taken (the
    table's limit is 16), vLLM's own ``_forward_prefill`` runs and its FlashMLA call
    gets 32 query heads (not 64), 32 sink entries and 32 output heads, views of what
    vLLM's method had; the real heads equal the reference, the padded ones stay
    unwritten."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 32
    cls = _fresh(native)
    model, layer = _c4a_layer(g, heads, cls)
    step = model.step([12, 7], [700, 7], num_decodes=0)
    q = _q(step["total"], heads, g)
    native.recorder.calls.clear()
    out = _run_layer(cls, layer, step, q)
    calls = native.recorder.calls
    assert len(calls) == 1, calls  # one prefill chunk
    call = calls[0]
    assert tuple(call["q"].shape) == (step["total"], heads, 512)
    assert call["q"].data_ptr() == q.data_ptr()  # vLLM's q, its first 32 heads
    assert tuple(call["attn_sink"].shape) == (heads,)
    assert call["attn_sink"].data_ptr() == layer.attn_sink.data_ptr()
    assert tuple(call["out"].shape) == (step["total"], heads, 512)
    assert call["out"].data_ptr() == out.data_ptr()
    assert call["sm_scale"] == layer.scale and call["d_v"] == 512
    assert bool(out[:, heads:].isnan().all()), "a padded head was written"
    assert not bool(out[:, :heads].isnan().any()), "a real head was not written"
    _close(out[:, :heads], _reference(layer, step, q, heads), f"seed {seed}")
    state = cls.dsv4_runtime.kinds[(4, heads)]
    assert not state.prefill.ours and state.native.ours, state
    assert "measured faster than the padded call at 32 heads" in state.native.reason


@ONLY_033
def test_8_heads_run_ours_and_never_call_flashmla(
    native: types.SimpleNamespace, workspace: Any, no_warmup: None
) -> None:
    """At 8 local heads (V4-Flash at TP8) our prefill runs: vLLM's FlashMLA is not
    called, the real heads equal the reference, the padded ones stay unwritten."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    cls = _fresh(native)
    model, layer = _c4a_layer(g, heads, cls)
    step = model.step([12, 7], [700, 7], num_decodes=0)
    q = _q(step["total"], heads, g)
    native.recorder.calls.clear()
    out = _run_layer(cls, layer, step, q)
    assert native.recorder.calls == []
    assert bool(out[:, heads:].isnan().all()) and not bool(out[:, :heads].isnan().any())
    _close(out[:, :heads], _reference(layer, step, q, heads), f"seed {seed}")
    state = cls.dsv4_runtime.kinds[(4, heads)]
    assert state.prefill.ours and not state.native.ours, state


@ONLY_033
def test_outside_the_plugins_call_the_wrapper_passes_everything_through(
    native: types.SimpleNamespace, workspace: Any
) -> None:
    """Called directly, and by vLLM's own class (not the plugin's subclass), the wrapper
    hands the bundled function exactly what it was given: 64 heads."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 32
    q = torch.randn(5, PADDED, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(40, 1, 512, generator=g).to(torch.bfloat16)
    indices = torch.randint(0, 40, (5, 1, 128), generator=g, dtype=torch.int32)
    lens = torch.full((5,), 128, dtype=torch.int32)
    sink = torch.randn(PADDED, generator=g)
    out = torch.empty(5, PADDED, 512, dtype=torch.bfloat16)
    native.recorder.calls.clear()
    native.wrapper(q, kv, indices, 0.5, attn_sink=sink, topk_length=lens, out=out)
    (call,) = native.recorder.calls
    assert call["q"] is q and call["kv"] is kv and call["indices"] is indices
    assert call["attn_sink"] is sink and call["topk_length"] is lens and call["out"] is out
    assert call["sm_scale"] == 0.5 and call["d_v"] == 512
    # vLLM's own class at 32 heads: its padded call, unchanged
    base = native.cls.__mro__[1]
    model, layer = _c4a_layer(g, heads, base)
    step = model.step([6], [300], num_decodes=0)
    native.recorder.calls.clear()
    result = _run_layer(base, layer, step, _q(step["total"], heads, g))
    (call,) = native.recorder.calls
    assert call["q"].shape[1] == call["attn_sink"].shape[0] == call["out"].shape[1] == PADDED
    assert not bool(result.isnan().any())  # vLLM's padded call writes every head


@ONLY_033
def test_a_failing_real_heads_call_falls_back_to_the_padded_call(
    native: types.SimpleNamespace,
    workspace: Any,
    no_warmup: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bundled function raising at 32 heads: one warning, vLLM's prefill rerun as
    vLLM calls it (64 heads) in the same step, and every later step padded from the
    start; the real heads equal the reference each time."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 32
    cls = _fresh(native)
    model, layer = _c4a_layer(g, heads, cls)
    native.recorder.raise_at = heads
    try:
        seen = []
        with caplog.at_level("INFO"):
            for query_lens, seq_lens in (([9, 4], [500, 4]), ([6], [260])):
                step = model.step(query_lens, seq_lens, num_decodes=0)
                q = _q(step["total"], heads, g)
                native.recorder.calls.clear()
                out = _run_layer(cls, layer, step, q)
                seen.append([c["q"].shape[1] for c in native.recorder.calls])
                assert not bool(out[:, :heads].isnan().any()), seen
                _close(out[:, :heads], _reference(layer, step, q, heads), f"seed {seed}, {seen}")
    finally:
        native.recorder.raise_at = None
    assert seen == [[heads, PADDED], [PADDED]], seen
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("dsv4_attention") and r.levelname == "WARNING"
    ]
    assert len(warnings) == 1, warnings
    assert "vLLM's prefill at the real heads raised RuntimeError" in warnings[0]
    assert "run it padded" in warnings[0]
    state = cls.dsv4_runtime.kinds[(4, heads)]
    assert not state.native.ours and not state.prefill.ours, state
