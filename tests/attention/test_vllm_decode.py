"""The head-exact decode inside vLLM's ``_forward_decode`` contract (``vllm`` session).

vLLM's own pieces: cache views from vLLM's allocator and grouping, vLLM's
metadata classes for a decode batch (window slots per token, global C128A
slots, the C4A top-k mapped by vLLM's own ``compute_global_topk_indices_and_lens``,
staged from the installed vLLM and run through Triton's interpreter), vLLM's
workspace manager for the scratch, and the attention class the plugin builds
over vLLM's FlashMLA class (the plugin's own, as vLLM's wrapped selector returns
it on faked Hopper, and the same construction over a fresh runtime per test:
(faked) Hopper with the Gluon kernel, a measured table, the switches).  FlashMLA
cannot run on a CPU, so vLLM's own decode is observed by what it is called with;
ours is compared with the pure-torch reference attention over exactly the indexed
slots.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import decode_table
from dsv4_attention.facts import ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess, make_attention_cls
from dsv4_attention.tables import DecodeTable, MeasuredTable, table_for
from dsv4_kernels import _paged_keys
from dsv4_kernels.testing.common import fresh_seed, generator

from .test_vllm_step import HEADS, MAX_MODEL_LEN, MAX_TOKENS, PADDED, Model, ours_cls  # noqa: F401

pytestmark = pytest.mark.vllm


def _h200() -> MeasuredTable:
    table = table_for("NVIDIA H200", (9, 0))
    assert table is not None
    return table


H200 = _h200()
HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)
SERVING = ServingConfig(
    architectures=("DeepseekV4ForCausalLM",),
    max_num_batched_tokens=MAX_TOKENS,
    max_model_len=MAX_MODEL_LEN,
)


@dataclasses.dataclass
class Built:
    """A fresh runtime, the attention class over it, and the lines it logged."""

    cls: Any  # the plugin's attention class
    runtime: HeadExactRuntime
    info: list[str]
    warning: list[str]


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch, workspace: Any) -> Callable[..., Built]:
    """A fresh runtime (``Device``, table and switches as given: by default an H200 with
    the Gluon wgmma kernel, its measured table, no switches) reaching vLLM's workspace
    manager, and the plugin's attention class over vLLM's FlashMLA class for it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.v1.worker.ubatching import dbo_enabled

    from dsv4_kernels import sparse_mla

    # the Gluon kernel as built (what the table measured; the runtime checks it after
    # each warm-up on a device that reports it)
    monkeypatch.setattr(sparse_mla, "wgmma_available", lambda: True)

    def build(
        device: Device = HOPPER,
        table: MeasuredTable | None = H200,
        switches: Switches | None = None,
    ) -> Built:
        info: list[str] = []
        warning: list[str] = []
        access = VllmAccess(
            forward_context=lambda: (
                get_forward_context() if is_forward_context_available() else None
            ),
            workspace=lambda: (
                workspace.current_workspace_manager()
                if workspace.is_workspace_manager_initialized()
                else None
            ),
            info=info.append,
            warning=warning.append,
            dual_batch=dbo_enabled,
        )
        rt = HeadExactRuntime(SERVING, device, table, switches or Switches(), access)
        return Built(make_attention_cls(DeepseekV4FlashMLAAttention, rt), rt, info, warning)

    return build


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


def _reference(layer, swa, attn, q, peer_topk, heads=HEADS) -> torch.Tensor:  # type: ignore[no-untyped-def]
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
        q[:T, :heads],
        layer.swa_view.view,
        swa.decode_swa_indices,
        swa.decode_swa_lens,
        layer.scale,
        swa_block_size=64,
        attn_sink=layer.attn_sink[:heads],
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


def _profile(cls: Any, layer: types.SimpleNamespace) -> None:
    """vLLM's profile run for one layer: its own ``forward_mqa`` without metadata (which
    zeroes the output), after which the runtime has decided the layer's kind."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    layer.PREFILL_CHUNK_SIZE = cls.PREFILL_CHUNK_SIZE
    q = torch.zeros(MAX_TOKENS, PADDED, 512, dtype=torch.bfloat16)
    out = torch.full_like(q, 3.0)
    with set_forward_context(None, VllmConfig()):
        cls.forward_mqa(layer, q, None, torch.zeros(MAX_TOKENS), out)
    assert bool((out == 0).all())  # vLLM's profile path ran


def test_signature_is_vllms(ours_cls: Any) -> None:  # noqa: F811
    """The plugin's class (as vLLM's wrapped selector returns it) keeps vLLM's decode
    signature, holds the runtime the start-up decision built (forced: decided as on the
    H200, with its table), and is the same construction the tests below build."""
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    base = ours_cls.__mro__[1]
    assert base is DeepseekV4FlashMLAAttention
    assert inspect.signature(ours_cls._forward_decode).parameters.keys() == (
        inspect.signature(base._forward_decode).parameters.keys()
    )
    rt = ours_cls.dsv4_runtime
    assert isinstance(rt, HeadExactRuntime)
    assert rt.table is H200 and rt.device.forced and rt.device.capability == (9, 0)
    assert not rt.switches.decode_disable
    fresh = make_attention_cls(base, rt)
    for name in ("_forward_decode", "_forward_prefill", "forward_mqa"):
        assert getattr(fresh, name).__code__ is getattr(ours_cls, name).__code__


@pytest.mark.parametrize("per_req", [1, 2])
def test_decode_matches_reference_where_the_table_takes_it(
    hopper: Callable[..., Built],
    workspace: Any,
    peer_topk: Callable[..., Any],
    per_req: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On faked Hopper, after vLLM's profile run decided every layer kind (scratch from
    vLLM's workspace, then locked as vLLM locks it), at step sizes the table takes, every
    layer type's decode is ours (vLLM's FlashMLA call never made), equal to the
    reference, padded heads untouched, nothing warned."""
    from vllm.models.deepseek_v4.nvidia import flashmla as module

    built = hopper()
    flashmla = built.cls.__mro__[1]
    monkeypatch.setattr(module, "compute_global_topk_indices_and_lens", peer_topk)
    monkeypatch.setattr(
        flashmla, "_forward_decode", lambda self, **kw: pytest.fail("vLLM's decode ran")
    )
    seed = fresh_seed()
    g = generator(seed)
    model = Model(g, ratios=(1, 4, 128))
    for layer in model.layers:
        _profile(built.cls, layer)
    rt = built.runtime
    assert sorted(rt.kinds) == [(1, HEADS), (4, HEADS), (128, HEADS)]
    assert all(state.decode.ours for state in rt.kinds.values()), built.info
    assert rt.reserved["decode"] > 0
    workspace.lock_workspace()
    for layer in model.layers:
        layer.swa_cache_layer = types.SimpleNamespace(kv_cache=layer.swa_view.view)
        seqs = [300, 1400, 57][: 3 if per_req == 1 else 2]
        assert decode_table.use_head_exact_decode(layer.compress_ratio, HEADS, len(seqs) * per_req)
        swa, attn, T = _decode_batch(model, layer, seqs, per_req)
        q = torch.randn(T, PADDED, 512, generator=g).to(torch.bfloat16)
        out = _call(built.cls, layer, swa, attn, q, T)
        assert bool(out[:, HEADS:].isnan().all()), "padded heads were written"
        assert not bool(out[:, :HEADS].isnan().any())
        torch.testing.assert_close(
            out[:, :HEADS].float(),
            _reference(layer, swa, attn, q, peer_topk).float(),
            atol=2e-2,
            rtol=2e-2,
            msg=lambda m, prefix=layer.prefix: f"seed {seed} {prefix}: {m}",
        )
    # the next step: each layer's binding (its caches checked once, at vLLM's page sizes)
    # runs with the new step's rows; no cache view is checked again
    checked: list[str] = []
    real = _paged_keys.check_page_cache
    monkeypatch.setattr(
        _paged_keys, "check_page_cache", lambda *a: checked.append(a[0]) or real(*a)
    )
    for layer in model.layers:
        bound = layer._dsv4_binding[1]
        assert bound.window.page_size == 64 and bound.heads == HEADS
        assert bound.window.page_stride == layer.swa_view.view.stride(0)
        if layer.compress_ratio > 1:
            assert bound.comp.page_size == 256 // layer.compress_ratio
        swa, attn, T = _decode_batch(model, layer, [700, 90], per_req)
        q = torch.randn(T, PADDED, 512, generator=g).to(torch.bfloat16)
        out = _call(built.cls, layer, swa, attn, q, T)
        assert checked == [] and layer._dsv4_binding[1] is bound
        torch.testing.assert_close(
            out[:, :HEADS].float(),
            _reference(layer, swa, attn, q, peer_topk).float(),
            atol=2e-2,
            rtol=2e-2,
            msg=lambda m, prefix=layer.prefix: f"seed {seed} {prefix}, next step: {m}",
        )
    assert built.warning == []


def test_dispatch_follows_the_table_and_the_switch(
    hopper: Callable[..., Built],
    workspace: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own decode runs where the table says FlashMLA was faster, with the switch
    on, on Hopper without the Gluon kernel, off Hopper, and without a reserved scratch;
    ours elsewhere."""
    flashmla = hopper().cls.__mro__[1]
    called: list[int] = []
    monkeypatch.setattr(
        flashmla, "_forward_decode", lambda self, **kw: called.append(kw["q"].shape[0])
    )
    g = generator(fresh_seed())
    model = Model(g, ratios=(1, 1))
    wide, narrow = model.layers  # 16 and 8 local heads, both SWA-only
    wide.n_local_heads = 16
    for layer in model.layers:
        layer.swa_cache_layer = types.SimpleNamespace(kv_cache=layer.swa_view.view)
    # a table with steps where FlashMLA was faster (the curated run has none left at 8
    # and 16 heads): SWA-only at 16 heads slower from 17 to 63 tokens
    ratios = {"swa": {8: {1: 1.3, 1024: 1.5}, 16: {1: 1.2, 16: 1.1, 32: 0.9, 64: 1.2}}}
    table = dataclasses.replace(H200, decode=DecodeTable(True, 16, 1.0, ratios))
    slower = [
        t
        for t in range(1, MAX_TOKENS + 1)
        if not decode_table.use_head_exact_decode(1, 16, t, table=table.decode)
    ]
    assert slower == list(range(17, 64))
    built = hopper(table=table)
    q = torch.randn(MAX_TOKENS, PADDED, 512, generator=g).to(torch.bfloat16)
    T = slower[0]
    swa, attn, _ = _decode_batch(model, wide, [60 + i % 4 for i in range(T)], 1)
    _call(built.cls, wide, swa, attn, q, T)
    assert called == [T]
    assert built.runtime.kinds[(1, 16)].decode.ours  # the step size decided, not the kind
    assert "SWA-only layers, 16 local heads" in built.info[-1]
    assert "decode ours (at the step sizes measured faster (3 of 4))" in built.info[-1]
    # a step size measured faster at 16 heads: ours, on all 16 real heads
    swa, attn, _ = _decode_batch(model, wide, [60 + i % 4 for i in range(T - 1)], 1)
    out = _call(built.cls, wide, swa, attn, q, T - 1)
    assert called == [T], "a step the table takes went to vLLM's decode"
    assert not bool(out[:, :16].isnan().any()) and bool(out[:, 16:].isnan().all())
    swa, attn, _ = _decode_batch(model, narrow, [300, 400], 1)
    _call(built.cls, narrow, swa, attn, q, 2)
    assert called == [T], "a step the table takes went to vLLM's decode"
    assert built.warning == []

    def vllms(**kwargs: Any) -> str:
        """A fresh runtime's decode of the 8-head layer's 2-token step: vLLM's; the
        runtime's decision line."""
        fresh = hopper(**kwargs)
        before = len(called)
        _call(fresh.cls, narrow, swa, attn, q, 2)
        assert called[before:] == [2], kwargs
        assert fresh.warning == []
        assert not fresh.runtime.kinds[(1, HEADS)].decode.ours
        return fresh.info[-1]

    monkeypatch.setenv("DSV4_DECODE_DISABLE", "1")
    assert "decode vLLM's (DSV4_DECODE_DISABLE=1)" in vllms(switches=Switches.read())
    monkeypatch.delenv("DSV4_DECODE_DISABLE")
    no_gluon = Device("NVIDIA H200", (9, 0), wgmma=False)
    assert "the Gluon wgmma kernel does not build here" in vllms(device=no_gluon)
    blackwell = Device("NVIDIA B200", (10, 0))  # not measured
    line = vllms(device=blackwell, table=table_for(blackwell.name, blackwell.capability))
    assert "decode vLLM's (no measured table for NVIDIA B200)" in line
    # no profile run before vLLM locked its workspace: no scratch, vLLM's decode
    workspace.lock_workspace()
    assert "decode vLLM's (no decode scratch could be reserved" in vllms()
