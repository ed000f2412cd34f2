"""The model facts of the benchmarks (``benchmarks/model_facts.json``) and their reader.

* **The file** (plain suite, no vLLM): every model has its fields, a ratio list of
  ``num_hidden_layers + num_nextn_predict_layers`` entries and only ratios its family
  has a kind for; the reader's derived facts are the published ones (V4-Flash: 43
  layers, 2 window-only, 21 C4A, 20 C128A, 64 heads, top-k 512; V4-Pro: 61 layers, 30
  C4A, 31 C128A, 128 heads, top-k 1024; window 128, head dim 512) and its KV bytes
  count what its docstring says.
* **vLLM's view** (``vllm`` session, 0.32 and 0.33): each model's ``config.json``,
  rebuilt from the file, is parsed by vLLM's ``get_config`` from a local folder
  (``HF_HUB_OFFLINE=1``); its architecture resolves in vLLM's model registry; and
  every attention layer's compress ratio, kind, local heads and window are what
  vLLM's own ``DeepseekV4Attention.__init__`` (V4's, V4.1's) decides for that layer.
  vLLM has no separate function for a layer's ratio: the constructor computes it
  inline (0.32 V4: ``max(1, config.compress_ratios[layer_id])``; 0.33 V4:
  ``max(1, config.compress_rates.get(config.layer_types[layer_id], 0))``; V4.1:
  ``int(compress_ratios[layer_id])``, MTP layers included), so the constructor itself
  runs, on a subclass whose ``get_padded_num_q_heads`` (the first call after those
  decisions, before any weight is made) stops it and hands back the half-built layer.
  A ratio list with one layer changed is caught.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks import model_facts

FACTS = model_facts.load()
NAMES = sorted(FACTS)
# what vLLM's layer constructor reads before the probe stops it but the file does not
# record (any value: it sets no attention cost)
PARSE_EXTRAS = {"rms_norm_eps": 1e-6}
# vLLM's decode layer-type names (sparse_swa._layer_type_for, deepseek_v41_layer_type)
VLLM_KIND = {"swaonly": "swa", "c4a": "c4a", "c128a": "c128a", "c1a": "c1a", "c2a": "c2a"}


# --- the file and its reader (no vLLM) ---------------------------------------------


def test_the_models_vllm_serves_are_recorded() -> None:
    assert {"v4-flash", "v4-pro", "v41-flash"} <= set(FACTS)
    assert FACTS["v4-flash"].hf_id == "deepseek-ai/DeepSeek-V4-Flash"
    assert FACTS["v4-pro"].hf_id == "deepseek-ai/DeepSeek-V4-Pro"
    assert FACTS["v41-flash"].hf_id == "deepseek-ai/DeepSeek-V4.1-Flash"


@pytest.mark.parametrize(
    ("name", "layers", "counts", "heads", "topk"),
    [
        ("v4-flash", 43, {"swa": 2, "c4a": 21, "c128a": 20}, 64, 512),
        ("v4-pro", 61, {"swa": 0, "c4a": 30, "c128a": 31}, 128, 1024),
        ("v41-flash", 40, {"swa": 2, "c1a": 20, "c2a": 18}, 64, 512),
    ],
)
def test_derived_facts(
    name: str, layers: int, counts: dict[str, int], heads: int, topk: int
) -> None:
    facts = FACTS[name]
    assert facts.num_hidden_layers == layers
    assert facts.kind_counts == counts
    assert facts.num_attention_heads == heads
    assert facts.index_topk == topk
    assert (facts.sliding_window, facts.head_dim, facts.qk_rope_head_dim) == (128, 512, 64)
    assert [facts.local_heads(tp) for tp in model_facts.TP_SIZES] == [
        heads // tp for tp in (1, 2, 4, 8)
    ]


def test_v4_layouts() -> None:
    flash, pro = FACTS["v4-flash"], FACTS["v4-pro"]
    assert flash.kinds[:4] == ("swa", "swa", "c4a", "c128a")
    assert pro.kinds[:4] == ("c128a", "c128a", "c4a", "c128a")
    assert flash.mtp_ratios == pro.mtp_ratios == (0,)
    assert flash.family == pro.family == "v4"
    assert flash.max_image_tokens == pro.max_image_tokens == 0


def test_v41_sources_fit_the_ratios() -> None:
    """Every compressed V4.1 layer reads the nearest kv source at or below it, of its
    own ratio; the kv sources are index sources (they own the indexer keys)."""
    v41 = FACTS["v41-flash"]
    assert v41.family == "v41"
    assert v41.mtp_ratios == (0, 0, 0)
    kv = v41.kv_source_layer_ids or ()
    index = v41.index_source_layer_ids or ()
    assert set(kv) <= set(index)
    for layer, ratio in enumerate(v41.layer_ratios):
        if ratio:
            source = max(s for s in kv if s <= layer)
            assert v41.layer_ratios[source] == ratio, layer
    assert v41.compressed_cache_layers == v41.indexer_cache_layers == (2, 8, 14, 20)
    assert (v41.candidate_source_layer_id, v41.candidate_topk_blocks) == (20, 2048)
    assert (v41.vision_n_layers, v41.max_image_tokens) == (32, 1024)


@pytest.mark.parametrize("name", NAMES)
def test_file_is_well_formed(name: str) -> None:
    facts = FACTS[name]
    entry = facts.raw
    assert entry["source"]["url"].startswith("https://huggingface.co/" + facts.hf_id + "/")
    assert entry["source"]["figures"] and entry["source"]["cross_checks"]
    assert len(facts.compress_ratios) == facts.num_hidden_layers + facts.num_nextn_predict_layers
    assert len(facts.kinds) == facts.num_hidden_layers
    assert set(facts.kinds) <= set(model_facts.KINDS[facts.family].values())
    assert sum(facts.kind_counts.values()) == facts.num_hidden_layers
    assert facts.model_type == {"v4": "deepseek_v4", "v41": "deepseek_v41"}[facts.family]
    for ids in (facts.kv_source_layer_ids, facts.index_source_layer_ids):
        assert ids is None or all(0 <= i < facts.num_hidden_layers for i in ids)


def test_not_included_entries_say_why() -> None:
    data = json.loads(model_facts.FACTS_FILE.read_text())
    for name, entry in data["not_included"].items():
        assert name not in FACTS
        assert entry["hf_id"].startswith("deepseek-ai/") and entry["config"] is None
        assert entry["note"]


def test_kv_bytes() -> None:
    """The documented counts: FP8 entries of 584 bytes (one per ``r`` tokens in each
    compressed cache) and 132-byte indexer keys, plus every layer's window."""
    from dsv4_kernels.geometry import TOKEN_BYTES, WINDOW_SIZE

    flash, pro, v41 = FACTS["v4-flash"], FACTS["v4-pro"], FACTS["v41-flash"]
    assert flash.kv_record_bytes == TOKEN_BYTES == 584 and flash.sliding_window == WINDOW_SIZE
    assert flash.indexer_record_bytes == 128 + 4
    # C4A: (584 + 132) / 4 per token; C128A: 584 / 128
    assert flash.kv_bytes_per_token() == 21 * 716 / 4 + 20 * 584 / 128 == 3850.25
    assert pro.kv_bytes_per_token() == 30 * 716 / 4 + 31 * 584 / 128
    # V4.1: only the kv sources hold caches: three ratio-2, one full-length
    assert v41.kv_bytes_per_token() == 3 * 716 / 2 + 716 == 1790
    window = 43 * 128 * 584
    assert flash.kv_bytes_per_request(0) == 0
    assert flash.kv_bytes_per_request(100) == 43 * 100 * 584 + 21 * 25 * 716
    n = 1 << 20
    assert flash.kv_bytes_per_request(n) == window + n * 3850.25
    assert flash.kv_bytes_per_request(n, mtp=True) == window + 128 * 584 + n * 3850.25
    with pytest.raises(ValueError):
        flash.local_heads(3)


def test_a_malformed_entry_is_refused(tmp_path: Path) -> None:
    data = json.loads(model_facts.FACTS_FILE.read_text())
    entry = data["models"]["v4-flash"]
    config = entry["config"]
    short = {**config, "compress_ratios": config["compress_ratios"][:-1]}
    unknown = {**config, "compress_ratios": [2] * 44}
    headless = {k: v for k, v in config.items() if k != "num_attention_heads"}
    for broken, match in [(short, "expected 44"), (unknown, "no v4 kind"), (headless, "lacks")]:
        data["models"] = {"bad": {**entry, "config": broken}}
        (tmp_path / "facts.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            model_facts.load(tmp_path / "facts.json")


# --- vLLM's view of the same configs (vllm session) --------------------------------


class _Decided(Exception):
    """Raised where vLLM's layer constructor has decided the layer's geometry."""

    def __init__(self, layer: Any) -> None:
        super().__init__("decided")
        self.layer = layer


def _probe_class(module: types.ModuleType) -> type:
    """vLLM's ``DeepseekV4Attention`` of ``module``, its constructor stopped at the
    padded-heads query (after the ratio, heads, window and sources are set)."""

    base: Any = module.DeepseekV4Attention

    class Probe(base):
        def get_padded_num_q_heads(self, num_heads: int) -> int:
            raise _Decided(self)

        def forward_mqa(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError

        def _o_proj(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    return Probe


def _parse(config: dict[str, Any], folder: Path) -> Any:
    """vLLM's ``hf_config`` of a checkpoint folder holding this ``config.json``."""
    from vllm.transformers_utils.config import get_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return get_config(str(folder), trust_remote_code=False)


def _with_extras(facts: model_facts.ModelFacts, **changes: Any) -> dict[str, Any]:
    config = facts.config_json()
    text = config.get("text_config", config)
    text.update(PARSE_EXTRAS)
    text.update(changes)
    return config


def _vllm_layers(
    facts: model_facts.ModelFacts, hf_config: Any, monkeypatch: pytest.MonkeyPatch, tp: int
) -> Iterator[Any]:
    """Each attention layer (MTP layers last) as vLLM's constructor leaves it at ``tp``."""
    import importlib

    from vllm.config import VllmConfig

    package = {"v4": "deepseek_v4", "v41": "deepseek_v41"}[facts.family]
    module = importlib.import_module(f"vllm.models.{package}.attention")
    monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
    vllm_config = VllmConfig()
    vllm_config.model_config = types.SimpleNamespace(hf_config=hf_config)
    probe = _probe_class(module)
    for i in range(facts.num_hidden_layers + facts.num_nextn_predict_layers):
        try:
            probe(vllm_config, prefix=f"model.layers.{i}.attn")
        except _Decided as decided:
            yield decided.layer
        else:  # pragma: no cover - vLLM's constructor no longer asks for padded heads
            raise AssertionError("vLLM's layer constructor ran past get_padded_num_q_heads")


def _vllm_kind(family: str, ratio: int) -> str:
    """The layer type vLLM's decode metadata gives a layer of this ratio."""
    if family == "v41":
        from vllm.models.deepseek_v41.sparse_mla import deepseek_v41_layer_type

        return VLLM_KIND[deepseek_v41_layer_type(ratio)]
    from vllm.v1.attention.backends.mla.sparse_swa import _layer_type_for

    return VLLM_KIND[_layer_type_for(ratio)]


def _vllm_ratio_list(hf_config: Any) -> list[int]:
    """The per-layer ratio list vLLM's caches and metadata builders read: 0.33's
    ``get_compress_ratios`` (from ``layer_types`` where transformers' V4 config
    replaced ``compress_ratios``), 0.32's ``hf_config.compress_ratios``."""
    try:
        from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    except ImportError:  # 0.32
        return list(hf_config.compress_ratios)
    return list(get_compress_ratios(hf_config))


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_vllm_parses_the_same_model(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import ModelRegistry

    facts = FACTS[name]
    hf = _parse(_with_extras(facts), tmp_path / name)

    assert hf.architectures == [facts.architecture]
    model_cls, arch = ModelRegistry.resolve_model_cls(
        hf.architectures,
        types.SimpleNamespace(model_impl="auto", convert_type="none", runner_type="generate"),
    )
    assert arch == facts.architecture
    assert model_cls.__module__.startswith(f"vllm.models.deepseek_{facts.family}.")
    for key in model_facts.INT_KEYS:  # every integer field the file records
        assert getattr(hf, key) == getattr(facts, key), key
    assert _vllm_ratio_list(hf) == list(facts.compress_ratios)

    layers = list(_vllm_layers(facts, hf, monkeypatch, tp=8))
    backbone, mtp = layers[: facts.num_hidden_layers], layers[facts.num_hidden_layers :]
    assert [_vllm_kind(facts.family, layer.compress_ratio) for layer in backbone] == list(
        facts.kinds
    )
    for layer, ratio, kind in zip(backbone, facts.layer_ratios, facts.kinds, strict=True):
        # a compressed layer keeps the config's ratio; vLLM's V4 makes a window-only 0 a 1
        assert layer.compress_ratio in ((0, 1) if kind == "swa" else (ratio,))
        assert (layer.n_heads, layer.n_local_heads) == (
            facts.num_attention_heads,
            facts.local_heads(8),
        )
        assert (layer.window_size, layer.head_dim) == (facts.sliding_window, facts.head_dim)
    # the MTP layers are window-only (V4: ratio 1 past num_hidden_layers; V4.1: the
    # list's trailing entries)
    assert len(mtp) == facts.num_nextn_predict_layers
    assert all(_vllm_kind(facts.family, layer.compress_ratio) == "swa" for layer in mtp)
    if facts.family == "v41":
        kv_sources = tuple(i for i, layer in enumerate(backbone) if layer.is_kv_source)
        assert kv_sources == facts.compressed_cache_layers
        index_sources = tuple(i for i, layer in enumerate(backbone) if layer.is_index_source)
        assert index_sources == facts.index_source_layer_ids
        assert hf.candidate_source_layer_id == facts.candidate_source_layer_id
        assert (hf.vision_n_layers, hf.vision_max_n_token) == (
            facts.vision_n_layers,
            facts.max_image_tokens,
        )
    for tp in model_facts.TP_SIZES:
        first = next(_vllm_layers(facts, hf, monkeypatch, tp=tp))
        assert first.n_local_heads == facts.local_heads(tp), tp


@pytest.mark.vllm
def test_vllm_catches_a_wrong_ratio_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The V4-Flash config with layer 2 made a C128A layer: vLLM's layers no longer
    match the file's kinds (the check above can fail)."""
    facts = FACTS["v4-flash"]
    ratios = list(facts.compress_ratios)
    ratios[2] = 128
    hf = _parse(_with_extras(facts, compress_ratios=ratios), tmp_path / "wrong")
    assert _vllm_ratio_list(hf) != list(facts.compress_ratios)
    kinds = [
        _vllm_kind("v4", layer.compress_ratio) for layer in _vllm_layers(facts, hf, monkeypatch, 8)
    ]
    assert kinds[: facts.num_hidden_layers] != list(facts.kinds)
    assert kinds[2] == "c128a"


@pytest.mark.vllm
def test_vllm_record_sizes() -> None:
    """The file's record sizes are vLLM's: the window cache's packed FP8 entry and the
    FP8 indexer key row (vLLM's V4.1 helper; V4 computes the same inline)."""
    import inspect

    from vllm.models.deepseek_v41.attention import _indexer_k_cache_head_dim
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    default = inspect.signature(DeepseekV4SWACache.__init__).parameters["packed_bytes_per_token"]
    for facts in FACTS.values():
        assert default.default == facts.kv_record_bytes
        assert _indexer_k_cache_head_dim(facts.index_head_dim, False) == (
            facts.indexer_record_bytes
        )
