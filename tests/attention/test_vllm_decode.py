"""The head-exact decode inside vLLM's ``_forward_decode`` contract (``vllm`` session).

vLLM's own pieces: cache views from vLLM's allocator and grouping, vLLM's
metadata classes for a decode batch (window slots per token, global C128A
slots, the C4A top-k mapped by vLLM's own ``compute_global_topk_indices_and_lens``,
staged from the installed vLLM and run through Triton's interpreter), the
plugin's subclass as vLLM's patched selector returns it on (faked) Hopper.
FlashMLA cannot run on a CPU, so vLLM's own decode is observed by what it is
called with; ours is compared with the pure-torch reference attention over
exactly the indexed slots.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import decode_table
from dsv4_attention import vllm_backend as vb
from dsv4_kernels.testing.common import fresh_seed, generator

from .test_vllm_step import HEADS, PADDED, Model, ours_cls  # noqa: F401  (fixture)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def peer_topk(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """vLLM's own ``compute_global_topk_indices_and_lens`` (its Triton kernel)."""
    from benchmarks.support import vllm_peer

    folder = tmp_path_factory.mktemp("vllm_peer_decode")
    vllm_peer.stage(Path(folder))
    return vllm_peer.load(folder).compute_global_topk_indices_and_lens


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a Hopper GPU with the Gluon wgmma kernel (what the table measured)."""
    from dsv4_kernels import sparse_mla

    monkeypatch.setattr(vb, "_device_major", lambda: 9)
    monkeypatch.setattr(sparse_mla, "wgmma_available", lambda: True)
    monkeypatch.delenv(vb.ENV_DECODE_DISABLE, raising=False)
    monkeypatch.setitem(vb._DECODE, "scratch", None)
    monkeypatch.setitem(vb._DECODE, "key", None)


def _decode_batch(model: Model, layer: types.SimpleNamespace, seq_lens: list[int], per_req: int):
    """vLLM's decode metadata for requests at ``seq_lens`` with ``per_req`` tokens each."""
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    g = model.g
    reqs = len(seq_lens)
    T = reqs * per_req
    pos = torch.tensor([s - per_req + i for s in seq_lens for i in range(per_req)])
    req = torch.arange(reqs).repeat_interleave(per_req)
    wtable = model._table(layer.swa_view.view.shape[0], 64, seq_lens)
    cols = torch.arange(128)
    wpos = pos[:, None] - 127 + cols[None, :]
    wslot = wtable[req[:, None], (wpos.clamp(min=0) // 64)] * 64 + wpos.clamp(min=0) % 64
    wlens = torch.minimum(pos + 1, torch.tensor(128)).to(torch.int32)
    shift = 128 - wlens  # valid slots first, then -1
    order = (cols[None, :] + shift[:, None]).clamp(max=127)
    windex = torch.where(cols[None, :] < wlens[:, None], wslot.gather(1, order), -1).to(torch.int32)
    qsl = torch.arange(0, T + 1, per_req, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    swa = DeepseekSparseSWAMetadata(
        block_table=wtable,
        slot_mapping=torch.zeros(T, dtype=torch.int64),
        block_size=64,
        seq_lens=seq,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        is_valid_token=torch.ones(T, dtype=torch.bool),
        token_to_req_indices=req.to(torch.int32),
        decode_swa_indices=windex,
        decode_swa_lens=wlens,
        num_decodes=reqs,
        num_prefills=0,
        num_decode_tokens=T,
        num_prefill_tokens=0,
        max_decode_query_len=per_req,
    )
    attn = None
    if layer.compress_ratio > 1:
        ratio = layer.compress_ratio
        per_page = 256 // ratio
        ctable = model._table(layer.comp_view.view.shape[0], 256, seq_lens)
        c128a = {}
        if ratio == 128:
            width = 128
            n = ((pos + 1) // 128).clamp(max=width)
            c = torch.arange(width)[None, :]
            page = (c // per_page).clamp(max=ctable.shape[1] - 1)
            slots = ctable[req[:, None], page] * per_page + c % per_page
            c128a = dict(
                c128a_global_decode_topk_indices=torch.where(c < n[:, None], slots, -1)
                .to(torch.int32)
                .view(T, 1, width),
                c128a_decode_topk_lens=n.to(torch.int32),
            )
        else:
            buf = layer.topk_indices_buffer.fill_(-1)
            for t in range(T):
                avail = (int(pos[t]) + 1) // 4
                k = min(512, avail)
                buf[t, :k] = torch.randperm(avail, generator=g)[:k]
        attn = DeepseekV4FlashMLAMetadata(
            num_reqs=reqs,
            max_query_len=per_req,
            max_seq_len=max(seq_lens),
            num_actual_tokens=T,
            query_start_loc=qsl,
            slot_mapping=torch.zeros(T, dtype=torch.int64),
            block_table=ctable,
            req_id_per_token=req,
            block_size=256,
            topk_tokens=512,
            **c128a,
        )
    return swa, attn, T


def _reference(layer, swa, attn, q, peer_topk) -> torch.Tensor:  # type: ignore[no-untyped-def]
    comp: dict[str, object] = {}
    T = swa.num_decode_tokens
    if layer.compress_ratio == 4:
        idx, lens = peer_topk(
            layer.topk_indices_buffer[:T],
            swa.token_to_req_indices,
            attn.block_table[: swa.num_decodes],
            64,
            swa.is_valid_token[:T],
        )
        comp = dict(comp_cache=layer.comp_view.view, comp_indices=idx, comp_lens=lens)
    elif layer.compress_ratio == 128:
        comp = dict(
            comp_cache=layer.comp_view.view,
            comp_indices=attn.c128a_global_decode_topk_indices[:, 0],
            comp_lens=attn.c128a_decode_topk_lens,
        )
    if comp:
        comp["comp_block_size"] = 256 // layer.compress_ratio
    out, _ = dk.reference.sparse_mla_paged(
        q[:T, :HEADS],
        layer.swa_view.view,
        swa.decode_swa_indices,
        swa.decode_swa_lens,
        layer.scale,
        swa_block_size=64,
        attn_sink=layer.attn_sink[:HEADS],
        **comp,  # type: ignore[arg-type]
    )
    return out


def _call(cls, layer, swa, attn, q, T):  # type: ignore[no-untyped-def]
    out = torch.full((T, PADDED, 512), float("nan"), dtype=torch.bfloat16)
    cls._forward_decode(
        layer,
        q=q[:T],
        kv_cache=None if layer.comp_view is None else layer.comp_view.view,
        swa_metadata=swa,
        attn_metadata=attn,
        swa_only=layer.compress_ratio == 1,
        output=out,
    )
    return out


def test_signature_is_vllms(ours_cls: type) -> None:  # noqa: F811
    base = ours_cls.__mro__[1]
    assert inspect.signature(ours_cls._forward_decode).parameters.keys() == (
        inspect.signature(base._forward_decode).parameters.keys()
    )


@pytest.mark.parametrize("per_req", [1, 2])
def test_decode_matches_reference_where_the_table_takes_it(
    ours_cls: type,  # noqa: F811
    hopper: None,
    peer_topk,  # type: ignore[no-untyped-def]
    per_req: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On faked Hopper, at step sizes the table takes, every layer type's decode is ours
    (vLLM's FlashMLA call never made), equal to the reference, padded heads untouched."""
    flashmla = ours_cls.__mro__[1]
    module = inspect.getmodule(flashmla)
    monkeypatch.setattr(module, "compute_global_topk_indices_and_lens", peer_topk)
    monkeypatch.setattr(
        flashmla, "_forward_decode", lambda self, **kw: pytest.fail("vLLM's decode ran")
    )
    seed = fresh_seed()
    g = generator(seed)
    model = Model(g, ratios=(1, 4, 128))
    for layer in model.layers:
        layer.swa_cache_layer = types.SimpleNamespace(kv_cache=layer.swa_view.view)
        seqs = [300, 1400, 57][: 3 if per_req == 1 else 2]
        assert decode_table.use_head_exact_decode(layer.compress_ratio, HEADS, len(seqs) * per_req)
        swa, attn, T = _decode_batch(model, layer, seqs, per_req)
        q = torch.randn(T, PADDED, 512, generator=g).to(torch.bfloat16)
        out = _call(ours_cls, layer, swa, attn, q, T)
        assert bool(out[:, HEADS:].isnan().all()), "padded heads were written"
        assert not bool(out[:, :HEADS].isnan().any())
        torch.testing.assert_close(
            out[:, :HEADS].float(),
            _reference(layer, swa, attn, q, peer_topk).float(),
            atol=2e-2,
            rtol=2e-2,
            msg=lambda m, layer=layer: f"seed {seed} {layer.prefix}: {m}",
        )


def test_dispatch_follows_the_table_and_the_switch(
    ours_cls: type,  # noqa: F811
    hopper: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own decode runs where the table says FlashMLA was faster, with the switch
    off, and off Hopper; ours elsewhere."""
    flashmla = ours_cls.__mro__[1]
    called: list[int] = []
    monkeypatch.setattr(
        flashmla, "_forward_decode", lambda self, **kw: called.append(kw["q"].shape[0])
    )
    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    layer = model.layers[0]
    layer.swa_cache_layer = types.SimpleNamespace(kv_cache=layer.swa_view.view)
    # a table with a step where FlashMLA was faster (the curated run has none left at
    # 8 and 16 heads): SWA-only at 16 heads slower from 65 to 255 tokens
    table = {"swa": {8: {1: 1.3, 1024: 1.5}, 16: {1: 1.2, 64: 1.1, 128: 0.9, 256: 1.2}}}
    monkeypatch.setattr(decode_table, "MEASURED", table)
    slower = [t for t in range(1, 300) if not decode_table.use_head_exact_decode(1, 16, t)]
    assert slower == list(range(65, 256))
    layer.n_local_heads = 16
    T = slower[0]
    swa, attn, _ = _decode_batch(model, layer, [60 + i % 4 for i in range(T)], 1)
    q = torch.randn(T, PADDED, 512, generator=g).to(torch.bfloat16)
    _call(ours_cls, layer, swa, attn, q, T)
    assert called == [T]
    layer.n_local_heads = HEADS
    swa, attn, _ = _decode_batch(model, layer, [300, 400], 1)
    _call(ours_cls, layer, swa, attn, q, 2)
    assert called == [T], "a step the table takes went to vLLM's decode"
    monkeypatch.setenv(vb.ENV_DECODE_DISABLE, "1")
    _call(ours_cls, layer, swa, attn, q, 2)
    assert called == [T, 2]
    monkeypatch.delenv(vb.ENV_DECODE_DISABLE)
    monkeypatch.setattr(vb, "_device_major", lambda: 10)  # Blackwell: not measured
    _call(ours_cls, layer, swa, attn, q, 2)
    assert called == [T, 2, 2]
