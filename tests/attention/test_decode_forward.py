"""The decode forward from plain tensors shaped as vLLM's ``_forward_decode`` has them:
q and out slices of 64-head buffers, ``[T, 1, K]`` index rows, block-outer cache
views; against the float64 oracle (CUDA if present, else Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from tests.kernels._decode_oracle import oracle

from dsv4_attention.decode import forward_decode, make_decode_scratch
from dsv4_kernels.testing import decode as td
from dsv4_kernels.testing.common import fresh_seed

SCALE = 512**-0.5


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa"])
@pytest.mark.parametrize("heads", [8, 64])  # TP8, and DP attention's every head
def test_forward_decode_on_vllm_shaped_views(layer: str, heads: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(fresh_seed())
    pools = td.make_pools(layer, swa_pages=12, comp_pages=16, generator=g, device=device,
                          layers_per_block=2)  # fmt: skip
    case = td.make_decode_case(layer, 3, 2, heads, context=[300, 450, 700], generator=g,
                               device=device, pools=pools, topk=64, hole_fraction=0.1)  # fmt: skip
    T = case.q.shape[0]
    q_pad = torch.zeros((T, 64, 512), dtype=torch.bfloat16, device=device)
    q_pad[:, :heads] = case.q
    out_pad = torch.full((T, 64, 512), float("nan"), dtype=torch.bfloat16, device=device)
    scratch = make_decode_scratch(16, heads, 128 + 64, device)
    r = case.rows
    comp = {}
    if pools.comp is not None:
        comp = dict(comp_cache=pools.comp.cache, comp_indices=r.comp_indices.unsqueeze(1),
                    comp_lens=r.comp_lens)  # type: ignore[union-attr]  # fmt: skip
    got = forward_decode(q_pad[:, :heads], pools.swa.cache, r.swa_indices.unsqueeze(1),
                         r.swa_lens, case.sink, SCALE, out_pad[:, :heads], scratch,
                         **comp)  # fmt: skip
    assert got.data_ptr() == out_pad.data_ptr()
    assert torch.isnan(out_pad[:, heads:].float()).all(), "padded heads must not be written"
    want = oracle(case.q, case.sources(), SCALE, case.sink)
    out = out_pad[:, :heads]
    assert not torch.isnan(out.float()).any(), "unwritten (NaN) output elements"
    torch.testing.assert_close(out.double(), want[0], atol=2e-2, rtol=2e-2)


def test_forward_decode_rejects_partial_compressed_arguments() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    case = td.make_decode_case("c4a", 1, 1, 4, context=300, generator=g, device="cpu", topk=32)
    r = case.rows
    scratch = make_decode_scratch(4, 4, 192, "cpu")
    out = torch.empty((1, 4, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="comp_cache and comp_indices"):
        forward_decode(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, case.sink, SCALE,
                       out, scratch, comp_indices=r.comp_indices)  # fmt: skip
    with pytest.raises(ValueError, match=r"policy\['WIDE_HT'\]"):  # the table's entries arrive
        forward_decode(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, case.sink, SCALE,
                       out, scratch, policy={"WIDE_HT": 48})  # fmt: skip
    with pytest.raises(ValueError, match="swa_indices must be"):
        forward_decode(case.q, case.pools.swa.cache, r.swa_indices.view(1, 2, -1), r.swa_lens,
                       case.sink, SCALE, out, scratch)  # fmt: skip
