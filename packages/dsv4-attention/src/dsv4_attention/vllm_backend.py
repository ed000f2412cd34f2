"""The head-exact sparse-MLA prefill as a subclass of vLLM's FlashMLA attention layer.

vLLM 0.32 pads DSV4's query heads to 64 for FlashMLA (8 real ones per GPU for
V4-Flash at TP8, 16 for V4-Pro) and feeds its sparse prefill from a bf16
workspace gathered out of the FP8 pages.  The subclass made here keeps
everything of vLLM's class (backends, metadata builders, KV-cache specs,
decode) and overrides only ``_forward_prefill``: where it is measured faster
(``use_head_exact``) it runs :func:`dsv4_attention.prefill.forward_prefill`
on the real heads straight from the FP8 pages, with the step's index rows
built once per layer type (:class:`~dsv4_attention.prefill.PrefillPlan`);
otherwise it calls vLLM's own ``_forward_prefill``.

The subclass is created from the class vLLM defines at run time (the plugin
checks that class's ``_forward_prefill`` signature first), so this module
imports nothing of vLLM itself.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dsv4_kernels.geometry import slots_per_page

ENV_MAX_HEADS = "DSV4_PREFILL_MAX_HEADS"
ENV_DECODE_DISABLE = "DSV4_DECODE_DISABLE"
ENV_PREFILL_DISABLE = "DSV4_PREFILL_DISABLE"


def _switch(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


# Compute capabilities where vLLM's FlashMLA prefill runs (Hopper, Blackwell).
# On Hopper our Gluon wgmma kernel (dsv4_kernels._gluon_sparse_mla) is measured
# faster than FlashMLA padded to 64 heads (plus vLLM's gather and combine) at 8
# local heads (V4-Flash TP8) for every layer type; at 16 (V4-Pro TP8) on SWA-only
# and C128A layers (grouped rows), and on C4A layers only where their rows are
# short (docs/attention.md).  So the head-exact prefill takes up to 8 heads on C4A
# layers there (16 in steps whose C4A rows are short) and up to 16 on the others.
# On Blackwell only the Triton kernel runs, which FlashMLA beats: off.  Elsewhere
# (e.g. sm80, sm89, where FlashMLA cannot run) it is the only prefill and is on for
# every head count.
FLASHMLA_MAJORS = (9, 10)
HOPPER_MAX_HEADS = 8  # C4A layers
HOPPER_MAX_HEADS_SHARED_KEYS = 16  # SWA-only and C128A layers
# C4A layers above HOPPER_MAX_HEADS, up to HOPPER_MAX_HEADS_SHARED_KEYS (V4-Pro TP8)
# on Hopper take the head-exact prefill in steps whose C4A rows are short: run 17
# (``python3 -m benchmarks.experiments.exp_context``, 16 heads) measured ours 1.18x faster than
# FlashMLA plus gather at a mean of 248 valid keys per token, 1.08x at 380, even
# at 638 and 1.07-1.11x slower from 895 keys to the full 1,152.
C4A_SHORT_ROWS_MEAN_KEYS = 512


# What the layers of one step share: the prefill plan (built by the step's first
# layer) and the C4A rows' mean key counts.  vLLM gives each KV-cache group its own
# metadata object per step (DSV4's window caches form two groups, even and odd
# layers), so the step is recognised by vLLM's forward context (one per forward
# pass) and its attention-metadata dict, not by a metadata object; without a
# forward context (a layer driven by hand) by the metadata object.
_STEP: dict[str, Any] = {"ref": None, "dict_id": None, "plan": None, "keys": {}}
# How to reach vLLM at run time, set by the plugin from the release's facts
# (this module imports nothing of vLLM itself).
_RUNTIME: dict[str, Any] = {
    "forward_context": None,
    "workspace": None,
    "log": None,
    "dual_batch": None,
}


def configure_runtime(
    *,
    forward_context: Any = None,
    workspace: Any = None,
    log: Any = None,
    dual_batch: Any = None,
) -> None:
    """Tell the backend how to reach vLLM: ``forward_context()`` returns vLLM's current
    forward context or None, ``workspace()`` vLLM's workspace manager, ``log(line)``
    writes one line to vLLM's log, ``dual_batch()`` whether vLLM runs micro-batches
    on two threads (dual-batch overlap)."""
    _RUNTIME.update(
        forward_context=forward_context, workspace=workspace, log=log, dual_batch=dual_batch
    )


def dual_batch_active() -> bool:
    """Whether vLLM overlaps two micro-batches now: the process-wide scratch would be
    shared by both, so the head-exact paths leave such steps to vLLM."""
    getter = _RUNTIME["dual_batch"]
    return bool(getter()) if getter is not None else False


def _say(line: str) -> None:
    log = _RUNTIME["log"]
    if log is not None:
        log(line)


def _forward_context() -> Any:
    getter = _RUNTIME["forward_context"]
    return None if getter is None else getter()


def _step(swa_metadata: Any) -> dict[str, Any]:
    """The shared state of the step ``swa_metadata`` belongs to."""
    ctx = _forward_context()
    owner = ctx if ctx is not None else swa_metadata
    dict_id = id(getattr(ctx, "attn_metadata", None)) if ctx is not None else None
    held = _STEP["ref"]
    if held is None or held() is not owner or _STEP["dict_id"] != dict_id:
        _STEP.update(ref=weakref.ref(owner), dict_id=dict_id, plan=None, keys={})
    return _STEP


@functools.cache
def _device_major() -> int | None:
    """The GPU's compute-capability major as vLLM's platform reports it (None: no vLLM
    or no device).  vLLM's platform reads it through NVML: no CUDA context is created
    in the process that decides (vLLM forks workers after this)."""
    try:
        from vllm.platforms import current_platform

        capability = current_platform.get_device_capability()
    except Exception:  # no vLLM, or no device: not a FlashMLA GPU
        return None
    return None if capability is None else int(capability.major)


def _default_max_heads(compress_ratio: int = 4) -> int:
    major = _device_major()
    if major == 9:
        from dsv4_kernels.sparse_mla import wgmma_available

        # asked at every call: a Triton that cannot build the wgmma kernel is known
        # only after its first build fails, and from then on vLLM's prefill is faster
        if not wgmma_available():
            return 0
        return HOPPER_MAX_HEADS if compress_ratio == 4 else HOPPER_MAX_HEADS_SHARED_KEYS
    if major in FLASHMLA_MAJORS:
        return 0
    return 128


def max_heads(compress_ratio: int = 4) -> int:
    """Largest local head count that takes the head-exact prefill on layers of this
    compress ratio (4: C4A, the strictest; 1 and 128: SWA-only and C128A).

    ``DSV4_PREFILL_MAX_HEADS`` overrides the measured default for every layer type:
    on Hopper (with the Gluon wgmma kernel; 0 without it) 8 on C4A layers and 16 on
    SWA-only and C128A layers, 0 (off) on Blackwell, where vLLM's FlashMLA prefill is
    faster, and 128 (always) elsewhere.
    """
    raw = os.environ.get(ENV_MAX_HEADS, "")
    if not raw.strip():
        return _default_max_heads(4 if compress_ratio == 4 else 1)
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_MAX_HEADS} must be an integer, got {raw!r}") from exc
    return value


def short_rows_max_heads() -> int:
    """Largest local head count whose C4A layers take the head-exact prefill in steps
    with short rows (:data:`C4A_SHORT_ROWS_MEAN_KEYS`): 16 on Hopper with the Gluon
    wgmma kernel, 0 elsewhere and whenever ``DSV4_PREFILL_MAX_HEADS`` sets the limit."""
    if os.environ.get(ENV_MAX_HEADS, "").strip():
        return 0
    shared = _default_max_heads(1)
    return shared if shared == HOPPER_MAX_HEADS_SHARED_KEYS else 0


def _keys_upto(n: int, window: int, topk: int) -> int:
    """Valid keys of the C4A rows of positions ``0 .. n - 1`` together: position ``p``
    reads ``min(p + 1, window)`` window keys and ``min((p + 1) // 4, topk)`` compressed
    ones (its top-k, or every compressed entry while there are fewer)."""
    w = n * (n + 1) // 2 if n <= window else window * (window + 1) // 2 + (n - window) * window
    c = min(n, 4 * topk - 1)  # (m // 4) < topk for m <= c
    a, b = divmod(c, 4)
    comp = 2 * a * (a - 1) + (b + 1) * a + max(0, n - c) * topk
    return w + comp


def c4a_mean_keys(
    seq_lens: Sequence[int], query_lens: Sequence[int], window: int, topk: int
) -> float:
    """Mean valid keys per prefill token of a C4A layer for requests whose chunks end
    at ``seq_lens`` and hold ``query_lens`` tokens (0.0 for no tokens)."""
    tokens = sum(int(q) for q in query_lens)
    if tokens == 0:
        return 0.0
    total = sum(
        _keys_upto(int(s), window, topk) - _keys_upto(int(s) - int(q), window, topk)
        for s, q in zip(seq_lens, query_lens, strict=True)
    )
    return total / tokens


def _step_mean_keys(layer: Any, swa_metadata: Any) -> float:
    """:func:`c4a_mean_keys` of this step's prefills, from vLLM's host copies of the
    lengths (no device synchronisation), once per step and row shape; infinite when
    the metadata lacks them or the layer has no top-k buffer."""
    seq = getattr(swa_metadata, "prefill_seq_lens_cpu", None)
    qlen = getattr(swa_metadata, "prefill_query_lens_cpu", None)
    topk = getattr(layer, "topk_indices_buffer", None)
    if seq is None or qlen is None or topk is None:
        return float("inf")
    key = (int(layer.window_size), int(topk.shape[-1]))
    cache = _step(swa_metadata)["keys"]
    if key not in cache:
        cache[key] = c4a_mean_keys(seq.tolist(), qlen.tolist(), *key)
    return float(cache[key])


def use_head_exact(layer: Any, swa_metadata: Any) -> bool:
    """Whether this layer's prefill in this step takes the head-exact path: its local
    heads within :func:`max_heads` for its layer type, or a C4A layer within
    :func:`short_rows_max_heads` in a step whose rows are short."""
    ratio = int(layer.compress_ratio)
    if (
        ratio not in (1, 4, 128)
        or _switch(ENV_PREFILL_DISABLE)
        or getattr(swa_metadata, "prefill_left_visible", None) is not None
        or getattr(swa_metadata, "prefill_right_visible", None) is not None
    ):
        return False
    heads = int(layer.n_local_heads)
    if heads <= max_heads(ratio):
        return True
    return (
        ratio == 4
        and heads <= short_rows_max_heads()
        and _step_mean_keys(layer, swa_metadata) <= C4A_SHORT_ROWS_MEAN_KEYS
    )


def _step_plan(swa_metadata: Any, scratch: Any = None) -> Any:
    """The step's :class:`~dsv4_attention.prefill.PrefillPlan`, built by its first layer.

    Every attention layer of the step reuses it, whichever KV-cache group its
    metadata object belongs to, so the window and C128A rows the plan holds
    are built once per step and block table (the plan caches them per table).
    """
    from .prefill import PrefillPlan

    step = _step(swa_metadata)
    if step["plan"] is None:
        num_decodes = int(swa_metadata.num_decodes)
        num_prefills = int(swa_metadata.num_prefills)
        step["plan"] = PrefillPlan(
            swa_metadata.query_start_loc[num_decodes : num_decodes + num_prefills + 1],
            swa_metadata.prefill_seq_lens,
            num_tokens=int(swa_metadata.num_prefill_tokens),
            scratch=scratch,
        )
    return step["plan"]


def head_exact_prefill(
    layer: Any,
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor | None,
    swa_k_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: Any,
    swa_metadata: Any,
    scratch: Any = None,
) -> None:
    """vLLM's ``_forward_prefill`` inputs -> index rows -> attention on the real heads.

    ``q`` and ``output`` are the prefill tokens' ``[T, padded_heads, 512]``
    slices; only the first ``layer.n_local_heads`` heads are computed and
    written (vLLM drops the padded ones after attention).  With ``scratch`` every
    buffer of the step is a view of it (nothing allocated).
    """
    from .prefill import forward_prefill

    heads = int(layer.n_local_heads)
    ratio = int(layer.compress_ratio)
    num_decodes = int(swa_metadata.num_decodes)
    comp: dict[str, Any] = {}
    if ratio > 1:
        comp = {
            "comp_cache": compressed_k_cache,
            "comp_block_table": attn_metadata.block_table[num_decodes:],
            "comp_block_size": slots_per_page(ratio, int(attn_metadata.block_size)),
        }
        if ratio == 4:
            num_decode_tokens = int(swa_metadata.num_decode_tokens)
            comp["topk_indices"] = layer.topk_indices_buffer[num_decode_tokens:]
        else:
            comp["c128a_topk"] = int(attn_metadata.c128a_prefill_topk_indices.shape[-1])
    forward_prefill(
        q[:, :heads],
        _step_plan(swa_metadata, scratch),
        compress_ratio=ratio,
        scale=float(layer.scale),
        swa_cache=swa_k_cache,
        swa_block_table=swa_metadata.block_table[num_decodes:],
        swa_block_size=int(swa_metadata.block_size),
        attn_sink=layer.attn_sink[:heads],
        out=output[:, :heads],
        **comp,
    )


def _try_head_exact(
    layer: Any,
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor | None,
    swa_k_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: Any,
    swa_metadata: Any,
) -> bool:
    """Run the head-exact prefill where it applies; False: vLLM's own path must run."""
    from .scratch import ScratchTooSmall

    if not use_head_exact(layer, swa_metadata) or dual_batch_active():
        return False
    ratio = int(layer.compress_ratio)
    comp_slots = None if ratio == 1 else slots_per_page(ratio, int(attn_metadata.block_size))
    if not layout_ok(
        layer, swa_k_cache, compressed_k_cache, int(swa_metadata.block_size), comp_slots
    ):
        return False
    try:
        scratch = _scratch_for_step(layer, q)
    except AssertionError as exc:  # vLLM's locked workspace: nothing reserved in profiling
        return _refuse(f"no prefill scratch was reserved in vLLM's profile run ({exc})")
    try:
        head_exact_prefill(
            layer, q, compressed_k_cache, swa_k_cache, output, attn_metadata, swa_metadata, scratch
        )
    except ScratchTooSmall as exc:
        # nothing was written to ``output`` yet: the rows and the lse are taken first
        return _refuse(str(exc))
    return True


def make_head_exact_attention_cls(base: type) -> type:
    """A subclass of vLLM's ``DeepseekV4FlashMLAAttention`` with the head-exact prefill."""

    def _forward_prefill(
        self: Any,
        q: torch.Tensor,
        positions: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        swa_metadata: Any,
    ) -> None:
        if _try_head_exact(
            self, q, compressed_k_cache, swa_k_cache, output, attn_metadata, swa_metadata
        ):
            return
        base._forward_prefill(  # type: ignore[attr-defined]
            self,
            q=q,
            positions=positions,
            compressed_k_cache=compressed_k_cache,
            swa_k_cache=swa_k_cache,
            output=output,
            attn_metadata=attn_metadata,
            swa_metadata=swa_metadata,
        )

    module = sys.modules[base.__module__]

    def _forward_decode(
        self: Any,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata: Any,
        attn_metadata: Any,
        swa_only: bool,
        output: torch.Tensor,
    ) -> None:
        # vLLM's own global top-k mapping, looked up as vLLM's method looks it up
        global_topk = module.compute_global_topk_indices_and_lens
        if _try_head_exact_decode(
            self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output, global_topk
        ):
            return
        base._forward_decode(  # type: ignore[attr-defined]
            self,
            q=q,
            kv_cache=kv_cache,
            swa_metadata=swa_metadata,
            attn_metadata=attn_metadata,
            swa_only=swa_only,
            output=output,
        )

    def forward_mqa(
        self: Any, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor
    ) -> None:
        base.forward_mqa(self, q, kv, positions, output)  # type: ignore[attr-defined]
        ctx = _forward_context()
        if ctx is not None and getattr(ctx, "attn_metadata", None) is None:
            prepare_layer(self, q)  # vLLM's profile / dummy run
            prepare_decode(self, q)

    _forward_prefill.__doc__ = (
        "Head-exact sparse-MLA prefill from the FP8 pages where measured faster, else vLLM's own."
    )
    _forward_decode.__doc__ = (
        "Head-exact sparse FP8 decode where the H200 measured it faster, else vLLM's own."
    )
    forward_mqa.__doc__ = (
        "vLLM's forward_mqa; in its profile run also reserves the head-exact prefill's "
        "scratch and compiles its kernels."
    )
    return type(
        "Dsv4HeadExactFlashMLAAttention",
        (base,),
        {
            "__doc__": "vLLM's FlashMLA DSV4 attention with dsv4-attention's head-exact prefill.",
            "__module__": __name__,
            "_forward_prefill": _forward_prefill,
            "_forward_decode": _forward_decode,
            "forward_mqa": forward_mqa,
        },
    )


# The memory, guard and decode halves live in their own modules; their names stay
# importable from here (the plugin and the tests use them as vllm_backend.<name>).
from .vllm_decode import (  # noqa: E402
    _DECODE,
    _try_head_exact_decode,
    decode_enabled,
    head_exact_decode,
    prepare_decode,
    reserve_decode_scratch,
    use_head_exact_decode,
)
from .vllm_memory import (  # noqa: E402
    _SCRATCH,
    C128A_WIDTH_ALIGNMENT,
    DSV4_CACHE_DTYPES,
    WARMED,
    WINDOW_ROW_SETS,
    _refuse,
    _scratch_for_step,
    cache_layout_problem,
    could_take_head_exact,
    layer_scratch_spec,
    layout_ok,
    prepare_layer,
    reserve_scratch,
)

__all__ = [
    "C128A_WIDTH_ALIGNMENT",
    "DSV4_CACHE_DTYPES",
    "WARMED",
    "WINDOW_ROW_SETS",
    "_DECODE",
    "_SCRATCH",
    "_refuse",
    "_scratch_for_step",
    "_try_head_exact_decode",
    "cache_layout_problem",
    "configure_runtime",
    "could_take_head_exact",
    "decode_enabled",
    "head_exact_decode",
    "head_exact_prefill",
    "layer_scratch_spec",
    "layout_ok",
    "make_head_exact_attention_cls",
    "max_heads",
    "prepare_decode",
    "prepare_layer",
    "reserve_decode_scratch",
    "reserve_scratch",
    "short_rows_max_heads",
    "use_head_exact",
    "use_head_exact_decode",
]
