"""What the plugin knows of the served configuration and of each layer: read once, typed.

:class:`ServingConfig` is read from vLLM's ``VllmConfig`` once, when vLLM first
builds a DeepSeek-V4 attention layer; :class:`LayerFacts` once per layer, from
the layer and the serving config.  Every later decision (``policy``) and every
size (``runtime``) is a function of these values: nothing re-reads vLLM's
objects for a fact it already has.

Nothing here imports vLLM at module level; :func:`read_serving_config` calls
vLLM's own helpers (``get_dspark_swa_index_width``, ``max_decode_query_len``)
where they exist, so a width vLLM computes is never re-derived here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dsv4_kernels.geometry import (
    FAMILY_ROW_KINDS,
    KV_BLOCK_SIZE,
    WINDOW_SIZE,
    RowKind,
    slots_per_page,
)

from .vllm_targets import V41_ARCHITECTURES

__all__ = [
    "C128A_WIDTH_ALIGNMENT",
    "IndexerFacts",
    "LayerFacts",
    "ServingConfig",
    "read_serving_config",
]

# vLLM rounds its C128A row width up to a multiple of this (``_C128A_TOPK_ALIGNMENT``)
C128A_WIDTH_ALIGNMENT = 128
# Layer kinds by model family and vLLM's ``compress_ratio`` (their names, for the log
# and the measured tables): DeepSeek-V4 marks its window-only layers 1; DeepSeek-V4.1
# marks them 0 and its full-length compressed layers 1.  What rows each reads is
# ``dsv4_kernels.geometry.FAMILY_ROW_KINDS``, the one rule from ratio to rows.
KINDS = {
    "v4": {1: "swa", 4: "c4a", 128: "c128a"},
    "v41": {0: "swa", 1: "c1a", 2: "c2a"},
}
assert {f: set(k) for f, k in KINDS.items()} == {f: set(k) for f, k in FAMILY_ROW_KINDS.items()}, (
    "a layer kind without its rows"
)
FAMILY_RATIOS = {family: tuple(kinds) for family, kinds in KINDS.items()}
TOPK_KINDS = tuple(
    KINDS[f][r]
    for f, rows in FAMILY_ROW_KINDS.items()
    for r, k in rows.items()
    if k is RowKind.TOPK
)
KIND_TEXT = {
    "swa": "SWA-only",
    "c4a": "C4A",
    "c128a": "C128A",
    "c1a": "V4.1 full-length (ratio 1)",
    "c2a": "V4.1 ratio-2",
}


def family_of(architectures: tuple[str, ...]) -> str:
    """``"v41"`` for a DeepSeek-V4.1 model, else ``"v4"``."""
    return "v41" if set(architectures) & set(V41_ARCHITECTURES) else "v4"


def c128a_width(max_model_len: int) -> int:
    """vLLM's widest C128A row: one entry per 128 tokens, rounded up to its alignment."""
    entries = -(-int(max_model_len) // 128)
    return -(-entries // C128A_WIDTH_ALIGNMENT) * C128A_WIDTH_ALIGNMENT


@dataclass(frozen=True)
class ServingConfig:
    """The served configuration, as far as DSV4 attention is concerned.

    Attributes:
        architectures: the model's architectures (``DeepseekV4ForCausalLM``).
        max_num_batched_tokens: the token budget of one step (None: not known).
        max_model_len: the longest context (None: not known).
        spec_method: ``"mtp"``, ``"dspark"``, another method, or None.
        num_speculative_tokens: k of the drafter (0 without one).
        decode_window_width: the widest window row of vLLM's decode metadata: the
            window, or DSpark's non-causal width ``round_up(window + k, 64)``.
        max_decode_query_len: tokens of the widest request vLLM treats as a decode.
        cudagraph_mode: vLLM's CUDA-graph mode by name (``FULL_AND_PIECEWISE``...).
        dbo: whether dual-batch overlap is enabled.
        index_topk: the model's indexer top-k (0: not known).
        family: ``"v4"`` (DeepSeek-V4) or ``"v41"`` (DeepSeek-V4.1): which vLLM class
            the layers are (the plugin sets it from the selector that was called).
        native_prefill: whether vLLM's bundled FlashMLA runs the sparse prefill at the
            real heads on this GPU (vLLM 0.33 on SM90: 8, 16 or 32 heads).
        kv_cache_memory_bytes: ``--kv-cache-memory-bytes`` where given (vLLM then sizes
            the KV cache without its memory profile, so our scratch is not counted).
        dcp: vLLM's decode context parallel size (1: off).
        max_num_seqs: the most requests in one step (None: not known).
        tp: vLLM's tensor parallel size (the ranks that replicate the indexer).
    """

    architectures: tuple[str, ...] = ()
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    spec_method: str | None = None
    num_speculative_tokens: int = 0
    decode_window_width: int = WINDOW_SIZE
    max_decode_query_len: int = 1
    cudagraph_mode: str = "NONE"
    dbo: bool = False
    index_topk: int = 0
    family: str = "v4"
    native_prefill: bool = False
    kv_cache_memory_bytes: int | None = None
    dcp: int = 1
    max_num_seqs: int | None = None
    tp: int = 1

    @property
    def max_decode_rows(self) -> int:
        """The most query rows one decode step can hold: every request at its widest
        decode (MTP/DSpark rows included), within the token budget (0: not known)."""
        budget = self.max_num_batched_tokens or 0
        if self.max_num_seqs is None:
            return budget
        return min(budget, self.max_num_seqs * self.max_decode_query_len)

    @property
    def model_text(self) -> str:
        return "/".join(self.architectures) or "a DeepSeek-V4 model"


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def read_serving_config(vllm_config: Any) -> ServingConfig:
    """The :class:`ServingConfig` of vLLM's ``VllmConfig`` (fields vLLM has not set stay
    unknown; an unknown field is never guessed)."""
    model = _get(vllm_config, "model_config")
    hf = _get(model, "hf_config")
    window = int(_get(hf, "sliding_window", default=WINDOW_SIZE) or WINDOW_SIZE)
    spec = _get(vllm_config, "speculative_config")
    k = int(_get(spec, "num_speculative_tokens", default=0) or 0)
    method = _get(spec, "method")
    use_dspark = getattr(spec, "use_dspark", None)
    is_dspark = bool(use_dspark()) if callable(use_dspark) else method == "dspark"
    width = window
    if is_dspark:
        utils = importlib.import_module("vllm.v1.attention.backends.mla.compressor_utils")
        width = max(window, int(utils.get_dspark_swa_index_width(window, k)))
    decode_len = 1 + k
    if vllm_config is not None and spec is not None:
        backend = importlib.import_module("vllm.v1.attention.backend")
        decode_len = int(backend.max_decode_query_len(vllm_config))
    mode = _get(vllm_config, "compilation_config", "cudagraph_mode")
    tokens = _get(vllm_config, "scheduler_config", "max_num_batched_tokens")
    # the model's, as resolved; the scheduler holds the same value (and the only one
    # where no model config is set)
    length = _get(model, "max_model_len") or _get(vllm_config, "scheduler_config", "max_model_len")
    architectures = tuple(_get(model, "architectures", default=()) or ())
    kv_bytes = _get(vllm_config, "cache_config", "kv_cache_memory_bytes")
    dcp = _get(vllm_config, "parallel_config", "decode_context_parallel_size", default=1)
    seqs = _get(vllm_config, "scheduler_config", "max_num_seqs")
    tp = _get(vllm_config, "parallel_config", "tensor_parallel_size", default=1)
    return ServingConfig(
        architectures=architectures,
        max_num_batched_tokens=None if tokens is None else int(tokens),
        max_model_len=None if length is None else int(length),
        spec_method=None if spec is None else ("dspark" if is_dspark else str(method)),
        num_speculative_tokens=k,
        decode_window_width=width,
        max_decode_query_len=decode_len,
        cudagraph_mode="NONE" if mode is None else str(getattr(mode, "name", mode)),
        dbo=bool(_get(vllm_config, "parallel_config", "enable_dbo", default=False)),
        index_topk=int(_get(hf, "index_topk", default=0) or 0),
        family=family_of(architectures),
        kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes),
        dcp=int(dcp or 1),
        max_num_seqs=None if seqs is None else int(seqs),
        tp=int(tp or 1),
    )


@dataclass(frozen=True)
class LayerFacts:
    """One attention layer, read once.

    Attributes:
        name: vLLM's prefix of the layer.
        compress_ratio: vLLM's ratio: DeepSeek-V4 1 (SWA-only), 4 (C4A) or 128
            (C128A); DeepSeek-V4.1 0 (SWA-only), 1 or 2 (top-k rows over a
            full-length or ratio-2 compressed cache); another value is a layer kind
            the plugin does not know (it keeps vLLM's path).
        heads: local query heads (vLLM pads them to 64 or 128 for FlashMLA).
        window: sliding window W.
        topk: the C4A rows' width (the indexer's top-k buffer), 0 without one.
        c128a_width: the widest C128A row (from ``max_model_len``).
        max_tokens: the batched-token budget (largest step).
        decode_window_width: the widest window row a decode step can carry
            (DSpark's drafter rows are wider than the window).
        kv_cache_dtype: vLLM's cache dtype name.
        family: ``"v4"`` or ``"v41"`` (the model family; it gives the ratio's kind).
        pcp: whether vLLM runs prefill context parallelism on the layer.
        dcp: vLLM's decode context parallel size (1: off; above 1 vLLM keeps the layer).
        padded_heads: the heads vLLM pads the queries to (64 or 128).
        vllm_prefill_heads: the heads vLLM's own prefill computes (its V4.1 class
            on SM90 runs the real 8, 16 or 32: ``_prefill_num_heads``; else padded).
        native_prefill: whether vLLM's bundled FlashMLA can run the sparse prefill at
            the real heads here (vLLM 0.33 on SM90), for V4 layers too.
    """

    name: str
    compress_ratio: int
    heads: int
    window: int
    topk: int
    c128a_width: int
    max_tokens: int
    decode_window_width: int
    kv_cache_dtype: str | None = None
    family: str = "v4"
    pcp: bool = False
    dcp: int = 1
    padded_heads: int = 64
    vllm_prefill_heads: int = 64
    native_prefill: bool = False

    @property
    def vllm_native(self) -> bool:
        """Whether vLLM's own prefill of this layer already runs at the real heads."""
        return self.vllm_prefill_heads == self.heads < self.padded_heads

    @property
    def kind(self) -> str | None:
        """``"swa"``, ``"c4a"``, ``"c128a"`` (V4), ``"swa"``, ``"c1a"``, ``"c2a"`` (V4.1),
        or None for a ratio the plugin does not know."""
        return KINDS.get(self.family, {}).get(self.compress_ratio)

    @property
    def rows(self) -> RowKind | None:
        """What the layer's index rows hold after its window (None: an unknown ratio)."""
        return FAMILY_ROW_KINDS.get(self.family, {}).get(self.compress_ratio)

    @property
    def compressed(self) -> bool:
        """Whether the layer reads a compressed cache (top-k rows or every entry)."""
        return self.rows is not None and self.rows.compressed

    @property
    def topk_rows(self) -> bool:
        """Whether the layer reads the indexer's top-k rows (C4A, V4.1's compressed)."""
        return self.rows is RowKind.TOPK

    @property
    def kernel_ratio(self) -> int:
        """The ``compress_ratio`` our kernels are given: 1 for window-only layers (V4.1's
        0), else vLLM's (a ratio-1 layer with top-k rows is compressed)."""
        return 1 if self.rows is RowKind.WINDOW else self.compress_ratio

    @property
    def kind_text(self) -> str:
        return KIND_TEXT.get(self.kind or "", f"compress-ratio-{self.compress_ratio}")

    @property
    def comp_width(self) -> int:
        """Columns of the compressed part of a row (0 for SWA-only layers)."""
        if self.topk_rows:
            return self.topk
        return self.c128a_width if self.rows is RowKind.ALL else 0

    @property
    def comp_page_slots(self) -> int | None:
        """Compressed entries per cache page (None for SWA-only layers)."""
        if self.rows is None or not self.rows.compressed:
            return None
        return slots_per_page(self.kernel_ratio, KV_BLOCK_SIZE)

    @property
    def decode_row_width(self) -> int:
        """The widest decode row: widest window part plus the compressed part."""
        return self.decode_window_width + self.comp_width

    @classmethod
    def read(cls, layer: Any, serving: ServingConfig) -> LayerFacts:
        """The facts of ``layer`` (vLLM's DSV4 attention layer) under ``serving``."""
        topk_buffer = getattr(layer, "topk_indices_buffer", None)
        # the layer holds vLLM's values (read from the same config when it was built)
        max_model_len = getattr(layer, "max_model_len", None) or serving.max_model_len
        tokens = getattr(layer, "max_num_batched_tokens", None) or serving.max_num_batched_tokens
        if max_model_len is None or tokens is None:
            raise ValueError(
                f"{getattr(layer, 'prefix', 'the layer')}: neither the layer nor vLLM's config "
                "gives max_model_len and max_num_batched_tokens"
            )
        window = int(layer.window_size)
        dtype = getattr(layer, "kv_cache_dtype", None)
        heads = int(layer.n_local_heads)
        padded = int(getattr(layer, "padded_heads", None) or max(64, heads))
        return cls(
            name=str(getattr(layer, "prefix", "a DSV4 attention layer")),
            compress_ratio=int(layer.compress_ratio),
            heads=heads,
            window=window,
            topk=0 if topk_buffer is None else int(topk_buffer.shape[-1]),
            c128a_width=c128a_width(int(max_model_len)),
            max_tokens=int(tokens),
            decode_window_width=max(window, serving.decode_window_width),
            kv_cache_dtype=None if dtype is None else str(dtype),
            family=serving.family,
            pcp=bool(getattr(layer, "use_pcp", False)),
            dcp=serving.dcp,
            padded_heads=padded,
            vllm_prefill_heads=int(getattr(layer, "_prefill_num_heads", None) or padded),
            native_prefill=serving.native_prefill,
        )


@dataclass(frozen=True)
class IndexerFacts:
    """One lightning indexer (vLLM's ``DeepseekV4Indexer`` of a C4A layer), read once.

    Attributes:
        name: vLLM's prefix of its key cache (the key of its metadata).
        compress_ratio: the ratio of its compressed keys (4 on V4's C4A layers).
        heads: index heads (``index_n_heads``: 64 on V4, 32 on V4.1-Flash).
        head_dim: index head width (128).
        topk: entries selected per row (``index_topk``).
        max_entries: vLLM's widest row of scores (``max_model_len // ratio``).
        page_entries: compressed entries per index-cache page (block size / ratio).
        buffer_width: the width of vLLM's top-k buffer the indexer writes.
        fp4: whether vLLM keeps an MXFP4 index cache (``indexer_kv_dtype=mxfp4``).
        candidates: whether the indexer runs V4.1's two-level candidate selection.
        dcp: vLLM's decode context parallel size.
        max_rows: the most query rows of a decode step (the scores scratch's rows).
        family: ``"v4"`` or ``"v41"``.
    """

    name: str
    compress_ratio: int
    heads: int
    head_dim: int
    topk: int
    max_entries: int
    page_entries: int
    buffer_width: int
    fp4: bool = False
    candidates: bool = False
    dcp: int = 1
    max_rows: int = 0
    family: str = "v4"

    @property
    def key(self) -> tuple[int, int, int]:
        """What makes two indexers one kind: (ratio, heads, top-k)."""
        return (self.compress_ratio, self.heads, self.topk)

    @property
    def scores_bytes(self) -> int:
        """The float32 scores scratch a step of ``max_rows`` rows needs."""
        return 4 * self.max_rows * max(self.max_entries, 1)

    @classmethod
    def read(cls, indexer: Any, serving: ServingConfig) -> IndexerFacts:
        """The facts of vLLM's indexer module ``indexer`` (its ``indexer_op`` the
        ``SparseAttnIndexer`` it calls) under ``serving``."""
        op = indexer.indexer_op
        ratio = int(getattr(indexer, "compress_ratio", getattr(op, "compress_ratio", 1)))
        block = int(getattr(getattr(op.k_cache, "cache_config", None), "block_size", 0) or 0)
        buffer = op.topk_indices_buffer
        return cls(
            name=str(op.k_cache.prefix),
            compress_ratio=ratio,
            heads=int(indexer.n_head),
            head_dim=int(op.head_dim),
            topk=int(op.topk_tokens),
            max_entries=int(op.max_model_len),
            page_entries=block // max(ratio, 1),
            buffer_width=0 if buffer is None else int(buffer.shape[-1]),
            fp4=bool(getattr(op, "use_fp4_cache", False)),
            candidates=getattr(op, "candidate_blocks", None) is not None,
            dcp=serving.dcp,
            max_rows=serving.max_decode_rows,
            family=serving.family,
        )
