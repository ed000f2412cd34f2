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
* our path: the plugin's subclass (``_select_dsv4_attn_cls`` patched by the
  plugin, the CUDA platform faked), whose ``_forward_prefill`` reads the FP8
  pages for the real heads only.

What cannot be driven on a CPU: vLLM's metadata *builders* (they need a
scheduler output and CUDA tensors), FlashMLA, and the fused cache writers; the
metadata objects are therefore filled field by field, as the builders do.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels import sparse_mla
from dsv4_kernels.testing.common import fresh_seed, generator

from ._vllm_hopper import hopper_attention_class
from .vllm_layout import vllm_dsv4_caches

pytestmark = pytest.mark.vllm

HEADS, PADDED = 8, 64  # V4-Flash at TP8: 8 real heads, FlashMLA pads to 64
QLENS = (1, 1, 24, 6, 5)  # two decodes, then three prefills
SEQ = (400, 90, 2300, 9000, 41)  # the second prefill has 2250 > 4 x 512 C4A entries


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    from benchmarks.support import vllm_peer
    from vllm.models.deepseek_v4.nvidia import flashmla

    folder = tmp_path_factory.mktemp("vllm_peer")
    vllm_peer.stage(Path(folder))
    ops = vllm_peer.load(folder)
    with hopper_attention_class() as ours_cls:
        yield types.SimpleNamespace(ops=ops, flashmla=flashmla, ours_cls=ours_cls)


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
    ("ratio", "group"),
    [(1, 1), (4, 1), (128, 1), (1, 4), (128, 4)],
    ids=["swa", "c4a", "c128a", "swa-grouped", "c128a-grouped"],
)
def test_head_exact_prefill_matches_vllms_own_prefill(
    vllm_env: types.SimpleNamespace, ratio: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``group`` > 1: the forward takes grouped rows (as on Hopper, where the wgmma kernel
    consumes them; here they are expanded per token), built from vLLM's metadata for a
    batch whose requests start inside groups."""
    if group > 1:
        monkeypatch.setattr(sparse_mla, "prefill_group_size", lambda q: group)
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
    sink = torch.full((PADDED,), float("-inf"))
    sink[:HEADS] = torch.randn(HEADS, generator=g)
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    layer = types.SimpleNamespace(
        n_local_heads=HEADS,
        compress_ratio=ratio,
        window_size=128,
        scale=512**-0.5,
        attn_sink=sink,
        topk_indices_buffer=batch["topk_buffer"],
        max_image_tokens=0,
        max_num_batched_tokens=1024,
        max_model_len=16384,
        kv_cache_dtype="fp8_ds_mla",
        prefix=f"layers.{ratio}.attn",
        PREFILL_CHUNK_SIZE=DeepseekV4Attention.PREFILL_CHUNK_SIZE,
    )
    swa = batch["swa"]
    num_decode_tokens = swa.num_decode_tokens  # type: ignore[attr-defined]
    q = (torch.randn(total, PADDED, 512, generator=g)).to(torch.bfloat16)
    q[:, HEADS:] = 0  # vLLM's padded heads
    kwargs = {
        "positions": torch.zeros(total - num_decode_tokens, dtype=torch.int64),
        "compressed_k_cache": caches["c4a" if ratio == 4 else "c128a"] if ratio > 1 else None,
        "swa_k_cache": caches["window"],
        "attn_metadata": batch["attn"],
        "swa_metadata": swa,
    }
    outputs = {}
    flashmla = vllm_env.flashmla
    patches = {
        "flash_mla_sparse_fwd": _vllm_attention,
        "current_workspace_manager": _Workspace,
        "combine_topk_swa_indices": vllm_env.ops.combine_topk_swa_indices,
        "dequantize_and_gather_k_cache": vllm_env.ops.dequantize_and_gather_k_cache,
    }
    saved = {name: getattr(flashmla, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(flashmla, name, fn)
        for label, cls in (
            ("vllm", flashmla.DeepseekV4FlashMLAAttention),
            ("ours", vllm_env.ours_cls),
        ):
            out = torch.full((total, PADDED, 512), 7.0, dtype=torch.bfloat16)
            cls._forward_prefill(
                layer, q=q[num_decode_tokens:], output=out[num_decode_tokens:], **kwargs
            )
            outputs[label] = out
    finally:
        for name, fn in saved.items():
            setattr(flashmla, name, fn)
    vllm_out, ours = outputs["vllm"], outputs["ours"]
    prefill = slice(num_decode_tokens, total)
    assert bool((ours[:num_decode_tokens] == 7.0).all()), "decode rows were written"
    assert bool((ours[prefill, HEADS:] == 7.0).all()), "padded heads were written"
    assert not bool(ours[prefill, :HEADS].isnan().any())
    torch.testing.assert_close(
        ours[prefill, :HEADS].float(),
        vllm_out[prefill, :HEADS].float(),
        atol=2e-2,
        rtol=2e-2,
        msg=lambda m: f"seed {seed}: {m}",
    )


def test_c4a_short_row_rule_reads_vllms_step_metadata(
    vllm_env: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule for C4A layers at 9-16 heads on Hopper reads the host-side lengths of
    vLLM's own ``DeepseekSparseSWAMetadata`` (chunks at different depths, decodes first)
    and counts each prefill token's valid keys as the rows hold them."""
    from dsv4_attention import vllm_backend as vb

    g = generator(fresh_seed())
    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=96 << 20)
    caches = {v.kind: v.view for v in views}
    batch = _batch(g, 4, caches)
    swa = batch["swa"]
    buffer = batch["topk_buffer"]
    layer = types.SimpleNamespace(
        n_local_heads=16, compress_ratio=4, window_size=128, topk_indices_buffer=buffer
    )
    topk = int(buffer.shape[-1])  # type: ignore[attr-defined]
    keys = [
        min(p + 1, 128) + min((p + 1) // 4, topk)
        for s, q in zip(SEQ[2:], QLENS[2:], strict=True)
        for p in range(s - q, s)
    ]
    mean = sum(keys) / len(keys)
    assert vb._step_mean_keys(layer, swa) == pytest.approx(mean)
    # on Hopper (faked: 8 heads on C4A layers, 16 on the others) the threshold decides
    monkeypatch.setattr(vb, "_default_max_heads", lambda ratio=4: 8 if ratio == 4 else 16)
    monkeypatch.delenv(vb.ENV_MAX_HEADS, raising=False)
    monkeypatch.setattr(vb, "C4A_SHORT_ROWS_MEAN_KEYS", int(mean))
    assert not vb.use_head_exact(layer, swa)
    monkeypatch.setattr(vb, "C4A_SHORT_ROWS_MEAN_KEYS", int(mean) + 1)
    assert vb.use_head_exact(layer, swa)


def test_active_line_names_the_c4a_short_row_rule(
    vllm_env: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``vllm serve`` logs on Hopper (faked): both head limits and the row rule; a
    set ``DSV4_PREFILL_MAX_HEADS`` is one limit for every layer, without the rule."""
    from dsv4_attention import plugin
    from dsv4_attention import vllm_backend as vb

    monkeypatch.setenv("DSV4_KERNELS_FORCE", "1")  # this CPU platform takes the CUDA set
    monkeypatch.delenv(vb.ENV_MAX_HEADS, raising=False)
    monkeypatch.setattr(vb, "_default_max_heads", lambda ratio=4: 8 if ratio == 4 else 16)
    plugin.unregister()  # the plan checks vLLM's own functions, not ours in their place
    try:
        line = plugin._plan()[1]
        assert (
            "head-exact prefill on C4A layers up to 8 local heads, or 16 in steps whose rows "
            f"average at most {vb.C4A_SHORT_ROWS_MEAN_KEYS} valid keys per token; on SWA-only "
            "and C128A layers up to 16" in line
        ), line
        monkeypatch.setenv(vb.ENV_MAX_HEADS, "16")
        line = plugin._plan()[1]
        assert "head-exact prefill up to 16 local heads)" in line, line
    finally:
        plugin.register()  # as the module's fixture left it
