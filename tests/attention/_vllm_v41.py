"""DeepSeek-V4.1 layers, caches and steps built by vLLM's own code in this CPU process.

For the ``vllm`` tests of the plugin's DeepSeek-V4.1 support (``test_vllm_v41.py``).
What is vLLM's own here, and what stands in for what a CPU cannot run:

* **Layers.** vLLM's V4.1 ``DeepseekV4FlashMLAAttention.__init__`` itself (or that of
  the class the plugin's wrapped ``_select_dsv4_attn_cls`` returns, a subclass of
  it), called as vLLM's decoder layer calls it (``cls(vllm_config, prefix=...,
  topk_indices_buffer=...)``, one top-k buffer for the model), under vLLM's own
  tensor-parallel state at world size 1 (gloo).  That builds the real layer: its
  compress ratio and kv / index sources from the config, padded heads and sink, its
  window cache layer, compressors and indexers on the source layers, and (0.33)
  ``_prefill_num_heads``.  Stand-ins: the checkpoint's ``hf_config`` (a namespace
  with the fields vLLM's V4.1 code reads; a real one needs the checkpoint's files);
  the local heads are the model's heads at TP 1 (what one TP8 rank of a 64-, 128- or
  256-head model holds); vLLM's platform reports an SM90 GPU while the layers are
  built (``_prefill_num_heads``, the FP8 einsum recipe and the KV record read it);
  ``torch.cuda.Event`` (the layer makes four for its aux streams, which CPU torch
  cannot); ``attention_config.sparse_mla_prefill_workspace_factor`` is set as
  vLLM's post-init sets it once a model config is present (0.33).
* **Caches.** Each layer's own ``get_kv_cache_spec`` (window caches, kv-source
  compressed caches, indexer key caches, compressor state), vLLM's grouping
  (``kv_cache_utils`` in 0.32, ``kv_cache_planning`` in 0.33), its
  ``allocate_kv_cache`` (block-outer) and ``bind_kv_cache_to_layers``: every layer
  holds exactly the views vLLM binds (a consumer reads its source's cache through
  vLLM's ``_compressed_kv_cache``).  Off SM100 V4.1 keeps V4's 584-byte record; its
  window pages hold 32 tokens, its compressed pages ``256 / ratio`` entries.  The
  pages are filled with random keys by the reference FP8 encoder (vLLM's fused
  writers are CUDA ops).
* **Step metadata.** vLLM's ``DeepseekSparseSWAMetadata`` (one per window KV-cache
  group, each with its own block table) and V4.1's ``DeepseekV4FlashMLAMetadata``
  (one per compressed group, under the kv-source layers' prefixes), filled field by
  field as the builders fill them (their Triton kernels need CUDA): decode window
  rows as ``_compute_swa_indices_and_lens_kernel`` writes them, prefill gather
  lengths as ``_COMPUTE_PREFILL_METADATA_KERNEL`` computes them (both bounded below
  by the request's ``replay_start``), one empty ``FlashMLASchedMeta`` per layer type
  as ``build_tile_scheduler`` makes them.
* **vLLM's V4.1 ops.** ``vllm.models.deepseek_v41.common.ops.cache_utils`` (combine,
  gather, global top-k) staged unmodified from the installed vLLM beside the files
  ``benchmarks.support.vllm_peer`` stages, run through Triton's interpreter (vLLM's
  CPU build disables Triton).  FlashMLA (CUDA only) is answered by recorders that
  compute the pure-torch reference attention on what vLLM passes it.

Long on purpose (over 500 lines): the real V4.1 layers, caches, metadata and staged
ops of vLLM in one place, so the test modules stay about what they check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import dsv4_kernels as dk

# A V4.1 stack in miniature: a window-only layer, a full-length (ratio 1) kv + index
# source and a consumer reusing its cache and top-k, a ratio-2 source and its
# consumer, a window-only layer.
RATIOS = (0, 1, 1, 2, 2, 0)
SOURCES = (1, 3)
TOPK = 64  # the model's index_topk (the top-k buffer's width)
BUDGET = 24  # vLLM's max_num_batched_tokens (small: the warm-ups run within it)
MAX_MODEL_LEN = 4096
WINDOW = 128
PADDED = 64  # FlashMLA's padded query heads (up to 64 local heads)
V41 = "DeepseekV41ForCausalLM"


def layer_prefix(i: int) -> str:
    """vLLM's prefix of decoder layer ``i``'s attention."""
    return f"model.layers.{i}.attn"


def hf_config(heads: int, ratios: tuple[int, ...], sources: tuple[int, ...]) -> Any:
    """The checkpoint config's fields that vLLM's V4.1 attention, indexer and compressor
    read (small where the size is free: hidden size, LoRA ranks, indexer heads)."""
    return types.SimpleNamespace(
        hidden_size=64,
        num_attention_heads=heads,
        q_lora_rank=64,
        o_lora_rank=16,
        head_dim=512,
        qk_rope_head_dim=64,
        o_groups=8,
        sliding_window=WINDOW,
        compress_ratios=list(ratios),
        kv_source_layer_ids=list(sources),
        index_source_layer_ids=list(sources),
        num_hidden_layers=len(ratios),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default"},
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        max_position_embeddings=MAX_MODEL_LEN,
        index_topk=TOPK,
        index_n_heads=4,
        index_head_dim=128,
    )


def v41_config(
    heads: int = 8,
    ratios: tuple[int, ...] = RATIOS,
    sources: tuple[int, ...] = SOURCES,
    architectures: tuple[str, ...] = (V41,),
    bounded_replay: bool = False,
    budget: int = BUDGET,
    max_num_seqs: int = 8,
) -> Any:
    """vLLM's ``VllmConfig`` of a V4.1 deployment: vLLM's scheduler, cache and attention
    configs; the model config a stand-in with the fields vLLM reads.  SWA bounded replay
    (vLLM's default with model runner V2) is off unless ``bounded_replay`` (what bounds
    a request's window is the step's ``replay_start``, which the tests set).  ``budget``
    and ``max_num_seqs``: vLLM's ``max_num_batched_tokens`` and ``max_num_seqs``."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    scheduler = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        max_num_seqs=max_num_seqs,
    )
    cache = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla", swa_bounded_replay=bounded_replay)
    config = VllmConfig(scheduler_config=scheduler, cache_config=cache)
    config.model_config = types.SimpleNamespace(
        architectures=list(architectures),
        max_model_len=MAX_MODEL_LEN,
        hf_config=hf_config(heads, ratios, sources),
        dtype=torch.bfloat16,
        is_moe=False,
    )
    if hasattr(config.attention_config, "sparse_mla_prefill_workspace_factor"):
        # what vLLM's post-init resolves once a model config is set (0.33)
        config.attention_config.sparse_mla_prefill_workspace_factor = 5
    return config


@contextlib.contextmanager
def sm90_platform() -> Iterator[None]:
    """vLLM's platform reports an SM90 GPU (to what vLLM's own code asks it)."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability

    cls = type(vllm.platforms.current_platform)
    saved = cls.__dict__.get("get_device_capability")

    def capability(c: type, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(9, 0)

    cls.get_device_capability = classmethod(capability)  # type: ignore[method-assign,assignment,arg-type]
    try:
        yield
    finally:
        if saved is None:
            del cls.get_device_capability  # type: ignore[misc]
        else:
            cls.get_device_capability = saved  # type: ignore[method-assign]


class _Event:
    """Stands in for ``torch.cuda.Event`` while a layer is built (CPU torch has none)."""


@contextlib.contextmanager
def vllm_distributed() -> Iterator[None]:
    """vLLM's distributed state at world size 1 (gloo), as a single-GPU worker holds it;
    torn down afterwards."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with tempfile.TemporaryDirectory() as folder:
        with set_current_vllm_config(v41_config()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{folder}/init",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@dataclasses.dataclass
class Stack:
    """A V4.1 stack: vLLM's config, its layers (bound to vLLM's caches), the model's
    top-k buffer and the KV-cache group of every cache layer."""

    config: Any
    heads: int
    layers: list[Any]
    topk_buffer: torch.Tensor
    group_of: dict[str, int]

    @staticmethod
    def window_cache(layer: Any) -> torch.Tensor:
        return layer.swa_cache_layer.kv_cache

    @staticmethod
    def comp_cache(layer: Any) -> torch.Tensor | None:
        return None if layer.compress_ratio == 0 else layer._compressed_kv_cache()


def build_stack(
    cls: type,
    heads: int,
    ratios: tuple[int, ...] = RATIOS,
    sources: tuple[int, ...] = SOURCES,
    *,
    g: torch.Generator | None = None,
    config: Any = None,
    available_bytes: int = 24 << 20,
) -> Stack:
    """Build the layers with ``cls`` as vLLM's decoder layers do, allocate and bind their
    caches with vLLM's code, and (given ``g``) fill every page with random keys and the
    real heads' sink entries with random values (the padded ones stay -inf)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers

    from dsv4_attention.vllm_targets import installed_facts

    config = config if config is not None else v41_config(heads, ratios, sources)
    rows = int(config.scheduler_config.max_num_batched_tokens)  # vLLM's model buffer
    buffer = torch.full((rows, TOPK), -1, dtype=torch.int32)
    saved_event = torch.cuda.Event
    torch.cuda.Event = _Event  # type: ignore[misc,assignment]
    try:
        with set_current_vllm_config(config), sm90_platform():
            layers = [
                cls(config, prefix=layer_prefix(i), topk_indices_buffer=buffer)
                for i in range(len(ratios))
            ]
    finally:
        torch.cuda.Event = saved_event  # type: ignore[misc]
    context = config.compilation_config.static_forward_context
    specs = {}
    for name, module in context.items():
        spec = module.get_kv_cache_spec(config)
        if spec is not None:
            specs[name] = spec
    grouping = importlib.import_module(installed_facts().kv_cache_grouping_module)
    config.cache_config.kv_cache_layout = "BLHNC"
    with set_current_vllm_config(config):
        groups = grouping.get_kv_cache_groups(config, specs)
        kv_config = grouping.get_kv_cache_config_from_groups(config, groups, available_bytes)
        raw = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout["BLHNC"])
    bind_kv_cache_to_layers(raw, context)
    group_of = {n: i for i, grp in enumerate(kv_config.kv_cache_groups) for n in grp.layer_names}
    stack = Stack(config, heads, layers, buffer, group_of)
    if g is not None:
        fill(stack, g)
    return stack


def fill(stack: Stack, g: torch.Generator) -> None:
    """Random keys in every window and compressed page (FP8 records written by the
    reference encoder); random sinks for the real heads (the padded ones stay -inf)."""
    seen = set()
    for layer in stack.layers:
        for cache in (stack.window_cache(layer), stack.comp_cache(layer)):
            if cache is None or cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            n = cache.shape[0] * cache.shape[1]
            k = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
            dk.reference.quantize_and_insert_k_cache(k, cache, torch.arange(n), cache.shape[1])
        with torch.no_grad():
            layer.attn_sink.fill_(float("-inf"))
            layer.attn_sink[: stack.heads] = torch.randn(stack.heads, generator=g)


# --- one step's metadata, as vLLM's builders fill it --------------------------------


@dataclasses.dataclass
class Step:
    """One step: vLLM's per-layer metadata dict and what the reference needs."""

    metadata: dict[str, Any]  # vLLM's attn_metadata (cache layer name -> its group's)
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    positions: torch.Tensor  # [T] int64 positions of the step's tokens
    replay_start: list[int]
    # window metadata prefix -> the replay start its metadata was built from (where it
    # differs from the batch's: vLLM's decoder-side replay)
    layer_replay: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def replay_of(self, layer: Any) -> list[int]:
        """The replay start that bounds this layer's window (its metadata's)."""
        return self.layer_replay.get(layer.swa_cache_layer.prefix, self.replay_start)

    @property
    def total(self) -> int:
        return sum(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.query_lens[: self.num_decodes])

    def swa(self, layer: Any) -> Any:
        return self.metadata[layer.swa_cache_layer.prefix]

    def attn(self, layer: Any) -> Any:
        prefix = layer.compressed_cache_prefix
        return None if prefix is None else self.metadata[prefix]


def _block_table(g: torch.Generator, pages: int, per_page: int, seq: list[int]) -> torch.Tensor:
    """Distinct random pages for every request's positions (trailing entries 0)."""
    need = [-(-s // per_page) for s in seq]
    assert sum(need) <= pages, "cache too small for the batch"
    perm = torch.randperm(pages, generator=g)
    rows, start = [], 0
    for n in need:
        rows.append(torch.cat([perm[start : start + n], torch.zeros(max(need) + 2 - n)]))
        start += n
    return torch.stack(rows).to(torch.int32)


def make_step(
    stack: Stack,
    g: torch.Generator,
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    replay_start: list[int] | None = None,
    layer_replay: dict[int, list[int]] | None = None,
) -> Step:
    """vLLM's metadata of one step (decodes first): one ``DeepseekSparseSWAMetadata`` per
    window group, one V4.1 ``DeepseekV4FlashMLAMetadata`` per compressed group.
    ``replay_start``: per request, the first position with window KV (SWA bounded
    replay; zeros when nothing replays).  ``layer_replay``: layer index -> the replay
    start that layer's window metadata is built from instead (vLLM's decoder-side
    replay builds the first replay layer's from the batch's and every later one's from
    ``max(replay_start, seq - window)``, in one forward context); each such layer must
    be the only one of its window group."""
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
    from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta

    replay = list(replay_start or [0] * len(query_lens))
    qlen = torch.tensor(query_lens, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlen.cumsum(0).to(torch.int32)])
    total = int(qsl[-1])
    T = int(qsl[num_decodes])
    req = torch.arange(len(query_lens)).repeat_interleave(qlen)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    by_group: dict[int, Any] = {}
    metadata: dict[str, Any] = {}
    own = {stack.layers[i].swa_cache_layer.prefix: list(r) for i, r in (layer_replay or {}).items()}
    for layer in stack.layers:
        name = layer.swa_cache_layer.prefix
        group = stack.group_of[name]
        rs = torch.tensor(own.get(name, replay), dtype=torch.int32)
        if name in own:
            alone = [n for n, grp in stack.group_of.items() if grp == group]
            assert alone == [name], f"{name} shares its window group: {alone}"
        if group not in by_group:
            cache = stack.window_cache(layer)
            block = cache.shape[1]
            table = _block_table(g, cache.shape[0], block, seq_lens)
            # _compute_swa_indices_and_lens_kernel: each decode token's window, from
            # max(p - W + 1, replay_start) to p, as slots; then -1
            p = pos[:T]
            start = torch.maximum((p - (WINDOW - 1)).clamp(min=0), rs[req[:T]])
            lens = (p + 1 - start).to(torch.int32)
            cols = torch.arange(WINDOW)
            at = (start[:, None] + cols[None, :]).clamp(max=p[:, None])
            slots = table[req[:T, None], at // block].long() * block + at % block
            indices = torch.where(cols[None, :] < lens[:, None], slots, -1).to(torch.int32)
            md = DeepseekSparseSWAMetadata(
                block_table=table,
                slot_mapping=torch.zeros(total, dtype=torch.int64),
                block_size=block,
                seq_lens=seq.clone(),
                query_start_loc=qsl.clone(),
                query_start_loc_cpu=qsl.clone(),
                is_valid_token=torch.ones(total, dtype=torch.bool),
                token_to_req_indices=req.to(torch.int32),
                decode_swa_indices=indices[:, None, :],
                decode_swa_lens=lens,
                decode_swa_width=WINDOW,
                replay_start=rs.clone(),
                num_decodes=num_decodes,
                num_prefills=len(query_lens) - num_decodes,
                num_decode_tokens=T,
                num_prefill_tokens=total - T,
                max_decode_query_len=max(query_lens[:num_decodes], default=1),
            )
            if total > T:  # _build_deepseek_v4_metadata (gather lengths bounded by replay)
                visible = (seq - qlen - rs).clamp(min=0)
                md.prefill_seq_lens = seq[num_decodes:]
                md.prefill_seq_lens_cpu = seq[num_decodes:].clone()
                md.prefill_gather_lens = (qlen + visible.clamp(max=WINDOW - 1))[num_decodes:].to(
                    torch.int32
                )
                md.prefill_query_lens_cpu = qlen[num_decodes:].clone()
                md.prefill_window_size = WINDOW
                md.prefill_max_model_len = MAX_MODEL_LEN
                md.prefill_max_num_batched_tokens = BUDGET
            if T:  # build_tile_scheduler: one empty plan holder per V4.1 layer type
                md.tile_sched_swaonly = FlashMLASchedMeta()
                md.tile_sched_c1a = FlashMLASchedMeta()
                md.tile_sched_c2a = FlashMLASchedMeta()
            by_group[group] = md
        metadata[name] = by_group[group]
    for layer in stack.layers:
        if not layer.is_kv_source:
            continue
        group = stack.group_of[layer.prefix]
        if group not in by_group:
            cache = stack.comp_cache(layer)
            assert cache is not None
            by_group[group] = DeepseekV4FlashMLAMetadata(
                num_reqs=len(query_lens),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                num_actual_tokens=total,
                query_start_loc=qsl.clone(),
                slot_mapping=torch.zeros(total, dtype=torch.int64),
                block_table=_block_table(g, cache.shape[0], 256, seq_lens),
                req_id_per_token=req.to(torch.int32),
                block_size=256,
                topk_tokens=TOPK,
            )
        metadata[layer.prefix] = by_group[group]
    return Step(metadata, list(query_lens), list(seq_lens), num_decodes, pos, replay, own)


def fill_topk(stack: Stack, step: Step, ratio: int, g: torch.Generator) -> None:
    """What an index-source layer's indexer leaves in the model's top-k buffer for the
    step (its consumers read the same rows): for the token at position ``p``,
    ``min((p + 1) // ratio, topk)`` distinct random request-local entries, then -1."""
    buf = stack.topk_buffer.fill_(-1)
    for t, p in enumerate(step.positions.tolist()):
        avail = (p + 1) // ratio
        k = min(TOPK, avail)
        if k:
            buf[t, :k] = torch.randperm(avail, generator=g)[:k].to(torch.int32)


# --- the reference -------------------------------------------------------------------


def reference_rows(
    layer: Any, step: Step, topk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every token's keys as global cache slots, spelled out from vLLM's metadata and the
    top-k rows the layer read (``topk``): the window slots of positions
    ``max(p - W + 1, replay_start) .. p`` through the window block table; for ratio
    r > 0 the first ``min((p + 1) // r, topk)`` top-k entries (the ``topk_len`` of
    vLLM's combine kernel) through the compressed block table (``256 / r`` entries a
    page).  (window, lens, comp, lens)."""
    swa, attn = step.swa(layer), step.attn(layer)
    req = [b for b, n in enumerate(step.query_lens) for _ in range(n)]
    first = [0]
    for n in step.query_lens:
        first.append(first[-1] + n)
    wblock = int(swa.block_size)
    n_tok = step.total
    window = torch.full((n_tok, WINDOW), -1, dtype=torch.int32)
    wlens = torch.zeros(n_tok, dtype=torch.int32)
    r = layer.compress_ratio
    comp = torch.full((n_tok, TOPK), -1, dtype=torch.int32) if r else None
    comp_lens = torch.zeros(n_tok, dtype=torch.int32) if r else None
    for t in range(n_tok):
        b = req[t]
        p = step.seq_lens[b] - step.query_lens[b] + (t - first[b])
        ps = range(max(p - WINDOW + 1, step.replay_of(layer)[b], 0), p + 1)
        window[t, : len(ps)] = torch.tensor(
            [int(swa.block_table[b, x // wblock]) * wblock + x % wblock for x in ps]
        )
        wlens[t] = len(ps)
        if r:
            assert comp is not None and comp_lens is not None
            cblock = int(attn.block_size) // r
            n = min((p + 1) // r, TOPK)
            local = topk[t, :n].tolist()
            if n:
                comp[t, :n] = torch.tensor(
                    [int(attn.block_table[b, e // cblock]) * cblock + e % cblock for e in local],
                    dtype=torch.int32,
                )
            comp_lens[t] = n
    return window, wlens, comp, comp_lens


def reference_attention(
    layer: Any, step: Step, q: torch.Tensor, heads: int, topk: torch.Tensor
) -> torch.Tensor:
    """The pure-torch attention of every token of the step on the first ``heads`` heads
    over exactly :func:`reference_rows`' slots (``dsv4_kernels.reference``: dequantises
    those slots, float32, sink)."""
    window, wlens, comp, comp_lens = reference_rows(layer, step, topk)
    comp_kw: dict[str, Any] = {}
    if comp is not None:
        cache = layer._compressed_kv_cache()
        comp_kw = dict(
            comp_cache=cache,
            comp_indices=comp,
            comp_lens=comp_lens,
            comp_block_size=cache.shape[1],
        )
    wcache = layer.swa_cache_layer.kv_cache
    out, _ = dk.reference.sparse_mla_paged(
        q[:, :heads],
        wcache,
        window,
        wlens,
        float(layer.scale),
        swa_block_size=wcache.shape[1],
        attn_sink=layer.attn_sink[:heads],
        **comp_kw,
    )
    return out


# --- vLLM's own V4.1 ops, staged; FlashMLA answered by recorders -----------------------


def staged_v41_ops(folder: Path) -> types.ModuleType:
    """vLLM's V4.1 ``cache_utils`` (combine, gather, global top-k), staged from the
    installed vLLM into the tree ``benchmarks.support.vllm_peer`` stages (the one this
    process already imported, if any), run through Triton's interpreter."""
    from benchmarks.support import vllm_peer

    vllm_peer.load(vllm_peer.stage(folder).parent)
    root = Path(next(iter(sys.modules[vllm_peer.PACKAGE].__path__)))
    vllm_root = Path(importlib.import_module("vllm").__file__ or "").parent
    rel = Path("models/deepseek_v41/common/ops/cache_utils.py")
    dest = root / rel
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = (vllm_root / rel).read_text()
        dest.write_text(
            vllm_peer.IMPORT.sub(lambda m: f"{m.group(1)} {vllm_peer.PACKAGE}{m.group(2)}", text)
        )
        for package in (dest.parent, dest.parent.parent, dest.parent.parent.parent):
            (package / "__init__.py").touch(exist_ok=True)
    platforms = importlib.import_module(f"{vllm_peer.PACKAGE}.platforms")
    # the staged platform shim answers what V4's kernels ask; V4.1's gather also asks
    # whether the platform is ROCm (it is not)
    if not hasattr(platforms.current_platform, "is_rocm"):
        platforms.current_platform.is_rocm = lambda: False
    return importlib.import_module(
        f"{vllm_peer.PACKAGE}.models.deepseek_v41.common.ops.cache_utils"
    )


@dataclasses.dataclass
class FlashMLACalls:
    """What vLLM's V4.1 methods passed to FlashMLA (``prefill``: ``flash_mla_sparse_fwd``,
    ``decode``: ``flash_mla_with_kvcache``), keyword arguments as given."""

    prefill: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    decode: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    raise_at: int | None = None  # the prefill stand-in raises for calls at these heads


def flashmla_recorders(calls: FlashMLACalls) -> dict[str, Any]:
    """Stand-ins for FlashMLA's sparse prefill and decode (CUDA only): each records its
    arguments and writes the pure-torch reference attention of exactly what it is
    given into ``out`` (on every head it is given, as FlashMLA does); the prefill raises
    instead, after recording, for a call at ``calls.raise_at`` query heads."""

    def flash_mla_sparse_fwd(
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> Any:
        calls.prefill.append(
            dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                 topk_length=topk_length, out=out)
        )  # fmt: skip
        if calls.raise_at is not None and q.shape[1] == calls.raise_at:
            raise RuntimeError(f"no kernel for {q.shape[1]} heads")
        got, lse = dk.reference.sparse_mla_workspace(
            q, kv, indices.squeeze(1), topk_length, sm_scale, attn_sink=attn_sink
        )
        assert out is not None
        out.copy_(got)
        return out, lse

    def flash_mla_with_kvcache(**kw: Any) -> Any:
        calls.decode.append(kw)
        comp: dict[str, Any] = {}
        extra = kw.get("extra_k_cache")
        if extra is not None:
            comp = dict(
                comp_cache=extra[:, :, 0],
                comp_indices=kw["extra_indices_in_kvcache"][:, 0],
                comp_lens=kw["extra_topk_length"],
                comp_block_size=extra.shape[1],
            )
        cache = kw["k_cache"]
        got, lse = dk.reference.sparse_mla_paged(
            kw["q"][:, 0],
            cache[:, :, 0],
            kw["indices"][:, 0],
            kw["topk_length"],
            kw["softmax_scale"],
            swa_block_size=cache.shape[1],
            attn_sink=kw["attn_sink"],
            **comp,
        )
        kw["out"][:, 0].copy_(got)
        return kw["out"], lse

    return {
        "flash_mla_sparse_fwd": flash_mla_sparse_fwd,
        "flash_mla_with_kvcache": flash_mla_with_kvcache,
    }


# --- the plugin, active for a V4.1 model in this process -------------------------------


class FakeHopper:
    """vLLM's platform as a CUDA SM90 GPU, for vLLM's V4.1 selector (anything else: the
    real platform's answer)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def is_cuda(self) -> bool:
        return True

    def get_device_capability(self, device_id: int = 0) -> Any:
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(9, 0)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return capability // 10 == 9

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def plugin_v41_class(config: Any, env: dict[str, str] | None = None) -> Iterator[type]:
    """Register the plugin afresh under vLLM's current config ``config`` (with
    ``DSV4_KERNELS_FORCE=1``: this CPU platform decides as on the H200; plus ``env``)
    while vLLM's V4.1 package is imported (its trigger is installed then), and yield
    what vLLM's V4.1 selector returns for ``config`` on an SM90 GPU (its first call is
    the plugin's start-up decision); the plugin is unregistered at the end."""
    import vllm.models.deepseek_v41  # noqa: F401  (the package vLLM imports for V4.1)
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.nvidia import model

    from dsv4_attention import plugin

    plugin.unregister()
    names = {"DSV4_KERNELS_FORCE": "1", **(env or {})}
    saved_env = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    saved = model.current_platform
    try:
        with set_current_vllm_config(config):
            plugin.register()
        model.current_platform = FakeHopper(saved)
        cls = model._select_dsv4_attn_cls(config)
    finally:
        model.current_platform = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield cls
    finally:
        plugin.unregister()
