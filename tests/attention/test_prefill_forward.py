"""The prefill forward of a DSV4 layer (dsv4_attention.prefill) on a DSV4-shaped prefill.

Three layers (SWA-only, C4A, C128A), several requests of different lengths,
one past 4 x 512 compressed entries (C4A entries past 2048; C128A clamped to
a small row width at CPU sizes), chunked: the second step's chunk attends to
keys the first step cached.  Keys are bf16, stored as FP8 pages in vLLM's
block-outer layout.  Each layer's output is checked against

* the dense float64 oracle on the bf16 keys, within the FP8 quantisation
  bound (``_prefill_scenario.fp8_bound``): lse within ``E = max_j scale |q .
  delta_j|`` (+2e-4), out within ``e^2E sum p|delta| + (e^2E - 1 + E/4 +
  2^-7) sum p|k| + 2^-8 |out|``;
* the same oracle on the pages' own values (the keys' UE8M0 round trip), at
  float32/bf16 rounding (``bf16_bound``): lse to 2e-4, which one missing,
  extra or wrong key (weight ~1/150) would break;
* the pure-torch reference forward, at bf16 rounding;

and the reference forward against vLLM 0.32's own prefill construction (bf16
workspace gathered from the same pages, ``combine_topk_swa_indices`` rows,
attention over the workspace; all through ``dsv4_kernels.reference``): the
same keys in another order, so lse to 2e-4 and out to one bf16 unit (2^-7 relative).

Outputs are poisoned (NaN) and live in vLLM's padded buffers: the real heads
of the chunk's rows must all be written, padded heads and spare rows never.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsv4_attention.prefill import PrefillPlan, forward_prefill, reference_forward_prefill
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import (
    RATIO,
    SCALE,
    TOPK_LAYERS,
    V41_LAYERS,
    Scenario,
    StepInputs,
    StepRequest,
    bf16_bound,
    fp8_bound,
)


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def layer_kwargs(sc: Scenario, layer: str, inputs: StepInputs) -> dict[str, Any]:
    ratio = RATIO[layer]
    kw: dict[str, Any] = dict(
        compress_ratio=ratio,
        scale=SCALE,
        swa_cache=sc.window_cache[layer],
        swa_block_table=inputs.window_table,
        swa_block_size=64,
        attn_sink=sc.sinks[layer].to(sc.device),
    )
    if layer != "swa":
        kw.update(
            comp_cache=sc.comp_cache[layer],
            comp_block_table=inputs.comp_table,
            comp_block_size=256 // ratio,
        )
    if layer in TOPK_LAYERS:
        kw["topk_indices"] = inputs.topk[layer]
    if ratio == 128:
        kw["c128a_topk"] = sc.c128a_topk
    return kw


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    err = (got.cpu().to(torch.float64) - want).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at "
        f"{bad.nonzero()[0].tolist()}: got {float(got.flatten()[bad.flatten().nonzero()[0]])}, "
        f"want {float(want.flatten()[bad.flatten().nonzero()[0]])}, "
        f"max err/tol {float((err / tol).max()):.3g}"
    )


def run_scenario(
    sc: Scenario,
    layer_order: list[str],
    *,
    padded_heads: int,
    spare_rows: int = 2,
    expect_launches: Callable[[int], int] | None = None,
    group_size: int | None = None,
) -> None:
    H = sc.heads
    for s in range(len(sc.steps)):
        inputs = sc.prepare_step(s)
        T = inputs.num_tokens
        plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=T)
        for layer in layer_order:
            what = f"seed {sc.seed} step {s} layer {layer}"
            # vLLM's padded q and output buffers; the layer gets the real heads
            q_pad = torch.zeros((T + spare_rows, padded_heads, 512), dtype=torch.bfloat16)
            q_pad[:T, :H] = random_q(T, H, generator=sc.g, device="cpu")
            q_pad = q_pad.to(sc.device)
            out_pad = torch.full(
                (T + spare_rows, padded_heads, 512), float("nan"), dtype=torch.bfloat16
            ).to(sc.device)
            lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=sc.device)
            kw = layer_kwargs(sc, layer, inputs)
            got = forward_prefill(
                q_pad[:, :H], plan, out=out_pad[:, :H], lse=lse, group_size=group_size, **kw
            )
            assert got.data_ptr() == out_pad.data_ptr() and got.shape == (T, H, 512)
            o = out_pad.cpu().float()
            assert bool(torch.isfinite(o[:T, :H]).all()), f"{what}: unwritten or non-finite out"
            assert bool(o[:T, H:].isnan().all()), f"{what}: wrote padded heads"
            assert bool(o[T:].isnan().all()), f"{what}: wrote rows past the chunk"
            assert bool(torch.isfinite(lse).all()), f"{what}: unwritten lse"

            q = q_pad[:T, :H].cpu()
            dense_rt = sc.dense(layer, inputs, q, round_trip=True)
            dense_bf16 = sc.dense(layer, inputs, q, round_trip=False)
            tol_out, tol_lse = bf16_bound(dense_rt)
            assert_within(lse, dense_rt["lse"], tol_lse, f"{what}: lse vs dense (FP8 values)")
            assert_within(o[:T, :H], dense_rt["out"], tol_out, f"{what}: out vs dense (FP8 values)")
            tol_out, tol_lse = fp8_bound(dense_bf16)
            assert_within(lse, dense_bf16["lse"], tol_lse, f"{what}: lse vs dense (bf16 keys)")
            assert_within(o[:T, :H], dense_bf16["out"], tol_out, f"{what}: out vs dense (bf16)")
            ref_lse = torch.empty((T, H), dtype=torch.float32, device=sc.device)
            ref = reference_forward_prefill(q_pad[:, :H], plan, lse=ref_lse, **kw)
            tol_ref = 2.0**-7 * dense_rt["abs_pk"] + 2.0**-7 * dense_rt["out"].abs() + 1e-5
            assert_within(o[:T, :H], ref.cpu().to(torch.float64), tol_ref, f"{what}: vs reference")
            if layer == "c1a":
                # V4's combine (the workspace path's reference) reads ratio 1 as SWA-only;
                # V4.1's own combine is another vLLM function: the dense oracle above is
                # this layer's check
                continue
            # vLLM's own path (bf16 workspace + request-local rows) sees the same keys
            ws_out, ws_lse = sc.workspace_forward(layer, inputs, q)
            assert_within(
                ref_lse, ws_lse.cpu().to(torch.float64), tol_lse, f"{what}: lse vs vLLM's path"
            )
            assert_within(
                ref,
                ws_out.cpu().to(torch.float64),
                # one bf16 rounding of the result, plus the workspace kernel's bf16
                # probabilities in P @ V (half a bf16 step of each p|v| term): near-zero
                # outputs from cancellation need the second term (seen on the H200 at
                # 64 heads: err/tol 1.06-1.53 on 1-3 of 38M elements without it)
                2.0**-7 * ws_out.cpu().abs().to(torch.float64)
                + 2.0**-9 * dense_rt["abs_pk"]
                + 1e-6,
                f"{what}: reference forward vs vLLM's workspace path",
            )
        if expect_launches is not None:
            assert plan.launches == expect_launches(s), f"step {s}: {plan.launches} launches"


# Two steps.  Step 0: a fresh request and the first chunk of one with a cached
# prefix.  Step 1: that request's second chunk (its window reaches into the
# first chunk's keys) and a long request (8,300 cached tokens: 2,075+ C4A
# entries, past 4 x 512; 64 C128A entries, clamped to the row width of 32).
CPU_STEPS = [
    [StepRequest("fresh", 0, 6), StepRequest("chunked", 120, 8)],
    [StepRequest("chunked", 128, 6), StepRequest("long", 8300, 3)],
]


def test_dsv4_shaped_prefill() -> None:
    sc = Scenario(
        CPU_STEPS, heads=3, topk=16, c128a_topk=32, seed=fresh_seed(), device=kernel_device()
    )
    # One index launch per layer type and step: the window rows (reused by the
    # other layers), the C4A rows, the C128A rows.
    run_scenario(sc, ["swa", "c4a", "c128a"], padded_heads=8, expect_launches=lambda s: 3)


def test_v41_shaped_prefill() -> None:
    """DeepSeek-V4.1's layers: window-only, and top-k rows over a full-length (ratio 1)
    and a ratio-2 compressed cache (each token reads its first ``min((pos+1)//r, topk)``
    top-k columns, as vLLM's V4.1 combine computes them), 584-byte records in block-outer
    pages of 256 and 128 entries; equal to the dense float64 oracle, the torch reference
    and vLLM's workspace path.  One launch for the window rows, one per top-k layer."""
    sc = Scenario(
        CPU_STEPS,
        heads=3,
        topk=16,
        c128a_topk=32,
        seed=fresh_seed(),
        device=kernel_device(),
        layers=V41_LAYERS,
    )
    run_scenario(sc, ["c1a", "swa", "c2a"], padded_heads=8, expect_launches=lambda s: 2)


@pytest.mark.parametrize("group", [2, 3, 4])
def test_dsv4_shaped_prefill_grouped(group: int) -> None:
    """SWA-only and C128A layers on grouped rows (tokens sharing keys; here expanded per
    token, since the kernel that consumes them unexpanded runs on Hopper only)."""
    sc = Scenario(
        CPU_STEPS, heads=3, topk=16, c128a_topk=32, seed=fresh_seed(), device=kernel_device()
    )
    # grouped window rows (SWA layer), the C4A rows with their own per-token window
    # rows, then the grouped C128A rows (the grouped window rows reused)
    run_scenario(
        sc, ["swa", "c4a", "c128a"], padded_heads=8, expect_launches=lambda s: 3, group_size=group
    )


def test_plan_reuses_rows_across_layers_of_a_type() -> None:
    """A second C128A or SWA layer in the step builds nothing; C4A layers build their own."""
    sc = Scenario(
        CPU_STEPS[:1], heads=1, topk=8, c128a_topk=8, seed=fresh_seed(), device=kernel_device()
    )
    inputs = sc.prepare_step(0)
    plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    rows = {}
    for i, layer in enumerate(["c128a", "swa", "c128a", "c4a", "c4a"]):
        kw = layer_kwargs(sc, layer, inputs)
        got = plan.layer_rows(
            kw["compress_ratio"],
            window_block_table=kw["swa_block_table"],
            comp_block_table=kw.get("comp_block_table"),
            topk_indices=kw.get("topk_indices"),
            c128a_topk=kw.get("c128a_topk"),
        )
        rows[i] = got
    assert plan.launches == 3  # window + C128A together, then one per C4A layer
    assert rows[2].comp is rows[0].comp and rows[1].window is rows[0].window
    assert rows[3].comp is not rows[4].comp
    # a different window block table (another KV-cache group) gets its own rows
    other = inputs.window_table.clone()
    plan.layer_rows(1, window_block_table=other)
    assert plan.launches == 4


def test_images_are_refused() -> None:
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    seq = torch.tensor([4], dtype=torch.int32)
    vis = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="vLLM's own prefill path"):
        PrefillPlan(qsl, seq, num_tokens=4, left_visible=vis, right_visible=vis)


@pytest.fixture(scope="module")
def small() -> tuple[Scenario, StepInputs, PrefillPlan]:
    sc = Scenario(
        [[StepRequest("a", 3, 5)]], heads=2, topk=8, c128a_topk=8, seed=5, device=kernel_device()
    )
    inputs = sc.prepare_step(0)
    plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    return sc, inputs, plan


# (layer, change, message); the last two are sparse_mla_paged's own checks, which the
# pure-torch reference forward does not repeat.
BAD_LAYER_ARGS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("swa", lambda kw: kw.update(compress_ratio=3), "compress_ratio must be one of"),
    ("swa", lambda kw: kw.update(comp_cache=kw["swa_cache"]), "comp_cache must be given for"),
    ("c4a", lambda kw: kw.update(comp_cache=None), "comp_cache must be given for"),
    ("c4a", lambda kw: kw.update(topk_indices=None), "topk_indices .* is needed for C4A"),
    ("c4a", lambda kw: kw.update(c128a_topk=8), "c128a_topk must be None for C4A"),
    ("c4a", lambda kw: kw.update(comp_block_table=None), "comp_block_table is needed"),
    ("c128a", lambda kw: kw.update(c128a_topk=None), "c128a_topk .* is needed"),
    (
        "c128a",
        lambda kw: kw.update(topk_indices=torch.zeros((5, 8), dtype=torch.int32)),
        "topk_indices must be None for C128A",
    ),
    (
        "swa",
        lambda kw: kw.update(comp_block_table=torch.zeros((1, 1), dtype=torch.int32)),
        "comp_block_table must be None for SWA-only",
    ),
    (
        "swa",
        lambda kw: kw.update(out=torch.empty((5, 3, 512), dtype=torch.bfloat16)),
        r"out must be \[>= 5, 2, 512\]",
    ),
]
KERNEL_ONLY_BAD_ARGS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("swa", lambda kw: kw.update(scale=-1.0), "scale must be a finite positive"),
    ("swa", lambda kw: kw.update(attn_sink=torch.zeros(3)), "attn_sink must have 2 entries"),
]


@pytest.mark.parametrize(
    "impl,layer,change,match",
    [("kernel", *case) for case in BAD_LAYER_ARGS + KERNEL_ONLY_BAD_ARGS]
    + [("reference", *case) for case in BAD_LAYER_ARGS],
)
def test_bad_input(
    impl: str,
    layer: str,
    change: Callable[[dict[str, Any]], None],
    match: str,
    small: tuple[Scenario, StepInputs, PrefillPlan],
) -> None:
    sc, inputs, plan = small
    kw = layer_kwargs(sc, layer, inputs)
    change(kw)
    q = random_q(5, 2, generator=sc.g, device=sc.device)
    fn = forward_prefill if impl == "kernel" else reference_forward_prefill
    with pytest.raises(ValueError, match=match):
        fn(q, plan, **kw)


def test_reference_takes_the_forward_s_own_signature(
    small: tuple[Scenario, StepInputs, PrefillPlan],
) -> None:
    # reference_forward_prefill binds its keywords with forward_prefill's signature:
    # an unknown or missing keyword is refused by name, group_size with the reason.
    sc, inputs, plan = small
    kw = layer_kwargs(sc, "swa", inputs)
    q = random_q(5, 2, generator=sc.g, device=sc.device)
    with pytest.raises(TypeError, match="swa_blok_size"):
        reference_forward_prefill(q, plan, swa_blok_size=64, **kw)
    missing = {k: v for k, v in kw.items() if k != "scale"}
    with pytest.raises(TypeError, match="scale"):
        reference_forward_prefill(q, plan, **missing)
    with pytest.raises(ValueError, match="group_size: reference_forward_prefill builds per-token"):
        reference_forward_prefill(q, plan, group_size=2, **kw)


def test_q_shorter_than_the_chunk_is_refused(
    small: tuple[Scenario, StepInputs, PrefillPlan],
) -> None:
    sc, inputs, plan = small
    kw = layer_kwargs(sc, "swa", inputs)
    q = random_q(4, 2, generator=sc.g, device=sc.device)
    with pytest.raises(ValueError, match=r"q must have at least plan\.num_tokens"):
        forward_prefill(q, plan, **kw)
