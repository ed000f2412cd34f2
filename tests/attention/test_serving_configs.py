"""Every DeepSeek-V4 serving configuration starts and steps with the plugin (``vllm`` session).

For V4-Flash (8 local heads at TP8, top-k 512) and V4-Pro (16, top-k 1024), over
the drafters vLLM runs (none, MTP k = 1, 2, 3, DSpark k = 1, 3, 7, 15), token
budgets (128, 256, 511, 512, 8192, 65536) and context lengths (4K, 128K, 1M):

* the served configuration is vLLM's own ``VllmConfig`` (its scheduler, cache,
  compilation and parallel configs; the speculative config is vLLM's class
  without a draft model loaded, so its own ``use_dspark()`` answers; the model
  config is a stand-in with the fields vLLM's DSV4 code reads, since a real one
  needs the checkpoint's files), read once
  by the plugin's :func:`~dsv4_attention.facts.read_serving_config`, which takes
  DSpark's drafter row width from vLLM's ``get_dspark_swa_index_width``;
* the runtime's start-up runs as in vLLM's profile run: every layer kind
  decided, both scratches reserved from vLLM's own workspace manager (then
  locked, as vLLM locks it), the kernels warmed up (torch references on CPU);
  each kind ends up ours, or declined with its one log line, and no exception
  leaves the plugin;
* the reserved decode scratch holds every decode step vLLM can schedule: for
  every step size up to the budget and every row vLLM can build (the widest
  window row, DSpark's included, plus the kind's compressed width), the
  kernel's own ``decode_splits`` needs no more partial rows than reserved; the
  prefill scratch holds the largest prefill step (the kernels' own size
  function ``prefill_scratch_sizes`` at the budget).

Then, on a smaller set that covers each axis (both models; every drafter; every
budget; cudagraph modes; dual-batch overlap on and off; prefix caching on and
off), a prefill, a decode, a mixed and a drafter step run through the plugin's
attention class on caches from vLLM's own allocator and vLLM's metadata
classes, and each layer's output is compared with the pure-torch reference.
Fault injection: a kernel that raises, a renamed metadata field and a locked
workspace send the step to vLLM's own method (whose output is what vLLM's
method writes) with one warning.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dsv4_attention import policy
from dsv4_attention.facts import LayerFacts, ServingConfig, read_serving_config
from dsv4_attention.runtime import HeadExactRuntime, VllmAccess, make_attention_cls
from dsv4_attention.scratch import prefill_scratch_sizes
from dsv4_attention.tables import table_for

pytestmark = pytest.mark.vllm

MODELS = {"V4-Flash": (8, 512), "V4-Pro": (16, 1024)}  # local heads at TP8, index top-k
DRAFTERS: tuple[tuple[str, int] | None, ...] = (
    None,
    ("mtp", 1),
    ("mtp", 2),
    ("mtp", 3),
    ("dspark", 1),
    ("dspark", 3),
    ("dspark", 7),
    ("dspark", 15),
)
BUDGETS = (128, 256, 511, 512, 8192, 65536)
LENGTHS = (4096, 131072, 1048576)
PADDED = 64
H200 = table_for("NVIDIA H200", (9, 0))
FORCED = policy.Device("NVIDIA H200 (forced)", (9, 0), wgmma=True, forced=True)


def vllm_config(
    topk: int,
    budget: int,
    max_len: int,
    drafter: tuple[str, int] | None,
    *,
    cudagraph: str = "FULL_AND_PIECEWISE",
    dbo: bool = False,
    prefix_caching: bool = True,
) -> Any:
    """vLLM's own config objects for one serving configuration.  vLLM's CPU platform
    resets CUDA-graph mode and dual-batch overlap in its post-init; they are set back
    afterwards to what a CUDA worker's config holds."""
    from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    scheduler = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        max_num_seqs=min(256, budget),
    )
    cache = CacheConfig(
        block_size=256, cache_dtype="fp8_ds_mla", enable_prefix_caching=prefix_caching
    )
    config = VllmConfig(scheduler_config=scheduler, cache_config=cache)
    # the model's resolved facts (a ModelConfig needs the checkpoint's files): the
    # fields vLLM's own DSV4 code reads, under vLLM's names
    config.model_config = types.SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"],
        max_model_len=max_len,
        hf_config=types.SimpleNamespace(sliding_window=128, index_topk=topk),
    )
    config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph]
    config.parallel_config.enable_dbo = dbo
    if drafter is not None:
        # vLLM's class, without the draft model its validation would load
        spec = object.__new__(SpeculativeConfig)
        spec.method = drafter[0]
        spec.num_speculative_tokens = drafter[1]
        spec.parallel_drafting = False
        config.speculative_config = spec
    return config


def layer(ratio: int, heads: int, topk: int, budget: int, max_len: int, i: int = 0) -> Any:
    """A DSV4 attention layer's attributes as vLLM's ``DeepseekV4Attention`` holds them."""
    sink = torch.full((PADDED,), float("-inf"))
    sink[:heads] = torch.linspace(-1.0, 1.0, heads)
    return types.SimpleNamespace(
        prefix=f"model.layers.{i}.self_attn.attn",
        n_local_heads=heads,
        compress_ratio=ratio,
        window_size=128,
        scale=512**-0.5,
        attn_sink=sink,
        topk_indices_buffer=torch.full((min(budget, 64), topk), -1, dtype=torch.int32),
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        kv_cache_dtype="fp8_ds_mla",
    )


def _access(ws: Any, lines: list[tuple[int, str]]) -> VllmAccess:
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.v1.worker.ubatching import dbo_enabled

    return VllmAccess(
        forward_context=lambda: get_forward_context() if is_forward_context_available() else None,
        workspace=lambda: (
            ws.current_workspace_manager() if ws.is_workspace_manager_initialized() else None
        ),
        info=lambda s: lines.append((logging.INFO, s)),
        warning=lambda s: lines.append((logging.WARNING, s)),
        dual_batch=dbo_enabled,
    )


def _start(
    serving: ServingConfig, ws: Any, heads: int, topk: int, lines: list[tuple[int, str]]
) -> tuple[HeadExactRuntime, list[Any]]:
    """The runtime through vLLM's profile run: every layer kind prepared, then the
    workspace locked as vLLM locks it after its warm-up."""
    assert serving.max_num_batched_tokens is not None and serving.max_model_len is not None
    rt = HeadExactRuntime(serving, FORCED, H200, policy.Switches(), _access(ws, lines))
    layers = [
        layer(r, heads, topk, serving.max_num_batched_tokens, serving.max_model_len, i)
        for i, r in enumerate((1, 4, 128))
    ]
    q = torch.zeros((1, PADDED, 512), dtype=torch.bfloat16)
    for lay in layers:
        rt.prepare(lay, q)
    ws.lock_workspace()
    return rt, layers


def _check_decode_scratch_covers(rt: HeadExactRuntime, facts: LayerFacts) -> None:
    """Every decode step vLLM can schedule for this kind fits the reserved scratch, by
    the kernel's own split rule (``decode_splits``) at every step size up to the budget."""
    from dsv4_kernels.decode import decode_splits, num_sms

    z = rt.decode_scratch.sizes
    sms = num_sms(rt.decode_scratch.lse.device)
    assert z.max_tokens >= facts.max_tokens and z.max_heads >= facts.heads
    windows = {facts.window, facts.decode_window_width}
    for t in range(1, facts.max_tokens + 1):
        for a in windows:
            splits = decode_splits(t, facts.heads, a, facts.comp_width, sms)[0]
            need = t * splits if splits > 1 else 1
            assert need <= z.partial_rows, (facts, t, a, splits, z)


CONFIGS = list(itertools.product(MODELS, DRAFTERS, BUDGETS, LENGTHS))


@pytest.mark.parametrize(
    ("model", "drafter", "budget", "max_len"),
    CONFIGS,
    ids=[f"{m}-{d[0] + str(d[1]) if d else 'none'}-{b}-{n}" for m, d, b, n in CONFIGS],
)
def test_start_up_reserves_what_every_step_needs(
    model: str,
    drafter: tuple[str, int] | None,
    budget: int,
    max_len: int,
    workspace: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heads, topk = MODELS[model]
    serving = read_serving_config(vllm_config(topk, budget, max_len, drafter))
    assert (serving.max_num_batched_tokens, serving.max_model_len) == (budget, max_len)
    assert serving.index_topk == topk and serving.architectures == ("DeepseekV4ForCausalLM",)
    if drafter is not None and drafter[0] == "dspark":
        from vllm.v1.attention.backends.mla.compressor_utils import get_dspark_swa_index_width

        assert serving.decode_window_width == get_dspark_swa_index_width(128, drafter[1])
    else:
        assert serving.decode_window_width == 128
    lines: list[tuple[int, str]] = []
    warmed: list[tuple[str, int]] = []
    from dsv4_attention import warmup

    real_prefill, real_decode = warmup.warm_up_prefill, warmup.warm_up_decode
    # the warm-ups run for real (torch references on CPU) in the smallest budget with
    # the widest drafter rows, for both models; elsewhere only their arguments (within
    # the budget) are checked
    # (on CPU a real warm-up costs tens of seconds: the torch references)
    real = max_len == 4096 and budget == 128 and drafter == ("dspark", 15)

    def prefill(*a: Any, max_tokens: int | None = None, **k: Any) -> float:
        assert max_tokens is not None and max_tokens <= budget
        warmed.append(("prefill", max_tokens))
        if real:
            return real_prefill(*a, max_tokens=max_tokens, **k)
        return 0.0

    def decode(*a: Any, tokens: tuple[int, ...] = (), **k: Any) -> float:
        assert tokens and max(tokens) <= budget
        warmed.append(("decode", max(tokens)))
        if real:
            return real_decode(*a, tokens=tokens, **k)
        return 0.0

    monkeypatch.setattr(warmup, "warm_up_prefill", prefill)
    monkeypatch.setattr(warmup, "warm_up_decode", decode)
    rt, layers = _start(serving, workspace, heads, topk, lines)
    assert not [s for lvl, s in lines if lvl >= logging.WARNING], lines
    decided = [s for _, s in lines if " layers, " in s]
    assert len(decided) == 3, lines  # one line per layer kind
    assert any("reserved" in s and "MiB per GPU" in s for _, s in lines)
    for lay in layers:
        facts = rt.facts(lay)
        state = rt.kinds[(facts.compress_ratio, heads)]
        # the H200 table takes every kind's decode; the prefill up to its head limits
        assert state.decode.ours, state
        want = policy.prefill_choice(facts, FORCED, H200, policy.Switches()).ours
        assert state.prefill.ours == want, state
        if state.decode.ours:
            _check_decode_scratch_covers(rt, facts)
        if state.prefill.ours:
            assert rt.prefill_scratch is not None
            need = prefill_scratch_sizes(
                policy.prefill_scratch_spec([facts], rt.prefill_scratch.spec.max_group)
            )
            for name, (n, _dtype) in need.items():
                assert rt.prefill_scratch.buffers[name].numel() >= n, (name, facts)
    assert ("decode", min(512, budget)) in warmed


# --- fault injection: whatever goes wrong in our path, vLLM's own method runs ------------


class _Recorder:
    """vLLM's own ``_forward_prefill`` / ``_forward_decode`` as the base class's methods
    (FlashMLA cannot run on a CPU): each call is recorded and writes 7.0 to ``output``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prefill(self, layer: Any, **kw: Any) -> None:
        self.calls.append("prefill")
        kw["output"].fill_(7.0)

    def decode(self, layer: Any, **kw: Any) -> None:
        self.calls.append("decode")
        kw["output"].fill_(7.0)


@pytest.fixture
def faulty() -> Iterator[tuple[type, _Recorder, Any]]:
    """Our class over vLLM's FlashMLA class whose own methods are the recorder's."""
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    rec = _Recorder()
    base = type(
        "VllmMethods",
        (DeepseekV4FlashMLAAttention,),
        {
            "_forward_prefill": lambda self, **kw: rec.prefill(self, **kw),
            "_forward_decode": lambda self, **kw: rec.decode(self, **kw),
        },
    )
    yield base, rec, None


def _one_layer_step(ratio: int) -> tuple[Any, dict[str, Any]]:
    """One SWA-only or C4A layer on caches from vLLM's allocator, and one prefill step's
    metadata under vLLM's field names."""
    from .vllm_layout import vllm_dsv4_caches

    views, _ = vllm_dsv4_caches("BLHNC", available_bytes=8 << 20, ratios=(ratio,))
    swa = next(v for v in views if v.kind == "window")
    comp = next((v for v in views if v.kind in ("c4a", "c128a")), None)
    lay = layer(ratio, 8, 512, 64, 4096)
    lay.swa_cache_layer = types.SimpleNamespace(kv_cache=swa.view)
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    seq = torch.tensor([300], dtype=torch.int32)
    swa_md = types.SimpleNamespace(
        num_decodes=0,
        num_prefills=1,
        num_decode_tokens=0,
        num_prefill_tokens=5,
        query_start_loc=qsl,
        prefill_seq_lens=seq,
        prefill_seq_lens_cpu=seq,
        prefill_query_lens_cpu=torch.tensor([5], dtype=torch.int32),
        block_table=torch.arange(8, dtype=torch.int32)[None],
        block_size=64,
        prefill_left_visible=None,
        prefill_right_visible=None,
    )
    attn_md = types.SimpleNamespace(
        block_table=torch.arange(2, dtype=torch.int32)[None], block_size=256
    )
    q = torch.randn(5, PADDED, 512).to(torch.bfloat16)
    return lay, {
        "q": q,
        "positions": torch.arange(295, 300),
        "compressed_k_cache": None if comp is None else comp.view,
        "swa_k_cache": swa.view,
        "output": torch.zeros_like(q),
        "attn_metadata": attn_md,
        "swa_metadata": swa_md,
    }


def _runtime(lines: list[tuple[int, str]], **access: Any) -> HeadExactRuntime:
    serving = read_serving_config(vllm_config(512, 64, 4096, None))
    return HeadExactRuntime(
        serving,
        FORCED,
        H200,
        policy.Switches(),
        VllmAccess(
            info=lambda s: lines.append((logging.INFO, s)),
            warning=lambda s: lines.append((logging.WARNING, s)),
            **access,
        ),
    )


def test_a_kernel_that_raises_falls_back_to_vllm_once(
    faulty: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4_attention import vllm_calls

    base, rec, _ = faulty
    lines: list[tuple[int, str]] = []
    rt = _runtime(lines)
    cls = make_attention_cls(base, rt)
    lay, args = _one_layer_step(1)
    cls._forward_prefill(lay, **args)  # ours runs
    assert rec.calls == [] and not bool((args["output"][:, :8] == 7.0).any()), lines

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(vllm_calls, "run_prefill", boom)
    for _ in range(3):
        args["output"].zero_()
        cls._forward_prefill(lay, **args)
        assert bool((args["output"] == 7.0).all()), "vLLM's method did not write the output"
    assert rec.calls == ["prefill"] * 3
    warnings = [s for lvl, s in lines if lvl == logging.WARNING]
    assert len(warnings) == 1 and "injected kernel failure" in warnings[0], warnings
    assert not rt.kinds[(1, 8)].prefill.ours  # the kind stays on vLLM's path


def test_a_renamed_metadata_field_falls_back_to_vllm(faulty: Any) -> None:
    base, rec, _ = faulty
    lines: list[tuple[int, str]] = []
    cls = make_attention_cls(base, _runtime(lines))
    lay, args = _one_layer_step(4)
    md = args["swa_metadata"]
    md.prefill_seq_lens_v2 = md.prefill_seq_lens  # a patch release renames a field
    del md.prefill_seq_lens
    cls._forward_prefill(lay, **args)
    assert rec.calls == ["prefill"] and bool((args["output"] == 7.0).all())
    warnings = [s for lvl, s in lines if lvl == logging.WARNING]
    assert len(warnings) == 1 and "AttributeError" in warnings[0], warnings


def test_a_locked_workspace_declines_at_first_contact(faulty: Any, workspace: Any) -> None:
    """No profile run reserved anything and vLLM's workspace is locked: the kind keeps
    vLLM's path, with its one decision line and no exception."""
    base, rec, _ = faulty
    workspace.lock_workspace()
    lines: list[tuple[int, str]] = []
    cls = make_attention_cls(base, _runtime(lines, workspace=workspace.current_workspace_manager))
    lay, args = _one_layer_step(1)
    cls._forward_prefill(lay, **args)
    assert rec.calls == ["prefill"]
    decided = [s for _, s in lines if "SWA-only layers" in s]
    assert (
        len(decided) == 1 and "prefill vLLM's (no prefill scratch could be reserved" in decided[0]
    )
    assert not [s for lvl, s in lines if lvl >= logging.WARNING]


def test_under_capture_a_failure_fails_start_up(
    faulty: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a CUDA graph is captured, an exception of ours propagates (vLLM's start-up
    fails) instead of capturing vLLM's path silently."""
    from dsv4_attention import vllm_calls

    base, rec, _ = faulty
    cls = make_attention_cls(base, _runtime([], capturing=lambda: True))
    lay, args = _one_layer_step(1)

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(vllm_calls, "run_prefill", boom)
    with pytest.raises(RuntimeError, match="injected"):
        cls._forward_prefill(lay, **args)
    assert rec.calls == []
