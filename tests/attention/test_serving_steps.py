"""Steps through the plugin across serving configurations (``vllm`` session).

The start-up of every configuration is ``test_serving_configs.py``; here a set of
configurations that covers each axis (V4-Flash at 8 local heads and V4-Pro at 16;
no drafter, MTP, DSpark; budgets 128 to 65536; CUDA-graph modes FULL_AND_PIECEWISE,
PIECEWISE and NONE; dual-batch overlap on and off; prefix caching on and off) runs,
on caches from vLLM's own allocator with vLLM's metadata classes filled as its
builders fill them (the builders' Triton kernels cannot run on a CPU):

1. vLLM's profile run (its own ``forward_mqa`` without metadata, its own
   workspace manager, then locked as vLLM locks it);
2. a prefill step, a decode step (MTP or DSpark tokens per request as the
   drafter gives them), a mixed step (decodes first, then prefills, in one
   metadata object per KV-cache group) and, with DSpark, a drafter step whose
   window rows are DSpark's non-causal rows (``round_up(128 + k, 64)`` wide: the
   context window plus every query token of the request);

every layer's output equals the pure-torch reference over exactly its rows, and
nothing leaves the plugin: no warning, no kind dropped.  Under dual-batch overlap
the steps go to vLLM's own methods instead (a recorder, since FlashMLA cannot run
on a CPU).  vLLM's C4A top-k mapping (``compute_global_topk_indices_and_lens``,
its Triton kernel staged from the installed vLLM and run through Triton's
interpreter) is what ``_forward_decode`` calls, as on a GPU.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention.facts import read_serving_config
from dsv4_attention.policy import Switches
from dsv4_attention.runtime import HeadExactRuntime, make_attention_cls
from dsv4_attention.tables import table_for
from dsv4_kernels.testing.common import fresh_seed, generator

from .test_serving_configs import vllm_config
from .test_vllm_step import PADDED, Model, _reference, ours_cls  # noqa: F401  (fixture)

pytestmark = pytest.mark.vllm

RATIOS = (1, 4, 128)
# (model heads, C4A top-k, drafter, budget, max_model_len, cudagraph, dbo, prefix caching)
CONFIGS = [
    (8, 512, None, 128, 4096, "FULL_AND_PIECEWISE", False, True),
    (8, 512, ("mtp", 3), 8192, 131072, "PIECEWISE", False, False),
    (8, 512, ("dspark", 15), 511, 4096, "NONE", False, True),
    (16, 1024, None, 512, 1048576, "NONE", False, False),
    (16, 1024, ("mtp", 1), 256, 4096, "FULL_AND_PIECEWISE", False, True),
    (16, 1024, ("dspark", 7), 65536, 131072, "PIECEWISE", False, True),
    (8, 512, ("mtp", 2), 8192, 4096, "FULL_AND_PIECEWISE", True, True),
]


class Stack(Model):
    """:class:`Model`'s caches and metadata at ``heads`` local heads and a C4A top-k of
    ``topk``, each layer also holding its window cache as vLLM's layer does."""

    def __init__(self, g: torch.Generator, heads: int, topk: int, budget: int, max_len: int):
        super().__init__(g, ratios=RATIOS)
        self.heads = heads
        for lay in self.layers:
            lay.n_local_heads = heads
            lay.attn_sink[:heads] = torch.randn(heads, generator=g)
            lay.topk_indices_buffer = torch.full((96, topk), -1, dtype=torch.int32)
            lay.max_num_batched_tokens = budget
            lay.max_model_len = max_len
            lay.swa_cache_layer = types.SimpleNamespace(kv_cache=lay.swa_view.view)

    def attach_decode(
        self, step: dict, seq_lens: list[int], query_lens: list[int], width: int, causal: bool
    ) -> None:
        """vLLM's decode fields on the step's metadata objects for its first
        ``step['num_decodes']`` requests: window rows of ``width`` columns (the causal
        window, or DSpark's non-causal rows), the C128A global rows and lengths."""
        decodes = step["num_decodes"]
        if not decodes:
            return
        T = step["num_decode_tokens"]
        req = torch.arange(decodes).repeat_interleave(torch.tensor(query_lens[:decodes]))
        pos = torch.cat(
            [
                torch.arange(s - q, s)
                for s, q in zip(seq_lens[:decodes], query_lens[:decodes], strict=True)
            ]
        )
        first = torch.tensor([s - q for s, q in zip(seq_lens, query_lens, strict=True)])[req]
        last = torch.tensor(seq_lens)[req] - 1
        if causal:
            lo, hi = (pos - 127).clamp(min=0), pos
        else:  # DSpark: the context window before the block plus every query token
            lo, hi = (first - 127).clamp(min=0), last
        lens = (hi - lo + 1).to(torch.int32)
        assert int(lens.max()) <= width
        cols = torch.arange(width)[None, :]
        p = (lo[:, None] + cols).clamp(max=hi[:, None])
        md = step["dict"]
        for group, swa in {id(m): m for m in md.values() if hasattr(m, "decode_swa_lens")}.items():
            del group
            table = swa.block_table
            slots = table[req[:, None], p // 64].long() * 64 + p % 64
            swa.decode_swa_indices = torch.where(cols < lens[:, None], slots, -1).to(torch.int32)[
                :, None, :
            ]
            swa.decode_swa_lens = lens
            swa.token_to_req_indices = torch.cat(
                [req, torch.full((swa.num_prefill_tokens,), -1)]
            ).to(torch.int32)
            swa.is_valid_token = torch.ones(T + swa.num_prefill_tokens, dtype=torch.bool)
            swa.max_decode_query_len = max(query_lens[:decodes])
        n = ((pos + 1) // 128).clamp(max=128)
        c = torch.arange(128)[None, :]
        for attn in {
            id(m): m for m in md.values() if hasattr(m, "c128a_decode_topk_lens")
        }.values():
            page = (c // 2).clamp(max=attn.block_table.shape[1] - 1)
            slots = attn.block_table[req[:, None], page].long() * 2 + c % 2
            attn.c128a_global_decode_topk_indices = torch.where(c < n[:, None], slots, -1).to(
                torch.int32
            )[:, None, :]
            attn.c128a_decode_topk_lens = n.to(torch.int32)


def _decode_reference(
    stack: Stack, lay: Any, step: dict, q: torch.Tensor, peer_topk: Any
) -> torch.Tensor:
    md = step["dict"]
    swa, attn = md[lay.swa_prefix], md.get(lay.prefix)
    T, H = step["num_decode_tokens"], stack.heads
    comp: dict[str, Any] = {}
    if lay.compress_ratio == 4:
        idx, lens = peer_topk(
            lay.topk_indices_buffer[:T],
            swa.token_to_req_indices,
            attn.block_table[: swa.num_decodes],
            64,
            swa.is_valid_token[:T],
        )
        comp = dict(comp_cache=lay.comp_view.view, comp_indices=idx, comp_lens=lens)
    elif lay.compress_ratio == 128:
        comp = dict(
            comp_cache=lay.comp_view.view,
            comp_indices=attn.c128a_global_decode_topk_indices[:, 0],
            comp_lens=attn.c128a_decode_topk_lens,
        )
    if comp:
        comp["comp_block_size"] = 256 // lay.compress_ratio
    out, _ = dk.reference.sparse_mla_paged(
        q[:T, :H],
        lay.swa_view.view,
        swa.decode_swa_indices[:, 0],
        swa.decode_swa_lens,
        lay.scale,
        swa_block_size=64,
        attn_sink=lay.attn_sink[:H],
        **comp,
    )
    return out


@pytest.mark.parametrize(
    ("heads", "topk", "drafter", "budget", "max_len", "cudagraph", "dbo", "prefix"), CONFIGS
)
def test_steps_through_the_plugin(
    heads: int,
    topk: int,
    drafter: tuple[str, int] | None,
    budget: int,
    max_len: int,
    cudagraph: str,
    dbo: bool,
    prefix: bool,
    ours_cls: type,  # noqa: F811
    peer_topk: Any,
    workspace: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.v1.worker import ubatching

    serving = read_serving_config(
        vllm_config(
            topk, budget, max_len, drafter, cudagraph=cudagraph, dbo=dbo, prefix_caching=prefix
        )
    )
    assert serving.cudagraph_mode == cudagraph and serving.dbo == dbo
    built: HeadExactRuntime = ours_cls.dsv4_runtime
    rt = HeadExactRuntime(
        serving, built.device, table_for("NVIDIA H200", (9, 0)), Switches(), built.access
    )
    base = ours_cls.__mro__[1]
    calls: list[str] = []

    class Vllm(base):  # type: ignore[misc,valid-type]
        """vLLM's own prefill/decode observed (FlashMLA cannot run on a CPU)."""

        def _forward_prefill(self, **kw: Any) -> None:
            calls.append("prefill")
            kw["output"].fill_(7.0)

        def _forward_decode(self, **kw: Any) -> None:
            calls.append("decode")
            kw["output"].fill_(7.0)

    cls = make_attention_cls(Vllm, rt)
    # the start-up warm-ups are test_serving_configs.py's (here: only their budget)
    from dsv4_attention import warmup

    def within_budget(*a: Any, max_tokens: Any = None, tokens: Any = (), **kw: Any) -> float:
        assert max(tokens or (max_tokens or 0,)) <= budget
        return 0.0

    monkeypatch.setattr(warmup, "warm_up_prefill", within_budget)
    monkeypatch.setattr(warmup, "warm_up_decode", within_budget)
    monkeypatch.setattr(flashmla, "compute_global_topk_indices_and_lens", peer_topk)
    seed = fresh_seed()
    g = generator(seed)
    stack = Stack(g, heads, topk, budget, max_len)

    # 1. vLLM's profile run, then its workspace locked
    with set_forward_context(None, VllmConfig()):
        for lay in stack.layers:
            lay.PREFILL_CHUNK_SIZE = ours_cls.PREFILL_CHUNK_SIZE
            q = torch.zeros(8, PADDED, 512, dtype=torch.bfloat16)
            cls.forward_mqa(lay, q, None, torch.zeros(8), torch.full_like(q, 3.0))
    workspace.lock_workspace()
    for r in RATIOS:
        state = rt.kinds[(r, heads)]
        assert state.decode.ours, state
    k = 0 if drafter is None else drafter[1]
    per_req = 1 + k
    width = serving.decode_window_width
    prefill_budget = min(budget, 40)
    steps = [
        ("prefill", [prefill_budget - 9, 9], [700, 9], 0, True),
        ("decode", [per_req] * 2, [900, 300], 2, True),
        ("mixed", [per_req, per_req, min(budget - 2 * per_req, 20)], [650, 200, 500], 2, True),
    ]
    if drafter is not None and drafter[0] == "dspark":
        steps.append(("drafter", [per_req] * 3, [400, 140, 60], 3, False))
    for name, qlens, seqs, decodes, causal in steps:
        step = stack.step(qlens, seqs, num_decodes=decodes)
        step["num_decodes"] = decodes
        stack.attach_decode(step, seqs, qlens, 128 if causal else width, causal)
        q = torch.randn(step["total"], PADDED, 512, generator=g).to(torch.bfloat16)
        T = step["num_decode_tokens"]
        with set_forward_context(step["dict"], VllmConfig()):
            if dbo:
                monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 0)
            for lay in stack.layers:
                if name == "drafter" and lay.compress_ratio != 1:
                    continue  # drafter layers are window-only
                md = step["dict"]
                swa, attn = md[lay.swa_prefix], md.get(lay.prefix)
                comp = None if lay.comp_view is None else lay.comp_view.view
                out = torch.full((step["total"], PADDED, 512), float("nan"), dtype=torch.bfloat16)
                before = len(calls)
                if T:
                    cls._forward_decode(
                        lay,
                        q=q[:T],
                        kv_cache=comp,
                        swa_metadata=swa,
                        attn_metadata=attn,
                        swa_only=lay.compress_ratio == 1,
                        output=out[:T],
                    )
                if step["total"] > T:
                    cls._forward_prefill(
                        lay,
                        q=q[T:],
                        positions=torch.zeros(step["total"] - T, dtype=torch.int64),
                        compressed_k_cache=comp,
                        swa_k_cache=lay.swa_view.view,
                        output=out[T:],
                        attn_metadata=attn,
                        swa_metadata=swa,
                    )
                where = f"seed {seed}, {name} step, {lay.prefix}"
                if dbo:  # the process-wide scratch would be shared: vLLM's own methods
                    assert len(calls) > before, where
                    assert bool((out == 7.0).all()), where
                    continue
                assert len(calls) == before, f"{where}: vLLM's method ran ({calls})"
                assert bool(out[:, heads:].isnan().all()), f"{where}: a padded head was written"
                assert not bool(out[:, :heads].isnan().any()), f"{where}: a row was not written"
                if T:
                    torch.testing.assert_close(
                        out[:T, :heads].float(),
                        _decode_reference(stack, lay, step, q, peer_topk).float(),
                        atol=2e-2,
                        rtol=2e-2,
                        msg=lambda m, w=where: f"{w} (decode): {m}",
                    )
                if step["total"] > T:
                    torch.testing.assert_close(
                        out[T:, :heads].float(),
                        _reference(lay, step, q, stack.heads).float(),
                        atol=2e-2,
                        rtol=2e-2,
                        msg=lambda m, w=where: f"{w} (prefill): {m}",
                    )
            if dbo:
                monkeypatch.delitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident())
    warnings = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "dsv4" in r.name
    ]
    assert not warnings, warnings
    for r in RATIOS:
        assert rt.kinds[(r, heads)].decode.ours, "a step dropped a layer kind"
