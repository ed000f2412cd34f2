"""Our kernels behind vLLM's exact signatures, for the plugin to swap in, each falling
back to vLLM's own function.

The replaced ops run inside vLLM's own ``_forward_prefill`` (and wherever else vLLM
calls them), outside any ``try`` of ours: an error of our kernel there would otherwise
propagate into vLLM's step.  So every replacement is guarded (:class:`OpsGuard`): an
exception from ours outside CUDA-graph capture sends that call and every later one to
vLLM's original, with one warning per op; under capture it propagates, so vLLM's
start-up fails instead of a request.  A device-side fault (an illegal address, a
kernel that hangs) is not an exception Python sees at the call: no fallback can catch
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OpsGuard", "replacements"]


def _never() -> bool:
    return False


@dataclass
class OpsGuard:
    """How replaced ops fall back: ``warning`` (vLLM's logger), ``capturing`` (whether the
    current stream is being captured), and the ops that went back to vLLM's for good."""

    warning: Callable[[str], None] = print
    capturing: Callable[[], bool] = _never
    failed: dict[str, str] = field(default_factory=dict)  # op name -> what it raised

    def guard(
        self, name: str, ours: Callable[..., Any], original: Callable[..., Any]
    ) -> Callable[..., Any]:
        """``ours`` with vLLM's ``original`` behind it (same arguments)."""

        def replaced(*args: Any, **kwargs: Any) -> Any:
            if name in self.failed:
                return original(*args, **kwargs)
            try:
                return ours(*args, **kwargs)
            except Exception as exc:
                if self.capturing():
                    raise
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                self.warning(
                    f"dsv4-attention: our {name} raised {type(exc).__name__}: {exc}; this "
                    f"and every later call run vLLM's own {name}"
                )
            return original(*args, **kwargs)

        replaced.__name__ = name
        replaced.__qualname__ = name
        replaced.__doc__ = f"dsv4-kernels' {name}, vLLM's own on an error of ours."
        replaced.__wrapped__ = ours  # type: ignore[attr-defined]
        return replaced


def replacements(
    originals: dict[str, Callable[..., Any] | None], guard: OpsGuard | None = None
) -> dict[str, Callable[..., Any]]:
    """Replacement for each vLLM ops function in ``originals`` (vLLM's, by name), guarded
    by ``guard`` (a fresh :class:`OpsGuard` printing its warning when None).

    Arguments our kernels do not implement (the FNUZ fp8 encoding of ROCm's
    gfx942) go to vLLM's own function.
    """
    import dsv4_kernels as dk

    guard = guard or OpsGuard()
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

    def combine_topk_swa_indices(*args: Any, **kwargs: Any) -> Any:
        return dk.combine_topk_swa_indices(*args, **kwargs)

    def compute_global_topk_indices_and_lens(*args: Any, **kwargs: Any) -> Any:
        return dk.compute_global_topk_indices_and_lens(*args, **kwargs)

    # looked up in dsv4_kernels at each call (what a test injects there is what runs)
    ours: dict[str, Callable[..., Any]] = {
        "combine_topk_swa_indices": combine_topk_swa_indices,
        "compute_global_topk_indices_and_lens": compute_global_topk_indices_and_lens,
        "dequantize_and_gather_k_cache": dequantize_and_gather_k_cache,
    }
    out: dict[str, Callable[..., Any]] = {}
    for name, original in originals.items():
        if original is None:
            raise ValueError(f"originals[{name!r}] is None: vLLM's function is needed to fall back")
        out[name] = guard.guard(name, ours[name], original)
    return out
