"""The head-exact prefill inside vLLM's own ``_forward_prefill`` contract (``vllm`` session).

Both paths run on the same inputs built from vLLM's own pieces:

* caches: per-layer views from vLLM's allocator (``vllm_layout``), block-outer;
* metadata: vLLM's own ``DeepseekSparseSWAMetadata`` and
  ``DeepseekV4FlashMLAMetadata`` objects for a mixed batch (decodes first,
  then prefills of different lengths, one past 4 x 512 compressed entries);
* vLLM's path: ``DeepseekV4FlashMLAAttention._forward_prefill`` itself (its
  chunk plan, workspace, gather and combine calls), with its gather and
  combine being vLLM's own Triton kernels (staged by ``benchmarks.support.vllm_peer``,
  through Triton's interpreter) and, since FlashMLA cannot run on a CPU, the
  attention call answered by our bf16-workspace kernel on vLLM's padded heads;
* our path: the plugin's subclass (as vLLM's selector wrapped by the plugin
  returns it, the CUDA platform faked) over a fresh runtime per test (the
  plugin's device, table and access to vLLM), whose ``_forward_prefill`` reads
  the FP8 pages for the real heads only.

The prefill policy (which layer kinds and steps take ours on the H200) is
checked here too, from the measured table with an explicit device and
switches, and through the runtime on vLLM's own step metadata.

What cannot be driven on a CPU: vLLM's metadata *builders* (they need a
scheduler output and CUDA tensors), FlashMLA, and the fused cache writers; the
metadata objects are therefore filled field by field, as the builders do.
"""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import policy, tables, vllm_calls
from dsv4_attention.facts import LayerFacts, ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess
from dsv4_attention.tables import table_for
from dsv4_kernels import _paged_keys, sparse_mla
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_hopper import hopper_attention_class
from .test_vllm_step import PREFILL_ONLY, head_exact_cls
from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm

HEADS, PADDED = 8, 64  # V4-Flash at TP8: 8 real heads, FlashMLA pads to 64
QLENS = (1, 1, 24, 6, 5)  # two decodes, then three prefills
SEQ = (400, 90, 2300, 9000, 41)  # the second prefill has 2250 > 4 x 512 C4A entries
MAX_TOKENS, MAX_MODEL_LEN = 1024, 16384  # the layer's (vLLM's) limits
SERVING = ServingConfig(
    architectures=("DeepseekV4ForCausalLM",),
    max_num_batched_tokens=MAX_TOKENS,
    max_model_len=MAX_MODEL_LEN,
)
H200 = table_for("NVIDIA H200", (9, 0))
assert H200 is not None
HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)
# a wide row as a GPU run would write it (issue 41): C4A and C128A at 64 heads in the
# wgmma kernel's blocks of 64 (not measured: the shipped H200 table has none)
WIDE = {
    64: tables.WidePrefill(
        frozenset({"c4a", "c128a"}),
        {"MAX_BLOCK_H": 64, "BLOCK_N": 32, "NUM_WARPS": 8, "NUM_STAGES": 1, "PREFETCH": 0,
         "BF16_DEQUANT": 1, "KERNEL": 2, "ASYNC_PV": 1, "WIDE_HT": 64},
    )
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    from benchmarks.support import vllm_peer
    from vllm.models.deepseek_v4.nvidia import flashmla

    folder = tmp_path_factory.mktemp("vllm_peer")
    vllm_peer.stage(Path(folder))
    ops = vllm_peer.load(folder)
    with hopper_attention_class() as ours_cls:
        yield types.SimpleNamespace(ops=ops, flashmla=flashmla, ours_cls=ours_cls)


def _layer(ratio: int, heads: int, topk_buffer: torch.Tensor, g: torch.Generator):  # type: ignore[no-untyped-def]
    """vLLM's DSV4 attention layer as far as ``_forward_prefill`` reads it."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    sink = torch.full((PADDED,), float("-inf"))
    sink[:heads] = torch.randn(heads, generator=g)
    return types.SimpleNamespace(
        n_local_heads=heads,
        compress_ratio=ratio,
        window_size=128,
        scale=512**-0.5,
        attn_sink=sink,
        topk_indices_buffer=topk_buffer,
        max_image_tokens=0,
        max_num_batched_tokens=MAX_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_dtype="fp8_ds_mla",
        prefix=f"layers.{ratio}.attn",
        PREFILL_CHUNK_SIZE=DeepseekV4Attention.PREFILL_CHUNK_SIZE,
    )


def _vllm_attention(q, kv, indices, sm_scale, attn_sink, topk_length, out):
    """Stands in for FlashMLA's ``flash_mla_sparse_fwd`` (CUDA only): our workspace kernel."""
    got, _ = dk.sparse_mla_workspace(
        q, kv, indices.squeeze(1), topk_length, sm_scale, attn_sink=attn_sink
    )
    out.copy_(got)


class _Workspace:
    """vLLM's workspace manager needs an accelerator to grow; plain CPU allocations here."""

    def get_simultaneous(self, *shapes: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        return [torch.full(shape, -3, dtype=dtype) for shape, dtype in shapes]


def _batch(g: torch.Generator, ratio: int, caches: dict[str, torch.Tensor]) -> dict[str, object]:
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    num_decodes = 2
    qsl = torch.tensor([0, *torch.tensor(QLENS).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(SEQ, dtype=torch.int32)
    qlen = torch.tensor(QLENS, dtype=torch.int32)
    total = int(qsl[-1])
    num_prefill_tokens = total - int(qsl[num_decodes])

    def table(cache: torch.Tensor, per_page: int, entries: torch.Tensor) -> torch.Tensor:
        pages = [-(-int(n) // per_page) for n in entries]
        perm = torch.randperm(cache.shape[0], generator=g)
        assert sum(pages) <= cache.shape[0], "cache too small for the batch"
        rows, start = [], 0
        for n in pages:
            rows.append(torch.cat([perm[start : start + n], torch.zeros(max(pages) + 3 - n)]))
            start += n
        return torch.stack(rows).to(torch.int32)

    swa_cache = caches["window"]
    swa = DeepseekSparseSWAMetadata(
        block_table=table(swa_cache, 64, seq),
        slot_mapping=torch.zeros(total, dtype=torch.int64),
        block_size=64,
        seq_lens=seq,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        num_decodes=num_decodes,
        num_prefills=len(QLENS) - num_decodes,
        num_decode_tokens=int(qsl[num_decodes]),
        num_prefill_tokens=num_prefill_tokens,
        prefill_seq_lens=seq[num_decodes:],
        prefill_seq_lens_cpu=seq[num_decodes:].clone(),
        prefill_query_lens_cpu=qlen[num_decodes:].clone(),
        prefill_gather_lens=torch.minimum(seq, qlen + 127)[num_decodes:].to(torch.int32),
        prefill_window_size=128,
        prefill_max_model_len=16384,
        prefill_max_num_batched_tokens=1024,
    )
    attn = None
    topk_buffer = torch.full((total + 16, 512), -1, dtype=torch.int32)
    if ratio > 1:
        comp_cache = caches["c4a" if ratio == 4 else "c128a"]
        per_page = 256 // ratio
        entries = seq // ratio
        c128a_rows = None
        pos = torch.cat(
            [torch.arange(int(s) - int(q), int(s)) for s, q in zip(seq, qlen, strict=True)]
        )
        if ratio == 4:
            for t in range(total):
                n = min(512, (int(pos[t]) + 1) // 4)
                if n:
                    topk_buffer[t, :n] = torch.randperm((int(pos[t]) + 1) // 4, generator=g)[:n]
        else:
            width = 128  # vLLM's power-of-two C128A row width, >= max entries
            n = ((pos + 1) // 128).clamp(max=width)
            cols = torch.arange(width)[None, :]
            rows = torch.where(cols < n[:, None], cols, -1).to(torch.int32)
            c128a_rows = rows[int(qsl[num_decodes]) :]
        attn = DeepseekV4FlashMLAMetadata(
            num_reqs=len(QLENS),
            max_query_len=max(QLENS),
            max_seq_len=max(SEQ),
            num_actual_tokens=total,
            query_start_loc=qsl,
            slot_mapping=torch.zeros(total, dtype=torch.int64),
            block_table=table(comp_cache, per_page, entries),
            req_id_per_token=torch.repeat_interleave(torch.arange(len(QLENS)), qlen),
            block_size=256,
            topk_tokens=512,
            c128a_prefill_topk_indices=c128a_rows,
        )
    return {"swa": swa, "attn": attn, "topk_buffer": topk_buffer, "total": total}


@pytest.mark.parametrize(
    ("ratio", "group", "blocks", "heads"),
    [(1, 1, 0, HEADS), (4, 1, 0, HEADS), (128, 1, 0, HEADS), (1, 4, 0, HEADS),
     (128, 4, 0, HEADS), (128, 1, 1, HEADS), (128, 4, 1, HEADS), (4, 1, 0, 64)],
    ids=["swa", "c4a", "c128a", "swa-grouped", "c128a-grouped", "c128a-blocks",
         "c128a-grouped-blocks", "c4a-64-heads-wide"],
)  # fmt: skip
def test_head_exact_prefill_matches_vllms_own_prefill(
    vllm_env: types.SimpleNamespace,
    ratio: int,
    group: int,
    blocks: int,
    heads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``group`` > 1: the forward takes grouped rows (as on Hopper, where the wgmma kernel
    consumes them; here they are expanded per token), built from vLLM's metadata for a
    batch whose requests start inside groups.  ``blocks``: a table that says
    ``c128a_block_rows``: the C128A rows are read through vLLM's compressed block table
    (no row of entries reserved or built).  ``heads`` 64: V4-Flash at TP1 / DP attention,
    taken from a table with a wide row at 64 heads (issue 41), its tiles passed on."""
    if group > 1:
        monkeypatch.setattr(sparse_mla, "prefill_group_size", lambda q, tiles=None: group)
    seed = fresh_seed()
    g = generator(seed)
    views, storage = vllm_dsv4_caches("BLHNC", available_bytes=96 << 20)
    storage.random_(0, 256, generator=g)
    caches = {}
    for kind in ("window", "c4a", "c128a"):
        view = next(v for v in views if v.kind == kind)
        n = view.view.shape[0] * view.slots
        k = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
        dk.reference.quantize_and_insert_k_cache(k, view.view, torch.arange(n), view.slots)
        caches[kind] = view.view
    batch = _batch(g, ratio, caches)
    total = int(batch["total"])  # type: ignore[call-overload]
    layer = _layer(ratio, heads, batch["topk_buffer"], g)  # type: ignore[arg-type]
    # a fresh runtime: it decides this kind (scratch sized for ``group``) at first contact
    table = H200
    if blocks:
        table = dataclasses.replace(
            H200, prefill=dataclasses.replace(H200.prefill, c128a_block_rows=True)
        )
    if heads > 16:
        table = dataclasses.replace(H200, prefill=dataclasses.replace(H200.prefill, wide=WIDE))
    ours_cls = head_exact_cls(vllm_env.ours_cls, SERVING, table=table)
    swa = batch["swa"]
    num_decode_tokens = swa.num_decode_tokens  # type: ignore[attr-defined]
    q = (torch.randn(total, PADDED, 512, generator=g)).to(torch.bfloat16)
    q[:, heads:] = 0  # vLLM's padded heads
    kwargs = {
        "positions": torch.zeros(total - num_decode_tokens, dtype=torch.int64),
        "compressed_k_cache": caches["c4a" if ratio == 4 else "c128a"] if ratio > 1 else None,
        "swa_k_cache": caches["window"],
        "attn_metadata": batch["attn"],
        "swa_metadata": swa,
    }
    outputs = {}
    flashmla = vllm_env.flashmla
    attention_calls: dict[str, int] = {}

    def vllm_attention(*args, **kwargs):  # type: ignore[no-untyped-def]
        attention_calls[label] = attention_calls.get(label, 0) + 1
        _vllm_attention(*args, **kwargs)

    patches = {
        "flash_mla_sparse_fwd": vllm_attention,
        "current_workspace_manager": _Workspace,
        "combine_topk_swa_indices": vllm_env.ops.combine_topk_swa_indices,
        "dequantize_and_gather_k_cache": vllm_env.ops.dequantize_and_gather_k_cache,
    }
    saved = {name: getattr(flashmla, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(flashmla, name, fn)
        for label, cls in (("vllm", flashmla.DeepseekV4FlashMLAAttention), ("ours", ours_cls)):
            out = torch.full((total, PADDED, 512), 7.0, dtype=torch.bfloat16)
            cls._forward_prefill(
                layer, q=q[num_decode_tokens:], output=out[num_decode_tokens:], **kwargs
            )
            outputs[label] = out
        # the same step again: the layer's binding (made at its first call) runs with no
        # cache view checked again, and gives the same output
        bound = layer._dsv4_binding[1]
        checked: list[str] = []
        real = _paged_keys.check_page_cache
        monkeypatch.setattr(
            _paged_keys, "check_page_cache", lambda *a: checked.append(a[0]) or real(*a)
        )
        again = torch.full((total, PADDED, 512), 7.0, dtype=torch.bfloat16)
        ours_cls._forward_prefill(
            layer, q=q[num_decode_tokens:], output=again[num_decode_tokens:], **kwargs
        )
        assert checked == [] and layer._dsv4_binding[1] is bound
        assert torch.equal(again, outputs["ours"])
    finally:
        for name, fn in saved.items():
            setattr(flashmla, name, fn)
    vllm_out, ours = outputs["vllm"], outputs["ours"]
    # what the binding holds: vLLM's page sizes, the layer's rows and heads, the grouping
    assert (bound.window.page_size, bound.heads, bound.group_size) == (64, heads, group)
    assert bound.tiles == (None if heads <= 16 else {"large": dict(WIDE[heads].tiles)})
    if ratio == 1:
        assert bound.comp is None
    else:
        assert bound.comp is not None and bound.comp.page_size == 256 // ratio
    # ours ran (vLLM's FlashMLA call never made for it) and its kind stays ours
    assert attention_calls.get("vllm", 0) > 0 and "ours" not in attention_calls, attention_calls
    rt = ours_cls.dsv4_runtime
    state = rt.kinds[(ratio, heads)]
    assert state.prefill.ours and state.prefill.reason.startswith("every step"), state
    assert rt.prefill_scratch is not None and rt.prefill_scratch.spec.max_group == group
    plan = rt._step.plan
    assert plan is not None and plan.scratch is rt.prefill_scratch
    # the C128A rows: vLLM's compressed block table read by the kernel, no row of entries
    buffers = rt.prefill_scratch.buffers
    assert plan.c128a_blocks is bool(blocks) and ("c128a0" in buffers) is (not blocks)
    assert ("read through vLLM's block table" in rt.memory_line()) is bool(blocks)
    if blocks:
        built = [*plan._rows.values(), *plan._grouped.values()]
        comps = [getattr(b[1], "comp", b[1]) for b in built]
        assert any(isinstance(c, dk.BlockRows) for c in comps), comps
    # grouped rows where the group is wider than a token (never for C4A layers)
    assert bool(plan._grouped) == (group > 1) and bool(plan._rows) == (group == 1)
    prefill = slice(num_decode_tokens, total)
    assert bool((ours[:num_decode_tokens] == 7.0).all()), "decode rows were written"
    assert bool((ours[prefill, heads:] == 7.0).all()), "padded heads were written"
    assert not bool(ours[prefill, :heads].isnan().any())
    torch.testing.assert_close(
        ours[prefill, :heads].float(),
        vllm_out[prefill, :heads].float(),
        atol=2e-2,
        rtol=2e-2,
        msg=lambda m: f"seed {seed}: {m}",
    )


def _runtime(lines: list[str], table=H200, switches: Switches = PREFILL_ONLY):  # type: ignore[no-untyped-def]
    """A fresh runtime on (faked) Hopper with the Gluon kernel, logging into ``lines``,
    whose warm-ups do nothing (these tests ask what it decides, not what it compiles)."""
    access = VllmAccess(info=lines.append, warning=lines.append)
    return HeadExactRuntime(SERVING, HOPPER, table, switches, access)


@pytest.fixture
def no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-ups that do nothing, with the Gluon kernel reported built (faked Hopper)."""
    from dsv4_attention import warmup

    monkeypatch.setattr(warmup, "warm_up_prefill", lambda *a, **k: 0.0)
    monkeypatch.setattr(warmup, "warm_up_decode", lambda *a, **k: 0.0)
    monkeypatch.setattr(sparse_mla, "wgmma_available", lambda: True)


def _facts(ratio: int, heads: int) -> LayerFacts:
    return LayerFacts(
        name=f"layers.{ratio}.attn",
        compress_ratio=ratio,
        heads=heads,
        window=128,
        topk=512,
        c128a_width=128,
        max_tokens=MAX_TOKENS,
        decode_window_width=128,
        kv_cache_dtype="fp8_ds_mla",
    )


SHORT_ROWS = "in steps whose rows average at most 512 valid keys per token"


@pytest.mark.parametrize(
    ("ratio", "heads", "reason"),
    [
        (1, 8, "every step"),
        (4, 8, "every step"),
        (128, 8, "every step"),
        (1, 16, "every step"),
        (4, 16, SHORT_ROWS),  # V4-Pro TP8: C4A layers only where the rows are short
        (128, 16, "every step"),
        (1, 17, "measured faster above 16"),
        (4, 17, "measured faster above 16"),
        (128, 32, "measured faster above 16"),
        (4, 64, "measured faster above 16"),
        (2, 8, "compress ratio 2 is not a DSV4 layer kind"),
    ],
)
def test_prefill_choice_on_the_h200_table(ratio: int, heads: int, reason: str) -> None:
    """The H200's measured limits: head-exact prefill up to 8 local heads on C4A layers
    (16 in steps whose rows are short), up to 16 on SWA-only and C128A layers."""
    limits = H200.prefill
    assert (limits.c4a_max_heads, limits.shared_keys_max_heads) == (8, 16)
    assert (limits.c4a_short_rows_max_heads, limits.c4a_short_rows_mean_keys) == (16, 512)
    choice = policy.prefill_choice(_facts(ratio, heads), HOPPER, H200, Switches())
    assert choice.ours == (reason in ("every step", SHORT_ROWS))
    assert reason in choice.reason, choice
    if not choice.ours and ratio != 2:
        assert "NVIDIA H200" in choice.reason


def test_prefill_heads_limit_per_kind_and_override() -> None:
    limits = H200.prefill
    c4a, swa, c128a = _facts(4, 16), _facts(1, 16), _facts(128, 16)
    assert policy.prefill_heads_limit(c4a, limits, Switches()) == 8
    assert policy.prefill_heads_limit(c4a, limits, Switches(), short_rows=True) == 16
    for facts in (swa, c128a):
        assert policy.prefill_heads_limit(facts, limits, Switches()) == 16
        assert policy.prefill_heads_limit(facts, limits, Switches(), short_rows=True) == 16
    # DSV4_PREFILL_MAX_HEADS: one limit for every kind, short rows or not
    for n in (0, 4, 16, 128):
        for facts in (c4a, swa, c128a):
            for short in (False, True):
                got = policy.prefill_heads_limit(
                    facts, limits, Switches(max_heads=n), short_rows=short
                )
                assert got == n


def test_prefill_choice_off_where_nothing_was_measured_faster() -> None:
    """Without the Gluon kernel, off Hopper (no table for Blackwell or Ampere), with the
    switch, or at a head override below the layer's heads: vLLM's prefill; a Hopper
    without its own file has no table (none is borrowed from its family)."""
    facts = _facts(1, 8)
    no_gluon = policy.prefill_choice(facts, Device("NVIDIA H200", (9, 0)), H200, Switches())
    assert not no_gluon.ours and "wgmma" in no_gluon.reason
    for name, cap in (("NVIDIA B200", (10, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))):
        assert table_for(name, cap) is None
        device = Device(name, cap, wgmma=False)
        choice = policy.prefill_choice(facts, device, table_for(name, cap), Switches())
        assert not choice.ours and f"no measured table for {name}" in choice.reason
    assert table_for("NVIDIA H100 80GB HBM3", (9, 0)) is None  # no borrowing by family
    off = policy.prefill_choice(facts, HOPPER, H200, Switches(prefill_disable=True))
    assert not off.ours and "DSV4_PREFILL_DISABLE" in off.reason
    assert not policy.prefill_choice(facts, HOPPER, H200, Switches(max_heads=4)).ours
    assert not policy.prefill_choice(facts, HOPPER, H200, Switches(max_heads=0)).ours
    wide = _facts(4, 64)
    assert policy.prefill_choice(wide, HOPPER, H200, Switches(max_heads=128)).reason == "every step"
    at16 = policy.prefill_choice(_facts(4, 16), HOPPER, H200, Switches(max_heads=16))
    assert at16.ours and at16.reason == "every step"


def test_prefill_step_takes_ours_by_heads_and_mean_keys() -> None:
    """Within a kind's head limit every step is ours; a C4A layer above it only in steps
    whose rows average at most the measured mean (unknown lengths: vLLM's)."""
    limits = H200.prefill
    for facts in (_facts(4, 8), _facts(1, 16), _facts(128, 16)):
        for mean in (None, 0.0, 512.0, 513.0, 1152.0):
            assert policy.prefill_step_takes_ours(facts, limits, Switches(), mean)
    wide = _facts(4, 16)
    assert policy.prefill_step_takes_ours(wide, limits, Switches(), 248.0)
    assert policy.prefill_step_takes_ours(wide, limits, Switches(), 512.0)
    assert not policy.prefill_step_takes_ours(wide, limits, Switches(), 512.5)
    assert not policy.prefill_step_takes_ours(wide, limits, Switches(), 1152.0)
    assert not policy.prefill_step_takes_ours(wide, limits, Switches(), None)
    assert policy.prefill_step_takes_ours(wide, limits, Switches(max_heads=16), None)
    # (asked only of kinds whose prefill is ours: under DSV4_PREFILL_MAX_HEADS=8 the
    # 16-head C4A kind is not, test_prefill_choice_off_where_nothing_was_measured_faster)
    assert not policy.prefill_choice(wide, HOPPER, H200, Switches(max_heads=8)).ours


@pytest.mark.parametrize("topk", [512, 8])
def test_c4a_mean_keys_counts_each_tokens_valid_keys(topk: int) -> None:
    """Closed form vs. counting: position ``p`` reads ``min(p + 1, 128)`` window keys and
    ``min((p + 1) // 4, topk)`` compressed ones, past the window and past 4 x top-k."""
    g = generator(fresh_seed())
    for _ in range(20):
        n = int(torch.randint(1, 4, (1,), generator=g))
        seq = [int(s) for s in torch.randint(1, 3000, (n,), generator=g)]
        qlen = [int(torch.randint(1, s + 1, (1,), generator=g)) for s in seq]
        keys = [
            min(p + 1, 128) + min((p + 1) // 4, topk)
            for s, q in zip(seq, qlen, strict=True)
            for p in range(s - q, s)
        ]
        got = policy.c4a_mean_keys(seq, qlen, 128, topk)
        assert got == pytest.approx(sum(keys) / len(keys)), (seq, qlen)
    assert policy.c4a_mean_keys([], [], 128, topk) == 0.0


def test_c4a_short_row_rule_reads_vllms_step_metadata(
    no_warmup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule for C4A layers at 9-16 heads on Hopper reads the host-side lengths of
    vLLM's own ``DeepseekSparseSWAMetadata`` (chunks at different depths, decodes first),
    counts each prefill token's valid keys as the rows hold them, and the runtime sends
    the step to ours exactly when that mean is within the table's."""
    g = generator(fresh_seed())
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=96 << 20)
    caches = {v.kind: v.view for v in views}
    batch = _batch(g, 4, caches)
    swa, attn = batch["swa"], batch["attn"]
    buffer = batch["topk_buffer"]
    topk = int(buffer.shape[-1])  # type: ignore[attr-defined]
    keys = [
        min(p + 1, 128) + min((p + 1) // 4, topk)
        for s, q in zip(SEQ[2:], QLENS[2:], strict=True)
        for p in range(s - q, s)
    ]
    mean = sum(keys) / len(keys)
    assert policy.c4a_mean_keys(SEQ[2:], QLENS[2:], 128, topk) == pytest.approx(mean)
    total = int(batch["total"])  # type: ignore[call-overload]
    d = int(swa.num_decode_tokens)  # type: ignore[attr-defined]
    q = torch.zeros(total, PADDED, 512, dtype=torch.bfloat16)
    ran: list[str] = []
    monkeypatch.setattr(vllm_calls, "run_prefill", lambda layer, *a: ran.append(layer.prefix))
    edge = math.ceil(mean)  # the smallest whole threshold the step is within
    for threshold, ours in ((edge - 1, False), (edge, True)):
        limits = dataclasses.replace(H200.prefill, c4a_short_rows_mean_keys=threshold)
        lines: list[str] = []
        rt = _runtime(lines, table=dataclasses.replace(H200, prefill=limits))
        layer = _layer(4, 16, buffer, g)  # type: ignore[arg-type]
        facts = rt.facts(layer)
        assert facts.heads > policy.prefill_heads_limit(facts, limits, rt.switches)
        assert policy.prefill_step_takes_ours(facts, limits, rt.switches, mean) is ours
        ran.clear()
        took = rt.prefill(
            layer, q[d:], caches["c4a"], caches["window"], torch.empty_like(q[d:]), attn, swa
        )
        assert took is ours and ran == ([layer.prefix] if ours else [])
        state = rt.kinds[(4, 16)]
        assert state.prefill.ours and f"at most {threshold} valid keys" in state.prefill.reason
        # the mean the runtime used: vLLM's host lengths, once per step
        assert rt._step.mean_keys == {(128, topk, 4): pytest.approx(mean)}
        assert rt._step_mean_keys(facts, swa) == pytest.approx(mean)
        assert not [line for line in lines if "raised" in line], lines
    # metadata without host lengths: the mean is unknown and the step is vLLM's
    assert rt._step_mean_keys(facts, types.SimpleNamespace()) is None


def test_kind_lines_name_the_c4a_short_row_rule(no_warmup: None) -> None:
    """What each layer kind logs at start-up on Hopper: at 16 local heads the C4A line
    names the short-row rule, SWA-only and C128A take every step; a set
    ``DSV4_PREFILL_MAX_HEADS`` is one limit for every layer kind, without the rule."""
    g = generator(fresh_seed())
    buffer = torch.full((8, 512), -1, dtype=torch.int32)
    q = torch.zeros(4, PADDED, 512, dtype=torch.bfloat16)

    def kind_lines(heads: int, switches: Switches) -> dict[int, str]:
        lines: list[str] = []
        rt = _runtime(lines, switches=switches)
        for ratio in (1, 4, 128):
            rt.prepare(_layer(ratio, heads, buffer, g), q)
        assert sorted(rt.kinds) == [(r, heads) for r in (1, 4, 128)]
        found = {
            r: [line for line in lines if rt.kinds[(r, heads)].facts.kind_text + " layers" in line]
            for r in (1, 4, 128)
        }
        assert all(len(v) == 1 for v in found.values()), lines
        return {r: v[0] for r, v in found.items()}

    pro = kind_lines(16, PREFILL_ONLY)
    assert (
        f"C4A layers, 16 local heads, DeepseekV4ForCausalLM: prefill ours ({SHORT_ROWS})" in pro[4]
    )
    for r in (1, 128):
        assert "16 local heads" in pro[r] and "prefill ours (every step)" in pro[r], pro[r]
    flash = kind_lines(8, PREFILL_ONLY)
    assert all("prefill ours (every step)" in line for line in flash.values()), flash
    # the switch as the plugin reads it from the environment
    env = {"DSV4_PREFILL_MAX_HEADS": "16", "DSV4_DECODE_DISABLE": "1"}
    switches = Switches.read(env)
    assert switches == Switches(decode_disable=True, max_heads=16)
    forced = kind_lines(16, switches)
    assert all("prefill ours (every step)" in line for line in forced.values()), forced
    assert not any("valid keys" in line for line in forced.values())
    low = kind_lines(16, Switches.read({**env, "DSV4_PREFILL_MAX_HEADS": "8"}))
    for line in low.values():
        assert (
            "prefill vLLM's (16 local heads: vLLM's FlashMLA prefill (padded to 64 heads) is "
            "measured faster above 8" in line
        )
    with pytest.raises(ValueError, match="DSV4_PREFILL_MAX_HEADS"):
        Switches.read({"DSV4_PREFILL_MAX_HEADS": "sixteen"})
    with pytest.raises(ValueError, match="DSV4_PREFILL_MAX_HEADS"):
        Switches.read({"DSV4_PREFILL_MAX_HEADS": "-1"})


@pytest.mark.parametrize("ratio", [4, 128], ids=["c4a", "c128a"])
def test_replaced_ops_fall_back_to_vllms_inside_its_prefill(
    vllm_env: types.SimpleNamespace, ratio: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection inside vLLM's own ``_forward_prefill``: the combine and the gather
    the plugin puts in place (``adapters.replacements`` over vLLM's staged ops, as the
    plugin builds them) raise in our kernels; vLLM's own ops run instead, the output
    equals vLLM's, each op warns once, and a second step calls vLLM's ops directly (ours
    is not tried again).  Under capture the error propagates (start-up fails)."""
    from dsv4_attention.adapters import OpsGuard, replacements

    seed = fresh_seed()
    g = generator(seed)
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=96 << 20)
    caches = {}
    for kind in ("window", "c4a", "c128a"):
        view = next(v for v in views if v.kind == kind)
        n = view.view.shape[0] * view.slots
        k = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
        dk.reference.quantize_and_insert_k_cache(k, view.view, torch.arange(n), view.slots)
        caches[kind] = view.view
    batch = _batch(g, ratio, caches)
    total = int(batch["total"])  # type: ignore[call-overload]
    layer = _layer(ratio, HEADS, batch["topk_buffer"], g)  # type: ignore[arg-type]
    swa = batch["swa"]
    num_decode_tokens = swa.num_decode_tokens  # type: ignore[attr-defined]
    q = (torch.randn(total, PADDED, 512, generator=g)).to(torch.bfloat16)
    q[:, HEADS:] = 0
    kwargs = {
        "positions": torch.zeros(total - num_decode_tokens, dtype=torch.int64),
        "compressed_k_cache": caches["c4a" if ratio == 4 else "c128a"],
        "swa_k_cache": caches["window"],
        "attn_metadata": batch["attn"],
        "swa_metadata": swa,
    }
    names = ("combine_topk_swa_indices", "dequantize_and_gather_k_cache")
    warnings: list[str] = []
    guard = OpsGuard(warning=warnings.append)
    replaced = replacements({n: getattr(vllm_env.ops, n) for n in names}, guard)
    tried: list[str] = []

    def failing(name: str) -> Any:
        def fail(*args: Any, **kw: Any) -> None:
            tried.append(name)
            raise RuntimeError(f"injected fault in our {name}")

        return fail

    for name in names:
        monkeypatch.setattr(dk, name, failing(name))
    flashmla = vllm_env.flashmla
    monkeypatch.setattr(flashmla, "flash_mla_sparse_fwd", _vllm_attention)
    monkeypatch.setattr(flashmla, "current_workspace_manager", _Workspace)
    base = flashmla.DeepseekV4FlashMLAAttention

    def run(ops: dict[str, Any]) -> torch.Tensor:
        for name in names:
            monkeypatch.setattr(flashmla, name, ops[name])
        out = torch.full((total, PADDED, 512), 7.0, dtype=torch.bfloat16)
        base._forward_prefill(
            layer, q=q[num_decode_tokens:], output=out[num_decode_tokens:], **kwargs
        )
        return out

    want = run({n: getattr(vllm_env.ops, n) for n in names})
    for step in range(2):
        got = run(replaced)
        assert bool((got == want).all()), f"seed {seed}, step {step}: not vLLM's output"
    assert sorted(set(tried)) == sorted(names) and len(tried) == 2, tried  # once each
    assert len(warnings) == 2, warnings
    for name in names:
        assert name in guard.failed
        assert any(f"our {name} raised RuntimeError" in w for w in warnings), warnings
    # under CUDA-graph capture the error of ours is raised (it fails vLLM's start-up)
    capturing = OpsGuard(warning=warnings.append, capturing=lambda: True)
    combine = replacements({names[0]: getattr(vllm_env.ops, names[0])}, capturing)[names[0]]
    with pytest.raises(RuntimeError, match="injected fault"):
        combine(
            batch["topk_buffer"], swa.query_start_loc, swa.seq_lens, None, 128, ratio, 512, 1, 1
        )  # type: ignore[attr-defined]
    assert capturing.failed == {} and len(warnings) == 2
