"""DSV4 KV-cache views built by vLLM's own allocation code (for the ``vllm`` tests).

The layer specs come from vLLM's own ``get_kv_cache_spec`` methods of the DSV4
window cache, the compressed (C4A, C128A) attention caches and the C4A
indexer cache; grouping, block sizing and the per-layer views come from
vLLM's grouping module (``kv_cache_utils`` in 0.32, ``kv_cache_planning`` in
0.33: the release facts of ``dsv4_attention.vllm_targets`` say which) and
``vllm.v1.worker.utils.allocate_kv_cache``
under one of the block-outer layouts vLLM's DSV4 backends declare; each view
is then bound the way the layer binds it (``squeeze(1)``).  Nothing here
spells a stride.
"""

from __future__ import annotations

import dataclasses
import importlib
import types

import torch

# A DSV4 stack in miniature: compress ratio of each attention layer
# (V4-Flash starts with SWA-only layers, then alternates C4A and C128A).
RATIOS = (1, 4, 128, 4, 128)
LAYOUTS = ("BLHNC", "BLNHC")
INDEXER_HEAD_BYTES = 132  # vLLM's FP8 indexer cache: 128 fp8 + 4 fp32 scale bytes


@dataclasses.dataclass
class CacheView:
    """One layer's cache as the layer holds it, and what it is."""

    name: str
    kind: str  # "window", "c4a", "c128a" or "indexer"
    view: torch.Tensor  # [num_blocks, slots, bytes] uint8
    slots: int  # tokens or compressed entries per page
    group: int = -1  # index of the KV-cache group vLLM put the layer in


def vllm_dsv4_caches(
    layout: str, available_bytes: int = 24 << 20, ratios: tuple[int, ...] = RATIOS
) -> tuple[list[CacheView], torch.Tensor]:
    """Every layer's cache view (in ``ratios``' layer order, layer ``i`` with compress
    ratio ``ratios[i]``), and the one backing buffer vLLM allocated."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from dsv4_attention.vllm_targets import installed_facts

    facts = installed_facts()
    grouping = importlib.import_module(facts.kv_cache_grouping_module)
    allocate_kv_cache = importlib.import_module(facts.allocate_kv_cache_module).allocate_kv_cache

    cache_config = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla")
    config = VllmConfig(cache_config=cache_config)
    cache_config.kv_cache_layout = layout
    specs = {}
    kinds = {}
    with set_current_vllm_config(config):
        for i, ratio in enumerate(ratios):
            swa = DeepseekV4SWACache(
                head_dim=512,
                window_size=128,
                dtype=torch.uint8,
                prefix=f"layers.{i}.swa_cache",
                cache_config=cache_config,
            )
            specs[swa.prefix], kinds[swa.prefix] = swa.get_kv_cache_spec(config), "window"
            if ratio == 1:
                continue
            layer = types.SimpleNamespace(
                compress_ratio=ratio,
                head_dim=512,
                kv_cache_dtype="fp8_ds_mla",
                kv_cache_torch_dtype=torch.uint8,
            )
            name = f"layers.{i}.attn"
            specs[name] = DeepseekV4Attention.get_kv_cache_spec(layer, config)  # type: ignore[arg-type]
            kinds[name] = "c4a" if ratio == 4 else "c128a"
            if ratio == 4:
                indexer = DeepseekV4IndexerCache(
                    head_dim=INDEXER_HEAD_BYTES,
                    dtype=torch.uint8,
                    prefix=f"layers.{i}.indexer.k_cache",
                    cache_config=cache_config,
                    compress_ratio=4,
                )
                specs[indexer.prefix] = indexer.get_kv_cache_spec(config)
                kinds[indexer.prefix] = "indexer"
        groups = grouping.get_kv_cache_groups(config, specs)
        kv_config = grouping.get_kv_cache_config_from_groups(config, groups, available_bytes)
        raw = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout])
    group_of = {
        name: g for g, group in enumerate(kv_config.kv_cache_groups) for name in group.layer_names
    }
    views = []
    backing = None
    for name, tensor in raw.items():
        bound = tensor.squeeze(1)  # what every DSV4 cache layer's bind_kv_cache keeps
        backing = tensor if backing is None else backing
        views.append(CacheView(name, kinds[name], bound, bound.shape[1], group_of[name]))
    assert backing is not None
    storage = torch.empty(0, dtype=torch.uint8).set_(backing.untyped_storage())
    return views, storage
