"""The column-piece sparse MLA kernel (``_triton_sparse_mla_split``, ``KERNEL=1`` tiles) against
the per-token float64 spec oracle, through Triton's interpreter on CPU: both MMA orientations
(heads or keys on M), with and without the prefetch, FP8 pages and the bf16 workspace."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels.testing import sparse_mla as ts
from dsv4_kernels.testing.common import fresh_seed

from .test_sparse_mla import SCALE, _case, _check, _outputs, spec

_T = dict(KERNEL=1, MAX_BLOCK_H=16, BLOCK_N=16, NUM_WARPS=4, NUM_STAGES=1)
# ONE_DEQUANT: one dequantisation per piece; ASM (CUDA only) is off under the interpreter.
SPLIT = [
    dict(KEYS_M=0, PREFETCH=1, **_T),
    dict(KEYS_M=1, PREFETCH=0, **_T),
    dict(KEYS_M=0, PREFETCH=1, ONE_DEQUANT=1, ASM=1, **_T),
    dict(KEYS_M=1, PREFETCH=1, ONE_DEQUANT=1, ASM=1, **_T),
]
IDS = ["heads-m-prefetch", "keys-m", "heads-m-one-dequant", "keys-m-one-dequant-prefetch"]


@pytest.mark.parametrize("tiles", SPLIT, ids=IDS)
@pytest.mark.parametrize("H", [3, 20])
def test_split_kernel_paged(
    tiles: dict, H: int, kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Window + compressed sources with holes and lengths, one or two head blocks."""
    from dsv4_kernels import sparse_mla as sm

    monkeypatch.setattr(sm, "TILES", {"small": tiles, "large": tiles})
    seed = fresh_seed()
    g, swa, comp, a_idx, a_len, b_idx, b_len = _case(kernel_device, seed, layers=2, T=3)
    T = a_idx.shape[0]
    q = ts.random_q(T, H, generator=g, device=kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    out, lse = _outputs(T, H, kernel_device)
    dk.sparse_mla_paged(
        q, swa.cache, a_idx, a_len, SCALE, swa_block_size=64, attn_sink=sink,
        comp_cache=comp.cache, comp_indices=b_idx, comp_lens=b_len, comp_block_size=2,
        out=out, lse=lse,
    )  # fmt: skip
    sources = [(swa.values, a_idx, a_len), (comp.values, b_idx, b_len)]
    _check(out, lse, spec(q, sources, SCALE, sink))


@pytest.mark.parametrize("tiles", SPLIT, ids=IDS)
def test_split_kernel_workspace(
    tiles: dict, kernel_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 workspace rows with -1 holes, rows past the end and a token with no key."""
    from dsv4_kernels import sparse_mla as sm

    monkeypatch.setattr(sm, "TILES", {"small": tiles, "large": tiles})
    g = torch.Generator(device=kernel_device).manual_seed(fresh_seed())
    N, T, H, K = 40, 3, 8, 24
    kv = torch.randn(N, 512, generator=g, device=kernel_device).to(torch.bfloat16)
    idx = torch.randint(0, N + 4, (T, K), generator=g, device=kernel_device, dtype=torch.int32)
    idx[0, ::3] = -1
    lens = torch.tensor([K, 17, 0], dtype=torch.int32, device=kernel_device)
    q = ts.random_q(T, H, generator=g, device=kernel_device)
    sink = ts.random_sink(H, generator=g, device=kernel_device)
    out, lse = _outputs(T, H, kernel_device)
    dk.sparse_mla_workspace(q, kv, idx, lens, SCALE, attn_sink=sink, out=out, lse=lse)
    _check(out, lse, spec(q, [(kv.float(), idx, lens)], SCALE, sink))
