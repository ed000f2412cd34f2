"""The plugin under vLLM's own plugin loader, one fresh Python process per test.

Each test runs a short script in a new interpreter (so no test sees another's
imports or patches), loads plugins with vLLM's ``load_general_plugins`` (the
entry point installed with dsv4-attention), and reports what it saw as JSON on
its last output line; vLLM's log lines are read from the same output, and the
plugin's log records are also collected per stage of the script (``load``:
vLLM's plugin loader; ``import``: the import of vLLM's DSV4 package, where only
the selector trigger is installed; ``select``: the first call of vLLM's DSV4
selector, where the plugin decides).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

LINE = re.compile(r"dsv4-attention \S+: (active|inactive)\b.*? on vLLM ([^\s:;]+)")
OURS = "Dsv4HeadExactFlashMLAAttention"
VLLMS = "vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention"

PRELUDE = """
import json, logging, sys, types
import vllm
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as `vllm serve` does before it loads plugins
stage = ["load"]
records = []
class _Records(logging.Handler):
    def emit(self, record):
        records.append([stage[0], record.levelname, record.getMessage()])
logging.getLogger("vllm.dsv4_attention").addHandler(_Records())
{before}
from vllm.plugins import load_general_plugins
load_general_plugins()
from dsv4_attention import plugin
report = {{"dsv4_imported_after_load": "vllm.models.deepseek_v4" in sys.modules,
           "kernels_imported_after_load": "dsv4_kernels" in sys.modules}}
"""

IMPORT_DSV4 = """
stage[0] = "import"
from vllm.config import get_current_vllm_config_or_none
report["config_at_import"] = get_current_vllm_config_or_none() is not None
import vllm.models.deepseek_v4
from vllm.models.deepseek_v4.common.ops import cache_utils
from vllm.models.deepseek_v4.nvidia import flashmla, model
VLLM_SELECT = getattr(model._select_dsv4_attn_cls, "__wrapped__", model._select_dsv4_attn_cls)

def state():
    select = model._select_dsv4_attn_cls
    wrapped = getattr(select, "__wrapped__", None)
    ops = ("combine_topk_swa_indices", "dequantize_and_gather_k_cache")
    return {
        "patched": plugin.patched(),
        "ops_are_vllms": all(
            getattr(cache_utils, n).__module__ == cache_utils.__name__
            and getattr(flashmla, n) is getattr(cache_utils, n) for n in ops),
        "select_is_vllms": select.__module__ == model.__name__,
        "select_wraps_vllms": wrapped is not None and wrapped.__module__ == model.__name__
            and wrapped.__name__ == "_select_dsv4_attn_cls",
        "waiting": plugin.waiting(),
        "active": plugin.is_active(),
        "has_runtime": plugin.runtime() is not None,
        "kernels_imported": "dsv4_kernels" in sys.modules,
    }

report["import"] = state()
"""

# vLLM's platform as a CUDA GPU of a given name and capability (script text; needs
# ``vllm.platforms`` and ``DeviceCapability`` imported before it)
FAKE_CUDA_CLASS = """
REAL_PLATFORM = vllm.platforms.current_platform

class FakeCuda:
    def __init__(self, name, capability):
        self.name, self.capability = name, capability
    def is_cuda(self):
        return True
    def get_device_capability(self, device_id=0):
        return DeviceCapability(*self.capability)
    def get_device_name(self, device_id=0):
        return self.name
    def __getattr__(self, attr):
        return getattr(REAL_PLATFORM, attr)
"""

# vLLM's platform as a CUDA GPU (for vLLM's selector and, where set, for the plugin)
FAKE_CUDA = (
    """
import vllm.platforms
from vllm.config import VllmConfig
from vllm.platforms.interface import DeviceCapability
import vllm.forward_context, vllm.v1.worker.workspace, vllm.v1.worker.ubatching
from vllm.utils import import_utils
config = VllmConfig()  # built on the real platform
"""
    + FAKE_CUDA_CLASS
    + """
def select(name="NVIDIA H200", capability=(9, 0), plugin_sees_it=False):
    # vLLM's selector always sees the GPU; the plugin (vllm.platforms) only when asked
    fake = FakeCuda(name, capability)
    model.current_platform = fake
    if plugin_sees_it:
        vllm.platforms.current_platform = fake
    stage[0] = "select"
    try:
        chosen = model._select_dsv4_attn_cls(config)
        again = model._select_dsv4_attn_cls(config)
    finally:
        vllm.platforms.current_platform = REAL_PLATFORM
    assert again is chosen
    report["vllms_choice"] = VLLM_SELECT(config).__name__
    report["chosen"] = chosen.__module__ + "." + chosen.__name__
    report["holds_the_runtime"] = (
        plugin.runtime() is not None and getattr(chosen, "dsv4_runtime", None) is plugin.runtime())
    report["select"] = state()
    rt = plugin.runtime()
    if rt is not None:
        report["device"] = [rt.device.name, list(rt.device.capability), rt.device.forced]
        report["table"] = rt.table.device_name
    return chosen
"""
)

SELECT_ONCE = FAKE_CUDA + "select()\n"


def run_script(body: str, before: str = "", **env: str) -> tuple[dict[str, Any], str]:
    """Run PRELUDE + body in a fresh interpreter; (the JSON report, all output)."""
    script = (
        PRELUDE.format(before=before)
        + textwrap.dedent(body)
        + "\nreport['records'] = records\nprint(json.dumps(report))\n"
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), output


def plugin_lines(output: str) -> list[re.Match[str]]:
    """vLLM's printed lines of the plugin (not the JSON report, which quotes them)."""
    lines = [line for line in output.splitlines() if not line.startswith("{")]
    return [m for m in map(LINE.search, lines) if m]


def records(report: dict[str, Any], stage: str) -> list[tuple[str, str]]:
    """The plugin's (level, message) records logged in one stage of the script."""
    return [(level, msg) for s, level, msg in report["records"] if s == stage]


def _left_alone(state: dict[str, Any]) -> None:
    assert state["patched"] == [] and state["ops_are_vllms"], state
    assert not state["active"] and not state["has_runtime"] and not state["waiting"], state


def test_import_installs_only_the_trigger_and_the_selector_activates() -> None:
    """Without a config at import time (vLLM's V1 runner imports DSV4 in every worker):
    the import wraps only the selector, replaces nothing, imports no kernels and logs
    nothing; the selector's first call (CUDA Hopper, forced: decided as on the H200)
    builds the runtime, replaces the CUDA set and says so once."""
    import vllm

    report, output = run_script(IMPORT_DSV4 + SELECT_ONCE, DSV4_KERNELS_FORCE="1")
    assert report["dsv4_imported_after_load"] is False
    assert report["kernels_imported_after_load"] is False
    assert report["config_at_import"] is False
    at_import = report["import"]
    assert at_import["patched"] == [] and at_import["ops_are_vllms"]
    assert not at_import["select_is_vllms"] and at_import["select_wraps_vllms"]
    assert at_import["waiting"] and not at_import["active"] and not at_import["has_runtime"]
    assert at_import["kernels_imported"] is False
    assert records(report, "load") == records(report, "import") == []
    after = report["select"]
    assert after["active"] and after["has_runtime"] and not after["waiting"]
    assert report["chosen"].endswith("." + OURS) and report["holds_the_runtime"]
    assert report["vllms_choice"] == "DeepseekV4FlashMLAAttention"
    assert report["device"] == ["NVIDIA H200 (forced)", [9, 0], True]
    assert report["table"] == "NVIDIA H200"
    patched = after["patched"]
    assert "vllm.models.deepseek_v4.common.ops.cache_utils.combine_topk_swa_indices" in patched
    assert "vllm.models.deepseek_v4.nvidia.flashmla.combine_topk_swa_indices" in patched
    assert not after["ops_are_vllms"]
    # the selector is wrapped, not replaced: the trigger is no patch
    assert not any("_select_dsv4_attn_cls" in p for p in patched)
    assert after["select_wraps_vllms"]
    # not proven faster on CUDA: vLLM's stays (docs/attention.md)
    assert not any("compute_global_topk_indices_and_lens" in p for p in patched)
    assert not any("quantize_and_insert_k_cache" in p for p in patched)
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("active", vllm.__version__)], output
    assert "replaced: combine_topk_swa_indices" in lines[0].string
    at_select = records(report, "select")
    active = [msg for _, msg in at_select if ": active for " in msg]
    assert len(active) == 1, at_select
    assert (
        f"active for a DeepSeek-V4 model on vLLM {vllm.__version__} "
        "(NVIDIA H200 (forced), table NVIDIA H200); replaced: combine_topk_swa_indices"
    ) in active[0]
    assert not any("inactive" in msg for _, _, msg in report["records"]), report["records"]


def test_cpu_platform_without_force_is_left_alone() -> None:
    report, output = run_script(IMPORT_DSV4 + SELECT_ONCE)
    assert report["import"]["waiting"] and report["import"]["patched"] == []
    assert records(report, "import") == []
    _left_alone(report["select"])
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "platform cpu" in lines[0].string
    assert [level for level, _ in records(report, "select")] == ["INFO"]


def test_off_switch_patches_nothing_and_says_so() -> None:
    report, output = run_script(
        IMPORT_DSV4 + SELECT_ONCE, DSV4_KERNELS_FORCE="1", DSV4_KERNELS_DISABLE="1"
    )
    for stage in ("import", "select"):
        _left_alone(report[stage])
        assert report[stage]["select_is_vllms"]
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "DSV4_KERNELS_DISABLE" in lines[0].string
    assert [level for level, _ in records(report, "load")] == ["INFO"]


def test_unsupported_version_patches_nothing_and_warns_once() -> None:
    report, output = run_script(
        IMPORT_DSV4 + SELECT_ONCE, before="vllm.__version__ = '0.99.1'", DSV4_KERNELS_FORCE="1"
    )
    for stage in ("import", "select"):
        _left_alone(report[stage])
        assert report[stage]["select_is_vllms"]
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("inactive", "0.99.1")], output
    assert "WARNING" in lines[0].string and "unsupported vLLM version 0.99.1" in lines[0].string


def test_startup_plan_keeps_the_plugin_off() -> None:
    """vLLM replaying a saved memory profile would not count the plugin's scratch."""
    report, output = run_script(
        IMPORT_DSV4 + SELECT_ONCE, DSV4_KERNELS_FORCE="1", VLLM_ENABLE_STARTUP_PLAN="1"
    )
    for stage in ("import", "select"):
        _left_alone(report[stage])
        assert report[stage]["select_is_vllms"]
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "VLLM_ENABLE_STARTUP_PLAN is set" in lines[0].string


def test_changed_signature_patches_nothing_at_all() -> None:
    # vLLM's gather with another signature (DSV4 already imported when the
    # plugin loads): refuse everything, also the combine whose check passed.
    before = """
import inspect
import vllm.models.deepseek_v4.common.ops.cache_utils as cu
gather = cu.dequantize_and_gather_k_cache
gather.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
     for n in ("out", "k_cache", "seq_lens", "block_table", "block_size")])
"""
    body = (
        IMPORT_DSV4
        + SELECT_ONCE
        + "report['gather_kept'] = cache_utils.dequantize_and_gather_k_cache is gather\n"
    )
    report, output = run_script(body, before=before, DSV4_KERNELS_FORCE="1")
    assert report["dsv4_imported_after_load"] is True
    _left_alone(report["select"])
    assert report["gather_kept"]
    assert report["chosen"] == VLLMS  # the trigger passes vLLM's choice through
    assert report["select"]["select_wraps_vllms"]
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "WARNING" in lines[0].string
    assert "dequantize_and_gather_k_cache has parameters" in lines[0].string
    assert "nothing replaced" in lines[0].string
    assert [stage for stage, _, _ in report["records"]] == ["select"]


def test_changed_class_signature_refuses_at_the_import() -> None:
    """vLLM's ``_forward_decode`` with other parameters: refused when DSV4 is imported,
    the selector left as vLLM's."""
    before = """
import inspect
from vllm.models.deepseek_v4.nvidia import flashmla as fm
fm.DeepseekV4FlashMLAAttention._forward_decode.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
     for n in ("self", "q", "kv_cache", "swa_metadata", "attn_metadata", "output")])
"""
    report, output = run_script(IMPORT_DSV4 + SELECT_ONCE, before=before, DSV4_KERNELS_FORCE="1")
    for stage in ("import", "select"):
        _left_alone(report[stage])
        assert report[stage]["select_is_vllms"]
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "_forward_decode has parameters" in lines[0].string
    assert [(s, level) for s, level, _ in report["records"]] == [("load", "WARNING")]


def test_exception_inside_the_plugin_leaves_vllm_working() -> None:
    before = """
import dsv4_attention.adapters as adapters
def broken(originals, guard=None):
    raise RuntimeError("boom in the plugin")
adapters.replacements = broken
"""
    report, output = run_script(IMPORT_DSV4 + SELECT_ONCE, before=before, DSV4_KERNELS_FORCE="1")
    _left_alone(report["select"])
    assert report["chosen"] == VLLMS
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "RuntimeError: boom in the plugin" in lines[0].string
    assert "nothing replaced" in lines[0].string


def test_non_dsv4_startup_never_imports_dsv4() -> None:
    # What vLLM does for a Llama: resolve the architecture and import its module.
    body = """
from vllm.model_executor.models.registry import ModelRegistry
report["arch"] = ModelRegistry._try_load_model_cls("LlamaForCausalLM").__name__
report["dsv4_imported"] = "vllm.models.deepseek_v4" in sys.modules
report["kernels_imported"] = "dsv4_kernels" in sys.modules
report["patched"] = plugin.patched()
"""
    report, output = run_script(body, DSV4_KERNELS_FORCE="1")
    assert report["arch"] == "LlamaForCausalLM"
    assert report["dsv4_imported"] is False
    assert report["kernels_imported"] is False
    assert report["patched"] == []
    assert plugin_lines(output) == []
    assert report["records"] == []


RUNNER_UNDER_CONFIG = """
from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
config = VllmConfig()
config.model_config = types.SimpleNamespace(architectures={architectures!r})
stage[0] = "import"
with set_current_vllm_config(config):
    report["current_architectures"] = get_current_vllm_config_or_none().model_config.architectures
    import vllm.v1.worker.gpu.model_runner  # vLLM's V2 model runner: imports DSV4 (EPLB)
report["dsv4_imported"] = "vllm.models.deepseek_v4" in sys.modules
"""


@pytest.mark.parametrize(
    ("architectures", "acts"),
    [(["LlamaForCausalLM"], False), (["DeepseekV4ForCausalLM"], True)],
    ids=["llama", "deepseek-v4"],
)
def test_model_runner_import_under_another_models_config(
    architectures: list[str], acts: bool
) -> None:
    """vLLM's model runner imports DSV4 in every worker, whatever the model.  Under a
    config naming another model (forced, so only the model decides): nothing installed,
    the selector is vLLM's even when called later, one line saying the plugin acts on
    DeepSeek-V4 only, never an 'active' line.  Under a DeepSeek-V4 config: the trigger
    is installed and waits for the selector."""
    import vllm

    body = RUNNER_UNDER_CONFIG.format(architectures=architectures) + IMPORT_DSV4 + SELECT_ONCE
    report, output = run_script(body, DSV4_KERNELS_FORCE="1")
    assert report["current_architectures"] == architectures
    assert report["dsv4_imported_after_load"] is False and report["dsv4_imported"] is True
    at_import = report["import"]
    if not acts:
        for stage in ("import", "select"):
            _left_alone(report[stage])
            assert report[stage]["select_is_vllms"]
        assert report["chosen"] == VLLMS
        assert records(report, "import") == [
            (
                "INFO",
                f"dsv4-attention {_our_version()}: inactive on vLLM {vllm.__version__}: the "
                "model is LlamaForCausalLM; dsv4-attention acts on DeepSeek-V4 and "
                "DeepSeek-V4.1 only",
            )
        ]
        assert records(report, "select") == []
        lines = plugin_lines(output)
        assert [m.group(1) for m in lines] == ["inactive"], output
        assert "acts on DeepSeek-V4 and DeepSeek-V4.1 only" in lines[0].string
    else:
        assert at_import["waiting"] and at_import["select_wraps_vllms"]
        assert at_import["patched"] == [] and records(report, "import") == []
        assert report["chosen"].endswith("." + OURS) and report["select"]["active"]
        assert [m.group(1) for m in plugin_lines(output)] == ["active"], output
    actives = [msg for _, _, msg in report["records"] if ": active for " in msg]
    assert len(actives) == (1 if acts else 0), report["records"]


def _our_version() -> str:
    from dsv4_attention import __version__

    return __version__


UNMEASURED = [
    ("NVIDIA B200", (10, 0)),
    ("NVIDIA H100 80GB HBM3", (9, 0)),
    ("NVIDIA H800", (9, 0)),
    ("NVIDIA H20", (9, 0)),
    ("NVIDIA GH200 480GB", (9, 0)),
]


@pytest.mark.parametrize(("name", "capability"), UNMEASURED, ids=[n for n, _ in UNMEASURED])
def test_a_gpu_without_a_measured_table_keeps_vllm(name: str, capability: tuple[int, int]) -> None:
    """vLLM's platform reports a CUDA GPU (not forced) that has no table of its own, an
    SM90 one included (the H200's crossovers are not an H100's): vLLM's class from the
    selector, nothing replaced, and one line naming the missing table and the command
    that measures one."""
    body = IMPORT_DSV4 + FAKE_CUDA + f"select({name!r}, {capability!r}, plugin_sees_it=True)\n"
    report, output = run_script(body)
    assert report["import"]["waiting"] and records(report, "import") == []
    lines = plugin_lines(output)
    _left_alone(report["select"])
    assert (
        report["chosen"]
        == VLLMS
        == "vllm.models.deepseek_v4.nvidia.flashmla." + (report["vllms_choice"])
    )
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert (
        f"{name} has no measured table (measured: NVIDIA H200; tables are used only on the "
        "GPU they were measured on); vLLM's kernels run unchanged. To measure one on this "
        "GPU, from a clone of dsv4-serving run `python3 -m benchmarks.measure_table --out DIR` "
        "and serve with DSV4_TABLES_DIR=DIR"
    ) in lines[0].string
    assert [level for level, _ in records(report, "select")] == ["INFO"]


def test_a_table_a_user_measured_is_taken_from_dsv4_tables_dir(tmp_path: Path) -> None:
    """An H100 with a table of its own in ``DSV4_TABLES_DIR`` (as ``benchmarks.measure_table``
    writes one: the device name as the file name): the plugin is active with that table;
    a malformed table there leaves the plugin inactive with a warning naming the file."""
    from dsv4_attention import tables

    name = "NVIDIA H100 80GB HBM3"
    shipped = json.loads((Path(tables.__file__).parent / "tables" / "NVIDIA_H200.json").read_text())
    table = {**shipped, "device_name": name, "source": "measured by the test"}
    (tmp_path / tables.file_name(name)).write_text(json.dumps(table))
    body = IMPORT_DSV4 + FAKE_CUDA + f"select({name!r}, (9, 0), plugin_sees_it=True)\n"
    report, output = run_script(body, DSV4_TABLES_DIR=str(tmp_path))
    assert report["select"]["active"] and report["chosen"].endswith("." + OURS)
    assert report["table"] == name
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["active"], output
    assert f"({name}, table {name})" in lines[0].string
    (tmp_path / tables.file_name(name)).write_text(json.dumps({"device_name": name}))
    report, output = run_script(body, DSV4_TABLES_DIR=str(tmp_path))
    _left_alone(report["select"])
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "is malformed" in lines[0].string and str(tmp_path) in lines[0].string
    assert "WARNING" in lines[0].string


SELECT = """
from vllm.config import VllmConfig
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
import inspect, types
import vllm.models.deepseek_v4
from vllm.models.deepseek_v4.nvidia import flashmla, model
# a CUDA Hopper platform, as _select_dsv4_attn_cls sees it
model.current_platform = types.SimpleNamespace(
    get_device_capability=lambda device_id=0: DeviceCapability(9, 0), is_cuda=lambda: True)
config = VllmConfig()
chosen = {}
for backend in (None, AttentionBackendEnum.FLASHMLA_SPARSE,
                AttentionBackendEnum.FLASHINFER_MLA_SPARSE_DSV4):
    config.attention_config.backend = backend
    chosen[str(backend)] = model._select_dsv4_attn_cls(config)
base = flashmla.DeepseekV4FlashMLAAttention
ours = [v for k, v in chosen.items() if "FLASHINFER" not in k]
report["names"] = {k: v.__name__ for k, v in chosen.items()}
report["one_class"] = all(v is ours[0] for v in ours)
report["holds_the_runtime"] = all(
    getattr(v, "dsv4_runtime", None) is plugin.runtime() is not None for v in ours)
report["subclass"] = all(issubclass(v, base) for v in ours)
report["same_signature"] = all(
    list(inspect.signature(v._forward_prefill).parameters)
    == list(inspect.signature(base._forward_prefill).parameters)
    for v in ours)
report["decode_overridden"] = all(
    v._forward_decode is not base._forward_decode
    and list(inspect.signature(v._forward_decode).parameters)
    == list(inspect.signature(base._forward_decode).parameters)
    for v in ours)
from dsv4_attention import policy
from dsv4_attention.facts import LayerFacts
rt = plugin.runtime()
report["choices"] = {}
if rt is not None:
    for ratio in (1, 4, 128):
        facts = LayerFacts(name="x", compress_ratio=ratio, heads=8, window=128, topk=512,
                           c128a_width=128, max_tokens=256, decode_window_width=128)
        report["choices"][str(ratio)] = [
            policy.prefill_choice(facts, rt.device, rt.table, rt.switches).ours,
            policy.decode_choice(facts, rt.device, rt.table, rt.switches).ours,
        ]
"""


def test_selector_returns_our_subclass_under_cuda() -> None:
    report, _ = run_script(SELECT, DSV4_KERNELS_FORCE="1")
    names = report["names"]
    assert names["None"] == names["AttentionBackendEnum.FLASHMLA_SPARSE"] == OURS
    assert names["AttentionBackendEnum.FLASHINFER_MLA_SPARSE_DSV4"] == (
        "DeepseekV4FlashInferMLAAttention"
    )
    assert report["subclass"] and report["same_signature"] and report["decode_overridden"]
    assert report["one_class"] and report["holds_the_runtime"]
    # 8 local heads on the H200's table: every kind's prefill and decode are ours
    assert report["choices"] == {r: [True, True] for r in ("1", "4", "128")}


@pytest.mark.parametrize(
    ("env", "before"),
    [
        ({"DSV4_KERNELS_DISABLE": "1"}, ""),
        ({}, "vllm.__version__ = '0.31.0'"),
        ({}, "vllm.__version__ = '0.35.0'"),
    ],
    ids=["off-switch", "version-gate-0.31", "version-gate-0.35"],
)
def test_switches_and_gate_keep_vllms_class(env: dict[str, str], before: str) -> None:
    report, _ = run_script(SELECT, before=before, DSV4_KERNELS_FORCE="1", **env)
    assert set(report["names"].values()) == {
        "DeepseekV4FlashMLAAttention",
        "DeepseekV4FlashInferMLAAttention",
    }
    assert report["choices"] == {}


@pytest.mark.parametrize(
    ("env", "choice"),
    [
        ({"DSV4_PREFILL_DISABLE": "1"}, [False, True]),
        ({"DSV4_PREFILL_MAX_HEADS": "0"}, [False, True]),
        ({"DSV4_PREFILL_MAX_HEADS": "8"}, [True, True]),
        ({"DSV4_DECODE_DISABLE": "1"}, [True, False]),
        ({"DSV4_PREFILL_DISABLE": "1", "DSV4_DECODE_DISABLE": "1"}, [False, False]),
    ],
    ids=["prefill-switch", "max-heads-0", "max-heads-8", "decode-switch", "both-switches"],
)
def test_path_switches_reach_the_runtime(env: dict[str, str], choice: list[bool]) -> None:
    """The prefill and decode switches are read once, at the start-up decision: the class
    is the plugin's (the other path may still be ours), and each layer kind's choice of
    that path is vLLM's."""
    report, _ = run_script(SELECT, DSV4_KERNELS_FORCE="1", **env)
    assert report["names"]["None"] == OURS
    assert report["choices"] == {r: choice for r in ("1", "4", "128")}


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0"])
def test_neighbouring_releases_stay_off_and_name_the_supported_ones(version: str) -> None:
    report, output = run_script(
        IMPORT_DSV4, before=f"vllm.__version__ = {version!r}", DSV4_KERNELS_FORCE="1"
    )
    _left_alone(report["import"])
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("inactive", version)], output
    assert "supported: 0.32.x, 0.33.x, 0.34.x" in lines[0].string


UNTOUCHED = (
    IMPORT_DSV4
    + SELECT_ONCE
    + """
import importlib, importlib.util
from dsv4_attention.vllm_targets import installed_facts
facts = installed_facts()
report["release"] = list(facts.release)
report["untouched"] = list(facts.untouched_models)
report["v41_present"] = importlib.util.find_spec("vllm.models.deepseek_v41") is not None
report["v41"] = {}
for package in facts.untouched_models:
    ops = importlib.import_module(package + ".common.ops.cache_utils")
    v41_flashmla = importlib.import_module(package + ".nvidia.flashmla")
    v41_model = importlib.import_module(package + ".nvidia.model")
    v41_model.current_platform = FakeCuda("NVIDIA H200", (9, 0))
    v41_chosen = v41_model._select_dsv4_attn_cls(config)
    report["v41"][package] = {
        "ops_are_vllms": all(
            getattr(v41_flashmla, n) is getattr(ops, n)
            and getattr(ops, n).__module__ == ops.__name__
            for n in ("combine_topk_swa_indices", "dequantize_and_gather_k_cache",
                      "compute_global_topk_indices_and_lens")),
        "select_is_vllms": v41_model._select_dsv4_attn_cls.__module__ == v41_model.__name__,
        "chosen": v41_chosen.__module__ + "." + v41_chosen.__name__,
    }
report["patched_any_untouched"] = [
    p for p in plugin.patched() for m in facts.untouched_models if p.startswith(m)]
report["patched"] = plugin.patched()
"""
)


def test_dsv4_relatives_are_never_routed_to_our_kernels() -> None:
    """DeepSeek-V4.1 (in 0.32 and 0.33) has its own attention classes, ops and cache layout: with
    the plugin active, its modules hold vLLM's functions and its selector picks vLLM's
    class (faked Hopper), while V4's are ours."""
    report, output = run_script(UNTOUCHED, DSV4_KERNELS_FORCE="1")
    assert report["patched"], output  # the plugin is active on V4
    assert report["chosen"].endswith("." + OURS)
    assert report["patched_any_untouched"] == []
    # both releases ship V4.1 (0.32.0 already), and the facts say to leave it alone
    assert report["untouched"] == ["vllm.models.deepseek_v41"]
    assert report["v41_present"]
    assert report["v41"], "no V4.1 package was checked"
    for package, found in report["v41"].items():
        assert found["ops_are_vllms"] and found["select_is_vllms"], found
        assert found["chosen"] == f"{package}.nvidia.flashmla.DeepseekV4FlashMLAAttention"
