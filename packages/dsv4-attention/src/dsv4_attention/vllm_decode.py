"""The head-exact decode inside vLLM's ``_forward_decode`` (split from ``vllm_backend``).

Dispatch by the H200 measurements (``dsv4_attention.decode_table``), the decode
scratch reserved in vLLM's profile run from its workspace manager, the call
itself (``dsv4_attention.decode.forward_decode`` on the real heads, ``output``
written in place, nothing allocated, no host sync: vLLM's FULL CUDA graphs
capture and replay it), and the decode kernels compiled in the profile run.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_kernels.geometry import slots_per_page

from . import vllm_backend as vb
from .vllm_memory import C128A_WIDTH_ALIGNMENT, WARMED, _refuse, layout_ok

# The process's decode scratch (reserved in vLLM's profile run) and what it was sized for.
_DECODE: dict[str, Any] = {"scratch": None, "key": None}


def decode_enabled() -> bool:
    """Whether the head-exact decode may run in this process: on Hopper with the Gluon
    wgmma kernel (where ``dsv4_attention.decode_table`` was measured), unless
    ``DSV4_DECODE_DISABLE=1``."""
    if vb._switch(vb.ENV_DECODE_DISABLE):
        return False
    if vb._device_major() != 9:
        return False
    from dsv4_kernels.sparse_mla import wgmma_available

    return bool(wgmma_available())


def use_head_exact_decode(layer: Any, num_tokens: int) -> bool:
    """Whether this layer's decode of ``num_tokens`` tokens takes the head-exact kernel:
    enabled, at most 16 local heads, and a step size the H200 measured faster
    (:func:`dsv4_attention.decode_table.use_head_exact_decode`).  Everything it reads is
    fixed for a CUDA graph (the graph's batch size, the layer), so a captured graph
    replays the same choice."""
    from .decode_table import use_head_exact_decode as measured_faster

    ratio = int(layer.compress_ratio)
    heads = int(layer.n_local_heads)
    return (
        ratio in (1, 4, 128)
        and heads <= 16
        and decode_enabled()
        and measured_faster(ratio, heads, int(num_tokens))
    )


def _decode_limits(layer: Any) -> tuple[int, int, int]:
    """(largest decode batch, local heads, most columns per token) of this layer's model."""
    topk_buffer = getattr(layer, "topk_indices_buffer", None)
    topk = 0 if topk_buffer is None else int(topk_buffer.shape[-1])
    entries = -(-int(layer.max_model_len) // 128)
    c128a = -(-entries // C128A_WIDTH_ALIGNMENT) * C128A_WIDTH_ALIGNMENT
    return (
        int(layer.max_num_batched_tokens),
        int(layer.n_local_heads),
        int(layer.window_size) + max(topk, c128a),
    )


def reserve_decode_scratch(layer: Any, device: Any) -> Any:
    """The process's decode scratch for this layer's model: one flat float32 buffer from
    vLLM's workspace manager (persistent, so its memory profile counts it), or a plain
    allocation without one.  Raises what a locked manager raises."""
    from .decode import decode_scratch_sizes, make_decode_scratch

    limits = _decode_limits(layer)
    key = (str(device), *limits)
    if _DECODE["key"] is not None and all(
        a >= b for a, b in zip(_DECODE["key"][1:], limits, strict=True)
    ):
        return _DECODE["scratch"]
    sizes = decode_scratch_sizes(*limits, device)
    manager = vb._RUNTIME["workspace"]() if vb._RUNTIME["workspace"] is not None else None
    buffer = None
    if manager is not None:
        buffer = manager.get_persistent(
            ("dsv4_attention.decode", *limits), (sizes.total,), torch.float32
        )
    _DECODE.update(scratch=make_decode_scratch(*limits, device, buffer=buffer), key=key)
    return _DECODE["scratch"]


def head_exact_decode(
    layer: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor | None,
    swa_metadata: Any,
    attn_metadata: Any,
    swa_only: bool,
    output: torch.Tensor,
    scratch: Any,
    global_topk: Any,
) -> None:
    """vLLM's ``_forward_decode`` inputs -> the head-exact decode on the real heads, into
    ``output`` in place (the padded heads are left as they are)."""
    from .decode import forward_decode

    heads = int(layer.n_local_heads)
    num_tokens = int(swa_metadata.num_decode_tokens)
    comp: dict[str, Any] = {}
    if not swa_only:
        ratio = int(layer.compress_ratio)
        if ratio == 4:  # the layer's own top-k, mapped to cache slots as vLLM maps them
            indices, lens = global_topk(
                layer.topk_indices_buffer[:num_tokens],
                swa_metadata.token_to_req_indices,
                attn_metadata.block_table[: int(swa_metadata.num_decodes)],
                slots_per_page(ratio, int(attn_metadata.block_size)),
                swa_metadata.is_valid_token[:num_tokens],
            )
        else:
            indices = attn_metadata.c128a_global_decode_topk_indices
            lens = attn_metadata.c128a_decode_topk_lens
        comp = {"comp_cache": kv_cache, "comp_indices": indices, "comp_lens": lens}
    forward_decode(
        q[:num_tokens, :heads],
        layer.swa_cache_layer.kv_cache,
        swa_metadata.decode_swa_indices,
        swa_metadata.decode_swa_lens,
        layer.attn_sink[:heads],
        float(layer.scale),
        output[:num_tokens, :heads],
        scratch,
        **comp,
    )


def _try_head_exact_decode(
    layer: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor | None,
    swa_metadata: Any,
    attn_metadata: Any,
    swa_only: bool,
    output: torch.Tensor,
    global_topk: Any,
) -> bool:
    """Run the head-exact decode where it applies; False: vLLM's own must run."""
    if not use_head_exact_decode(layer, int(swa_metadata.num_decode_tokens)):
        return False
    if vb.dual_batch_active():
        return False
    ratio = int(layer.compress_ratio)
    comp_slots = None if swa_only else slots_per_page(ratio, int(attn_metadata.block_size))
    window = layer.swa_cache_layer.kv_cache
    if not layout_ok(layer, window, kv_cache, int(swa_metadata.block_size), comp_slots):
        return False
    scratch = _DECODE["scratch"]
    if scratch is None:
        try:
            scratch = reserve_decode_scratch(layer, q.device)
        except AssertionError as exc:  # vLLM's locked workspace
            return _refuse(f"no decode scratch was reserved in vLLM's profile run ({exc})")
    head_exact_decode(
        layer, q, kv_cache, swa_metadata, attn_metadata, swa_only, output, scratch, global_topk
    )
    return True


def prepare_decode(layer: Any, q: Any) -> None:
    """vLLM's profile run: reserve the decode scratch and compile the decode kernels for
    this layer's type and heads (before vLLM captures its CUDA graphs)."""
    ratio, heads = int(layer.compress_ratio), int(layer.n_local_heads)
    if ratio not in (1, 4, 128) or heads > 16 or not decode_enabled():
        return
    scratch = reserve_decode_scratch(layer, q.device)
    from .warmup import warm_up_decode

    key = ("decode", str(q.device), heads, ratio)
    if key not in WARMED:
        WARMED[key] = warm_up_decode(q.device, heads, ratio, _decode_limits(layer)[2], scratch)
