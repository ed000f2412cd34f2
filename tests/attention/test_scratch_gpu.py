"""On a GPU: a prefill step with the reserved scratch makes no allocation through torch's
allocator (what vLLM's memory profile could not see), and equals the step without it."""

from __future__ import annotations

import pytest
import torch

from dsv4_attention.prefill import PrefillPlan, forward_prefill
from dsv4_attention.scratch import PrefillScratch, ScratchSpec
from dsv4_kernels.sparse_mla import prefill_group_size
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import Scenario, StepRequest
from .test_prefill_forward import layer_kwargs

pytestmark = pytest.mark.gpu

STEPS = [
    [StepRequest("fresh", 0, 700), StepRequest("long", 20000, 256)],
    [StepRequest("long", 20256, 300), StepRequest("short", 40, 17), StepRequest("b", 0, 90)],
]


def _allocations() -> int:
    return int(torch.cuda.memory_stats()["allocation.all.allocated"])


@pytest.mark.parametrize("heads", [8, 16])
def test_step_with_scratch_allocates_nothing_gpu(heads: int) -> None:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    gpu = torch.device("cuda")
    sc = Scenario(STEPS, heads=heads, topk=512, c128a_topk=256, seed=fresh_seed(), device=gpu)
    steps = [sc.prepare_step(s) for s in range(len(STEPS))]
    q1 = torch.empty((1, heads, 512), dtype=torch.bfloat16, device=gpu)
    spec = ScratchSpec(
        max_tokens=max(i.num_tokens for i in steps),
        max_heads=heads,
        max_group=prefill_group_size(q1),
        c4a_topk=512,
        c128a_width=256,
    )
    scratch = PrefillScratch(spec, device=gpu)
    layers = ("swa", "c4a", "c128a")
    for s, inputs in enumerate(steps):
        q = random_q(inputs.num_tokens, heads, generator=sc.g, device="cpu").to(gpu)
        outs = {
            n: torch.full(
                (inputs.num_tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device=gpu
            )
            for n in layers
        }
        want = {}
        for layer in layers:  # without scratch first (compiles; allocates)
            plan = PrefillPlan(
                inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens
            )
            want[layer] = forward_prefill(q, plan, **layer_kwargs(sc, layer, inputs))
        torch.cuda.synchronize()
        plan = PrefillPlan(
            inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens, scratch=scratch
        )
        kwargs = {layer: layer_kwargs(sc, layer, inputs) for layer in layers}  # copies sinks
        torch.cuda.synchronize()
        before = _allocations()
        for layer in layers:
            forward_prefill(q, plan, out=outs[layer], **kwargs[layer])
        torch.cuda.synchronize()
        assert _allocations() == before, f"step {s} allocated through torch's allocator"
        for layer in layers:
            assert not bool(outs[layer].isnan().any()), f"step {s} {layer}: rows not written"
            torch.testing.assert_close(outs[layer], want[layer], atol=0, rtol=0)
