"""Sparse MLA decode on the GPU: matrix sizes against the float64 oracle (splits on and
off, 1-4 tokens per request), the Hopper wgmma path taken, CUDA-graph capture and replay
with new rows written into the same buffers, and FlashMLA's decode on the same pages
(skipped, saying so, where FlashMLA is not built)."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import _paged_keys
from dsv4_kernels.testing import decode as td
from dsv4_kernels.testing.common import fresh_seed

from ._decode_oracle import check, oracle

pytestmark = pytest.mark.gpu
SCALE = 512**-0.5
CONTEXT = 131072
_POOLS: dict[str, td.DecodePools] = {}


def _pools(layer: str, gpu: torch.device) -> td.DecodePools:
    if layer not in _POOLS:
        g = torch.Generator(device=gpu).manual_seed(fresh_seed())
        comp = {"swa": 0, "c4a": 2048, "c128a": 65536, "c1a": 512, "c2a": 1024}[layer]
        _POOLS[layer] = td.make_pools(layer, swa_pages=1024, comp_pages=comp, generator=g,
                                      device=gpu, layers_per_block=2)  # fmt: skip
    return _POOLS[layer]


def _case(layer: str, tokens: int, per_request: int, heads: int, gpu: torch.device,
          **options: object) -> td.DecodeCase:  # fmt: skip
    g = torch.Generator(device=gpu).manual_seed(fresh_seed())
    topk = 1024 if heads in (16, 128) else 512  # V4-Pro at TP8 and DP
    return td.make_decode_case(
        layer,
        tokens // per_request,
        per_request,
        heads,
        context=CONTEXT,
        generator=g,
        device=gpu,
        pools=_pools(layer, gpu),
        topk=topk,
        comp_width=CONTEXT // 128,
        **options,
    )  # type: ignore[arg-type]


_SCRATCH: dict[str, dk.DecodeScratch] = {}
# The launches before decode v2 (the defaults now launch the combine as a programmatic
# dependent and run more than 16 heads on the wgmma kernel in blocks of 16 heads).
V1 = {"PDL": 0, "HEAD_BLOCKS": 0}


def _scratch(gpu: torch.device) -> dk.DecodeScratch:
    if "s" not in _SCRATCH:
        sizes = dk.decode_scratch_sizes(1024, 128, 128 + 1024, gpu)
        sizes = dk.DecodeScratchSizes(max(sizes.partial_rows, 256 * 8), 128, 1024)
        _SCRATCH["s"] = dk.make_decode_scratch(sizes, gpu)
    return _SCRATCH["s"]


def _call(case: td.DecodeCase, gpu: torch.device, splits: int | None = None,
          rows: td.DecodeRows | None = None, out: torch.Tensor | None = None,
          lse: torch.Tensor | None = None,
          policy: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    r = case.rows if rows is None else rows
    T, H, _ = case.q.shape
    if out is None:
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
        lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=gpu)
    return dk.sparse_mla_decode(case.q, case.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE,
                                scratch=_scratch(gpu), out=out, lse=lse, num_splits=splits,
                                policy=policy, **case.kwargs(r))  # fmt: skip


def _sample_check(case: td.DecodeCase, out: torch.Tensor, lse: torch.Tensor) -> None:
    T = case.q.shape[0]
    s = torch.unique(torch.cat([torch.arange(0, T, max(1, T // 48)), torch.tensor([T - 1])]))
    s = s.to(case.q.device)
    sources = [(v, i[s], None if n is None else n[s]) for v, i, n in case.sources()]
    want = oracle(case.q[s], sources, SCALE, case.sink)
    assert not torch.isnan(out.float()).any(), "unwritten (NaN) output elements"
    assert not torch.isnan(lse).any(), "unwritten (NaN) lse elements"
    check(out[s], lse[s], want)


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa", "c1a", "c2a"])
@pytest.mark.parametrize("heads", [8, 16, 3, 32, 64, 128])
@pytest.mark.parametrize("tokens,per_request", [(1, 1), (4, 4), (32, 2), (256, 1), (48, 3)])
def test_decode_matrix(layer: str, heads: int, tokens: int, per_request: int,
                       gpu: torch.device) -> None:  # fmt: skip
    from dsv4_kernels import _gluon_decode

    case = _case(layer, tokens, per_request, heads, gpu, hole_fraction=0.05, empty_tokens=1)
    for splits in (None, 1, 7):
        out, lse = _call(case, gpu, splits)
        _sample_check(case, out, lse)
    if heads <= 16:
        assert not _paged_keys.SPLIT_BROKEN, _paged_keys.SPLIT_BROKEN
        assert _gluon_decode.compiled_variants() > 0, "the wgmma split kernel did not run"
    for splits in (None, 2):  # without PDL, and more than 16 heads on the Triton kernel
        out, lse = _call(case, gpu, splits, policy=V1)
        _sample_check(case, out, lse)
    if heads > 16:  # the launcher's own choice: the wgmma kernel in blocks of 16 heads
        assert _paged_keys.wgmma_runs(case.q, _paged_keys.tiles_for(16), True, True, split=True,
                                      head_blocks=True)  # fmt: skip
        for wide in (32, 64):  # issue 41's wide blocks on two warpgroups (off by default)
            for splits in (None, 1, 3):
                out, lse = _call(case, gpu, splits, policy={"WIDE_HT": wide})
                _sample_check(case, out, lse)
        assert not _paged_keys.SPLIT_BROKEN, _paged_keys.SPLIT_BROKEN


@pytest.mark.parametrize("policy", [None, V1], ids=["defaults", "v1"])
def test_decode_graph_replay_with_new_rows(policy: dict[str, int] | None,
                                           gpu: torch.device) -> None:  # fmt: skip
    """Capture once; write new rows and lengths into the same buffers; replay == eager
    (the defaults: the combine a programmatic dependent of the split kernel)."""
    for layer, tokens, heads in (
        ("c4a", 4, 8),
        ("c128a", 16, 16),
        ("swa", 2, 8),
        ("c4a", 512, 16),
        ("c1a", 8, 8),  # DeepSeek-V4.1's top-k layers
        ("c2a", 64, 16),
        ("c4a", 2, 64),  # DP attention's heads
    ):
        case = _case(layer, tokens, 2 if tokens > 2 else 1, heads, gpu)
        T, H, _ = case.q.shape
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=gpu)
        lse = torch.empty((T, H), dtype=torch.float32, device=gpu)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _call(case, gpu, out=out, lse=lse, policy=policy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _call(case, gpu, out=out, lse=lse, policy=policy)
        for _ in range(2):
            fresh = _case(layer, tokens, 2 if tokens > 2 else 1, heads, gpu, hole_fraction=0.1,
                          empty_tokens=1)  # fmt: skip
            case.rows.swa_indices.copy_(fresh.rows.swa_indices)
            case.rows.swa_lens.copy_(fresh.rows.swa_lens)
            if case.rows.comp_indices is not None:
                case.rows.comp_indices.copy_(fresh.rows.comp_indices)  # type: ignore[arg-type]
                case.rows.comp_lens.copy_(fresh.rows.comp_lens)  # type: ignore[union-attr,arg-type]
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager = _call(case, gpu, policy=policy)
            assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
            _sample_check(case, out, lse)


@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa", "c1a", "c2a"])
@pytest.mark.parametrize("heads,tokens", [(8, 1), (16, 2), (8, 64), (16, 512), (64, 4)])
def test_matches_flashmla_decode(layer: str, heads: int, tokens: int, gpu: torch.device) -> None:
    from benchmarks.flashmla_decode import PaddedFlashMLADecode, load_decode

    fns, why = load_decode()
    if fns is None:
        pytest.skip(f"FlashMLA not importable here ({why}); the benchmark compares with it")
    case = _case(layer, tokens, 1, heads, gpu, hole_fraction=0.05)
    pools = case.pools
    fm = PaddedFlashMLADecode(case.q, pools.swa.cache, None if pools.comp is None else
                              pools.comp.cache, [case.rows], SCALE, case.sink)  # fmt: skip
    fm.call(0)
    f_out, f_lse = fm.outputs()
    for policy in (None, V1):
        out, lse = _call(case, gpu, policy=policy)
        torch.testing.assert_close(out.float(), f_out.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, f_lse, atol=2e-3, rtol=1e-4)
