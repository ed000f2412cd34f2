"""What the plugin replaces in vLLM, on which platform, and the shapes it expects to find.

Everything here was read from vLLM 0.32's source (``vllm/models/deepseek_v4``);
the plugin checks each entry against the running vLLM before it changes
anything, and changes nothing when one does not match.

What is replaced where, and the measurements behind it, is in
``docs/attention.md`` ("What the plugin replaces").
"""

from __future__ import annotations

import re

# vLLM releases whose DSV4 code this table was read from (major, minor).
SUPPORTED_VLLM = ((0, 32),)

# The package whose first import triggers patching.  On CUDA its __init__
# imports the nvidia/ model modules, so every target below is loaded when it
# finishes executing.
DSV4_PACKAGE = "vllm.models.deepseek_v4"
OPS_MODULE = "vllm.models.deepseek_v4.common.ops.cache_utils"
OPS_PACKAGE = "vllm.models.deepseek_v4.common.ops"
FLASHMLA_MODULE = "vllm.models.deepseek_v4.nvidia.flashmla"
FLASHINFER_MODULE = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"

# Parameter names, in order, of every vLLM function the plugin may replace or
# wrap, as vLLM 0.32 defines them.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "combine_topk_swa_indices": (
        "topk_indices",
        "query_start_loc",
        "seq_lens",
        "gather_lens",
        "window_size",
        "compress_ratio",
        "topk",
        "M",
        "N",
        "out",
        "left_visible",
        "right_visible",
        "max_image_tokens",
    ),
    "compute_global_topk_indices_and_lens": (
        "topk_indices",
        "token_to_req_indices",
        "block_table",
        "block_size",
        "is_valid_token",
    ),
    "dequantize_and_gather_k_cache": (
        "out",
        "k_cache",
        "seq_lens",
        "gather_lens",
        "block_table",
        "block_size",
        "offset",
        "use_fnuz",
    ),
    "_select_dsv4_attn_cls": ("vllm_config",),
    "_forward_prefill": (
        "self",
        "q",
        "positions",
        "compressed_k_cache",
        "swa_k_cache",
        "output",
        "attn_metadata",
        "swa_metadata",
    ),
}

# Modules that import an ops function by name (``from ... import name``) and
# so hold their own binding, which must be the function defined in
# OPS_MODULE before the plugin replaces it there.
CONSUMERS: dict[str, tuple[str, ...]] = {
    "combine_topk_swa_indices": (OPS_PACKAGE, FLASHMLA_MODULE),
    "compute_global_topk_indices_and_lens": (OPS_PACKAGE, FLASHMLA_MODULE, FLASHINFER_MODULE),
    "dequantize_and_gather_k_cache": (OPS_PACKAGE, FLASHMLA_MODULE),
}

# The ops functions replaced on CUDA: only those measured faster than the
# kernel vLLM runs there (docs/plugin.md, H200 against vLLM 0.32's own
# kernels).  Combine is 1.49-2.93x faster; vLLM's
# ``compute_global_topk_indices_and_lens`` is 3-8% faster than ours, so it stays;
# ``quantize_and_insert_k_cache`` is never called on CUDA (fused writers fill
# the caches); ``dequantize_and_gather_k_cache`` races a CuTe-DSL kernel there
# (see GATHER_ON_CUDA).
CUDA_OPS: tuple[str, ...] = ("combine_topk_swa_indices",)
# Our gather replaces vLLM's only where vLLM would run its Triton gather
# (``cutlass`` not importable) and GATHER_ON_CUDA allows it; see docs/attention.md.
GATHER_ON_CUDA = "when-no-cutedsl"


def parse_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as ``0.32.0`` or ``0.32.1+cpu``."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.|$)", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def is_supported(version: str) -> bool:
    """Whether the plugin knows this vLLM release's DSV4 code."""
    return parse_version(version) in SUPPORTED_VLLM


def supported_text() -> str:
    """Human-readable list of supported releases, e.g. ``0.32.x``."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM)
