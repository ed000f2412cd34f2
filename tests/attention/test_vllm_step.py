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

Every test drives the plugin's attention class over a fresh runtime
(:class:`~dsv4_attention.runtime.HeadExactRuntime`, built as the plugin builds
it: its device, its measured table, its access to vLLM's forward context,
workspace manager, logger and dual-batch state), so no step state, scratch or
layer-kind decision leaks from one test into the next.

Checks: one plan per step (index builds counted), every layer's output against
the pure-torch reference over its own tables, scratch reserved in the profile
run and used by the largest step with the workspace locked, kernels compiled in
the profile run, and the cache layout guard.
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import policy
from dsv4_attention.facts import ServingConfig
from dsv4_attention.policy import Switches
from dsv4_attention.prefill import PrefillPlan, reference_forward_prefill
from dsv4_attention.runtime import HeadExactRuntime, make_attention_cls
from dsv4_attention.tables import table_for
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_hopper import hopper_attention_class
from .conftest import PoolRecorder
from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm

HEADS, PADDED = 8, 64
# V4-Flash's order in miniature: two SWA-only layers, then C4A and C128A alternating.
RATIOS = (1, 1, 4, 128, 4, 128, 4, 128)
MAX_TOKENS = 64  # vLLM's max_num_batched_tokens for these tests
MAX_MODEL_LEN = 4096
# (the kernels run through Triton's interpreter here: sizes are kept small)
SERVING = ServingConfig(
    architectures=("DeepseekV4ForCausalLM",),
    max_num_batched_tokens=MAX_TOKENS,
    max_model_len=MAX_MODEL_LEN,
)
# These tests drive the prefill only: a runtime with decode off does not compile the
# decode kernels at each layer kind's first contact (test_vllm_decode.py does).
PREFILL_ONLY = Switches(decode_disable=True)


@pytest.fixture(scope="module")
def ours_cls() -> Iterator[type]:
    """The plugin's attention class, as vLLM's wrapped selector returns it on Hopper."""
    with hopper_attention_class() as cls:
        assert cls.__name__ == "Dsv4HeadExactFlashMLAAttention"
        yield cls


def head_exact_cls(
    plugin_cls: type,
    serving: ServingConfig = SERVING,
    switches: Switches = PREFILL_ONLY,
    table: Any = None,
) -> type:
    """The plugin's construction over vLLM's FlashMLA class with a fresh runtime: the
    device, measured table (or ``table``) and access to vLLM of the runtime the plugin
    built (``plugin_cls.dsv4_runtime``), this serving config and these switches."""
    built: HeadExactRuntime = plugin_cls.dsv4_runtime
    table = built.table if table is None else table
    runtime = HeadExactRuntime(serving, built.device, table, switches, built.access)
    return make_attention_cls(plugin_cls.__mro__[1], runtime)


@pytest.fixture
def fresh_cls(ours_cls: type) -> type:
    """The plugin's attention class over a fresh runtime (nothing decided, reserved or
    warmed up; no step state), decode off."""
    return head_exact_cls(ours_cls)


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


def _reference(
    layer: types.SimpleNamespace, step: dict, q: torch.Tensor, heads: int = HEADS
) -> torch.Tensor:
    """The pure-torch prefill of ``layer`` over the step's own tables, on ``heads`` heads,
    its window starting no lower than its own metadata's window region (the last
    ``prefill_gather_lens`` tokens of each request)."""
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
    floor = (swa.prefill_seq_lens - swa.prefill_gather_lens).to(torch.int32)
    return reference_forward_prefill(
        q[d:, :heads],
        plan,
        compress_ratio=layer.compress_ratio,
        scale=layer.scale,
        swa_cache=layer.swa_view.view,
        swa_block_table=swa.block_table[num_dec:],
        attn_sink=layer.attn_sink[:heads],
        window_floor=floor,
        **comp,  # type: ignore[arg-type]
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the runtime warned (a step of ours that raised and went back to vLLM)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("dsv4_attention") and r.levelname == "WARNING"
    ]


def test_plugin_runtime_is_the_one_the_tests_build_on(ours_cls: type) -> None:
    """The runtime the plugin's start-up decision built on this (forced) CPU platform
    decides as on the H200 with its measured table, and reaches vLLM's forward context
    and workspace manager (the fresh runtimes below take the same)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from dsv4_attention import plugin

    rt = ours_cls.dsv4_runtime
    assert isinstance(rt, HeadExactRuntime) and plugin.runtime() is rt
    assert rt.device.capability == (9, 0) and rt.device.wgmma and rt.device.forced
    assert rt.table is not None and rt.table is table_for("NVIDIA H200", (9, 0))
    # read from the environment at the decision (the forcing switch only: nothing off)
    assert rt.switches == Switches(force=True)
    assert rt.access.forward_context() is None
    assert rt.access.workspace() is None  # vLLM's workspace manager is not initialised
    assert not rt.access.dual_batch()
    with set_forward_context({}, VllmConfig()):
        ctx = rt.access.forward_context()
        assert ctx is not None and ctx.attn_metadata == {}


def test_window_caches_form_two_groups_under_vllms_grouping() -> None:
    """The fact the scratch is sized by: vLLM puts DSV4's window caches in two groups."""
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=48 << 20, ratios=RATIOS)
    groups = {v.group for v in views if v.kind == "window"}
    assert len(groups) == 2
    assert 2 * len(groups) <= policy.WINDOW_ROW_SETS  # per-token and grouped rows of each


def test_one_plan_per_step_across_vllms_cache_groups(fresh_cls: type) -> None:
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
    rt = fresh_cls.dsv4_runtime
    plans = []
    with set_forward_context(step["dict"], VllmConfig()):
        for layer in model.layers:
            out = _run_layer(fresh_cls, layer, step, q)
            plans.append(rt._step.plan)
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
    assert plans[0] is not None and all(p is plans[0] for p in plans), "plan rebuilt in the step"
    # decided at first contact (no profile run here): every kind's prefill is ours, the
    # plan's rows are views of the scratch reserved then (no workspace manager: torch's)
    assert sorted(rt.kinds) == [(1, HEADS), (4, HEADS), (128, HEADS)]
    assert all(state.prefill.ours for state in rt.kinds.values()), rt.kinds
    assert not any(state.decode.ours for state in rt.kinds.values())  # switched off
    assert plans[0].scratch is rt.prefill_scratch is not None
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
        out = _run_layer(fresh_cls, model.layers[0], step2, q[:3])
    assert rt._step.plan is not None and rt._step.plan is not plans[0]
    assert rt._step.plan.num_tokens == 3
    torch.testing.assert_close(
        out[:, :HEADS].float(),
        _reference(model.layers[0], step2, q[:3]).float(),
        atol=2e-2,
        rtol=2e-2,
    )


def test_window_groups_whose_metadata_differ_each_get_their_own_rows(fresh_cls: type) -> None:
    """DSV4's two window KV-cache groups each get their own metadata object in a step; where
    those differ in their window region (``prefill_gather_lens``: here the second group's
    windows are cut to the last 40 positions before each chunk, as a bounded replay cuts
    them), every layer reads its own group's window: each equals the reference over its
    own metadata, and the two groups' layers differ from each other's reference."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    seed = fresh_seed()
    g = generator(seed)
    model = Model(g)
    step = model.step([1, 12, 7, 5], [300, 1500, 2600, 240], num_decodes=1)
    groups = model.window_groups
    cut = step["dict"][next(x.swa_prefix for x in model.layers if x.swa_view.group == groups[1])]
    qlen = cut.prefill_query_lens_cpu
    cut.prefill_gather_lens = torch.minimum(cut.prefill_seq_lens, qlen + 40).to(torch.int32)
    q = torch.randn(step["total"], PADDED, 512, generator=g).to(torch.bfloat16)
    d = step["num_decode_tokens"]
    with set_forward_context(step["dict"], VllmConfig()):
        for layer in model.layers:
            out = _run_layer(fresh_cls, layer, step, q)
            want = _reference(layer, step, q)
            torch.testing.assert_close(
                out[d:, :HEADS].float(), want.float(), atol=2e-2, rtol=2e-2,
                msg=lambda m, layer=layer: f"seed {seed}, {layer.prefix}: {m}",
            )  # fmt: skip
            other = next(
                x.swa_prefix for x in model.layers if x.swa_view.group != layer.swa_view.group
            )
            mine = copy.copy(step["dict"][layer.swa_prefix])  # its tables, the other's region
            mine.prefill_gather_lens = step["dict"][other].prefill_gather_lens
            swapped = dict(step, dict={**step["dict"], layer.swa_prefix: mine})
            wrong = _reference(layer, swapped, q)
            assert (wrong.float() - want.float()).abs().max() > 0.1, layer.prefix
    rt = fresh_cls.dsv4_runtime
    assert all(state.prefill.ours for state in rt.kinds.values()), rt.kinds


def test_profile_run_reserves_what_the_largest_step_uses(
    fresh_cls: type,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    pool_recorder: PoolRecorder,
) -> None:
    """vLLM's profile run (its own forward_mqa without metadata, its own workspace
    manager) decides every layer kind, reserves the prefill scratch (inside the
    allocation context vLLM's manager allocates its workspace in) and compiles the
    kernels; with the workspace locked as after vLLM's warm-up, the largest step runs on
    those buffers alone (vLLM's own prefill never runs, nothing is warned)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import workspace

    from dsv4_attention.scratch import prefill_scratch_sizes, scratch_bytes
    from dsv4_kernels import sparse_mla

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1, 4, 128))
    rt = fresh_cls.dsv4_runtime
    base = fresh_cls.__mro__[1]
    made = pool_recorder.made  # tensors torch.empty made inside vLLM's allocation context
    workspace.init_workspace_manager(torch.device("cpu"), alloc_context=pool_recorder.pool)
    try:
        with set_forward_context(None, VllmConfig()), caplog.at_level("INFO"):
            for layer in model.layers:
                layer.PREFILL_CHUNK_SIZE = fresh_cls.PREFILL_CHUNK_SIZE
                q = torch.zeros(MAX_TOKENS, PADDED, 512, dtype=torch.bfloat16)
                out = torch.full_like(q, 3.0)
                fresh_cls.forward_mqa(layer, q, None, torch.zeros(MAX_TOKENS), out)
                assert bool((out == 0).all())  # vLLM's profile path ran (it zeroes)
        # every kind decided in the profile run, its kernels compiled there
        assert sorted(rt.kinds) == [(1, HEADS), (4, HEADS), (128, HEADS)]
        for state in rt.kinds.values():
            assert state.prefill.ours and state.prefill.reason == "every step", state
            assert state.warmup_seconds > 0
        kind_lines = [r.getMessage() for r in caplog.records if "local heads" in r.getMessage()]
        assert len(kind_lines) == 3 and all("prefill ours" in line for line in kind_lines)
        # the scratch: the largest step of every kind, reserved once, from vLLM's manager
        group = sparse_mla.prefill_group_size(torch.zeros(1, HEADS, 512, dtype=torch.bfloat16))
        spec = rt.prefill_scratch.spec
        assert spec == policy.prefill_scratch_spec(
            [state.facts for state in rt.kinds.values()], group
        )
        assert spec.max_tokens == MAX_TOKENS and spec.max_heads == HEADS
        assert spec.c4a_topk == 512 and spec.c128a_width == 128  # 4096 / 128 -> 32 -> 128
        assert rt.reserved == {"prefill": scratch_bytes(spec)}
        memory = [
            r.getMessage() for r in caplog.records if "in vLLM's profile run" in r.getMessage()
        ]
        assert len(memory) == 1 and f"budget {MAX_TOKENS} tokens" in memory[0], memory
        assert "workspace memory pool" in memory[0]
        reserved = dict(rt.prefill_scratch.buffers)
        assert set(reserved) == set(prefill_scratch_sizes(spec))
        # every buffer allocated inside the manager's allocation context (sleep's pool)
        assert all(t.data_ptr() in made for t in reserved.values())
        monkeypatch.setattr(torch, "empty", pool_recorder.real_empty)
        workspace.lock_workspace()
        monkeypatch.setattr(
            base, "_forward_prefill", lambda self, **kw: pytest.fail("vLLM's prefill ran")
        )
        caplog.clear()
        # the largest step: MAX_TOKENS prefill tokens, the longest context
        step = model.step([MAX_TOKENS - 16, 16], [MAX_MODEL_LEN, 900], num_decodes=0)
        q = torch.randn(step["total"], PADDED, 512, generator=g).to(torch.bfloat16)
        with set_forward_context(step["dict"], VllmConfig()), caplog.at_level("INFO"):
            for layer in model.layers:
                out = _run_layer(fresh_cls, layer, step, q)
                assert not bool(out[:, :HEADS].isnan().any()), "a row was not written"
                torch.testing.assert_close(
                    out[:, :HEADS].float(), _reference(layer, step, q).float(), atol=2e-2, rtol=2e-2
                )
        assert _warnings(caplog) == []
        assert all(state.prefill.ours for state in rt.kinds.values()), rt.kinds
        assert rt.prefill_scratch.spec is spec  # nothing reserved again
        plan = rt._step.plan
        assert plan is not None and plan.scratch is rt.prefill_scratch
        buffers = list(reserved.values())
        rows = [t for entry in plan._rows.values() for t in entry[1:]]
        assert rows, "the plan built no rows"
        for tensor in rows:
            assert any(
                b.data_ptr() <= tensor.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                for b in buffers
            ), "a row buffer of the step is not one of the reserved scratch"
    finally:
        workspace.reset_workspace_manager()


def test_foreign_cache_layout_keeps_vllms_path(
    fresh_cls: type, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer whose cache is not DSV4's 584-byte UE8M0 pages (here: a bf16-sized view,
    as another model's layout would be) runs vLLM's own prefill, with one log line; its
    kind stays ours (another layer with DSV4's pages runs ours in the same step)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    layer, other = model.layers
    foreign = torch.zeros(layer.swa_view.view.shape[0], 64, 1024, dtype=torch.uint8)
    layer.swa_view = types.SimpleNamespace(view=foreign, group=layer.swa_view.group)
    step = model.step([4], [200], num_decodes=0)
    called = []
    base = fresh_cls.__mro__[1]
    monkeypatch.setattr(base, "_forward_prefill", lambda self, **kw: called.append(self.prefix))
    with set_forward_context(step["dict"], VllmConfig()), caplog.at_level("INFO"):
        q = torch.randn(4, PADDED, 512, generator=g).to(torch.bfloat16)
        _run_layer(fresh_cls, layer, step, q)
        _run_layer(fresh_cls, layer, step, q)
        out = _run_layer(fresh_cls, other, step, q)
    assert called == [layer.prefix, layer.prefix]
    assert not bool(out[:, :HEADS].isnan().any())  # the other layer ran ours
    lines = [r.getMessage() for r in caplog.records if "keeps vLLM's attention" in r.getMessage()]
    assert len(lines) == 1 and "584" in lines[0] and layer.prefix in lines[0], lines
    assert fresh_cls.dsv4_runtime.kinds[(1, HEADS)].prefill.ours
    assert _warnings(caplog) == []


def test_dual_batch_overlap_keeps_vllms_path(
    fresh_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While vLLM overlaps two micro-batches (its ``dbo_enabled()``, read through the
    runtime's access to vLLM), the process-wide scratch would be shared: vLLM's own
    prefill runs; the next step without overlap runs ours again."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker import ubatching

    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    layer = model.layers[0]
    step = model.step([4], [200], num_decodes=0)
    called = []
    base = fresh_cls.__mro__[1]
    monkeypatch.setattr(base, "_forward_prefill", lambda self, **kw: called.append(1))
    q = torch.randn(4, PADDED, 512, generator=g).to(torch.bfloat16)
    with set_forward_context(step["dict"], VllmConfig()):
        monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 0)
        assert ubatching.dbo_enabled()
        _run_layer(fresh_cls, layer, step, q)
        assert called == [1]
        monkeypatch.delitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident())
        out = _run_layer(fresh_cls, layer, step, q)
        assert called == [1] and not bool(out[:, :HEADS].isnan().any())
    assert fresh_cls.dsv4_runtime.kinds[(1, HEADS)].prefill.ours
