"""The decode lightning indexer through the plugin, on vLLM's own objects (``vllm`` session).

vLLM's pieces: its ``SparseAttnIndexer`` op and ``DeepseekV4IndexerCache`` built under
its config, the index-key pages from its allocator and grouping, and the indexer
metadata built by its own ``DeepseekV4IndexerBackend`` builder from a
``CommonAttentionMetadata`` (plain decode; MTP at k=1, which vLLM runs natively as
``(B, 2)`` lengths; k=2, which it flattens into one row and one block-table row per
token; a step with a prefill).  The attention region the plugin overrides
(``_sparse_indexer_and_attn``) is driven as vLLM's layer calls it: the profile run
first (no metadata: the runtime decides and reserves), then the step.  vLLM's indexer
kernels (DeepGEMM, its top-k) cannot run on a CPU, so ours is compared with the
float64 reference over lengths computed here from the batch (vLLM's rule: row ``j`` of
a request of ``L`` tokens and ``n`` rows sees ``(L - n + j + 1) // 4`` entries), and
vLLM's op is observed by its calls where it must run.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention.facts import ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess, make_attention_cls
from dsv4_attention.tables import IndexerTable, MeasuredTable, table_for
from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator

from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm

HEADS = 16  # index heads (64 in V4; fewer keeps the interpreter quick)
TOPK = 64
BUDGET = 64
MAX_MODEL_LEN = 4096
PREFIX = "model.layers.0.self_attn.indexer.k_cache"
HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)


def _table(rows: dict[int, float] | None) -> MeasuredTable:
    """The H200's table with a decode-indexer section for ``HEADS`` x ``TOPK`` (None: none)."""
    h200 = table_for("NVIDIA H200", (9, 0))
    assert h200 is not None
    indexer = None if rows is None else IndexerTable(1.0, {HEADS: {TOPK: rows}})
    return dataclasses.replace(h200, indexer=indexer)


FASTER = _table({1: 2.0, 4: 2.0, 16: 2.0, 64: 1.5})


def _config(k: int) -> Any:
    from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    scheduler = SchedulerConfig(
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        max_num_seqs=16,
    )
    cache = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla")
    config = VllmConfig(scheduler_config=scheduler, cache_config=cache)
    hf_config = types.SimpleNamespace(
        sliding_window=128, index_topk=TOPK, index_n_heads=HEADS, index_head_dim=128
    )
    config.model_config = types.SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"],
        max_model_len=MAX_MODEL_LEN,
        hf_config=hf_config,
        # a text model's text config is its config (0.34's indexer builder reads it)
        hf_text_config=hf_config,
    )
    if getattr(config.attention_config, "sparse_mla_prefill_workspace_factor", 0) is None:
        # what vLLM's post-init resolves once a model config is set (0.33)
        config.attention_config.sparse_mla_prefill_workspace_factor = 5
    if k:
        spec = object.__new__(SpeculativeConfig)  # vLLM's class, without a draft model
        spec.method = "mtp"
        spec.num_speculative_tokens = k
        spec.parallel_drafting = False
        spec.enable_adaptive_verification = False
        config.speculative_config = spec
    return config


@dataclasses.dataclass
class Rig:
    """vLLM's indexer op over vLLM's pages, a layer holding it, and the plugin's class."""

    config: Any
    cls: Any
    runtime: HeadExactRuntime
    layer: Any
    op: Any
    cache: torch.Tensor
    info: list[str]
    warning: list[str]
    mqa_calls: list[tuple[Any, ...]]
    capturing: list[bool]


def make_rig(
    workspace: Any,
    k: int = 0,
    table: MeasuredTable | None = FASTER,
    switches: Any = None,
    tp_group: Callable[[], Any] | None = None,
) -> Rig:
    """vLLM's indexer op, pages and layer under the plugin (``workspace``: vLLM's
    workspace module, its manager made; ``tp_group``: how the runtime reaches vLLM's TP
    group, None: no group)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    config = _config(k)
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=8 << 20, ratios=(1, 4))
    (index_view,) = [v.view for v in views if v.kind == "indexer"]
    with set_current_vllm_config(config):
        k_cache = DeepseekV4IndexerCache(
            head_dim=132,
            dtype=torch.uint8,
            prefix=PREFIX,
            cache_config=config.cache_config,
            compress_ratio=4,
        )
        k_cache.bind_kv_cache(index_view.unsqueeze(1))  # as vLLM binds [B, 1, N, C]
        buffer = torch.full((BUDGET, TOPK), 7, dtype=torch.int32)
        op = SparseAttnIndexer(
            k_cache, 128, "ue8m0", TOPK, 128, MAX_MODEL_LEN // 4, BUDGET, buffer,
            skip_k_cache_insert=True, use_fp4_cache=False, compress_ratio=4,
        )  # fmt: skip
    mqa_calls: list[tuple[Any, ...]] = []
    layer = types.SimpleNamespace(
        indexer=types.SimpleNamespace(indexer_op=op, n_head=HEADS, compress_ratio=4),
        forward_mqa=lambda *args: mqa_calls.append(args),
    )
    info: list[str] = []
    warning: list[str] = []
    capturing = [False]
    access = VllmAccess(
        forward_context=lambda: get_forward_context() if is_forward_context_available() else None,
        workspace=lambda: (
            workspace.current_workspace_manager()
            if workspace.is_workspace_manager_initialized()
            else None
        ),
        info=info.append,
        warning=warning.append,
        capturing=lambda: capturing[0],
        tp_group=tp_group or (lambda: None),
    )
    serving = ServingConfig(
        architectures=("DeepseekV4ForCausalLM",),
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        max_decode_query_len=1 + k,
        index_topk=TOPK,
    )
    rt = HeadExactRuntime(serving, HOPPER, table, switches or Switches(), access)
    cls = make_attention_cls(DeepseekV4FlashMLAAttention, rt)
    return Rig(config, cls, rt, layer, op, k_cache.kv_cache, info, warning, mqa_calls,
               capturing)  # fmt: skip


@pytest.fixture
def rig(workspace: Any) -> Callable[..., Rig]:
    return functools.partial(make_rig, workspace)


def _region(rig: Rig, q: torch.Tensor, weights: torch.Tensor) -> None:
    """The plugin's ``_sparse_indexer_and_attn`` as vLLM's layer calls it."""
    hidden = torch.zeros(q.shape[0], 8)
    rig.cls._sparse_indexer_and_attn(
        rig.layer, hidden, q, None, weights, "q", "kv", "positions", "out"
    )


def _profile(rig: Rig) -> None:
    """vLLM's profile run: the region without metadata (vLLM's op reserves its own)."""
    from vllm.forward_context import set_forward_context

    q = torch.zeros(BUDGET, HEADS, 128).to(torch.float8_e4m3fn)
    with set_forward_context(None, rig.config):
        _region(rig, q, torch.zeros(BUDGET, HEADS))


@dataclasses.dataclass
class Batch:
    meta: Any
    seq_lens: list[int]
    query_lens: list[int]
    table: torch.Tensor  # request-level block table (index pages)


def _batch(rig: Rig, g: torch.Generator, seq_lens: list[int], query_lens: list[int]) -> Batch:
    """vLLM's indexer metadata for these requests, built by vLLM's own builder, and the
    index keys of every request's compressed entries written into vLLM's pages."""
    import vllm.v1.attention.backends.mla.indexer as vllm_indexer
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    pages = rig.cache.shape[0]
    width = MAX_MODEL_LEN // 256
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        need = -(-s // 256)
        table[b, :need] = perm[used : used + need]
        used += need
        n = s // 4
        j = torch.arange(n)
        slots = table[b, j // 64].to(torch.int64) * 64 + j % 64
        keys = torch.randn(n, 128, generator=g) * torch.rand(n, 1, generator=g) * 4
        ref.insert_index_k(keys, rig.cache, slots)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    spec = MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=132, dtype=torch.uint8, tokens_per_state=4
    )
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl_t,
        query_start_loc_cpu=qsl_t.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=T,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.zeros(T, dtype=torch.int64),
    )

    def no_slots(num_tokens: int, *args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # vLLM's Triton kernel of the cache writer's slot mapping (vLLM's CPU build runs
        # no Triton): V4's indexer skips the insert, and the decode path never reads it
        return out[:num_tokens].fill_(-1)

    with set_current_vllm_config(rig.config), pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_indexer, "num_compute_units", lambda index: 132)
        mp.setattr(vllm_indexer, "get_compressed_slot_mapping", no_slots)
        builder = vllm_indexer.DeepseekV4IndexerBackend.get_builder_cls()(
            spec, [PREFIX], rig.config, torch.device("cpu"), block_table_width=width
        )
        meta = builder.build(0, common)
    return Batch(meta, seq_lens, query_lens, table)


def _expected(rig: Rig, batch: Batch, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference top-k of every decode row, lengths by vLLM's rule from the batch."""
    lens, reqs = [], []
    for b, (s, n) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        for j in range(n):
            lens.append(max(s - n + j + 1, 0) // 4)
            reqs.append(b)
    T = len(lens)
    return ref.indexer_decode_topk(
        q[:T], w[:T], rig.cache, torch.tensor(lens, dtype=torch.int32),
        torch.tensor(reqs, dtype=torch.int32), batch.table, TOPK,
    )  # fmt: skip


def _same_sets(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    for t in range(want.shape[0]):
        g, w = got[t].tolist(), want[t].tolist()
        n = sum(1 for x in w if x >= 0)
        assert g[n:] == [-1] * (len(g) - n), f"{where}, row {t}: the -1 fill"
        assert sorted(g[:n]) == sorted(w[:n]), f"{where}, row {t}"


def _inputs(g: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = (torch.randn(rows, HEADS, 128, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, torch.randn(rows, HEADS, generator=g) * HEADS**-0.5


@pytest.mark.parametrize(
    ("k", "seq_lens", "query_lens"),
    [
        (0, [1500, 300, 2100, 260], [1, 1, 1, 1]),  # plain decode: (B, 1) lengths
        (1, [1500, 301, 2101], [2, 2, 2]),  # MTP k=1: vLLM's native (B, 2) lengths
        # k=2 (no native SM90 kernel): vLLM flattens every row, each with its own lengths
        # and block-table row (the ragged batch: vLLM's torch path, no Triton)
        (2, [1500, 302, 2102], [3, 2, 3]),
    ],
)
def test_decode_indexer_through_the_plugin_equals_the_reference(
    rig: Callable[..., Rig], k: int, seq_lens: list[int], query_lens: list[int]
) -> None:
    from vllm.forward_context import set_forward_context

    seed = fresh_seed()
    g = generator(seed)
    r = rig(k)
    _profile(r)
    assert r.runtime.indexers.scores is not None, r.info
    assert "indexer" in r.runtime.reserved
    assert any("lightning indexer" in line and "decode ours" in line for line in r.info), r.info
    batch = _batch(r, g, seq_lens, query_lens)
    assert batch.meta.num_prefills == 0 and batch.meta.decode is not None
    T = sum(batch.query_lens)
    padded = T + 3  # the step's padded tokens (a CUDA-graph size)
    q, w = _inputs(g, padded)
    r.op.topk_indices_buffer.fill_(7)  # poison
    r.mqa_calls.clear()
    with set_forward_context({PREFIX: batch.meta}, r.config):
        _region(r, q, w)
    assert r.mqa_calls == [("q", "kv", "positions", "out")], "forward_mqa runs once after"
    buf = r.op.topk_indices_buffer
    _same_sets(buf[:T], _expected(r, batch, q, w), f"seed {seed}, k={k}")
    assert bool((buf[T:padded] == -1).all()), "the padded tokens' rows cleared as vLLM does"
    assert bool((buf[padded:] == 7).all()), "nothing past the step's tokens"
    assert r.warning == []


class _Recorder:
    """vLLM's op with its calls recorded (what the region calls where vLLM's must run)."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)

    def __call__(self, hidden_states: torch.Tensor, *args: Any) -> Any:
        self.calls.append(int(hidden_states.shape[0]))
        self.op.topk_indices_buffer[: hidden_states.shape[0]] = -5  # vLLM's result, marked
        return self.op.topk_indices_buffer


def test_steps_ours_does_not_run_go_to_vllms_op(rig: Callable[..., Rig]) -> None:
    """vLLM's padded MTP layout (k=1, a request with one token where others have two),
    a step with a prefill, a row count the table did not measure faster, the switch, a
    table without an indexer section: vLLM's op runs with the layer's arguments."""
    from vllm.forward_context import set_forward_context

    g = generator(fresh_seed())
    r = rig(1, table=_table({1: 2.0, 2: 0.8, 4: 0.8, 6: 2.0}))
    _profile(r)
    recorder = _Recorder(r.op)
    r.layer.indexer.indexer_op = recorder
    q, w = _inputs(g, 40)
    # vLLM's builder marks a batch it packs (requires_padding: decode lengths that are
    # not uniform, which its CPU split already sends to prefill); and a prefill beside
    # the decodes (vLLM's CPU build cannot build prefill chunks: a Triton kernel).  The
    # decision reads those fields only.
    uniform = _batch(r, g, [1500, 300, 700], [2, 2, 2]).meta
    ragged = dataclasses.replace(
        uniform, decode=dataclasses.replace(uniform.decode, requires_padding=True)
    )
    with set_forward_context({PREFIX: ragged}, r.config):
        _region(r, q[:5], w[:5])
    assert recorder.calls == [5], "vLLM's padded layout: vLLM's op"
    mixed = dataclasses.replace(uniform, num_prefills=1, num_prefill_tokens=30)
    with set_forward_context({PREFIX: mixed}, r.config):
        _region(r, q[:36], w[:36])
    assert recorder.calls == [5, 36], "a step with a prefill: vLLM's op"
    slow = _batch(r, g, [1500, 300], [2, 2])
    with set_forward_context({PREFIX: slow.meta}, r.config):
        _region(r, q[:4], w[:4])
    assert recorder.calls == [5, 36, 4], "4 rows: measured slower, vLLM's op"
    fast = _batch(r, g, [1500, 300, 900], [2, 2, 2])
    with set_forward_context({PREFIX: fast.meta}, r.config):
        _region(r, q[:6], w[:6])
    assert recorder.calls == [5, 36, 4], "6 rows: measured faster, ours"
    assert len(r.mqa_calls) == 5  # profile + four steps

    for table, switches, reason in (
        (_table(None), None, "not measured on NVIDIA H200"),
        (FASTER, Switches(indexer_disable=True), "DSV4_INDEXER_DISABLE=1"),
        (None, None, "no measured table"),
    ):
        other = rig(0, table=table, switches=switches)
        _profile(other)
        assert other.runtime.indexers.scores is None, "nothing reserved"
        line = [x for x in other.info if "lightning indexer" in x]
        assert len(line) == 1 and "decode vLLM's" in line[0] and reason in line[0], line
        rec = _Recorder(other.op)
        other.layer.indexer.indexer_op = rec
        step = _batch(other, g, [1500], [1])
        with set_forward_context({PREFIX: step.meta}, other.config):
            _region(other, q[:1], w[:1])
        assert rec.calls == [1]


def test_an_error_of_ours_falls_back_once_and_fails_capture(
    rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.forward_context import set_forward_context

    g = generator(fresh_seed())
    r = rig(0)
    _profile(r)
    recorder = _Recorder(r.op)
    r.layer.indexer.indexer_op = recorder
    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("injected")

    monkeypatch.setattr(dk, "indexer_decode_topk", broken)
    q, w = _inputs(g, 4)
    step = _batch(r, g, [1500, 900], [1, 1])
    r.capturing[0] = True
    with set_forward_context({PREFIX: step.meta}, r.config), pytest.raises(RuntimeError):
        _region(r, q[:2], w[:2])
    assert recorder.calls == [] and r.warning == [], "under capture it propagates"
    r.capturing[0] = False
    for _ in range(2):
        with set_forward_context({PREFIX: step.meta}, r.config):
            _region(r, q[:2], w[:2])
    assert recorder.calls == [2, 2], "vLLM's op ran both times"
    assert len(calls) == 2, "ours tried under capture and once outside it, then off"
    assert len(r.warning) == 1 and "injected" in r.warning[0], r.warning
    assert r.runtime.indexers.scores is None, "the scratch no kind takes is released"
