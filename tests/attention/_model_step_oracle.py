"""Float64 oracles of the model-step benchmark's layers (``benchmarks/model_step*``), from
the steps' raw inputs (request-local top-k, block tables, positions), not from the rows
the benchmark derived: shared by the CPU and the GPU tests."""

from __future__ import annotations

from typing import Any

import torch
from benchmarks.model_step_common import value_tolerance
from tests.kernels._decode_oracle import oracle

from dsv4_kernels.reference.sparse_mla import dequantize_slots

SCALE = 512**-0.5


def values(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every slot of an FP8 page cache, dequantised ``[slots, 512]``."""
    slots = torch.arange(cache.shape[0] * block_size, device=cache.device)
    return dequantize_slots(cache, slots, block_size)


def decode_oracle(step: Any, i: int, tokens: torch.Tensor) -> torch.Tensor:
    """Layer ``i`` of a decode step at ``tokens``: float64 ``[n, H, 512]``.  C4A's slots are
    mapped here from the layer's local top-k and block table."""
    layer = step.layers[i]
    H = step.cell.model.heads
    pools = step.pools
    sources = [(pools["swa"].values, layer.swa_indices[tokens], layer.swa_lens[tokens])]
    if layer.kind == "c4a":
        bs = pools["c4a"].block_size
        local = layer.local[tokens].to(torch.int64)
        req = step.token_to_req[tokens].to(torch.int64).unsqueeze(1)
        page = layer.table.to(torch.int64)[req, (local.clamp(min=0) // bs)]
        slots = torch.where(local >= 0, page * bs + local.clamp(min=0) % bs, -1)
        sources.append((pools["c4a"].values, slots, None))
    elif layer.kind == "c128a":
        sources.append((pools["c128a"].values, layer.comp_indices[tokens], layer.comp_lens[tokens]))
    return oracle(step.q[tokens, :H], sources, SCALE, step.sink[:H])[0]


def prefill_oracle(step: Any, i: int, tokens: torch.Tensor) -> torch.Tensor:
    """Layer ``i`` of a prefill step at ``tokens``: its rows from the pure-torch reference
    index builder, its own caches' values."""
    from dsv4_kernels import reference as ref

    inp = step.layers[i]
    c = inp.index_case
    rows = ref.build_prefill_indices(
        c.query_start_loc,
        c.seq_lens,
        num_tokens=c.num_tokens,
        window_block_table=c.window_block_table,
        window_block_size=64,
        window_size=128,
        compress_ratio=c.compress_ratio if inp.comp_cache is not None else 1,
        comp_block_table=c.comp_block_table if inp.comp_cache is not None else None,
        comp_block_size=inp.comp_block_size,
        topk_indices=c.topk_indices if inp.shape.topk_rows else None,
        topk=c.topk if inp.comp_cache is not None else None,
    )
    sources = [(values(inp.swa_cache, 64), rows.window[tokens], rows.window_lens[tokens])]
    if inp.comp_cache is not None:
        sources.append(
            (values(inp.comp_cache, inp.comp_block_size), rows.comp[tokens], rows.comp_lens[tokens])
        )
    return oracle(inp.q[tokens], sources, SCALE, inp.sink)[0]


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert not torch.isnan(got.float()).any(), f"{what}: unwritten (NaN) output"
    atol = value_tolerance(want)  # grows with the values the output mixes (bf16 steps)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=2e-2, msg=what)
