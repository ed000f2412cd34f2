"""The DSV4-shaped prefill of ``test_prefill_forward.py`` at larger sizes, compiled on a GPU.

Index top-k 512 (V4-Flash), C128A rows as wide as vLLM makes them (no clamp),
a 20,000-token cached request (5,000+ C4A entries), a 1,024-token fresh
request, a request prefilled in two chunks, and the head counts of the
flagship presets: 8 (V4-Flash TP8), 16 (V4-Pro TP8), 64 (V4-Flash DP).  Run
with ``python3 -m pytest -m gpu`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_attention.prefill import PrefillPlan, forward_prefill
from dsv4_kernels.sparse_mla import prefill_group_size
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import V41_LAYERS, Scenario, StepRequest
from .test_prefill_forward import layer_kwargs, run_scenario

pytestmark = pytest.mark.gpu

GPU_STEPS = [
    [StepRequest("fresh", 0, 1024), StepRequest("chunked", 0, 700)],
    [
        StepRequest("chunked", 700, 900),
        StepRequest("long", 20000, 256),
        StepRequest("short", 40, 17),
    ],
]


@pytest.fixture
def gpu() -> torch.device:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    return torch.device("cuda")


@pytest.mark.parametrize("heads", [8, 16, 64])
def test_dsv4_shaped_prefill_gpu(heads: int, gpu: torch.device) -> None:
    # vLLM's C128A width: next power of two of max_seq_len // 128, at least 128
    sc = Scenario(GPU_STEPS, heads=heads, topk=512, c128a_topk=256, seed=fresh_seed(), device=gpu)
    # C4A first: its window and C4A rows come from one fused launch; the SWA layer
    # reuses the window rows, the C128A layer adds one launch; where the forward groups
    # tokens (Hopper, up to 16 heads) the SWA and C128A layers take grouped rows
    # instead: one launch for the SWA layer's, one for the C128A layer's
    q = torch.empty((1, heads, 512), dtype=torch.bfloat16, device=gpu)
    launches = 2 if prefill_group_size(q) == 1 else 3
    run_scenario(sc, ["c4a", "swa", "c128a"], padded_heads=64, expect_launches=lambda s: launches)


@pytest.mark.parametrize("heads,topk", [(8, 512), (16, 1024)])
def test_v41_shaped_prefill_gpu(heads: int, topk: int, gpu: torch.device) -> None:
    """DeepSeek-V4.1's layers at TP8's heads (window-only; top-k rows over full-length and
    ratio-2 compressed caches, pages of 256 and 128 entries): equal to the float64 oracle
    on every token and head, every real-head element written, nothing else."""
    sc = Scenario(
        GPU_STEPS,
        heads=heads,
        topk=topk,
        c128a_topk=256,
        seed=fresh_seed(),
        device=gpu,
        layers=V41_LAYERS,
    )
    run_scenario(sc, ["c1a", "swa", "c2a"], padded_heads=64)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_dsv4_shaped_prefill_group_sizes_gpu(group: int, gpu: torch.device) -> None:
    """Each group size the forward may pick (and 1: per-token rows) at 8 heads."""
    sc = Scenario(GPU_STEPS, heads=8, topk=512, c128a_topk=256, seed=fresh_seed(), device=gpu)
    run_scenario(sc, ["swa", "c128a"], padded_heads=64, group_size=group)


def test_c128a_clamped_rows_gpu(gpu: torch.device) -> None:
    """A C128A row width below the longest request's entries: rows clamp to it."""
    steps = [[StepRequest("long", 30000, 64), StepRequest("fresh", 0, 300)]]
    sc = Scenario(steps, heads=16, topk=512, c128a_topk=128, seed=fresh_seed(), device=gpu)
    run_scenario(sc, ["c128a"], padded_heads=64)


def test_allocating_output_matches_given_output_gpu(gpu: torch.device) -> None:
    sc = Scenario(
        [[StepRequest("a", 500, 300)]],
        heads=8,
        topk=512,
        c128a_topk=128,
        seed=fresh_seed(),
        device=gpu,
    )
    inputs = sc.prepare_step(0)
    plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    q = random_q(inputs.num_tokens, 8, generator=sc.g, device="cpu").to(gpu)
    for layer in ("swa", "c4a", "c128a"):
        kw = layer_kwargs(sc, layer, inputs)
        fresh = forward_prefill(q, plan, **kw)
        given = torch.full_like(fresh, float("nan"))
        forward_prefill(q, plan, out=given, **kw)
        assert torch.equal(fresh, given), layer
