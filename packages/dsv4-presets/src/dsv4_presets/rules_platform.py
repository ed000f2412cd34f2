"""Rules about kernels and the GPU they need: Blackwell-only, NVIDIA-only, ROCm-only, indexer cache.

The facts come from vLLM 0.32's own capability checks, each named where it
is used.  A preset's ``dsv4.hardware`` says what it runs on: ``vendor``
(``nvidia`` or ``amd``), ``arch`` (``hopper``, ``blackwell``, ``cdna4``).
"""

from __future__ import annotations

from typing import Any

from dsv4_presets.configs import ServeConfig
from dsv4_presets.findings import Finding
from dsv4_presets.rules_topology import truthy

__all__ = [
    "AMD_ONLY",
    "BLACKWELL_ONLY",
    "rule_indexer_cache",
    "rule_kernel_platform",
    "rule_mega_moe_expert_parallel",
    "vendor",
]

# Option values that need Blackwell datacenter GPUs (SM 10.x): refused or
# failing on Hopper, and NVIDIA kernels that do not exist on ROCm at all.
BLACKWELL_ONLY: dict[str, dict[str, str]] = {
    "attention-backend": {
        "FLASHINFER_MLA_SPARSE_DSV4": "FlashInfer's DSV4 sparse MLA runs on SM 10.x/12.x only",
        "FLASHINFER_MLA_SPARSE": "FlashInfer's TRT-LLM sparse MLA kernels run on SM 10.x only",
        "FLASHINFER_MLA": "FlashInfer's MLA kernels run on SM 10.x only",
        "CUTLASS_MLA": "CUTLASS MLA kernels run on SM 10.x only",
        "TOKENSPEED_MLA": "TokenSpeed MLA kernels run on SM 10.x only",
    },
    "moe-backend": {
        "flashinfer_trtllm": "TRT-LLM-gen MXFP4 MoE kernels run on SM 10.x only",
        "deep_gemm_mega_moe": "DeepGEMM's MegaMoE runs on SM 10.x only "
        "(vLLM 0.32 fused_moe/deep_gemm_mega_moe.py: 'DeepGEMM MegaMoE requires SM100 GPUs')",
        "flashinfer_moe_ep_mega_deep_gemm": "FlashInfer's MoE-EP MegaMoE runs on Blackwell only",
        "flashinfer_moe_ep_cutedsl": "FlashInfer's CuTeDSL MoE-EP runs on Blackwell only",
    },
    "kv-cache-dtype": {
        "nvfp4": "FP4 KV cache needs Blackwell's FP4 tensor cores",
        "nvfp4_ds_mla": "FP4 KV cache needs Blackwell's FP4 tensor cores",
    },
    "attention-config.indexer_kv_dtype": {
        "mxfp4": "the MXFP4 indexer cache needs SM 10.x (vLLM 0.32 "
        "v1/attention/backends/mla/indexer.py: 'requires Blackwell datacenter GPUs')",
    },
}

# AMD AITER kernels (vLLM 0.32 config/kernel.py: "ROCm only").
AMD_ONLY: dict[str, dict[str, str]] = {
    "moe-backend": {
        "aiter": "AMD AITER MoE kernels run on ROCm only",
        "aiter_mega_moe": "AMD AITER MegaMoE runs on ROCm only",
        "aiter_triton_mxfp4_bf16": "AMD AITER Triton MXFP4 MoE runs on ROCm only",
    },
}


def vendor(config: ServeConfig) -> str:
    """``nvidia`` or ``amd`` (``nvidia`` when the preset does not say: the common case)."""
    return str(config.hardware.get("vendor", "nvidia")).lower()


def _value(config: ServeConfig, key: str) -> Any:
    """An option's value; ``option.field`` reads one field of a JSON option."""
    option, _, sub = key.partition(".")
    value = config.args.get(option)
    if sub:
        return value.get(sub) if isinstance(value, dict) else None
    return value


def _hits(config: ServeConfig, table: dict[str, dict[str, str]]) -> list[tuple[str, str, str]]:
    out = []
    for key, values in table.items():
        value = _value(config, key)
        if value is None:
            continue
        lookup = {k.lower(): (k, why) for k, why in values.items()}
        hit = lookup.get(str(value).lower())
        if hit:
            out.append((key, hit[0], hit[1]))
    return out


def rule_kernel_platform(config: ServeConfig) -> list[Finding]:
    """Kernels match the GPU: SM 10.x kernels on Blackwell, NVIDIA kernels not on ROCm."""
    arch = str(config.hardware.get("arch", "")).lower()
    if not arch:
        return []
    gpu = config.hardware.get("name", arch)
    findings = []
    if vendor(config) == "amd":
        for key, value, why in _hits(config, BLACKWELL_ONLY):
            if key == "attention-config.indexer_kv_dtype":
                continue  # ROCm has its own MXFP4 indexer path: rule indexer-cache
            findings.append(
                Finding(
                    "error",
                    "kernel-platform",
                    f"{key}: {value} is an NVIDIA kernel ({why}) and {gpu} runs ROCm: remove "
                    f"{key} (vLLM picks AMD's AITER kernel there)",
                )
            )
        return findings
    for key, value, why in _hits(config, AMD_ONLY):
        findings.append(
            Finding(
                "error",
                "kernel-platform",
                f"{key}: {value} on {gpu}: {why}; remove {key} or use an MI355X preset",
            )
        )
    if arch != "blackwell":
        for key, value, why in _hits(config, BLACKWELL_ONLY):
            findings.append(
                Finding(
                    "error",
                    "kernel-platform",
                    f"{key}: {value} on {gpu} ({arch}): {why}; remove {key} "
                    "(vLLM picks the Hopper kernel) or use a Blackwell preset (B200, B300, GB200)",
                )
            )
    return findings


def rule_mega_moe_expert_parallel(config: ServeConfig) -> list[Finding]:
    """DeepGEMM's MegaMoE backend needs expert parallel (NVIDIA only)."""
    if str(config.args.get("moe-backend", "")) != "deep_gemm_mega_moe":
        return []
    if truthy(config.args.get("enable-expert-parallel")):
        return []
    return [
        Finding(
            "error",
            "mega-moe-expert-parallel",
            "moe-backend deep_gemm_mega_moe without enable-expert-parallel: vLLM 0.32 refuses "
            "it at start-up (models/deepseek_v4/nvidia/model.py: 'DeepSeek V4 MegaMoE "
            "currently requires expert parallel'); set enable-expert-parallel: true",
        )
    ]


# The DeepSeek sparse indexer accepts these indexer_kv_dtype values (vLLM 0.32
# v1/attention/backends/mla/indexer.py, DSA_INDEXER_KV_DTYPES, plus "auto").
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")


def rule_indexer_cache(config: ServeConfig) -> list[Finding]:
    """The indexer cache is asked for the way vLLM 0.32 spells it, with a value DSV4 supports."""
    attention = config.args.get("attention-config")
    if not isinstance(attention, dict):
        return []
    findings = []
    if "use_fp4_indexer_cache" in attention:
        want = "mxfp4" if truthy(attention["use_fp4_indexer_cache"]) else "fp8"
        findings.append(
            Finding(
                "error",
                "indexer-cache",
                "attention-config.use_fp4_indexer_cache is the spelling of older vLLM releases "
                "and older recipes; vLLM 0.32's AttentionConfig has no such field and refuses "
                f"it: set attention-config.indexer_kv_dtype: {want} instead",
            )
        )
    dtype = attention.get("indexer_kv_dtype")
    if dtype is not None and str(dtype) not in INDEXER_KV_DTYPES:
        findings.append(
            Finding(
                "error",
                "indexer-cache",
                f"attention-config.indexer_kv_dtype {dtype!r}: DSV4's sparse indexer takes only "
                f"{', '.join(INDEXER_KV_DTYPES)} (vLLM 0.32 raises at start-up for anything else)",
            )
        )
    if (
        str(dtype) == "mxfp4"
        and vendor(config) == "amd"
        and config.checkpoint.get("model_type") != "deepseek_v41"
    ):
        findings.append(
            Finding(
                "error",
                "indexer-cache",
                "attention-config.indexer_kv_dtype mxfp4 on ROCm: vLLM 0.32 wires the MXFP4 "
                "indexer cache on ROCm for DeepSeek-V4.1 only; remove it for this checkpoint",
            )
        )
    return findings
