"""Our kernels on vLLM's own cache views and against vLLM's own kernels (``vllm`` session).

* Cache views come from vLLM's allocator (:mod:`tests.attention.vllm_layout`):
  our insert, then gather, round-trips within the FP8 bound on the window,
  C4A and C128A caches of both block-outer layouts, and no byte of another
  layer (or another group sharing the block) changes.
* vLLM's own Triton kernels (its ``cache_utils`` staged by
  :mod:`benchmarks.support.vllm_peer`, run through Triton's interpreter: vLLM's CPU
  build disables Triton, the staged copy does not) give the same outputs as
  ours at vLLM's call-site shapes: workspace slices, strided C128A top-k,
  SWA-only with top_k 0, image spans, a ``query_start_loc`` slice with a
  nonzero base, decode top-k with the batch's whole ``token_to_req_indices``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels.geometry import NOPE_DIM, QUANT_BLOCK, TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES
from dsv4_kernels.testing.common import POISON, fresh_seed, generator

from .vllm_layout import LAYOUTS, CacheView, vllm_dsv4_caches

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=LAYOUTS)
def caches(request: pytest.FixtureRequest) -> tuple[list[CacheView], torch.Tensor]:
    return vllm_dsv4_caches(request.param)


@pytest.fixture(scope="module")
def vllm_ops(tmp_path_factory: pytest.TempPathFactory) -> object:
    from benchmarks.support import vllm_peer

    folder = tmp_path_factory.mktemp("vllm_peer")
    vllm_peer.stage(Path(folder))
    return vllm_peer.load(folder)


def test_vllm_packs_several_layers_into_one_block(
    caches: tuple[list[CacheView], torch.Tensor],
) -> None:
    views, _ = caches
    dsv4 = [v for v in views if v.kind != "indexer"]
    assert {v.kind for v in dsv4} == {"window", "c4a", "c128a"}
    # the case the kernels used to reject: a page stride wider than the page
    assert any(v.view.stride(0) > dk.k_cache_page_stride(v.slots) for v in dsv4)
    assert any(v.view.storage_offset() > 0 for v in dsv4)


def _layer_bytes(
    view: torch.Tensor, slots: torch.Tensor, per_page: int, total: int
) -> torch.Tensor:
    """Mask over the backing storage: the data and scale bytes of ``slots`` in ``view``."""
    mask = torch.zeros(total, dtype=torch.bool)
    for s in slots.tolist():
        base = view.storage_offset() + (s // per_page) * view.stride(0)
        i = s % per_page
        mask[base + i * TOKEN_DATA_BYTES : base + (i + 1) * TOKEN_DATA_BYTES] = True
        scale = base + per_page * TOKEN_DATA_BYTES + i * TOKEN_SCALE_BYTES
        mask[scale : scale + TOKEN_SCALE_BYTES] = True
    return mask


def _fp8_bound(k: torch.Tensor) -> torch.Tensor:
    """Per-element round-trip bound: half an E4M3 step at the code's magnitude, times 2**e.

    The block's scale is ``2**e`` with ``e = ceil(log2(max(amax, 1e-4) / 448))``;
    a code ``c = x / 2**e`` is rounded to 3 mantissa bits (subnormal below
    2**-6), so ``|y - x| <= 2**(floor(log2 |c|) - 4) * 2**e``.  Rope values are exact.
    """
    nope = k[:, :NOPE_DIM].float().reshape(k.shape[0], -1, QUANT_BLOCK)
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    code = (nope.abs() / scale).clamp(min=2.0**-6)
    bound = (2.0 ** (torch.floor(torch.log2(code)) - 4) * scale).reshape(k.shape[0], NOPE_DIM)
    return torch.cat([bound, torch.zeros(k.shape[0], k.shape[1] - NOPE_DIM)], dim=1)


@pytest.mark.parametrize("kind", ["window", "c4a", "c128a"])
def test_insert_then_gather_on_vllm_views(
    caches: tuple[list[CacheView], torch.Tensor], kind: str
) -> None:
    views, storage = caches
    seed = fresh_seed()
    g = generator(seed)
    for cache in [v for v in views if v.kind == kind]:
        storage.random_(0, 256, generator=g)  # every layer's bytes: random
        before = storage.clone()
        per_page = cache.slots
        num_pages = min(cache.view.shape[0], max(3, 48 // per_page))
        pages = torch.randperm(cache.view.shape[0], generator=g)[:num_pages]
        slots = (pages[:, None] * per_page + torch.arange(per_page)[None, :]).reshape(-1)
        k = (torch.randn(slots.numel(), 512, generator=g) * 3).to(torch.bfloat16)
        dk.quantize_and_insert_k_cache(k, cache.view, slots, per_page)
        changed = storage != before
        allowed = _layer_bytes(cache.view, slots, per_page, storage.numel())
        assert not bool((changed & ~allowed).any()), (
            f"{cache.name} (seed {seed}): bytes outside its slots changed"
        )
        # the same bytes as the reference writes into the same (vLLM) view
        want = before.clone()
        view_of_want = torch.as_strided(
            want, cache.view.shape, cache.view.stride(), cache.view.storage_offset()
        )
        dk.reference.quantize_and_insert_k_cache(k, view_of_want, slots, per_page)
        assert torch.equal(storage[allowed], want[allowed]), f"{cache.name} (seed {seed})"
        # gather the pages back as one request, in slot order
        out = torch.full((1, slots.numel() + 3, 512), float("nan"), dtype=torch.bfloat16)
        dk.dequantize_and_gather_k_cache(
            out,
            cache.view,
            torch.tensor([slots.numel()], dtype=torch.int32),
            None,
            pages[None, :].to(torch.int32),
            per_page,
            3,
        )
        got = out[0, 3:].float()
        err = (got - k.float()).abs()
        assert bool((err <= _fp8_bound(k)).all()), f"{cache.name} (seed {seed}): round trip"
        assert bool(out[0, :3].isnan().all()), "gather wrote before its offset"


def test_gather_equals_vllms_on_vllm_views(
    caches: tuple[list[CacheView], torch.Tensor], vllm_ops: object
) -> None:
    views, storage = caches
    seed = fresh_seed()
    g = generator(seed)
    storage.random_(0, 256, generator=g)
    # one layer of each kind: the largest page stride and offset of its kind
    kinds = {}
    for v in views:
        if v.kind != "indexer":
            best = kinds.get(v.kind)
            if best is None or v.view.storage_offset() > best.view.storage_offset():
                kinds[v.kind] = v
    for cache in kinds.values():
        num_reqs = 3
        seq = torch.randint(1, 160, (num_reqs,), generator=g, dtype=torch.int32)
        gather = torch.minimum(seq, torch.randint(1, 100, (num_reqs,), generator=g)).to(torch.int32)
        width = -(-int(seq.max()) // cache.slots) + 2
        pages = torch.randperm(cache.view.shape[0], generator=g)[: num_reqs * width]
        table = pages.reshape(num_reqs, width).to(torch.int32)
        # valid FP8 pages where the requests read (the rest stays random bytes)
        slots = (pages[:, None] * cache.slots + torch.arange(cache.slots)[None, :]).reshape(-1)
        k = torch.randn(slots.numel(), 512, generator=g).to(torch.bfloat16)
        dk.reference.quantize_and_insert_k_cache(k, cache.view, slots, cache.slots)
        for gl in (None, gather):
            rows = int(seq.max()) + 5
            ours = torch.full((num_reqs, rows, 512), -3.0, dtype=torch.bfloat16)
            theirs = ours.clone()
            dk.dequantize_and_gather_k_cache(ours, cache.view, seq, gl, table, cache.slots, 5)
            vllm_ops.dequantize_and_gather_k_cache(  # type: ignore[attr-defined]
                theirs, cache.view, seq, gl, table, cache.slots, 5
            )
            assert torch.equal(ours, theirs), f"{cache.name} (seed {seed}, gather_lens={gl})"


def _prefill_batch(g: torch.Generator, ratio: int, images: bool) -> dict[str, object]:
    """A mixed batch as vLLM's _forward_prefill sees it: 2 decodes, then 3 prefills."""
    num_decodes = 2
    qlens = [1, 1, 37, 5, 90]
    seq = torch.tensor([300, 41, 37, 700, 1500], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    num_prefill_tokens = sum(qlens[num_decodes:])
    window = 128
    gather = torch.minimum(seq, torch.tensor(qlens) + window - 1).to(torch.int32)
    prefill_seq, prefill_gather = seq[num_decodes:], gather[num_decodes:]
    topk = {1: 0, 4: 512, 128: 16}[ratio]
    N = -(-int(prefill_seq.max()) // ratio) if ratio > 1 else 0
    M = N + int(prefill_gather.max())
    if ratio == 4:
        # the indexer's top-k buffer for the whole batch; valid prefix >= 0
        buffer = torch.randint(0, max(N, 1), (qsl[-1] + 8, topk), generator=g, dtype=torch.int32)
        topk_rows = buffer[qsl[num_decodes] :][:num_prefill_tokens]
    elif ratio == 128:
        # vLLM's C128A prefill rows: 0..n-1 then -1, a slice of a wider buffer
        pos = torch.cat(
            [
                torch.arange(int(s) - q, int(s))
                for s, q in zip(prefill_seq, qlens[num_decodes:], strict=True)
            ]
        )
        n = ((pos + 1) // 128).clamp(max=topk)
        cols = torch.arange(topk + 32)[None, :]
        topk_rows = torch.where(cols < n[:, None], cols, -1).to(torch.int32)[:, :topk]
    else:
        topk_rows = torch.randint(-1, 50, (num_prefill_tokens, 512), generator=g, dtype=torch.int32)
    left = right = None
    max_image_tokens = 0
    if images:
        max_image_tokens = 64
        left = torch.randint(0, 200, (qsl[-1],), generator=g, dtype=torch.int32)
        right = torch.randint(0, 40, (qsl[-1],), generator=g, dtype=torch.int32)
        left, right = left[qsl[num_decodes] :], right[qsl[num_decodes] :]
    return {
        "topk_indices": topk_rows,
        # a slice of the batch's query_start_loc: nonzero base
        "query_start_loc": qsl[num_decodes:],
        "seq_lens": prefill_seq,
        "gather_lens": prefill_gather,
        "window_size": window,
        "compress_ratio": ratio,
        "topk": topk,
        "M": M,
        "N": N,
        "left_visible": left,
        "right_visible": right,
        "max_image_tokens": max_image_tokens,
        "num_tokens": num_prefill_tokens,
    }


@pytest.mark.parametrize(
    ("ratio", "images"), [(4, False), (128, False), (1, False), (4, True), (1, True)]
)
def test_combine_equals_vllms_at_its_call_site(vllm_ops: object, ratio: int, images: bool) -> None:
    seed = fresh_seed()
    batch = _prefill_batch(generator(seed), ratio, images)
    num_tokens = int(batch.pop("num_tokens"))  # type: ignore[call-overload]
    width = dk.geometry.combined_width(
        int(batch["topk"]),  # type: ignore[call-overload]
        max_image_tokens=int(batch["max_image_tokens"]),  # type: ignore[call-overload]
    )
    outputs = []
    for fn in (dk.combine_topk_swa_indices, vllm_ops.combine_topk_swa_indices):  # type: ignore[attr-defined]
        # vLLM's workspaces have max_num_batched_tokens rows; it slices the chunk's
        ws = torch.full((num_tokens + 50, width), POISON, dtype=torch.int32)
        lens_ws = torch.full((num_tokens + 50,), POISON, dtype=torch.int32)
        out = (ws[:num_tokens], lens_ws[:num_tokens])
        got = fn(**batch, out=out)
        assert got[0].data_ptr() == ws.data_ptr() and got[1].data_ptr() == lens_ws.data_ptr()
        assert bool((ws[num_tokens:] == POISON).all()), "wrote past the chunk's rows"
        outputs.append((ws[:num_tokens].clone(), lens_ws[:num_tokens].clone()))
    (ours, our_lens), (theirs, their_lens) = outputs
    assert torch.equal(our_lens, their_lens), f"lens differ (seed {seed})"
    assert torch.equal(ours, theirs), f"combined rows differ (seed {seed})"


def test_global_index_equals_vllms_in_decode(vllm_ops: object) -> None:
    seed = fresh_seed()
    g = generator(seed)
    num_decodes, num_tokens_batch, block_size = 6, 40, 64
    topk = torch.randint(-1, 5000, (16, 512), generator=g, dtype=torch.int32)
    buffer = torch.randint(-1, 5000, (num_tokens_batch, 512), generator=g, dtype=torch.int32)
    buffer[:num_decodes] = topk[:num_decodes]
    token_to_req = torch.randint(0, 9, (num_tokens_batch,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 10**5, (9, 80), generator=g, dtype=torch.int32)
    valid = torch.rand(num_tokens_batch, generator=g) > 0.2
    valid[0], valid[1] = True, False
    args = (
        buffer[:num_decodes],
        token_to_req,
        table[:num_decodes],
        block_size,
        valid[:num_decodes],
    )
    ours = dk.compute_global_topk_indices_and_lens(*args)
    theirs = vllm_ops.compute_global_topk_indices_and_lens(*args)  # type: ignore[attr-defined]
    assert torch.equal(ours[1], theirs[1]), f"lens differ (seed {seed})"
    live = valid[:num_decodes]
    assert bool(live.any()) and not bool(live.all()), f"seed {seed}: want both kinds of token"
    assert torch.equal(ours[0][live], theirs[0][live]), f"global indices differ (seed {seed})"
    # Padding tokens: both give length 0, so attention reads nothing of their
    # rows; vLLM still maps them (reading the block table with the padding
    # token's request id), we write -1 and read nothing (docs/design.md).
    assert bool((ours[0][~live] == -1).all())
