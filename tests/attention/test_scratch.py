"""The prefill scratch: sizes, views, refusals, and a plan that builds into it (CPU).

The plan's rows and the forward's lse must be views of the scratch (nothing
allocated by the step on a GPU: ``test_prefill_forward_gpu.py`` counts torch's
allocations there), and a step larger than the reservation must be refused
before anything is written, so vLLM's own path can run instead.
"""

from __future__ import annotations

import types

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import policy, vllm_calls
from dsv4_attention.facts import FAMILY_RATIOS, LayerFacts, ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.prefill import PrefillPlan, forward_prefill, reference_forward_prefill
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess
from dsv4_attention.scratch import (
    PrefillScratch,
    ScratchSpec,
    ScratchTooSmall,
    prefill_scratch_sizes,
    scratch_bytes,
)
from dsv4_kernels.geometry import TOKEN_BYTES, RowKind, page_stride_bytes
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import Scenario, StepRequest
from .test_prefill_forward import layer_kwargs

LAYER_RATIOS = FAMILY_RATIOS["v4"]


def test_sizes_cover_every_row_kind() -> None:
    spec = ScratchSpec(max_tokens=100, max_heads=16, max_group=4, c4a_topk=512, c128a_width=256)
    sizes = prefill_scratch_sizes(spec)
    assert sizes["lse"] == (100 * 16, torch.float32)
    assert sizes["window0"] == (100 * (128 + 3), torch.int32)
    assert sizes["c4a"] == (100 * 512, torch.int32)
    assert sizes["c128a0"] == (100 * 256, torch.int32)
    assert sum(1 for n in sizes if n.startswith("window") and n[6:].isdigit()) == 2
    assert scratch_bytes(spec) == sum(n * d.itemsize for n, d in sizes.values())
    assert "c4a" not in prefill_scratch_sizes(ScratchSpec(max_tokens=1, max_heads=1))


def test_block_rows_reserve_requests_not_rows_of_entries() -> None:
    """With the C128A rows read through the block table the scratch holds each token's
    request instead of a ``[tokens, c128a_width]`` row: at 1M context and a 16K budget
    (width 8192) that is 512 MiB less."""
    rows = ScratchSpec(max_tokens=16384, max_heads=8, max_group=4, c128a_width=8192)
    blocks = ScratchSpec(**{**rows.__dict__, "c128a_blocks": 1})
    sizes = prefill_scratch_sizes(blocks)
    assert "c128a0" not in sizes and sizes["c128a0_req"] == (16384, torch.int32)
    assert sizes["c128a0_lens"] == prefill_scratch_sizes(rows)["c128a0_lens"]
    saved = scratch_bytes(rows) - scratch_bytes(blocks)
    assert saved == 16384 * 8192 * 4 - 16384 * 4
    assert rows.merged(blocks).c128a_blocks == 1


def test_merged_spec_covers_both() -> None:
    a = ScratchSpec(max_tokens=100, max_heads=8, c4a_topk=512)
    b = ScratchSpec(max_tokens=50, max_heads=16, c128a_width=128, max_group=4)
    m = a.merged(b)
    assert (m.max_tokens, m.max_heads, m.c4a_topk, m.c128a_width, m.max_group) == (
        100,
        16,
        512,
        128,
        4,
    )


def test_take_views_and_refuses_too_large() -> None:
    scratch = PrefillScratch(ScratchSpec(max_tokens=10, max_heads=2))
    view = scratch.take("window0", (10, 128))
    assert view.data_ptr() == scratch.buffers["window0"].data_ptr()
    with pytest.raises(ScratchTooSmall, match="window0"):
        scratch.take("window0", (11, 128))
    with pytest.raises(ScratchTooSmall, match="c4a"):
        scratch.take("c4a", (1, 512))  # not reserved: no C4A top-k in the spec


def _inside(t: torch.Tensor, scratch: PrefillScratch) -> bool:
    return any(
        b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
        for b in scratch.buffers.values()
    )


@pytest.mark.parametrize("group, blocks", [(1, False), (4, False), (1, True), (4, True)])
def test_plan_builds_into_the_scratch_and_matches_the_reference(
    group: int, blocks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and lse of every layer type live in the scratch; outputs equal the reference.
    With ``blocks`` (the table's ``c128a_block_rows``) the C128A rows are each token's
    length and request in the scratch, read through vLLM's compressed block table."""
    from dsv4_kernels import sparse_mla

    monkeypatch.setattr(sparse_mla, "prefill_group_size", lambda q, tiles=None: group)
    steps = [[StepRequest("a", 300, 9), StepRequest("b", 0, 7)]]
    sc = Scenario(
        steps, heads=4, topk=64, c128a_topk=8, seed=fresh_seed(), device=torch.device("cpu")
    )
    inputs = sc.prepare_step(0)
    spec = ScratchSpec(
        max_tokens=inputs.num_tokens + 3,
        max_heads=4,
        max_group=4,
        c4a_topk=64,
        c128a_width=8,
        c128a_blocks=int(blocks),
    )
    scratch = PrefillScratch(spec)
    for buffer in scratch.buffers.values():
        buffer.fill_(-77)  # poison: every row the step uses must be written
    plan = PrefillPlan(
        inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens, scratch=scratch
    )
    q = random_q(inputs.num_tokens, 4, generator=sc.g, device="cpu")
    for layer in ("swa", "c4a", "c128a"):
        kw = layer_kwargs(sc, layer, inputs)
        out = torch.full((inputs.num_tokens, 4, 512), float("nan"), dtype=torch.bfloat16)
        forward_prefill(q, plan, out=out, **kw)
        fresh = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
        want = reference_forward_prefill(q, fresh, **kw)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert plan.c128a_blocks is blocks
    rows = [*plan._rows.values(), *plan._grouped.values()]
    assert rows, "the plan built no shared rows"
    seen_blocks = 0
    for entry in rows:
        built = entry[1:] if isinstance(entry[1], (torch.Tensor, dk.BlockRows)) else entry[1]
        for t in built:
            if isinstance(t, dk.BlockRows):  # the table is vLLM's, the requests ours
                assert t.block_table is layer_kwargs(sc, "c128a", inputs)["comp_block_table"]
                assert _inside(t.req, scratch), "the requests are not a view of the scratch"
                seen_blocks += 1
            elif isinstance(t, torch.Tensor):
                assert _inside(t, scratch), "a row of the step is not a view of the scratch"
    assert seen_blocks == int(blocks)
    assert (scratch.buffers["lse"][: inputs.num_tokens * 4] != -77).all()


def test_plan_reuses_slots_when_a_step_has_more_row_sets_than_reserved() -> None:
    """More distinct window tables in a step than reserved row sets (DeepSeek-V4.1's window
    caches form many KV-cache groups): the set built first gives up its slot, a later
    layer of its table builds its rows again, and every output equals the reference."""
    steps = [[StepRequest("a", 100, 5)]]
    sc = Scenario(
        steps, heads=2, topk=64, c128a_topk=8, seed=fresh_seed(), device=torch.device("cpu")
    )
    inputs = sc.prepare_step(0)
    scratch = PrefillScratch(
        ScratchSpec(max_tokens=inputs.num_tokens, max_heads=2, c4a_topk=64, window_slots=1)
    )
    plan = PrefillPlan(
        inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens, scratch=scratch
    )
    kw = layer_kwargs(sc, "swa", inputs)
    q = random_q(inputs.num_tokens, 2, generator=sc.g, device="cpu")
    other = kw["swa_block_table"].clone()  # a second window table: a second row set
    ref = reference_forward_prefill(q, plan, **kw).float()
    outs = []
    for table, launches, evictions in ((kw["swa_block_table"], 1, 0), (other, 2, 1),
                                       (kw["swa_block_table"], 3, 2), (other, 4, 3)):  # fmt: skip
        out = torch.full((inputs.num_tokens, 2, 512), float("nan"), dtype=torch.bfloat16)
        outs.append(forward_prefill(q, plan, out=out, **{**kw, "swa_block_table": table}))
        assert plan.launches == launches and plan.evictions == evictions
    # the same rows (both tables map the same pages) through reused slots: the same output
    assert all(torch.equal(o, outs[0]) for o in outs), "rows from a reused slot differ"
    torch.testing.assert_close(outs[0].float(), ref, atol=2e-2, rtol=2e-2)


def _page_view(pages: int, slots: int, width: int = TOKEN_BYTES, stride: int | None = None):
    stride = page_stride_bytes(slots) if stride is None else stride
    flat = torch.zeros(pages * stride + width, dtype=torch.uint8)
    return flat.as_strided((pages, slots, width), (stride, width, 1))


def _layer(ratio: int = 1, dtype: str | None = "fp8_ds_mla", **kw: object) -> types.SimpleNamespace:
    """The attributes of vLLM's DSV4 attention layer the plugin reads its facts from."""
    fields = dict(
        prefix="layers.3.attn",
        compress_ratio=ratio,
        n_local_heads=8,
        window_size=128,
        topk_indices_buffer=torch.zeros(4, 512, dtype=torch.int32),
        max_model_len=4096,
        max_num_batched_tokens=64,
        scale=512**-0.5,
    )
    if dtype is not None:
        fields["kv_cache_dtype"] = dtype
    return types.SimpleNamespace(**{**fields, **kw})


def _facts(ratio: int = 1, dtype: str | None = "fp8_ds_mla", **kw: object) -> LayerFacts:
    return LayerFacts.read(_layer(ratio, dtype, **kw), ServingConfig())


@pytest.mark.parametrize(
    ("cache", "slots", "dtype", "problem"),
    [
        (_page_view(3, 64), 64, "fp8_ds_mla", None),
        (_page_view(3, 64), 64, "fp8", None),
        (_page_view(3, 64), 64, None, None),  # a layer without a dtype: not checked
        (_page_view(1, 64, stride=64 * 584), 64, "fp8_ds_mla", None),  # one page: no stride
        (_page_view(3, 2), 2, "fp8_ds_mla", None),  # a C128A page
        (_page_view(3, 64, width=528), 64, "fp8_ds_mla", "528"),  # V4.1's MXFP8 record
        (_page_view(3, 64), 2, "fp8_ds_mla", "expected (2, 584)"),
        (_page_view(3, 64), None, "fp8_ds_mla", "expected (None, 584)"),  # no block size
        (_page_view(3, 64, stride=64 * 584), 64, "fp8_ds_mla", "page stride"),
        (torch.zeros(3, 64, 584, dtype=torch.bfloat16), 64, "fp8_ds_mla", "bfloat16"),
        (_page_view(3, 64), 64, "auto", "kv_cache_dtype 'auto'"),
        (torch.zeros(3 * 64 * 584, dtype=torch.uint8), 64, "fp8_ds_mla", "not a uint8 page view"),
        (torch.zeros(3, 584, 64, dtype=torch.uint8).transpose(1, 2), 64, "fp8_ds_mla", "strides"),
        (None, 64, "fp8_ds_mla", "not a tensor"),
    ],
)
def test_cache_layout_problem(
    cache, slots: int | None, dtype: str | None, problem: str | None
) -> None:  # type: ignore[no-untyped-def]
    """The guard over one cache, with the layer's cache dtype as its facts hold it."""
    facts = _facts(dtype=dtype)
    assert facts.kv_cache_dtype == dtype
    found = vllm_calls.cache_layout_problem(facts, cache, slots, "window")
    if problem is None:
        assert found is None, found
    else:
        assert found is not None and problem in found, found
        # a problem of the cache names which cache (the dtype is the layer's)
        assert "kv_cache_dtype" in problem or "the window cache" in found, found


def _runtime(lines: list[str]) -> HeadExactRuntime:
    """A runtime that logs into ``lines`` (no vLLM, no table: only its guard is used)."""
    access = VllmAccess(info=lines.append, warning=lines.append)
    return HeadExactRuntime(ServingConfig(), Device(None, None), None, Switches(), access)


_Q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)  # vLLM's padded queries (8 real heads)


def test_layout_checked_once_per_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard runs once per layer and cache binding (a refusal logged once, naming the
    layer); a new binding is checked again, and the binding is kept while the caches
    are the same views."""
    lines: list[str] = []
    rt = _runtime(lines)
    layer = _layer()
    facts = rt.facts(layer)
    assert rt.facts(layer) is facts  # read once, kept on the layer
    checks: list[object] = []
    real = vllm_calls.cache_layout_problem

    def counted(*args: object) -> str | None:
        checks.append(args[1])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(vllm_calls, "cache_layout_problem", counted)
    bad = _page_view(3, 64, width=528)
    assert rt.binding(layer, facts, _Q, bad, None, 64, None) is None
    assert rt.binding(layer, facts, _Q, bad, None, 64, None) is None
    assert len(checks) == 1
    assert len(lines) == 1 and "layers.3.attn" in lines[0] and "528" in lines[0], lines
    good = _page_view(3, 64)
    bound = rt.binding(layer, facts, _Q, good, None, 64, None)  # a new binding: checked again
    assert bound is not None
    assert rt.binding(layer, facts, _Q, good, None, 64, None) is bound
    assert len(checks) == 2 and len(lines) == 1
    # what it holds for the run: the typed page view, the rows, the real heads, the window
    assert bound.window.page_size == 64 and bound.window.num_slots == 192
    assert bound.window.page_stride == page_stride_bytes(64)
    assert bound.comp is None and bound.rows is RowKind.WINDOW and bound.ratio == 1
    assert (bound.heads, bound.window_size, bound.scale) == (8, 128, 512**-0.5)
    # another view of the same memory and shape is the same binding; another page size is not
    assert rt.binding(layer, facts, _Q, good[:], None, 64, None) is bound
    assert rt.binding(layer, facts, _Q, good, None, 32, None) is None
    assert len(checks) == 3


@pytest.mark.parametrize(
    ("ratio", "slots", "block_size", "problem"),
    [
        (4, 64, 256, None),  # C4A: 256 // 4 entries a page
        (128, 2, 256, None),  # C128A: 256 // 128
        (4, 2, 256, "expected (64, 584)"),  # a C128A view bound to a C4A layer
        (128, 64, 256, "expected (2, 584)"),
        (4, 64, None, "expected (None, 584)"),  # no compressed block size
    ],
)
def test_layout_checks_the_compressed_cache_at_vllms_block_size(
    ratio: int, slots: int, block_size: int | None, problem: str | None
) -> None:
    """C4A and C128A layers: the compressed cache too, at ``block_size // ratio`` entries a
    page (vLLM's metadata block size), after a good window cache."""
    lines: list[str] = []
    rt = _runtime(lines)
    layer = _layer(ratio)
    facts = rt.facts(layer)
    bound = rt.binding(layer, facts, _Q, _page_view(3, 64), _page_view(3, slots), 64, block_size)
    assert (bound is not None) == (problem is None)
    if bound is not None:
        assert lines == []
        assert bound.comp is not None and bound.comp.page_size == slots
        assert bound.rows is (RowKind.TOPK if ratio == 4 else RowKind.ALL)
    else:
        assert len(lines) == 1 and "compressed" in lines[0] and problem in lines[0], lines


def test_prefill_scratch_spec_covers_the_kinds_present() -> None:
    """The scratch holds the largest step of the kinds the prefill takes: the token budget,
    their heads, the window, the group size, the C4A top-k only with C4A layers and
    vLLM's widest C128A row (one entry per 128 tokens, rounded up to 128) only with
    C128A layers, and a window row set per group and row kind."""
    kinds = {r: _facts(r, max_model_len=16385, max_num_batched_tokens=96) for r in LAYER_RATIOS}
    assert kinds[128].c128a_width == 256 and _facts(128).c128a_width == 128
    spec = policy.prefill_scratch_spec(list(kinds.values()), 4)
    assert spec == ScratchSpec(
        max_tokens=96,
        max_heads=8,
        window_size=128,
        max_group=4,
        c4a_topk=512,
        c128a_width=256,
        window_slots=policy.WINDOW_ROW_SETS,
        c128a_slots=1,
    )
    assert policy.WINDOW_ROW_SETS == 4  # two window groups, per-token and grouped rows
    swa = policy.prefill_scratch_spec([kinds[1]], 1)
    assert (swa.c4a_topk, swa.c128a_width, swa.max_group) == (0, 0, 1)
    names = set(prefill_scratch_sizes(swa))
    assert not any(n.startswith(("c4a", "c128a")) for n in names)
    wide = _facts(1, n_local_heads=16, max_num_batched_tokens=32)
    both = policy.prefill_scratch_spec([kinds[4], wide], 2)
    assert (both.max_tokens, both.max_heads, both.c4a_topk, both.c128a_width) == (96, 16, 512, 0)
