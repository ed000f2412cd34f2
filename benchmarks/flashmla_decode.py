"""FlashMLA's sparse FP8 decode as vLLM runs it for DSV4: the decode benchmark's peer.

vLLM's ``_forward_decode`` (``models/deepseek_v4/nvidia/flashmla.py``, the same in
0.32 and 0.33) calls ``flash_mla_with_kvcache`` with the query padded to 64 heads
(128 above 64) as ``[T, 1, H_pad, 512]``, the window cache view unsqueezed to
``[pages, 64, 1, 584]`` with window indices ``[T, 1, 128]`` and ``topk_length``,
the compressed cache as the extra cache with ``[T, 1, K]`` global slots and
``extra_topk_length``, the sink (padded heads at ``-inf`` here) and the scale, and
one ``FlashMLASchedMeta`` per layer type and step: its first call runs FlashMLA's
tile-scheduler planner, later layers of the step reuse the plan.  Here the plan is
made once by a warm-up call and every timed call reuses it (the planner's cost,
paid once per layer type per step in vLLM, is left out: in FlashMLA's favour).

Imports FlashMLA only (never copies it): built with ``bash .fmla/build-on-gpu.sh``
into ``/tmp/fmla`` or ``DSV4_FLASHMLA_PATH``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .flashmla_provider import import_flashmla, padded_heads


def load_decode() -> tuple[tuple[Callable[..., Any], Callable[..., Any]] | None, str]:
    """((``flash_mla_with_kvcache``, ``get_mla_metadata``) or None, why not)."""
    fns, why = import_flashmla("flash_mla_with_kvcache", "get_mla_metadata")
    return (None if fns is None else (fns[0], fns[1])), why


class PaddedFlashMLADecode:
    """``flash_mla_with_kvcache`` on heads padded to 64/128 over our FP8 pages.

    ``rows`` is a list of index-row sets (each with ``swa_indices``, ``swa_lens``,
    ``comp_indices``, ``comp_lens``); ``call(i)`` runs set ``i`` (the benchmark
    rotates sets inside one CUDA graph).  ``outputs()`` gives the real heads of the
    last call, with FlashMLA's ``+inf`` lse of a row without keys as ``-inf``.
    ``fns`` (another build's ``flash_mla_with_kvcache`` and ``get_mla_metadata``) and
    ``out`` (write into a preallocated ``[T, 1, H_pad, 512]`` output, as vLLM 0.33 does,
    which :meth:`poison` fills with NaN) serve vLLM's bundled FlashMLA
    (:mod:`.flashmla_vllm`).
    """

    def __init__(
        self,
        q: torch.Tensor,
        swa_cache: torch.Tensor,
        comp_cache: torch.Tensor | None,
        rows: list[Any],
        scale: float,
        attn_sink: torch.Tensor,
        *,
        fns: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
        out: bool = False,
    ) -> None:
        if fns is None:
            fns, why = load_decode()
            if fns is None:
                raise RuntimeError(why)
        self._fn, get_meta = fns
        T, H, D = q.shape
        self.heads = H
        hp = padded_heads(H)
        self.q = torch.zeros((T, 1, hp, D), dtype=q.dtype, device=q.device)
        self.q[:, 0, :H] = q
        self.sink = torch.full((hp,), float("-inf"), dtype=torch.float32, device=q.device)
        self.sink[:H] = attn_sink
        self.swa = swa_cache.unsqueeze(-2)
        self.comp = None if comp_cache is None else comp_cache.unsqueeze(-2)
        self.rows = rows
        self.scale = scale
        self.meta = get_meta()[0]
        self.out = torch.empty_like(self.q) if out else None
        self.result: tuple[torch.Tensor, ...] = ()

    def call(self, i: int = 0) -> None:
        r = self.rows[i]
        kw = {} if self.out is None else {"out": self.out}
        self.result = self._fn(
            q=self.q,
            k_cache=self.swa,
            block_table=None,
            cache_seqlens=None,
            head_dim_v=512,
            tile_scheduler_metadata=self.meta,
            softmax_scale=self.scale,
            is_fp8_kvcache=True,
            indices=r.swa_indices.unsqueeze(1),
            topk_length=r.swa_lens,
            attn_sink=self.sink,
            extra_k_cache=self.comp,
            extra_indices_in_kvcache=None if self.comp is None else r.comp_indices.unsqueeze(1),
            extra_topk_length=None if self.comp is None else r.comp_lens,
            **kw,
        )

    def poison(self) -> None:
        """NaN into what the calls write: the preallocated output (else the last result's)
        and the last result's lse (a CUDA graph's replays write the same tensors again)."""
        targets = [t for t in (self.out, *self.result) if t is not None]
        for t in {id(t): t for t in targets}.values():
            t.fill_(float("nan"))

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.result  # [T, 1, hp, 512], [T, hp, 1]
        if self.out is not None:  # the preallocated output the calls were given
            out = self.out
        o = out[:, 0, : self.heads]
        lse = lse.reshape(lse.shape[0], -1)[:, : self.heads]
        return o, torch.where(torch.isposinf(lse), float("-inf"), lse)
