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

from dsv4_attention import vllm_backend as vb
from dsv4_attention.prefill import PrefillPlan, forward_prefill, reference_forward_prefill
from dsv4_attention.scratch import (
    PrefillScratch,
    ScratchSpec,
    ScratchTooSmall,
    prefill_scratch_sizes,
    scratch_bytes,
)
from dsv4_kernels.geometry import TOKEN_BYTES, page_stride_bytes
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import Scenario, StepRequest
from .test_prefill_forward import layer_kwargs


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


@pytest.mark.parametrize("group", [1, 4])
def test_plan_builds_into_the_scratch_and_matches_the_reference(
    group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and lse of every layer type live in the scratch; outputs equal the reference."""
    from dsv4_kernels import sparse_mla

    monkeypatch.setattr(sparse_mla, "prefill_group_size", lambda q: group)
    steps = [[StepRequest("a", 300, 9), StepRequest("b", 0, 7)]]
    sc = Scenario(
        steps, heads=4, topk=64, c128a_topk=8, seed=fresh_seed(), device=torch.device("cpu")
    )
    inputs = sc.prepare_step(0)
    spec = ScratchSpec(
        max_tokens=inputs.num_tokens + 3, max_heads=4, max_group=4, c4a_topk=64, c128a_width=8
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
    rows = [*plan._rows.values(), *plan._grouped.values()]
    assert rows, "the plan built no shared rows"
    for entry in rows:
        built = entry[1:] if isinstance(entry[1], torch.Tensor) else entry[1]
        for t in built:
            if isinstance(t, torch.Tensor):
                assert _inside(t, scratch), "a row of the step is not a view of the scratch"
    assert (scratch.buffers["lse"][: inputs.num_tokens * 4] != -77).all()


def test_plan_refuses_more_row_sets_than_reserved() -> None:
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
    forward_prefill(q, plan, **kw)
    other = kw["swa_block_table"].clone()  # a second window table: a second row set
    out = torch.full((inputs.num_tokens, 2, 512), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ScratchTooSmall, match="window"):
        forward_prefill(q, plan, out=out, **{**kw, "swa_block_table": other})
    assert bool(out.isnan().all()), "the refused call wrote output"


def _page_view(pages: int, slots: int, width: int = TOKEN_BYTES, stride: int | None = None):
    stride = page_stride_bytes(slots) if stride is None else stride
    flat = torch.zeros(pages * stride + width, dtype=torch.uint8)
    return flat.as_strided((pages, slots, width), (stride, width, 1))


@pytest.mark.parametrize(
    ("cache", "slots", "dtype", "problem"),
    [
        (_page_view(3, 64), 64, "fp8_ds_mla", None),
        (_page_view(3, 64), 64, "fp8", None),
        (_page_view(3, 64, width=528), 64, "fp8_ds_mla", "528"),  # V4.1's MXFP8 record
        (_page_view(3, 64), 2, "fp8_ds_mla", "expected (2, 584)"),
        (_page_view(3, 64, stride=64 * 584), 64, "fp8_ds_mla", "page stride"),
        (torch.zeros(3, 64, 584, dtype=torch.bfloat16), 64, "fp8_ds_mla", "bfloat16"),
        (_page_view(3, 64), 64, "auto", "kv_cache_dtype 'auto'"),
        (None, 64, "fp8_ds_mla", "not a tensor"),
    ],
)
def test_cache_layout_problem(cache, slots: int, dtype: str, problem: str | None) -> None:  # type: ignore[no-untyped-def]
    layer = types.SimpleNamespace(kv_cache_dtype=dtype)
    found = vb.cache_layout_problem(layer, cache, slots, "window")
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


def test_layout_checked_once_per_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setitem(vb._RUNTIME, "log", lines.append)
    layer = types.SimpleNamespace(kv_cache_dtype="fp8_ds_mla", prefix="layers.3.attn")
    bad = _page_view(3, 64, width=528)
    assert not vb.layout_ok(layer, bad, None, 64, None)
    assert not vb.layout_ok(layer, bad, None, 64, None)
    assert len(lines) == 1 and "layers.3.attn" in lines[0]
    good = _page_view(3, 64)
    assert vb.layout_ok(layer, good, None, 64, None)  # a new binding is checked again
