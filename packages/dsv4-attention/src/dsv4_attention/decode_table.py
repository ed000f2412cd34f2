"""Where the head-exact decode is faster than vLLM's padded FlashMLA decode: measured data.

``MEASURED[layer][heads][tokens]`` is FlashMLA's time over ours (above 1: ours is
faster) for a decode step of ``tokens`` query tokens, from the curated H200 run in
``docs/results/h200-decode/`` (run 3 at fa69732: the final kernel code, measured
beside FlashMLA in one run): both under CUDA graphs on the same FP8 pages,
131,072-token contexts, FlashMLA padded to 64 heads as vLLM runs it.  Where the
matrix also measured the step as 2 tokens per request (MTP), the smaller of the two
ratios is kept.

:func:`use_head_exact_decode` says whether a step should take
:func:`dsv4_attention.decode.forward_decode`: only where the measurements on both
sides of its size (or, past the largest measured step, the largest) were faster.
Heads are looked up by the kernel's MMA width: up to 8 heads run as 8 rows (the
8-head row), 9 to 16 as 16; more heads are never taken (FlashMLA is 2-3x faster
at 64).  Regenerate the table from a new run's ``decode_table.json`` (written by
``python -m benchmarks.kernels --only sparse_mla_decode``) and say so here.
"""

from __future__ import annotations

__all__ = ["MEASURED", "MIN_RATIO", "faster_steps", "use_head_exact_decode"]

MIN_RATIO = 1.0  # ours must have been strictly faster
LAYERS = {1: "swa", 4: "c4a", 128: "c128a"}

MEASURED: dict[str, dict[int, dict[int, float]]] = {
    "c4a": {
        8: {
            1: 1.41,
            2: 1.39,
            4: 1.4,
            8: 1.46,
            16: 1.45,
            32: 1.57,
            64: 1.84,
            128: 1.14,
            256: 1.43,
            512: 1.32,
            1024: 1.51,
        },
        16: {
            1: 1.36,
            2: 1.35,
            4: 1.38,
            8: 1.3,
            16: 1.22,
            32: 1.36,
            64: 1.53,
            128: 1.15,
            256: 1.35,
            512: 1.35,
            1024: 1.37,
        },
    },
    "c128a": {
        8: {
            1: 1.56,
            2: 1.51,
            4: 1.49,
            8: 1.42,
            16: 1.43,
            32: 1.51,
            64: 1.89,
            128: 1.36,
            256: 1.4,
            512: 1.29,
            1024: 1.54,
        },
        16: {
            1: 1.38,
            2: 1.35,
            4: 1.39,
            8: 1.29,
            16: 1.24,
            32: 1.37,
            64: 1.54,
            128: 1.16,
            256: 1.36,
            512: 1.37,
            1024: 1.39,
        },
    },
    "swa": {
        8: {
            1: 1.4,
            2: 1.4,
            4: 1.41,
            8: 1.4,
            16: 1.43,
            32: 1.39,
            64: 1.38,
            128: 1.49,
            256: 2.06,
            512: 1.85,
            1024: 2.24,
        },
        16: {
            1: 1.28,
            2: 1.3,
            4: 1.31,
            8: 1.29,
            16: 1.31,
            32: 1.26,
            64: 1.2,
            128: 1.03,
            256: 1.59,
            512: 1.54,
            1024: 1.57,
        },
    },
}


def _row(layer: str | int, heads: int) -> dict[int, float] | None:
    name = LAYERS.get(layer, "") if isinstance(layer, int) else layer
    if name not in MEASURED or not 1 <= heads <= 16:
        return None
    return MEASURED[name].get(8 if heads <= 8 else 16)


def faster_steps(layer: str | int, heads: int) -> tuple[int, ...]:
    """The measured step sizes at which ours was faster, for a layer type (``"swa"``,
    ``"c4a"``, ``"c128a"`` or the compress ratio 1, 4, 128) and local head count."""
    row = _row(layer, heads)
    return () if row is None else tuple(t for t, x in sorted(row.items()) if x > MIN_RATIO)


def use_head_exact_decode(layer: str | int, heads: int, num_tokens: int) -> bool:
    """Whether a decode step of ``num_tokens`` tokens on this layer type and local head
    count takes the head-exact decode: the measured steps bracketing ``num_tokens``
    (the nearest at or below and at or above it) were both faster, or, past the
    largest measured step, the largest was."""
    row = _row(layer, heads)
    if row is None or num_tokens <= 0:
        return False
    steps = sorted(row)
    below = [t for t in steps if t <= num_tokens]
    above = [t for t in steps if t >= num_tokens]
    sides = [below[-1]] if below else []
    sides += [above[0]] if above else []
    return bool(sides) and all(row[t] > MIN_RATIO for t in sides)
