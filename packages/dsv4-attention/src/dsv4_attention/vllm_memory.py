"""The head-exact paths' memory and cache checks inside vLLM (split from ``vllm_backend``).

* the cache layout guard: a layer's caches must be DSV4's UE8M0 pages before our
  kernels read them (checked once per layer and binding);
* the prefill scratch: reserved in vLLM's profile run as persistent buffers of
  vLLM's workspace manager, at the size of the largest step, so vLLM's memory
  profile sees it and real steps allocate nothing;
* the warm-up: our kernels compiled in the same profile run.

Everything here reaches vLLM only through ``vllm_backend._RUNTIME`` (set by the
plugin); this module imports nothing of vLLM.
"""

from __future__ import annotations

from typing import Any

from . import vllm_backend as vb

# --- the cache layout guard ------------------------------------------------------------

# vLLM's names of the cache dtype whose pages are the UE8M0 layout our kernels read
DSV4_CACHE_DTYPES = ("fp8_ds_mla", "fp8")


def cache_layout_problem(layer: Any, cache: Any, slots: int, what: str) -> str | None:
    """Why ``cache`` is not a DSV4 FP8 (UE8M0, 584 bytes a token) page view of ``slots``
    entries per page, or None when it is."""
    import torch

    from dsv4_kernels.geometry import TOKEN_BYTES, page_stride_bytes

    if not isinstance(cache, torch.Tensor):
        return f"the {what} cache is {type(cache).__name__}, not a tensor"
    if cache.dtype != torch.uint8 or cache.dim() != 3:
        return f"the {what} cache is {cache.dtype} {tuple(cache.shape)}, not a uint8 page view"
    if cache.shape[1] != slots or cache.shape[2] != TOKEN_BYTES:
        return (
            f"the {what} cache pages are {tuple(cache.shape[1:])}, expected ({slots}, "
            f"{TOKEN_BYTES}) (DSV4's UE8M0 layout, {TOKEN_BYTES} bytes a token)"
        )
    if cache.stride(2) != 1 or cache.stride(1) != TOKEN_BYTES:
        return f"the {what} cache has strides {cache.stride()}, not packed {TOKEN_BYTES}-byte rows"
    if cache.shape[0] > 1 and cache.stride(0) < page_stride_bytes(slots):
        return (
            f"the {what} cache's page stride {cache.stride(0)} is smaller than a page "
            f"({page_stride_bytes(slots)} bytes)"
        )
    dtype = getattr(layer, "kv_cache_dtype", None)
    if dtype is not None and str(dtype) not in DSV4_CACHE_DTYPES:
        return f"kv_cache_dtype {dtype!r} is not one of {DSV4_CACHE_DTYPES}"
    return None


def layout_ok(
    layer: Any, swa_cache: Any, comp_cache: Any, swa_block_size: int, comp_slots: int | None
) -> bool:
    """Whether this layer's caches have DSV4's FP8 page layout; checked once per layer
    and cache binding, a refusal logged once."""
    key = (
        getattr(swa_cache, "data_ptr", lambda: 0)(),
        getattr(comp_cache, "data_ptr", lambda: 0)(),
        tuple(getattr(swa_cache, "shape", ())),
        tuple(getattr(comp_cache, "shape", ())),
    )
    held = getattr(layer, "_dsv4_layout", None)
    if held is not None and held[0] == key:
        return bool(held[1])
    problem = cache_layout_problem(layer, swa_cache, swa_block_size, "window")
    if problem is None and comp_slots is not None:
        problem = cache_layout_problem(layer, comp_cache, comp_slots, "compressed")
    layer._dsv4_layout = (key, problem is None)
    if problem is not None:
        vb._say(
            f"dsv4-attention: {getattr(layer, 'prefix', 'a DSV4 layer')} keeps vLLM's "
            f"attention (prefill and decode): {problem}"
        )
    return problem is None


# --- memory vLLM can see, and kernels compiled before the first request ----------------

# The process's prefill scratch, reserved in vLLM's profile run; warm-ups done so far.
_SCRATCH: dict[str, Any] = {"scratch": None, "spec": None, "refused": False}
WARMED: dict[tuple[Any, ...], float] = {}  # (device, heads, ratio, C4A top-k) -> seconds


def layer_scratch_spec(layer: Any, q: Any) -> Any:
    """The largest prefill step of this layer's model (vLLM's own limits on the layer)."""
    from dsv4_kernels import sparse_mla

    from .scratch import ScratchSpec

    heads = int(layer.n_local_heads)
    topk_buffer = getattr(layer, "topk_indices_buffer", None)
    max_model_len = int(layer.max_model_len)
    entries = -(-max_model_len // 128)
    return ScratchSpec(
        max_tokens=int(layer.max_num_batched_tokens),
        max_heads=heads,
        window_size=int(layer.window_size),
        max_group=sparse_mla.prefill_group_size(q[:1, :heads]),
        c4a_topk=0 if topk_buffer is None else int(topk_buffer.shape[-1]),
        c128a_width=-(-entries // C128A_WIDTH_ALIGNMENT) * C128A_WIDTH_ALIGNMENT,
        window_slots=WINDOW_ROW_SETS,
        c128a_slots=1,
    )


# vLLM rounds its C128A row width up to a multiple of this (``_C128A_TOPK_ALIGNMENT``).
C128A_WIDTH_ALIGNMENT = 128
# Distinct window row sets per step: two window KV-cache groups, each read with
# per-token rows (C4A layers) and grouped rows (SWA-only, C128A layers).
WINDOW_ROW_SETS = 4


def reserve_scratch(spec: Any, device: Any) -> Any:
    """The process's :class:`~dsv4_attention.scratch.PrefillScratch` covering ``spec``:
    the workspace manager's persistent buffers in vLLM (visible to its memory
    profile), plain allocations without one.  Raises what the manager raises once
    it is locked (a buffer that was not reserved in the profile run)."""
    from .scratch import PrefillScratch

    held = _SCRATCH["spec"]
    if held is not None and held.merged(spec) == held:
        return _SCRATCH["scratch"]
    spec = spec if held is None else held.merged(spec)
    manager = vb._RUNTIME["workspace"]() if vb._RUNTIME["workspace"] is not None else None
    if manager is None:
        scratch = PrefillScratch(spec, device=device)
    else:
        scratch = PrefillScratch(
            spec,
            lambda name, n, dtype: manager.get_persistent(
                ("dsv4_attention.prefill", name, n), (n,), dtype
            ),
        )
    _SCRATCH.update(scratch=scratch, spec=spec)
    return scratch


def could_take_head_exact(layer: Any) -> bool:
    """Whether any step could send this layer to the head-exact prefill."""
    ratio = int(layer.compress_ratio)
    if ratio not in (1, 4, 128) or vb._switch(vb.ENV_PREFILL_DISABLE):
        return False
    limit = max(vb.max_heads(ratio), vb.short_rows_max_heads() if ratio == 4 else 0)
    return int(layer.n_local_heads) <= limit


def prepare_layer(layer: Any, q: Any) -> None:
    """vLLM's profile run (no metadata): reserve the scratch the largest step needs and
    compile our kernels for this layer's shape, so neither happens in a request."""
    if not could_take_head_exact(layer):
        return
    reserve_scratch(layer_scratch_spec(layer, q), q.device)
    from .warmup import warm_up_prefill

    heads = int(layer.n_local_heads)
    ratio = int(layer.compress_ratio)
    topk_buffer = getattr(layer, "topk_indices_buffer", None)
    topk = 512 if topk_buffer is None else int(topk_buffer.shape[-1])
    key = (str(q.device), heads, ratio, topk if ratio == 4 else 0)
    if key not in WARMED:
        WARMED[key] = warm_up_prefill(q.device, heads, ratio, topk)


def _scratch_for_step(layer: Any, q: Any) -> Any:
    """The reserved scratch; reserved now when no profile run did (refused, and logged
    once, where vLLM's workspace is already locked)."""
    if _SCRATCH["scratch"] is not None:
        return _SCRATCH["scratch"]
    return reserve_scratch(layer_scratch_spec(layer, q), q.device)


def _refuse(reason: str) -> bool:
    """Log (once per process) why a step takes vLLM's prefill; False."""
    if not _SCRATCH["refused"]:
        _SCRATCH["refused"] = True
        vb._say(f"dsv4-attention: a prefill step takes vLLM's path: {reason}")
    return False
