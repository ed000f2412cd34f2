"""The head-exact prefill across a whole step inside vLLM's own structures (``vllm`` session).

What vLLM's model runner really does around one attention layer, built with
vLLM's own code wherever it runs on a CPU:

* the KV-cache groups and per-layer views come from vLLM's grouping and
  allocation code for a V4-Flash-like layer list (SWA-only layers first, then
  C4A and C128A alternating): DSV4's window caches land in two groups;
* every group gets its own metadata object per step (vLLM's
  ``DeepseekSparseSWAMetadata`` / ``DeepseekV4FlashMLAMetadata``, filled field
  by field as the builders fill them, each with its own block table), and the
  layers run under vLLM's ``set_forward_context`` with the per-layer dict;
* the profile run (``attn_metadata`` None) goes through vLLM's own
  ``forward_mqa`` and vLLM's own workspace manager, which is then locked as
  vLLM locks it after warm-up.

Checks: one plan per step (index builds counted), every layer's output against
the pure-torch reference over its own tables, scratch reserved in the profile
run and used by the largest step with the workspace locked, kernels compiled in
the profile run, and the cache layout guard.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import vllm_backend as vb
from dsv4_attention.prefill import PrefillPlan, reference_forward_prefill
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_hopper import hopper_attention_class
from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm

HEADS, PADDED = 8, 64
# V4-Flash's order in miniature: two SWA-only layers, then C4A and C128A alternating.
RATIOS = (1, 1, 4, 128, 4, 128, 4, 128)
MAX_TOKENS = 64  # vLLM's max_num_batched_tokens for these tests
MAX_MODEL_LEN = 4096
# (the kernels run through Triton's interpreter here: sizes are kept small)


@pytest.fixture(scope="module")
def ours_cls() -> Iterator[type]:
    """The plugin's attention class, as vLLM's patched selector returns it on Hopper."""
    with hopper_attention_class() as cls:
        assert cls.__name__ == "Dsv4HeadExactFlashMLAAttention"
        yield cls


class Model:
    """A V4-Flash-like stack's caches (vLLM's allocator) and one step's metadata."""

    def __init__(self, g: torch.Generator, ratios: tuple[int, ...] = RATIOS) -> None:
        self.g = g
        self.ratios = ratios
        views, storage = vllm_dsv4_caches("BLHNC", available_bytes=16 << 20, ratios=ratios)
        storage.random_(0, 256, generator=g)
        self.views = {v.name: v for v in views}
        for v in views:
            if v.kind in ("window", "c4a", "c128a"):
                n = v.view.shape[0] * v.slots
                k = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
                dk.reference.quantize_and_insert_k_cache(k, v.view, torch.arange(n), v.slots)
        self.window_groups = sorted({v.group for v in views if v.kind == "window"})
        self.comp_groups = sorted({v.group for v in views if v.kind in ("c4a", "c128a")})
        self.layers = [self._layer(i, r) for i, r in enumerate(ratios)]

    def _layer(self, i: int, ratio: int) -> types.SimpleNamespace:
        sink = torch.full((PADDED,), float("-inf"))
        sink[:HEADS] = torch.randn(HEADS, generator=self.g)
        swa = self.views[f"layers.{i}.swa_cache"]
        comp = self.views.get(f"layers.{i}.attn")
        return types.SimpleNamespace(
            prefix=f"layers.{i}.attn",
            swa_prefix=swa.name,
            swa_view=swa,
            comp_view=comp,
            n_local_heads=HEADS,
            compress_ratio=ratio,
            window_size=128,
            scale=512**-0.5,
            attn_sink=sink,
            topk_indices_buffer=torch.full((MAX_TOKENS + 8, 512), -1, dtype=torch.int32),
            max_image_tokens=0,
            max_num_batched_tokens=MAX_TOKENS,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_dtype="fp8_ds_mla",
        )

    def _table(self, pages: int, per_page: int, seq: list[int]) -> torch.Tensor:
        need = [-(-s // per_page) for s in seq]
        assert sum(need) <= pages, "cache too small for the batch"
        perm = torch.randperm(pages, generator=self.g)
        rows, start = [], 0
        for n in need:
            rows.append(torch.cat([perm[start : start + n], torch.zeros(max(need) + 2 - n)]))
            start += n
        return torch.stack(rows).to(torch.int32)

    def step(self, query_lens: list[int], seq_lens: list[int], num_decodes: int) -> dict:
        """Per-layer metadata dict of one step: a metadata object per KV-cache group."""
        from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

        qlen = torch.tensor(query_lens, dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlen.cumsum(0).to(torch.int32)])
        total = int(qsl[-1])
        pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
        any_window = next(v for v in self.views.values() if v.kind == "window")
        swa_md = {}
        for group in self.window_groups:
            swa_md[group] = DeepseekSparseSWAMetadata(
                block_table=self._table(any_window.view.shape[0], 64, seq_lens),
                slot_mapping=torch.zeros(total, dtype=torch.int64),
                block_size=64,
                seq_lens=seq.clone(),
                query_start_loc=qsl.clone(),
                query_start_loc_cpu=qsl.clone(),
                num_decodes=num_decodes,
                num_prefills=len(query_lens) - num_decodes,
                num_decode_tokens=int(qsl[num_decodes]),
                num_prefill_tokens=total - int(qsl[num_decodes]),
                prefill_seq_lens=seq[num_decodes:].clone(),
                prefill_seq_lens_cpu=seq[num_decodes:].clone(),
                prefill_query_lens_cpu=qlen[num_decodes:].clone(),
                prefill_gather_lens=torch.minimum(seq, qlen + 127)[num_decodes:].to(torch.int32),
                prefill_window_size=128,
                prefill_max_model_len=MAX_MODEL_LEN,
                prefill_max_num_batched_tokens=MAX_TOKENS,
            )
        comp_md = {}
        width = max(128, 1 << max(0, (max(seq_lens) // 128 - 1).bit_length()))
        n = ((pos + 1) // 128).clamp(max=width)
        cols = torch.arange(width)[None, :]
        c128a_rows = torch.where(cols < n[:, None], cols, -1).to(torch.int32)
        for group in self.comp_groups:
            pages = next(v for v in self.views.values() if v.group == group).view.shape[0]
            comp_md[group] = DeepseekV4FlashMLAMetadata(
                num_reqs=len(query_lens),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                num_actual_tokens=total,
                query_start_loc=qsl,
                slot_mapping=torch.zeros(total, dtype=torch.int64),
                block_table=self._table(pages, 256, seq_lens),
                req_id_per_token=torch.repeat_interleave(torch.arange(len(query_lens)), qlen),
                block_size=256,
                topk_tokens=512,
                c128a_prefill_topk_indices=c128a_rows[int(qsl[num_decodes]) :],
            )
        for layer in self.layers:  # the indexer's top-k of this step, per C4A layer
            if layer.compress_ratio == 4:
                buf = layer.topk_indices_buffer.fill_(-1)
                for t in range(total):
                    avail = (int(pos[t]) + 1) // 4
                    k = min(512, avail)
                    if k:
                        buf[t, :k] = torch.randperm(avail, generator=self.g)[:k]
        by_layer: dict[str, object] = {}
        for layer in self.layers:
            by_layer[layer.swa_prefix] = swa_md[layer.swa_view.group]
            if layer.comp_view is not None:
                by_layer[layer.prefix] = comp_md[layer.comp_view.group]
        return {"dict": by_layer, "total": total, "num_decode_tokens": int(qsl[num_decodes])}


def _run_layer(
    cls: type, layer: types.SimpleNamespace, step: dict, q: torch.Tensor
) -> torch.Tensor:
    """The layer's ``_forward_prefill`` as vLLM's ``forward_mqa`` calls it; its output."""
    md = step["dict"]
    swa = md[layer.swa_prefix]
    attn = md.get(layer.prefix)
    d = step["num_decode_tokens"]
    out = torch.full((step["total"], PADDED, 512), float("nan"), dtype=torch.bfloat16)
    cls._forward_prefill(
        layer,
        q=q[d:],
        positions=torch.zeros(step["total"] - d, dtype=torch.int64),
        compressed_k_cache=None if layer.comp_view is None else layer.comp_view.view,
        swa_k_cache=layer.swa_view.view,
        output=out[d:],
        attn_metadata=attn,
        swa_metadata=swa,
    )
    return out


def _reference(layer: types.SimpleNamespace, step: dict, q: torch.Tensor) -> torch.Tensor:
    md = step["dict"]
    swa = md[layer.swa_prefix]
    attn = md.get(layer.prefix)
    num_dec, d = swa.num_decodes, step["num_decode_tokens"]
    plan = PrefillPlan(
        swa.query_start_loc[num_dec : num_dec + swa.num_prefills + 1],
        swa.prefill_seq_lens,
        num_tokens=swa.num_prefill_tokens,
    )
    comp: dict[str, object] = {}
    if layer.compress_ratio > 1:
        comp = dict(
            comp_cache=layer.comp_view.view,
            comp_block_table=attn.block_table[num_dec:],
            comp_block_size=256 // layer.compress_ratio,
        )
        if layer.compress_ratio == 4:
            comp["topk_indices"] = layer.topk_indices_buffer[d:]
        else:
            comp["c128a_topk"] = attn.c128a_prefill_topk_indices.shape[-1]
    return reference_forward_prefill(
        q[d:, :HEADS],
        plan,
        compress_ratio=layer.compress_ratio,
        scale=layer.scale,
        swa_cache=layer.swa_view.view,
        swa_block_table=swa.block_table[num_dec:],
        attn_sink=layer.attn_sink[:HEADS],
        **comp,  # type: ignore[arg-type]
    )


@pytest.fixture
def fresh_backend() -> Iterator[None]:
    """Each test starts with no step state, scratch or warm-up of an earlier test."""
    saved_scratch = dict(vb._SCRATCH)
    vb._SCRATCH.update(scratch=None, spec=None, refused=False)
    vb._STEP.update(ref=None, dict_id=None, plan=None, keys={})
    yield
    vb._SCRATCH.update(saved_scratch)
    vb._STEP.update(ref=None, dict_id=None, plan=None, keys={})


def test_window_caches_form_two_groups_under_vllms_grouping() -> None:
    """The fact the scratch is sized by: vLLM puts DSV4's window caches in two groups."""
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=48 << 20, ratios=RATIOS)
    groups = {v.group for v in views if v.kind == "window"}
    assert len(groups) == 2
    assert 2 * len(groups) <= vb.WINDOW_ROW_SETS  # per-token and grouped rows of each


def test_one_plan_per_step_across_vllms_cache_groups(ours_cls: type, fresh_backend: None) -> None:
    """Every layer of the step shares one plan although each window group has its own
    metadata object; the shared rows are built once per block table, every layer's
    output equals the reference over its own tables, and the next step starts anew."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    seed = fresh_seed()
    g = generator(seed)
    model = Model(g)
    assert len(model.window_groups) == 2
    step = model.step([1, 1, 12, 7, 5], [300, 70, 1500, 2600, 40], num_decodes=2)
    q = torch.randn(step["total"], PADDED, 512, generator=g).to(torch.bfloat16)
    plans = []
    with set_forward_context(step["dict"], VllmConfig()):
        for layer in model.layers:
            out = _run_layer(ours_cls, layer, step, q)
            plans.append(vb._STEP["plan"])
            d = step["num_decode_tokens"]
            assert bool(out[:d].isnan().all()) and bool(out[d:, HEADS:].isnan().all())
            assert not bool(out[d:, :HEADS].isnan().any()), "a real head's row was not written"
            torch.testing.assert_close(
                out[d:, :HEADS].float(),
                _reference(layer, step, q).float(),
                atol=2e-2,
                rtol=2e-2,
                msg=lambda m, layer=layer: f"seed {seed}, {layer.prefix}: {m}",
            )
    assert all(p is plans[0] for p in plans), "the plan was rebuilt within the step"
    # window rows once per window group; C128A rows once per C128A table; C4A rows are
    # each layer's own top-k (one launch per C4A layer, built with nothing else)
    c4a_layers = sum(1 for r in RATIOS if r == 4)
    c128a_tables = len(
        {layer.comp_view.group for layer in model.layers if layer.compress_ratio == 128}
    )
    assert plans[0].launches == len(model.window_groups) + c128a_tables + c4a_layers
    # the layer types share rows: this equals the number of layer types (SWA, C4A,
    # C128A) plus the C4A layers' own top-k rows
    assert plans[0].launches - c4a_layers == len(set(RATIOS))
    step2 = model.step([3], [500], num_decodes=0)
    with set_forward_context(step2["dict"], VllmConfig()):
        _run_layer(ours_cls, model.layers[0], step2, q[:3])
    assert vb._STEP["plan"] is not plans[0]


def test_profile_run_reserves_what_the_largest_step_uses(
    ours_cls: type, fresh_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's profile run (its own forward_mqa without metadata, its own workspace
    manager) reserves the prefill scratch and compiles the kernels; with the workspace
    locked as after vLLM's warm-up, the largest step runs on those buffers alone."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import workspace

    from dsv4_attention.scratch import prefill_scratch_sizes

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1, 4, 128))
    # the one accelerator call of vLLM's manager (releasing cached memory before it
    # grows) has nothing to release on a CPU and raises there
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        vb.WARMED.clear()
        with set_forward_context(None, VllmConfig()):
            for layer in model.layers:
                layer.PREFILL_CHUNK_SIZE = ours_cls.PREFILL_CHUNK_SIZE
                q = torch.zeros(MAX_TOKENS, PADDED, 512, dtype=torch.bfloat16)
                out = torch.full_like(q, 3.0)
                ours_cls.forward_mqa(layer, q, None, torch.zeros(MAX_TOKENS), out)
                assert bool((out == 0).all())  # vLLM's profile path ran (it zeroes)
        assert {key[1:3] for key in vb.WARMED} == {(HEADS, r) for r in (1, 4, 128)}
        manager = workspace.current_workspace_manager()
        spec = vb._SCRATCH["spec"]
        assert spec is not None and spec.max_tokens == MAX_TOKENS
        # vLLM's manager keys a persistent tensor as (torch.Tensor, our key)
        reserved = {
            key[1][1]: tensor
            for key, tensor in manager._persistent_resources[0].items()
            if key[1][0] == "dsv4_attention.prefill"
        }
        assert set(reserved) == set(prefill_scratch_sizes(spec))
        workspace.lock_workspace()
        # the largest step: MAX_TOKENS prefill tokens, the longest context
        step = model.step([MAX_TOKENS - 16, 16], [MAX_MODEL_LEN, 900], num_decodes=0)
        q = torch.randn(step["total"], PADDED, 512, generator=g).to(torch.bfloat16)
        with set_forward_context(step["dict"], VllmConfig()):
            for layer in model.layers:
                out = _run_layer(ours_cls, layer, step, q)
                assert not vb._SCRATCH["refused"], "a step needed more than the profile run"
                assert not bool(out[:, :HEADS].isnan().any()), "a row was not written"
                torch.testing.assert_close(
                    out[:, :HEADS].float(), _reference(layer, step, q).float(), atol=2e-2, rtol=2e-2
                )
        plan = vb._STEP["plan"]
        assert plan.scratch is vb._SCRATCH["scratch"]
        buffers = [t for t in reserved.values()]
        for rows in plan._rows.values():
            for tensor in rows[1:]:
                assert any(
                    b.data_ptr() <= tensor.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                    for b in buffers
                ), "a row buffer of the step is not one vLLM's workspace reserved"
    finally:
        workspace.reset_workspace_manager()


def test_foreign_cache_layout_keeps_vllms_path(
    ours_cls: type, fresh_backend: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer whose cache is not DSV4's 584-byte UE8M0 pages (here: a bf16-sized view,
    as another model's layout would be) runs vLLM's own prefill, with one log line."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    layer = model.layers[0]
    foreign = torch.zeros(layer.swa_view.view.shape[0], 64, 1024, dtype=torch.uint8)
    layer.swa_view = types.SimpleNamespace(view=foreign, group=layer.swa_view.group)
    step = model.step([4], [200], num_decodes=0)
    called = []
    base = ours_cls.__mro__[1]
    saved = base._forward_prefill
    base._forward_prefill = lambda self, **kw: called.append(self.prefix)
    try:
        with set_forward_context(step["dict"], VllmConfig()), caplog.at_level("INFO"):
            q = torch.randn(4, PADDED, 512, generator=g).to(torch.bfloat16)
            _run_layer(ours_cls, layer, step, q)
            _run_layer(ours_cls, layer, step, q)
    finally:
        base._forward_prefill = saved
    assert called == [layer.prefix, layer.prefix]
    lines = [r.getMessage() for r in caplog.records if "keeps vLLM's attention" in r.getMessage()]
    assert len(lines) == 1 and "584" in lines[0], lines


def test_dual_batch_overlap_keeps_vllms_path(
    ours_cls: type, fresh_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While vLLM overlaps two micro-batches (its ``dbo_enabled()``, read through the
    plugin), the process-wide scratch would be shared: vLLM's own prefill runs."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import ubatching

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    layer = model.layers[0]
    step = model.step([4], [200], num_decodes=0)
    called = []
    base = ours_cls.__mro__[1]
    monkeypatch.setattr(base, "_forward_prefill", lambda self, **kw: called.append(1))
    q = torch.randn(4, PADDED, 512, generator=g).to(torch.bfloat16)
    with set_forward_context(step["dict"], VllmConfig()):
        monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 0)
        assert ubatching.dbo_enabled()
        _run_layer(ours_cls, layer, step, q)
        assert called == [1]
        monkeypatch.delitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident())
        out = _run_layer(ours_cls, layer, step, q)
        assert called == [1] and not bool(out[:, :HEADS].isnan().any())
