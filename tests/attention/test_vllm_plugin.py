"""The plugin under vLLM's own plugin loader, one fresh Python process per test.

Each test runs a short script in a new interpreter (so no test sees another's
imports or patches), loads plugins with vLLM's ``load_general_plugins`` (the
entry point installed with dsv4-attention), and reports what it saw as JSON on
its last output line; vLLM's log lines are read from the same output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

LINE = re.compile(r"dsv4-attention \S+: (active|inactive) on vLLM ([^\s:;]+)")

PRELUDE = """
import json, sys
import vllm
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as `vllm serve` does before it loads plugins
{before}
from vllm.plugins import load_general_plugins
load_general_plugins()
from dsv4_attention import plugin
report = {{"dsv4_imported_after_load": "vllm.models.deepseek_v4" in sys.modules,
           "kernels_imported_after_load": "dsv4_kernels" in sys.modules}}
"""

IMPORT_DSV4 = """
import vllm.models.deepseek_v4
from vllm.models.deepseek_v4.common.ops import cache_utils
from vllm.models.deepseek_v4.nvidia import flashmla, model
report["patched"] = plugin.patched()
report["combine_is_vllms"] = (
    cache_utils.combine_topk_swa_indices.__module__ == cache_utils.__name__
    and flashmla.combine_topk_swa_indices is cache_utils.combine_topk_swa_indices)
report["select_is_vllms"] = model._select_dsv4_attn_cls.__module__ == model.__name__
"""


def run_script(body: str, before: str = "", **env: str) -> tuple[dict, str]:
    """Run PRELUDE + body in a fresh interpreter; (the JSON report, all output)."""
    script = PRELUDE.format(before=before) + textwrap.dedent(body) + "\nprint(json.dumps(report))\n"
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
    return [m for m in map(LINE.search, output.splitlines()) if m]


def test_active_with_force_replaces_the_cuda_set_and_says_so() -> None:
    import vllm

    report, output = run_script(IMPORT_DSV4, DSV4_KERNELS_FORCE="1")
    assert report["dsv4_imported_after_load"] is False
    assert report["kernels_imported_after_load"] is False
    assert report["combine_is_vllms"] is False
    assert report["select_is_vllms"] is False
    assert (
        "vllm.models.deepseek_v4.common.ops.cache_utils.combine_topk_swa_indices"
        in (report["patched"])
    )
    assert "vllm.models.deepseek_v4.nvidia.flashmla.combine_topk_swa_indices" in report["patched"]
    assert "vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls" in report["patched"]
    # not proven faster on CUDA: vLLM's stays (docs/attention.md)
    assert not any("compute_global_topk_indices_and_lens" in p for p in report["patched"])
    assert not any("quantize_and_insert_k_cache" in p for p in report["patched"])
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("active", vllm.__version__)], output
    assert "replaced: combine_topk_swa_indices" in lines[0].string


def test_cpu_platform_without_force_is_left_alone() -> None:
    report, output = run_script(IMPORT_DSV4)
    assert report["patched"] == []
    assert report["combine_is_vllms"] and report["select_is_vllms"]
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "platform cpu" in lines[0].string


def test_off_switch_patches_nothing_and_says_so() -> None:
    report, output = run_script(IMPORT_DSV4, DSV4_KERNELS_FORCE="1", DSV4_KERNELS_DISABLE="1")
    assert report["patched"] == []
    assert report["combine_is_vllms"] and report["select_is_vllms"]
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "DSV4_KERNELS_DISABLE" in lines[0].string


def test_unsupported_version_patches_nothing_and_warns_once() -> None:
    report, output = run_script(
        IMPORT_DSV4, before="vllm.__version__ = '0.99.1'", DSV4_KERNELS_FORCE="1"
    )
    assert report["patched"] == []
    assert report["combine_is_vllms"] and report["select_is_vllms"]
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("inactive", "0.99.1")], output
    assert "WARNING" in lines[0].string and "unsupported vLLM version 0.99.1" in lines[0].string


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
        + "report['gather_kept'] = cache_utils.dequantize_and_gather_k_cache is gather\n"
    )
    report, output = run_script(body, before=before, DSV4_KERNELS_FORCE="1")
    assert report["dsv4_imported_after_load"] is True
    assert report["patched"] == []
    assert report["combine_is_vllms"] and report["select_is_vllms"] and report["gather_kept"]
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "dequantize_and_gather_k_cache has parameters" in lines[0].string
    assert "nothing patched" in lines[0].string


def test_exception_inside_the_plugin_leaves_vllm_working() -> None:
    before = """
import dsv4_attention.adapters as adapters
def broken(originals):
    raise RuntimeError("boom in the plugin")
adapters.replacements = broken
"""
    report, output = run_script(IMPORT_DSV4, before=before, DSV4_KERNELS_FORCE="1")
    assert report["patched"] == []
    assert report["combine_is_vllms"] and report["select_is_vllms"]
    lines = plugin_lines(output)
    assert [m.group(1) for m in lines] == ["inactive"], output
    assert "RuntimeError: boom in the plugin" in lines[0].string


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
report["names"] = {k: v.__name__ for k, v in chosen.items()}
report["subclass"] = all(issubclass(v, base) for k, v in chosen.items() if "FLASHINFER" not in k)
report["same_signature"] = all(
    list(inspect.signature(v._forward_prefill).parameters)
    == list(inspect.signature(base._forward_prefill).parameters)
    for k, v in chosen.items() if "FLASHINFER" not in k)
report["decode_overridden"] = all(
    v._forward_decode is not base._forward_decode
    and list(inspect.signature(v._forward_decode).parameters)
    == list(inspect.signature(base._forward_decode).parameters)
    for k, v in chosen.items() if "FLASHINFER" not in k)
"""


def test_selector_returns_our_subclass_under_cuda() -> None:
    report, _ = run_script(SELECT, DSV4_KERNELS_FORCE="1")
    names = report["names"]
    assert (
        names["None"]
        == names["AttentionBackendEnum.FLASHMLA_SPARSE"]
        == ("Dsv4HeadExactFlashMLAAttention")
    )
    assert names["AttentionBackendEnum.FLASHINFER_MLA_SPARSE_DSV4"] != (
        "Dsv4HeadExactFlashMLAAttention"
    )
    assert report["subclass"] and report["same_signature"] and report["decode_overridden"]


@pytest.mark.parametrize(
    ("env", "before"),
    [
        ({"DSV4_KERNELS_DISABLE": "1"}, ""),
        ({"DSV4_PREFILL_DISABLE": "1"}, ""),
        ({"DSV4_PREFILL_MAX_HEADS": "0"}, ""),
        ({}, "vllm.__version__ = '0.31.0'"),
        ({}, "vllm.__version__ = '0.34.0'"),
    ],
    ids=["off-switch", "prefill-switch", "max-heads-0", "version-gate-0.31", "version-gate-0.34"],
)
def test_switches_and_gate_keep_vllms_class(env: dict[str, str], before: str) -> None:
    report, _ = run_script(SELECT, before=before, DSV4_KERNELS_FORCE="1", **env)
    assert set(report["names"].values()) <= {
        "DeepseekV4FlashMLAAttention",
        "DeepseekV4FlashInferMLAAttention",
    }


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0"])
def test_neighbouring_releases_stay_off_and_name_the_supported_ones(version: str) -> None:
    report, output = run_script(
        IMPORT_DSV4, before=f"vllm.__version__ = {version!r}", DSV4_KERNELS_FORCE="1"
    )
    assert report["patched"] == []
    lines = plugin_lines(output)
    assert [(m.group(1), m.group(2)) for m in lines] == [("inactive", version)], output
    assert "supported: 0.32.x, 0.33.x" in lines[0].string


UNTOUCHED = """
import importlib, importlib.util, types
from dsv4_attention.vllm_targets import installed_facts
from vllm.platforms.interface import DeviceCapability
from vllm.config import VllmConfig
import vllm.models.deepseek_v4  # the plugin activates here
facts = installed_facts()
report["release"] = list(facts.release)
report["untouched"] = list(facts.untouched_models)
report["v41_present"] = importlib.util.find_spec("vllm.models.deepseek_v41") is not None
report["patched_any_untouched"] = [
    p for p in plugin.patched() for m in facts.untouched_models if p.startswith(m)]
report["v41"] = {}
for package in facts.untouched_models:
    ops = importlib.import_module(package + ".common.ops.cache_utils")
    flashmla = importlib.import_module(package + ".nvidia.flashmla")
    model = importlib.import_module(package + ".nvidia.model")
    model.current_platform = types.SimpleNamespace(
        get_device_capability=lambda device_id=0: DeviceCapability(9, 0), is_cuda=lambda: True)
    chosen = model._select_dsv4_attn_cls(VllmConfig())
    report["v41"][package] = {
        "ops_are_vllms": all(
            getattr(flashmla, n) is getattr(ops, n) and getattr(ops, n).__module__ == ops.__name__
            for n in ("combine_topk_swa_indices", "dequantize_and_gather_k_cache",
                      "compute_global_topk_indices_and_lens")),
        "select_is_vllms": model._select_dsv4_attn_cls.__module__ == model.__name__,
        "chosen": chosen.__module__ + "." + chosen.__name__,
    }
report["patched"] = plugin.patched()
"""


def test_dsv4_relatives_are_never_routed_to_our_kernels() -> None:
    """DeepSeek-V4.1 (in 0.32 and 0.33) has its own attention classes, ops and cache layout: with
    the plugin active, its modules hold vLLM's functions and its selector picks vLLM's
    class (faked Hopper), while V4's are ours."""
    report, output = run_script(UNTOUCHED, DSV4_KERNELS_FORCE="1")
    assert report["patched"], output  # the plugin is active on V4
    assert report["patched_any_untouched"] == []
    # both releases ship V4.1 (0.32.0 already), and the facts say to leave it alone
    assert report["untouched"] == ["vllm.models.deepseek_v41"]
    assert report["v41_present"]
    for package, found in report["v41"].items():
        assert found["ops_are_vllms"] and found["select_is_vllms"], found
        assert found["chosen"] == f"{package}.nvidia.flashmla.DeepseekV4FlashMLAAttention"
