"""The DeepSeek-V4 family's attention facts, as data: ``model_facts.json`` and its reader.

The JSON file holds, per checkpoint vLLM serves (DeepSeek-V4-Flash, -Pro, V4.1-Flash),
the fields of its published Hugging Face ``config.json`` that set the cost of a step of
attention, unchanged (the per-layer ``compress_ratios`` list included, with its trailing
entries for the MTP layers), and where each figure was read.  This module reads it and
derives, never stores: each layer's kind, the count per kind, the query heads one
tensor-parallel rank holds, and the KV-cache bytes a context costs.

    from benchmarks import model_facts
    flash = model_facts.load()["v4-flash"]
    flash.kind_counts          # {'swa': 2, 'c4a': 21, 'c128a': 20}
    flash.local_heads(8)       # 8
    flash.kv_bytes_per_token() # 3850.25

Layer kinds, as vLLM's decode metadata names its FlashMLA plans
(``vllm/v1/attention/backends/mla/sparse_swa.py``; ``swaonly`` here ``swa``):

* DeepSeek-V4 (``DeepseekV4ForCausalLM``): ratio 0 or 1 ``swa`` (the window only; vLLM
  turns a 0 into 1), 4 ``c4a`` (compressed entries chosen by the lightning indexer's
  top-k), 128 ``c128a`` (every compressed entry).
* DeepSeek-V4.1 (``DeepseekV41ForCausalLM``): 0 ``swa``, 1 ``c1a`` and 2 ``c2a``
  (top-k rows over a full-length or ratio-2 compressed cache that only the
  ``kv_source_layer_ids`` layers own; the layers above a source read its cache).

Standard library only: the benchmark reads it on a GPU machine without vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FACTS_FILE = Path(__file__).with_name("model_facts.json")

# vLLM's architecture name -> family
FAMILIES = {"DeepseekV4ForCausalLM": "v4", "DeepseekV41ForCausalLM": "v41"}
# family -> the config's compress ratio -> layer kind (in the order counts are listed)
KINDS: dict[str, dict[int, str]] = {
    "v4": {0: "swa", 1: "swa", 4: "c4a", 128: "c128a"},
    "v41": {0: "swa", 1: "c1a", 2: "c2a"},
}
TP_SIZES = (1, 2, 4, 8)

# config keys every model carries (ints), and the V4.1-only ones
INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "sliding_window",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "num_nextn_predict_layers",
    "max_position_embeddings",
)
_V41_KEYS = (
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "candidate_topk_blocks",
    "candidate_block_size",
)


@dataclass(frozen=True)
class ModelFacts:
    """One checkpoint's attention facts: the config's raw fields, plus derived views.

    Field names and values are the config's (``compress_ratios`` has
    ``num_hidden_layers + num_nextn_predict_layers`` entries); the V4.1-only fields
    are ``None`` for V4.  ``vision_n_layers`` and ``max_image_tokens`` come from
    the checkpoint's ``vision_config`` (0 for the text-only V4).  The record sizes
    are the file's ``records`` (bytes of one FP8 KV entry and one FP8 indexer key).
    """

    name: str
    hf_id: str
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    num_nextn_predict_layers: int
    max_position_embeddings: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...] | None
    index_source_layer_ids: tuple[int, ...] | None
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int | None
    candidate_block_size: int | None
    vision_n_layers: int
    max_image_tokens: int
    kv_record_bytes: int
    indexer_record_bytes: int
    # the model's entry in the JSON file (config, nesting, source): not compared
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        """``"v4"`` or ``"v41"``, from the architecture."""
        return FAMILIES[self.architecture]

    @property
    def source(self) -> Mapping[str, str]:
        """Where the figures were read: ``url``, ``figures``, ``cross_checks``."""
        return dict(self.raw.get("source", {}))

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """The config's compress ratio of each attention layer (the MTP entries dropped)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def mtp_ratios(self) -> tuple[int, ...]:
        """The trailing entries of ``compress_ratios``: one per MTP (next-n) layer."""
        return self.compress_ratios[self.num_hidden_layers :]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each attention layer's kind (``swa``, ``c4a``, ``c128a``; V4.1 ``swa``,
        ``c1a``, ``c2a``), the MTP layers excluded."""
        table = KINDS[self.family]
        unknown = sorted({r for r in self.layer_ratios if r not in table})
        if unknown:
            raise ValueError(f"{self.name}: compress ratios {unknown} have no {self.family} kind")
        return tuple(table[r] for r in self.layer_ratios)

    @property
    def kind_counts(self) -> dict[str, int]:
        """Attention layers per kind, every kind of the family listed (0 where none)."""
        kinds = self.kinds
        return {k: kinds.count(k) for k in dict.fromkeys(KINDS[self.family].values())}

    def local_heads(self, tp: int) -> int:
        """Query heads one rank holds at tensor parallelism ``tp`` (vLLM: heads // tp,
        asserting that tp divides the heads)."""
        if tp < 1 or self.num_attention_heads % tp:
            raise ValueError(f"{self.name}: {self.num_attention_heads} heads over TP {tp}")
        return self.num_attention_heads // tp

    @property
    def compressed_cache_layers(self) -> tuple[int, ...]:
        """Attention layers that own a compressed KV cache: V4 every ratio-4 and
        ratio-128 layer; V4.1 only the ``kv_source_layer_ids`` (the layers above a
        source read its cache)."""
        if self.family == "v41":
            return tuple(i for i in self.kv_source_layer_ids or () if i < self.num_hidden_layers)
        return tuple(i for i, r in enumerate(self.layer_ratios) if r > 1)

    @property
    def indexer_cache_layers(self) -> tuple[int, ...]:
        """Attention layers that own a lightning-indexer key cache: V4 the ratio-4
        layers; V4.1 the kv sources that are also index sources (an index source
        without its own KV reuses its kv source's keys)."""
        if self.family == "v41":
            index_sources = set(self.index_source_layer_ids or ())
            return tuple(i for i in self.compressed_cache_layers if i in index_sources)
        return tuple(i for i, r in enumerate(self.layer_ratios) if r == 4)

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one more token of context adds, on every GPU, at long context.

        Counts, over the attention layers: ``kv_record_bytes / r`` for each layer that
        owns a compressed cache of ratio ``r`` (one entry per ``r`` tokens), plus
        ``indexer_record_bytes / r`` for each layer that owns an indexer key cache.
        Not counted: the sliding-window caches (a fixed ``sliding_window`` entries
        per layer and request, see :meth:`kv_bytes_per_request`), the compressors'
        per-request state, page rounding (256-token blocks, 576-byte alignment) and
        the MTP layers (window-only).  Per GPU equals the total: the cache is one
        latent head that vLLM does not shard over tensor-parallel ranks, so every
        rank holds all of it.
        """
        ratios = self.compress_ratios
        kv = sum(self.kv_record_bytes / ratios[i] for i in self.compressed_cache_layers)
        index = sum(self.indexer_record_bytes / ratios[i] for i in self.indexer_cache_layers)
        return kv + index

    def kv_bytes_per_request(self, context_len: int, *, mtp: bool = False) -> int:
        """KV-cache bytes one request of ``context_len`` tokens holds, on every GPU.

        The window of every attention layer (``min(context_len, sliding_window)``
        entries), plus ``context_len // r`` entries in each compressed cache and each
        indexer key cache (only whole groups of ``r`` tokens are compressed).  With
        ``mtp``, also the window of each of the ``num_nextn_predict_layers`` draft
        layers (window-only in vLLM).  Same exclusions as :meth:`kv_bytes_per_token`.
        """
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        layers = self.num_hidden_layers + (self.num_nextn_predict_layers if mtp else 0)
        total = layers * min(context_len, self.sliding_window) * self.kv_record_bytes
        ratios = self.compress_ratios
        total += sum(context_len // ratios[i] for i in self.compressed_cache_layers) * (
            self.kv_record_bytes
        )
        total += sum(context_len // ratios[i] for i in self.indexer_cache_layers) * (
            self.indexer_record_bytes
        )
        return total

    def config_json(self) -> dict[str, Any]:
        """The checkpoint's ``config.json`` cut down to the recorded keys, laid out as
        published (V4.1: the text keys under ``text_config``, with ``vision_config``)."""
        config = dict(self.raw["config"])
        if self.raw.get("config_nesting") != "text_config":
            return config
        text = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        text["model_type"] = text.pop("text_model_type")
        out: dict[str, Any] = {
            "architectures": config["architectures"],
            "model_type": config["model_type"],
            "text_config": text,
        }
        if "vision_config" in self.raw:
            out["vision_config"] = dict(self.raw["vision_config"])
        return out


def _optional_ids(config: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    value = config.get(key)
    return None if value is None else tuple(int(i) for i in value)


def _facts(name: str, entry: Mapping[str, Any], records: Mapping[str, Any]) -> ModelFacts:
    config = entry["config"]
    missing = [
        k for k in ("architectures", "model_type", "compress_ratios", *INT_KEYS) if k not in config
    ]
    if missing:
        raise ValueError(f"{name}: config lacks {missing}")
    (architecture,) = config["architectures"]
    if architecture not in FAMILIES:
        raise ValueError(f"{name}: unknown architecture {architecture}")
    if FAMILIES[architecture] == "v41":
        missing = [k for k in _V41_KEYS if k not in config]
        if missing:
            raise ValueError(f"{name}: V4.1 config lacks {missing}")
    vision = entry.get("vision_config") or {}
    vision_layers = int(vision.get("num_hidden_layers", 0))
    facts = ModelFacts(
        name=name,
        hf_id=entry["hf_id"],
        architecture=architecture,
        model_type=config["model_type"],
        **{k: int(config[k]) for k in INT_KEYS},
        compress_ratios=tuple(int(r) for r in config["compress_ratios"]),
        kv_source_layer_ids=_optional_ids(config, "kv_source_layer_ids"),
        index_source_layer_ids=_optional_ids(config, "index_source_layer_ids"),
        candidate_source_layer_id=config.get("candidate_source_layer_id"),
        candidate_topk_blocks=config.get("candidate_topk_blocks"),
        candidate_block_size=config.get("candidate_block_size"),
        vision_n_layers=vision_layers,
        max_image_tokens=int(vision.get("max_image_tokens", 0)) if vision_layers else 0,
        kv_record_bytes=int(records["kv_record_bytes"]),
        indexer_record_bytes=int(records["indexer_record_bytes"]),
        raw=entry,
    )
    expected = facts.num_hidden_layers + facts.num_nextn_predict_layers
    if len(facts.compress_ratios) != expected:
        raise ValueError(
            f"{name}: {len(facts.compress_ratios)} compress ratios, expected {expected} "
            "(num_hidden_layers + num_nextn_predict_layers)"
        )
    facts.kinds  # noqa: B018  (raises on a ratio the family has no kind for)
    return facts


def load(path: Path = FACTS_FILE) -> dict[str, ModelFacts]:
    """Every recorded model, by short name (``v4-flash``, ``v4-pro``, ``v41-flash``).

    Raises ``ValueError`` where an entry lacks a field, its ratio list does not have
    ``num_hidden_layers + num_nextn_predict_layers`` entries or holds a ratio its
    family has no kind for.  (The file's ``not_included`` entries, checkpoints whose
    config could not be found, are not loaded.)
    """
    data = json.loads(Path(path).read_text())
    return {name: _facts(name, entry, data["records"]) for name, entry in data["models"].items()}
