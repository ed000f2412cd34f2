"""On the GPU: the plugin's runtime object decides, reserves, warms up and decodes as vLLM
drives it, with the decode captured into a CUDA graph and replayed on new queries.

The runtime is built as the plugin builds it on this machine (its device name and
capability, the Gluon kernel's availability, the measured table found for it) with
a served configuration whose decode rows are DSpark-wide (``round_up(128 + 15, 64)``
= 192 window columns) and whose token budget is below the warm-up's default sizes.
For each layer kind at 8 and 16 local heads: the profile-run decision takes our
decode, the warm-up stays within the budget, and a decode step run through
``runtime.decode`` under ``torch.cuda.graph`` equals the float reference on the
real heads after replay with fresh queries, the padded heads untouched.
"""

from __future__ import annotations

import types

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import policy
from dsv4_attention.facts import ServingConfig
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess
from dsv4_attention.tables import table_for
from dsv4_kernels.testing import fresh_seed, generator
from dsv4_kernels.testing.decode import make_decode_case

pytestmark = pytest.mark.gpu

PADDED = 64
BUDGET = 384  # below the warm-up's default 512-token decode step
WINDOW_WIDTH = 192  # DSpark k = 15


def _device() -> policy.Device:
    from dsv4_kernels.sparse_mla import wgmma_available

    cap = torch.cuda.get_device_capability()
    return policy.Device(torch.cuda.get_device_name(), (cap[0], cap[1]), wgmma=wgmma_available())


@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("layer", ["swa", "c4a", "c128a"])
def test_decode_through_the_runtime_under_cuda_graphs(layer: str, heads: int) -> None:
    dev = torch.device("cuda")
    device = _device()
    table = table_for(device.name, device.capability)
    assert table is not None, f"no measured table for {device.name}"
    serving = ServingConfig(
        architectures=("DeepseekV4ForCausalLM",),
        max_num_batched_tokens=BUDGET,
        max_model_len=8192,
        spec_method="dspark",
        num_speculative_tokens=15,
        decode_window_width=WINDOW_WIDTH,
    )
    lines: list[str] = []
    rt = HeadExactRuntime(
        serving,
        device,
        table,
        policy.Switches(),
        VllmAccess(info=lines.append, warning=lines.append),
    )
    seed = fresh_seed()
    g = generator(seed, dev)
    tokens = 8
    case = make_decode_case(layer, tokens, 1, heads, context=3000, generator=g, device=dev)
    ratio = {"swa": 1, "c4a": 4, "c128a": 128}[layer]
    topk = 512
    lay = types.SimpleNamespace(
        prefix=f"layers.0.{layer}",
        n_local_heads=heads,
        compress_ratio=ratio,
        window_size=128,
        scale=512**-0.5,
        attn_sink=torch.cat([case.sink, torch.full((PADDED - heads,), float("-inf"), device=dev)]),
        topk_indices_buffer=torch.full((BUDGET, topk), -1, dtype=torch.int32, device=dev),
        max_num_batched_tokens=BUDGET,
        max_model_len=8192,
        kv_cache_dtype="fp8_ds_mla",
        swa_cache_layer=types.SimpleNamespace(kv_cache=case.pools.swa.cache),
    )
    q_pad = torch.zeros((tokens, PADDED, 512), dtype=torch.bfloat16, device=dev)
    rt.prepare(lay, q_pad)
    state = rt.kinds[(ratio, heads)]
    assert state.decode.ours, lines
    # the window rows as vLLM's DSpark metadata holds them: [T, 1, 192], -1 past 128
    rows = torch.full((tokens, 1, WINDOW_WIDTH), -1, dtype=torch.int32, device=dev)
    rows[:, 0, :128] = case.rows.swa_indices
    swa_md = types.SimpleNamespace(
        num_decode_tokens=tokens,
        num_decodes=tokens,
        decode_swa_indices=rows,
        decode_swa_lens=case.rows.swa_lens,
        token_to_req_indices=torch.arange(tokens, dtype=torch.int32, device=dev),
        is_valid_token=torch.ones(tokens, dtype=torch.bool, device=dev),
        block_size=64,
    )
    comp = case.pools.comp
    attn_md = types.SimpleNamespace(
        block_size=256, block_table=torch.zeros((tokens, 1), dtype=torch.int32, device=dev)
    )
    if layer == "c128a":
        attn_md.c128a_global_decode_topk_indices = case.rows.comp_indices.unsqueeze(1)  # type: ignore[union-attr]
        attn_md.c128a_decode_topk_lens = case.rows.comp_lens

    def global_topk(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's mapping of the indexer's rows to cache slots, already applied by the case
        return case.rows.comp_indices, case.rows.comp_lens  # type: ignore[return-value]

    q = torch.zeros((tokens, PADDED, 512), dtype=torch.bfloat16, device=dev)
    out = torch.full((tokens, PADDED, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    kv = None if comp is None else comp.cache

    def step() -> bool:
        return rt.decode(lay, q, kv, swa_md, attn_md, layer == "swa", out, global_topk)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert step()
    for _ in range(2):
        fresh = torch.randn((tokens, heads, 512), generator=g, device=dev).to(torch.bfloat16)
        q[:, :heads].copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        kw = case.kwargs()
        ref, _ = dk.reference.sparse_mla_decode(
            fresh, case.pools.swa.cache, case.rows.swa_indices, case.rows.swa_lens, 512**-0.5, **kw
        )
        assert not bool(out[:, :heads].isnan().any()), f"seed {seed}: a real head was not written"
        assert bool(out[:, heads:].isnan().all()), f"seed {seed}: a padded head was written"
        torch.testing.assert_close(
            out[:, :heads].float(),
            ref.float(),
            atol=2e-2,
            rtol=2e-2,
            msg=lambda m: f"seed {seed}: {m}",
        )
    assert not [s for s in lines if "raised" in s], lines
