"""FlashMLA's sparse prefill as vLLM 0.32 runs it for DSV4: the benchmark's peer.

vLLM pads DSV4's query heads to 64 (or 128) for ``flash_mla_sparse_fwd`` and
feeds it a bf16 workspace with request-local rows and ``topk_length``.  This
module only imports FlashMLA (never copies it): build it on the GPU machine
with the project's ``tools/flashmla`` scripts (``bash .fmla/build-on-gpu.sh``
puts it in ``/tmp/fmla``) or point ``DSV4_FLASHMLA_PATH`` at a built tree.
Benchmarks and GPU tests use it when it imports and say so when it does not.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_PATH = "/tmp/fmla"
# FlashMLA's sparse prefill supports these head counts; vLLM pads up to the next.
FLASHMLA_HEADS = (64, 128)

_LOADED: dict[tuple[str, ...], tuple[tuple[Any, ...] | None, str]] = {}


def import_flashmla(*names: str) -> tuple[tuple[Any, ...] | None, str]:
    """(the named functions of FlashMLA's ``flash_mla`` module or None, why not)."""
    if names in _LOADED:
        return _LOADED[names]
    path = os.environ.get("DSV4_FLASHMLA_PATH", DEFAULT_PATH)
    fns = None
    why = ""
    if not torch.cuda.is_available():
        why = "FlashMLA needs a CUDA GPU"
    elif not os.path.isdir(path):
        why = f"FlashMLA is not built at {path} (run bash .fmla/build-on-gpu.sh on the GPU machine)"
    else:
        if path not in sys.path:
            sys.path.insert(0, path)
        try:
            module = importlib.import_module("flash_mla")
            fns = tuple(getattr(module, name) for name in names)
        except Exception as exc:  # an unbuilt or mismatched extension raises many kinds
            why = f"FlashMLA at {path} does not import: {type(exc).__name__}: {exc}"
    _LOADED[names] = fns, why
    return fns, why


def load_sparse_fwd() -> tuple[Callable[..., tuple[torch.Tensor, ...]] | None, str]:
    """(``flash_mla_sparse_fwd`` or None, why not)."""
    fns, why = import_flashmla("flash_mla_sparse_fwd")
    return (None if fns is None else fns[0]), why


def padded_heads(num_heads: int) -> int:
    """The head count vLLM gives FlashMLA for ``num_heads`` real heads."""
    for h in FLASHMLA_HEADS:
        if num_heads <= h:
            return h
    raise ValueError(f"FlashMLA supports at most {FLASHMLA_HEADS[-1]} heads, got {num_heads}")


class PaddedFlashMLA:
    """``flash_mla_sparse_fwd`` on heads padded to 64/128, as vLLM runs it.

    The padded query and sink are prepared once (vLLM's projection writes the
    padded query directly); a call runs only FlashMLA.  ``out``/``lse`` give
    the real heads' rows, with FlashMLA's ``+inf`` lse for a row without keys
    turned into our ``-inf``.  ``fn`` and ``heads`` (another build's function, the
    head count to run at; default: this FlashMLA, padded to 64/128) and ``out``
    (write into a preallocated output, which :meth:`poison` fills with NaN) serve
    vLLM's bundled FlashMLA (:mod:`.flashmla_vllm`).
    """

    def __init__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        attn_sink: torch.Tensor | None,
        *,
        fn: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        heads: int | None = None,
        out: bool = False,
    ) -> None:
        if fn is None:
            fn, why = load_sparse_fwd()
            if fn is None:
                raise RuntimeError(why)
        self._fn = fn
        T, H, D = q.shape
        self.heads = H
        hp = padded_heads(H) if heads is None else heads
        self.q = torch.zeros((T, hp, D), dtype=q.dtype, device=q.device)
        self.q[:, :H] = q
        self.sink = None
        if attn_sink is not None:
            self.sink = torch.full((hp,), float("-inf"), dtype=torch.float32, device=q.device)
            self.sink[:H] = attn_sink
        self.kv = kv.reshape(kv.shape[0], 1, D)
        self.indices = indices.unsqueeze(1)
        self.lens = lens
        self.scale = scale
        self.out = torch.empty((T, hp, 512), dtype=q.dtype, device=q.device) if out else None
        self.result: tuple[torch.Tensor, ...] = ()

    def __call__(self) -> None:
        kw = {} if self.out is None else {"out": self.out}
        self.result = self._fn(
            self.q, self.kv, self.indices, self.scale, 512, self.sink, self.lens, **kw
        )

    def poison(self) -> None:
        """Forget the last result; NaN into the preallocated output, where there is one."""
        self.result = ()
        if self.out is not None:
            self.out.fill_(float("nan"))

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the real heads; ``out`` from the preallocated output where there is
        one (vLLM 0.33 reads that buffer, not the returned tensor)."""
        out, _max_logits, lse = self.result
        if self.out is not None:
            out = self.out
        lse = lse[:, : self.heads]
        return out[:, : self.heads], torch.where(torch.isposinf(lse), float("-inf"), lse)
