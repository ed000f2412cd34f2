"""vLLM general plugin: put dsv4-kernels into vLLM's DeepSeek-V4 attention path.

vLLM calls :func:`register` in every process it starts (entry point group
``vllm.general_plugins``), before the model code is imported.  It replaces
vLLM's DSV4 metadata and K-cache functions with ours wherever vLLM defines or
has already imported them by name.  Everything is reversible
(:func:`unregister`) and nothing is patched when:

* ``DSV4_KERNELS_DISABLE=1`` is set (the A/B switch ``dsv4 compare`` uses);
* the vLLM build has no DSV4 ops module, or its functions are missing;
* the platform is not CUDA (ROCm and XPU have their own DSV4 kernels), unless
  ``DSV4_KERNELS_FORCE=1`` asks for it (our functions fall back to the torch
  references for CPU tensors).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("dsv4_attention")

# Where vLLM defines the DSV4 ops, and the package that re-exports them.
VLLM_OPS_MODULES = (
    "vllm.models.deepseek_v4.common.ops.cache_utils",
    "vllm.models.deepseek_v4.common.ops",
)
# Modules of vLLM that import these functions by name at import time.
VLLM_PREFIX = "vllm.models.deepseek_v4"

_ORIGINALS: dict[str, Callable[..., Any]] = {}  # vLLM's functions, by name
_OURS: dict[str, Callable[..., Any]] = {}  # what replaced them, by name


def _dsv4_modules() -> list[Any]:
    """vLLM's DSV4 modules imported so far (not ``deepseek_v41``, whose ops are its own)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == VLLM_PREFIX or name.startswith(VLLM_PREFIX + "."))
    ]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _replacements(originals: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Our functions, adapted to vLLM's exact signatures where they differ."""
    import dsv4_kernels as dk

    def quantize_and_insert_k_cache(
        k: Any,
        k_cache: Any,
        slot_mapping: Any,
        block_size: int = 64,
        is_ue8m0: bool = True,
        use_fnuz: bool = False,
    ) -> None:
        if not is_ue8m0 or use_fnuz:  # layouts we do not implement: vLLM's own kernel
            originals["quantize_and_insert_k_cache"](
                k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz
            )
            return
        # vLLM's [pages, block_size, 584] view of a padded page is accepted as is.
        dk.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)

    def dequantize_and_gather_k_cache(
        out: Any,
        k_cache: Any,
        seq_lens: Any,
        gather_lens: Any,
        block_table: Any,
        block_size: int,
        offset: int,
        use_fnuz: bool = False,
    ) -> None:
        if use_fnuz:
            originals["dequantize_and_gather_k_cache"](
                out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz
            )
            return
        dk.dequantize_and_gather_k_cache(
            out,
            k_cache,
            seq_lens,
            gather_lens,
            block_table,
            block_size,
            offset,
        )

    return {
        "combine_topk_swa_indices": dk.combine_topk_swa_indices,
        "compute_global_topk_indices_and_lens": dk.compute_global_topk_indices_and_lens,
        "quantize_and_insert_k_cache": quantize_and_insert_k_cache,
        "dequantize_and_gather_k_cache": dequantize_and_gather_k_cache,
    }


def _platform_is_cuda() -> bool:
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM without a usable platform: nothing to patch
        return False
    return bool(current_platform.is_cuda())


def register() -> None:
    """Entry point for vLLM's plugin loader; safe to call more than once."""
    if _OURS:
        return
    if _flag("DSV4_KERNELS_DISABLE"):
        logger.info("dsv4-kernels disabled by DSV4_KERNELS_DISABLE; using vLLM's kernels")
        return
    if not _flag("DSV4_KERNELS_FORCE") and not _platform_is_cuda():
        logger.info("dsv4-kernels: not a CUDA platform, vLLM's DSV4 kernels stay")
        return
    try:
        defining = importlib.import_module(VLLM_OPS_MODULES[0])
    except ImportError:
        logger.warning("dsv4-kernels: this vLLM has no DeepSeek-V4 ops module; nothing patched")
        return
    originals: dict[str, Callable[..., Any]] = {
        name: getattr(defining, name)
        for name in (
            "combine_topk_swa_indices",
            "compute_global_topk_indices_and_lens",
            "quantize_and_insert_k_cache",
            "dequantize_and_gather_k_cache",
        )
        if callable(getattr(defining, name, None))
    }
    if not originals:
        logger.warning("dsv4-kernels: vLLM's DSV4 ops have none of our functions; nothing patched")
        return
    _ORIGINALS.update(originals)
    ours = _replacements(originals)
    _OURS.update({name: ours[name] for name in originals})
    for module_name in VLLM_OPS_MODULES:
        importlib.import_module(module_name)
    # The defining module, its package, and any DSV4 module that already
    # imported a function by name (e.g. the attention backend).  Modules
    # imported later take the names from the patched package.
    for module in _dsv4_modules():
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                setattr(module, name, _OURS[name])
    logger.info(
        "dsv4-kernels: replaced %s in %d places", ", ".join(sorted(originals)), len(patched())
    )


def unregister() -> None:
    """Put vLLM's original functions back, also in modules imported after :func:`register`."""
    for module in _dsv4_modules():
        for name, ours in _OURS.items():
            if getattr(module, name, None) is ours:
                setattr(module, name, _ORIGINALS[name])
    _OURS.clear()
    _ORIGINALS.clear()


def patched() -> list[str]:
    """``module.function`` names that currently hold a dsv4-kernels function."""
    return sorted(
        f"{module.__name__}.{name}"
        for module in _dsv4_modules()
        for name, ours in _OURS.items()
        if getattr(module, name, None) is ours
    )
