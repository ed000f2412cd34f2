"""The H200's decode measurements, as the measured table holds them (for tools and tests).

The data lives in ``tables/NVIDIA_H200.json`` (``dsv4_attention.tables``):
``decode.ratios[layer][heads][tokens]`` is FlashMLA's time over ours (above 1:
ours is faster) for a decode step of ``tokens`` query tokens, from the curated
H200 run in ``docs/results/h200-decode-v2/`` (issue 32's decode v2 at 30607ea,
measured beside FlashMLA in one run; V4.1's rows from ``docs/results/h200-issue30``):
both under CUDA graphs on the same FP8 pages, 131,072-token contexts, FlashMLA padded
to 64 heads as vLLM runs it; rows at 8, 16 and 64 heads (DP attention).  Where the
matrix also measured the step as 2 tokens per request (MTP), the smaller of the two
ratios is kept.  The rule that turns it into a choice per step is
:func:`dsv4_attention.policy.decode_faster`.  Regenerate the table from new runs'
``decode_table.json`` (written by ``python -m benchmarks.cases_decode --out DIR``)
with ``python -m benchmarks.support.decode_table TABLE.json RUN.json...`` and name
the runs in its ``source``.
"""

from __future__ import annotations

from .policy import decode_faster
from .tables import DecodeTable, table_for

__all__ = ["H200", "MEASURED", "faster_steps", "use_head_exact_decode"]

_TABLE = table_for("NVIDIA H200", (9, 0))
assert _TABLE is not None, "the package's H200 table is missing"
H200: DecodeTable = _TABLE.decode
MEASURED = {layer: {h: dict(steps) for h, steps in by.items()} for layer, by in H200.ratios.items()}


def faster_steps(layer: str | int, heads: int, table: DecodeTable = H200) -> tuple[int, ...]:
    """The measured step sizes at which ours was faster, for a layer type (``"swa"``,
    ``"c4a"``, ``"c128a"`` or the compress ratio 1, 4, 128) and local head count."""
    row = table.row(layer, heads)
    return () if row is None else tuple(t for t, x in sorted(row.items()) if x > table.min_ratio)


def use_head_exact_decode(
    layer: str | int, heads: int, num_tokens: int, table: DecodeTable = H200
) -> bool:
    """Whether a decode step of ``num_tokens`` tokens takes the head-exact decode on the
    H200 (or ``table``): :func:`dsv4_attention.policy.decode_faster`."""
    return decode_faster(table, layer, heads, num_tokens)
