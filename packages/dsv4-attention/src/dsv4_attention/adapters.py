"""Our kernels behind vLLM 0.32's exact signatures, for the plugin to swap in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replacements(originals: dict[str, Callable[..., Any] | None]) -> dict[str, Callable[..., Any]]:
    """Replacement for each vLLM ops function; ``originals`` are vLLM's, by name.

    Arguments our kernels do not implement (the FNUZ fp8 encoding of ROCm's
    gfx942) go to vLLM's own function.
    """
    import dsv4_kernels as dk

    original_gather = originals.get("dequantize_and_gather_k_cache")

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
            assert original_gather is not None
            original_gather(
                out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz
            )
            return
        dk.dequantize_and_gather_k_cache(
            out, k_cache, seq_lens, gather_lens, block_table, block_size, offset
        )

    return {
        "combine_topk_swa_indices": dk.combine_topk_swa_indices,
        "compute_global_topk_indices_and_lens": dk.compute_global_topk_indices_and_lens,
        "dequantize_and_gather_k_cache": dequantize_and_gather_k_cache,
    }
