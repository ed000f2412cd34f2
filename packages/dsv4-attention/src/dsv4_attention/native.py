"""vLLM's own DeepSeek-V4 prefill, run at the real heads by the FlashMLA vLLM bundles.

vLLM 0.33 bundles a FlashMLA whose sparse prefill takes 8, 16 or 32 query heads
on SM90 (its interface: "SM90 supports 8, 16, 32, 64 or 128 heads"), and its
DeepSeek-V4.1 class calls it so (``q[..., :_prefill_num_heads]``).  Its V4 class
still pads to 64 heads.  Where the measured table says the real-heads call is
faster (at 32 local heads: V4-Pro TP4, V4-Flash TP2), the plugin runs vLLM's own
V4 ``_forward_prefill`` (its gathers, its combine, its chunk plan) unchanged,
with one difference: the ``flash_mla_sparse_fwd`` that method calls receives the
first ``heads`` query heads, sink entries and output heads, as V4.1's class
passes them.  The padded heads' outputs are left unwritten; vLLM drops them
after attention (``output[:, :n_local_heads]``).

:func:`wrap_sparse_fwd` builds that function from vLLM's; the plugin puts it in
place of the name in vLLM's V4 FlashMLA module (checked and reversible like the
other replacements), and :func:`real_heads` sets the head count around one call
of vLLM's method.  Outside :func:`real_heads` the wrapper is vLLM's function.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["real_heads", "wrap_sparse_fwd"]

_HEADS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dsv4_attention_native_heads", default=None
)


@contextlib.contextmanager
def real_heads(heads: int) -> Iterator[None]:
    """Within this block, the wrapped ``flash_mla_sparse_fwd`` computes ``heads`` heads."""
    if not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    token = _HEADS.set(heads)
    try:
        yield
    finally:
        _HEADS.reset(token)


def wrap_sparse_fwd(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``flash_mla_sparse_fwd`` (parameters ``q, kv, indices, sm_scale, d_v,
    attn_sink, topk_length, out``), computing only the first heads within
    :func:`real_heads`."""

    def flash_mla_sparse_fwd(
        q: Any,
        kv: Any,
        indices: Any,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: Any = None,
        topk_length: Any = None,
        out: Any = None,
    ) -> Any:
        heads = _HEADS.get()
        if heads is not None and q.shape[1] > heads:
            q = q[:, :heads]
            attn_sink = None if attn_sink is None else attn_sink[:heads]
            out = None if out is None else out[:, :heads]
        return original(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)

    flash_mla_sparse_fwd.__wrapped__ = original  # type: ignore[attr-defined]
    flash_mla_sparse_fwd.__doc__ = (
        "vLLM's flash_mla_sparse_fwd; within dsv4_attention.native.real_heads(h) it computes "
        "the first h query heads (the bundled FlashMLA's small-heads prefill)."
    )
    return flash_mla_sparse_fwd
