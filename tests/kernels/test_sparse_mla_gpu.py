"""GPU checks of sparse MLA with sink at benchmark sizes: against the float32 reference, paged
against workspace, against FlashMLA (when built) and vLLM 0.33's bundled FlashMLA (when
staged), 64-bit page offsets, one compiled kernel for every layer's view, CUDA graphs.  Run
with ``python3 -m pytest -m gpu`` on a CUDA machine.  (The bundled FlashMLA's loader tests
need no GPU: ``-m gpu -k vllm_flashmla_loader`` runs them anywhere.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from benchmarks import cases_sparse_mla as cs
from benchmarks import flashmla_vllm as fv
from benchmarks.flashmla_provider import PaddedFlashMLA, load_sparse_fwd

import dsv4_kernels as dk
from dsv4_kernels import _triton_sparse_mla as kernels
from dsv4_kernels.geometry import page_stride_bytes
from dsv4_kernels.testing import sparse_mla as ts
from dsv4_kernels.testing.common import fresh_seed

pytestmark = pytest.mark.gpu

SCALE = cs.SCALE
# Shapes: the benchmark's layers at a 131,072-token context, 2,048 query tokens
# (the same keys per token as the 16,384-token benchmark, less time), and fresh requests.
CONTEXT = 131072


def _shape(layer: str, heads: int, *, topk: int = 512, fresh: bool = False) -> cs.AttnShape:
    if fresh:
        return cs.AttnShape(f"{layer}-h{heads}-4x1024", layer, 4, 1024, 1024, heads, topk)
    return cs.AttnShape(f"{layer}-h{heads}-1x2048@131072", layer, 1, 2048, CONTEXT, heads, topk)


def _outputs(inp: cs.AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = inp.q.shape
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((T, H), dtype=torch.float32, device="cuda")
    ts.poison_outputs(out, lse)
    return out, lse


def _written(out: torch.Tensor, lse: torch.Tensor) -> None:
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten elements?)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten elements?)"


def _paged_against_reference(
    inp: cs.AttnInputs, gpu: torch.device, label: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the paged kernel into poisoned outputs; every element written, a token sample
    against the float32 reference.  Returns the outputs."""
    out, lse = _outputs(inp)
    inp.run_paged(out, lse)
    _written(out, lse)
    tokens = cs.check_tokens(out.shape[0], gpu)
    want = cs.reference_sample(inp, tokens)
    cs.assert_close_attention((out[tokens], lse[tokens]), want, label)
    return out, lse


@pytest.mark.parametrize("heads", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa"])
@pytest.mark.parametrize("fresh", [False, True])
def test_benchmark_sizes_match_reference(
    heads: int, layer: str, fresh: bool, gpu: torch.device
) -> None:
    topk = 1024 if heads == 16 else 512
    seed = fresh_seed()
    inp = cs.make_inputs(_shape(layer, heads, topk=topk, fresh=fresh), gpu, seed)
    out, lse = _paged_against_reference(inp, gpu, f"paged, seed {seed}")
    # The bf16 workspace with vLLM's combined rows holds the same keys.
    w_out, w_lse = _outputs(inp)
    inp.run_workspace(w_out, w_lse)
    _written(w_out, w_lse)
    cs.assert_close_attention((w_out, w_lse), (out, lse), f"workspace vs paged, seed {seed}")


FLASHMLA_SHAPES = {
    "flash-tp8-c4a": _shape("c4a", 8, topk=512),
    "pro-tp8-c4a": _shape("c4a", 16, topk=1024),
    "flash-tp8-swa": _shape("swa", 8),
    "flash-dp-c128a": _shape("c128a", 64),
    "pro-tp8-c4a-fresh": _shape("c4a", 16, topk=1024, fresh=True),
    # DeepSeek-V4.1's top-k layers: full-length (ratio 1) and ratio-2 pages
    "v41-flash-tp8-c1a": _shape("c1a", 8, topk=512),
    "v41-pro-tp8-c2a-fresh": _shape("c2a", 16, topk=1024, fresh=True),
}


@pytest.mark.parametrize("name", list(FLASHMLA_SHAPES))
def test_matches_flashmla(name: str, gpu: torch.device) -> None:
    fn, why = load_sparse_fwd()
    if fn is None:
        pytest.skip(f"FlashMLA not importable here ({why}); the benchmark compares with it")
    seed = fresh_seed()
    inp = cs.make_inputs(FLASHMLA_SHAPES[name], gpu, seed)
    out, lse = _outputs(inp)
    inp.run_paged(out, lse)
    fm = PaddedFlashMLA(inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink)
    fm()
    cs.assert_close_attention((out, lse), fm.outputs(), f"ours vs FlashMLA, seed {seed}")


def test_vllm_flashmla_loader_says_why_without_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No staged folder: the bundled FlashMLA is unavailable, with a reason naming the folder
    (or the missing GPU) and the fetch command; the matrix only prints it."""
    monkeypatch.setenv(fv.ENV, str(tmp_path))
    monkeypatch.setattr(fv, "_STATE", {})
    module, why = fv.load()
    assert module is None
    assert str(tmp_path) in why and "fetch_vllm_flashmla" in why, why
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in why, why
    assert fv.load_sparse_fwd() == (None, why) and fv.load_decode() == (None, why)
    assert fv.status() == f"unavailable: {why}"
    assert cs.vllm_flashmla_available() is False
    assert why in capsys.readouterr().out


FAKE_INTERFACE = """
import torch
import vllm._flashmla_C
flash_mla_cuda = torch.ops._flashmla_C
EXTENSION = vllm._flashmla_C


def flash_mla_sparse_fwd(*args, **kwargs): ...


def flash_mla_with_kvcache(*args, **kwargs): ...


def get_mla_metadata(*args, **kwargs): ...
"""


def test_vllm_flashmla_loader_imports_the_interface_without_vllm(tmp_path: Path) -> None:
    """The interface's ``import vllm._flashmla_C`` is answered by the loaded extension, with
    ``sys.modules`` as it was afterwards (no stub ``vllm`` left behind)."""
    (tmp_path / fv.INTERFACE).write_text(FAKE_INTERFACE)
    extension = type(sys)("vllm._flashmla_C")
    before = {name: sys.modules.get(name) for name in ("vllm", fv.EXTENSION_MODULE)}
    try:
        module = fv.import_interface(tmp_path / fv.INTERFACE, extension)
        assert module.EXTENSION is extension
        assert all(callable(getattr(module, name)) for name in fv.FUNCTIONS)
        assert {name: sys.modules.get(name) for name in before} == before
    finally:
        sys.modules.pop(fv.INTERFACE_MODULE, None)
    (tmp_path / fv.INTERFACE).write_text(FAKE_INTERFACE.replace("def get_mla_metadata", "def x"))
    with pytest.raises(ImportError, match="get_mla_metadata"):
        fv.import_interface(tmp_path / fv.INTERFACE, extension)
    assert {name: sys.modules.get(name) for name in before} == before


VLLM_FLASHMLA_SHAPES = {
    **FLASHMLA_SHAPES,
    "h32-c4a": _shape("c4a", 32, topk=512),
    "pro-tp8-c128a": _shape("c128a", 16, topk=1024),
}


@pytest.mark.parametrize("name", list(VLLM_FLASHMLA_SHAPES))
def test_matches_vllm_flashmla_native(name: str, gpu: torch.device) -> None:
    """vLLM 0.33's bundled ``flash_mla_sparse_fwd`` at the real heads (the benchmark's
    ``vllm-flashmla-native``), into a poisoned output: every element written, equal to ours
    on every token and to the float32 reference on a sample."""
    fn, why = fv.load_sparse_fwd()
    if fn is None:
        pytest.skip(f"vLLM 0.33's FlashMLA not loadable here ({why}); the benchmark compares")
    seed = fresh_seed()
    inp = cs.make_inputs(VLLM_FLASHMLA_SHAPES[name], gpu, seed)
    out, lse = _paged_against_reference(inp, gpu, f"paged, seed {seed}")
    fm = fv.NativeFlashMLA(inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink)
    assert fm.q.shape[1] == fv.native_heads(inp.q.shape[1], gpu)
    fm.poison()
    fm()
    assert fm.out is not None
    got = fm.outputs()  # read from fm.out, the buffer vLLM 0.33 passes and reads
    _written(*got)
    tokens = cs.check_tokens(out.shape[0], gpu)
    label = f"vLLM 0.33 FlashMLA at {fm.q.shape[1]} heads, seed {seed}"
    cs.assert_close_attention((got[0][tokens], got[1][tokens]), cs.reference_sample(inp, tokens),
                              label)  # fmt: skip
    cs.assert_close_attention(got, (out, lse), f"ours vs {label}")


def test_pages_past_2_gib(gpu: torch.device) -> None:
    """Page byte offsets past 2**31 in a block-outer view (3 layers per block)."""
    g = torch.Generator(device=gpu).manual_seed(fresh_seed())
    bs, layers = 64, 3
    ps = page_stride_bytes(bs)
    num_pages = (1 << 31) // (layers * ps) + 64  # the last pages start past 2 GiB
    buf = torch.empty((num_pages, layers * ps), dtype=torch.uint8, device=gpu)
    view = torch.as_strided(buf, (num_pages, bs, 584), (layers * ps, 584, 1), ps)  # layer 1
    used = torch.arange(num_pages - 40, num_pages, device=gpu)  # 40 pages past 2 GiB
    small = ts.paged_cache(40, bs, generator=g, device=gpu)
    for i, p in enumerate(used.tolist()):
        buf[p, ps : 2 * ps] = small.buffer[i]
    T, H = 64, 8
    idx, lens = ts.index_rows(T, 200, 40 * bs, generator=g, device=gpu)
    far_idx = torch.where(idx >= 0, idx + (num_pages - 40) * bs, idx).to(torch.int32)
    q = ts.random_q(T, H, generator=g, device=gpu)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    lse = torch.full((T, H), float("nan"), device=gpu)
    dk.sparse_mla_paged(q, view, far_idx, lens, SCALE, swa_block_size=bs, out=out, lse=lse)
    want = dk.sparse_mla_paged(q, small.cache, idx, lens, SCALE, swa_block_size=bs)
    _written(out, lse)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def _compiled(kernel: object) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("kernel", [0, 2], ids=["triton", "wgmma"])
def test_one_compiled_kernel_for_every_layer_view(
    kernel: int, gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-layer views (different page strides and offsets), token counts and lengths reuse
    one compiled kernel, the Triton one and (on Hopper) the Gluon wgmma one."""
    from dsv4_kernels import _paged_keys as pk

    monkeypatch.setattr(pk, "TILES", {**pk.TILES, "small": {**pk.TILES["small"], "KERNEL": kernel}})
    if kernel == 2:
        if torch.cuda.get_device_capability(gpu)[0] != 9:
            pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
        from dsv4_kernels import _gluon_sparse_mla as g

        jit = g._sparse_mla_wgmma_kernel
    else:
        jit = kernels._sparse_mla_kernel
    g = torch.Generator(device=gpu).manual_seed(fresh_seed())
    views = [
        ts.paged_cache(8, 64, generator=g, device=gpu, layers_per_block=n, layer=n - 1)
        for n in (1, 2, 3, 5)
    ]
    H = 8
    counts = []
    for i, v in enumerate(views):
        T = 17 + 40 * i
        idx, lens = ts.index_rows(T, 96, v.num_slots, generator=g, device=gpu)
        q = ts.random_q(T, H, generator=g, device=gpu)
        dk.sparse_mla_paged(q, v.cache, idx, lens, SCALE, swa_block_size=64)
        counts.append(_compiled(jit))
    assert counts[0] >= 1, "the kernel under test did not run"
    assert counts[1:] == counts[:-1], f"compiled variants grew across layer views: {counts}"


def test_cuda_graph_replay(gpu: torch.device) -> None:
    """out= and lse= buffers make the call capturable; replays see new inputs."""
    g = torch.Generator(device=gpu).manual_seed(fresh_seed())
    swa = ts.paged_cache(16, 64, generator=g, device=gpu, layers_per_block=3, layer=2)
    comp = ts.paged_cache(64, 2, generator=g, device=gpu, layers_per_block=3, layer=0)
    T, H = 100, 16
    idx, lens = ts.index_rows(T, 128, swa.num_slots, generator=g, device=gpu)
    cidx, comp_lens = ts.index_rows(T, 128, comp.num_slots, generator=g, device=gpu)
    q = ts.random_q(T, H, generator=g, device=gpu)
    sink = ts.random_sink(H, generator=g, device=gpu)
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=gpu)
    lse = torch.empty((T, H), dtype=torch.float32, device=gpu)
    kw = dict(
        swa_block_size=64,
        attn_sink=sink,
        comp_cache=comp.cache,
        comp_indices=cidx,
        comp_lens=comp_lens,
        comp_block_size=2,
        out=out,
        lse=lse,
    )
    dk.sparse_mla_paged(q, swa.cache, idx, lens, SCALE, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dk.sparse_mla_paged(q, swa.cache, idx, lens, SCALE, **kw)
    q.copy_(ts.random_q(T, H, generator=g, device=gpu))
    ts.poison_outputs(out, lse)
    graph.replay()
    torch.cuda.synchronize()
    want = dk.sparse_mla_paged(
        q, swa.cache, idx, lens, SCALE, **{k: v for k, v in kw.items() if k not in ("out", "lse")}
    )
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("heads", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa"])
@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize(
    "variant",
    [
        dict(ASYNC_PV=0),
        dict(ASYNC_PV=1, MAXNREG=168),
        dict(ASYNC_PV=1, REG_A=1),
        dict(ASYNC_PV=1, REG_A=1, MAXNREG=168),
    ],
    ids=["sync-pv", "async-pv-r168", "reg-a", "reg-a-r168"],
)
def test_wgmma_kernel_matches_reference_and_triton(
    heads: int, layer: str, fresh: bool, variant: dict, gpu: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The Gluon wgmma kernel (``KERNEL=2`` tiles, Hopper, up to 16 heads) against the
    float32 reference on a sample and against the Triton kernel on every element."""
    from dsv4_kernels import _paged_keys as pk

    if torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
    topk = 1024 if heads == 16 else 512
    seed = fresh_seed()
    inp = cs.make_inputs(_shape(layer, heads, topk=topk, fresh=fresh), gpu, seed)
    small = {
        k: v
        for k, v in pk.TILES["small"].items()
        if k not in ("KERNEL", "ASYNC_PV", "MAXNREG_H8", "REG_A_H8")
    }
    monkeypatch.setattr(pk, "TILES", {**pk.TILES, "small": {**small, "KERNEL": 0}})
    t_out, t_lse = _outputs(inp)
    inp.run_paged(t_out, t_lse)  # the Triton kernel
    wg = {**small, "KERNEL": 2, **variant}
    monkeypatch.setattr(pk, "TILES", {**pk.TILES, "small": wg})
    assert pk.wgmma_runs(inp.q, wg, True, True), "the wgmma kernel would not run here"
    out, lse = _paged_against_reference(inp, gpu, f"wgmma, seed {seed}")
    cs.assert_close_attention((out, lse), (t_out, t_lse), f"wgmma vs Triton, seed {seed}")


@pytest.mark.parametrize(
    ("heads", "wide", "async_pv"),
    [(17, 32, 1), (32, 32, 1), (64, 64, 1), (64, 32, 0), (100, 64, 0), (128, 64, 1)],
)
@pytest.mark.parametrize("layer", ["c4a", "c128a", "swa"])
def test_wide_head_blocks_match_reference_and_triton(
    heads: int, wide: int, async_pv: int, layer: str, gpu: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """DP attention's heads in wide blocks on two warpgroups (``WIDE_HT`` tiles, issue 41;
    uneven last blocks at 17 and 100 heads) against the float32 reference on a sample
    and the Triton kernel (the shipped large tiles) on every element."""
    from dsv4_kernels import _paged_keys as pk

    if torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
    seed = fresh_seed()
    inp = cs.make_inputs(_shape(layer, heads, topk=1024 if heads == 128 else 512), gpu, seed)
    t_out, t_lse = _outputs(inp)
    inp.run_paged(t_out, t_lse)  # the shipped large tiles: the Triton kernel
    wg = {**pk.TILES["large"], "KERNEL": 2, "ASYNC_PV": async_pv, "WIDE_HT": wide}
    monkeypatch.setattr(pk, "TILES", {**pk.TILES, "large": wg})
    assert pk.wgmma_runs(inp.q, wg, True, True), "the wide wgmma kernel would not run here"
    out, lse = _paged_against_reference(inp, gpu, f"wide {wide}, seed {seed}")
    cs.assert_close_attention((out, lse), (t_out, t_lse), f"wide vs Triton, seed {seed}")


def _semantic_cases() -> list[tuple[str, object, tuple]]:
    """The CPU suite's semantic tests (holes, lengths, slots past the cache, rows without
    keys, sinks, block-outer views, the float64 spec oracle) as (name, test, extra args)."""
    from tests.kernels import test_sparse_mla as cpu

    cases: list[tuple[str, object, tuple]] = [
        ("holes-lengths-out-of-range", cpu.test_holes_lengths_and_out_of_range, ()),
        ("sink", cpu.test_sink_semantics, ()),
    ]
    for kind in ("zero-length", "all-holes", "all-out-of-range", "zero-width"):
        cases.append((f"no-keys-{kind}", cpu.test_row_without_keys_gives_zero_and_neg_inf, (kind,)))
    for three_d in (True, False):
        cases.append(
            (
                f"block-outer-3d{int(three_d)}",
                cpu.test_block_outer_views_equal_page_contiguous,
                (three_d,),
            )
        )
    for heads in (1, 3, 8, 16):
        for comp in (True, False):
            cases.append(
                (f"spec-h{heads}-comp{int(comp)}", cpu.test_paged_matches_spec, (heads, comp, True))
            )
    return cases


@pytest.mark.parametrize("case", _semantic_cases(), ids=lambda c: c[0])
def test_semantics_on_the_wgmma_kernel(
    case: tuple[str, object, tuple], gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU suite's semantic cases, run on the GPU where the wgmma kernel takes them
    (asserted: every launch of the case went to it), against the same float64 oracle."""
    if torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
    launched = _count_wgmma_launches(monkeypatch)
    _name, test, extra = case
    test(*extra, gpu)  # type: ignore[operator]
    assert launched and all(launched), f"the wgmma kernel ran {sum(launched)} of {len(launched)}"


def _count_wgmma_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record whether each launch of the test went to the wgmma kernel."""
    from dsv4_kernels import _paged_keys as pk

    launched: list[bool] = []
    original = pk.launch_wgmma

    def counting(*args: object, **kwargs: object) -> bool:
        launched.append(original(*args, **kwargs))  # type: ignore[arg-type]
        return launched[-1]

    monkeypatch.setattr(pk, "launch_wgmma", counting)
    return launched


@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("q_exp", [-30, 0, 20])
@pytest.mark.parametrize("reg_a", [0, 1])
def test_wgmma_kernel_over_wide_value_ranges(
    heads: int, q_exp: int, reg_a: int, gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys whose 64-value blocks (rope included) span ``2**-16 .. 2**16`` of each other,
    keys ``2**-20 .. 2**20`` apart, queries scaled by ``2**q_exp``: the wgmma kernel's
    default tiles (K from shared memory or registers in S) against the float64 oracle.
    The output's tolerance is 2% of ``sum_k p_k |V_k|`` per element (with the sink's
    factor), the scale of bf16 attention's error (P is rounded to 16 bits); where the
    keys are of one magnitude that is the CPU suite's tolerance."""
    from tests.kernels import test_sparse_mla as cpu

    from dsv4_kernels import _paged_keys as pk

    if torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
    assert pk.TILES["small"]["KERNEL"] == 2, "the default small tiles name the wgmma kernel"
    tiles = {**pk.TILES["small"], "REG_A": reg_a}
    monkeypatch.setattr(pk, "TILES", {**pk.TILES, "small": tiles})
    launched = _count_wgmma_launches(monkeypatch)
    seed = fresh_seed()
    g = torch.Generator(device=gpu).manual_seed(seed)
    pages, block = 8, 64
    keys = ts.random_keys(pages * block, generator=g, device=gpu, spread=16).float()
    shift = torch.randint(-20, 21, (pages * block, 1), generator=g, device=gpu)
    keys = (keys * torch.exp2(shift.float())).to(torch.bfloat16)
    swa = ts.paged_cache(pages, block, generator=g, device=gpu, keys=keys)
    T = 24
    idx, lens = ts.index_rows(T, 200, swa.num_slots, generator=g, device=gpu, empty_rows=1)
    q = ts.random_q(T, heads, generator=g, device=gpu).float() * 2.0**q_exp
    q = q.to(torch.bfloat16)
    sink = ts.random_sink(heads, generator=g, device=gpu)
    out, lse = cpu._outputs(T, heads, gpu)
    dk.sparse_mla_paged(
        q, swa.cache, idx, lens, SCALE, swa_block_size=block, attn_sink=sink, out=out, lse=lse
    )
    assert launched == [True], f"the wgmma kernel did not take the call (seed {seed})"
    want_out, want_lse = cpu.spec(q, [(swa.values, idx, lens)], SCALE, sink)
    magnitude, _ = cpu.spec(q, [(swa.values, idx, lens)], SCALE, sink, abs_values=True)
    got = out.cpu().double()
    assert not torch.isnan(got).any() and not torch.isnan(lse).any(), f"NaN, seed {seed}"
    err = (got - want_out).abs()
    bad = err > 0.02 * magnitude + 1e-30
    assert not bad.any(), (
        f"seed {seed}: {int(bad.sum())} elements off by more than 2% of sum p|V|, worst "
        f"{float((err / magnitude.clamp_min(1e-300)).max()):.3g}"
    )
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), "lse -inf exactly where no key"
    # A logit's float32 sum (the tensor cores') is good to a few units of 2**-23 of
    # sum |q_d k_d|, which cancellation over these ranges can make far larger than the
    # logit: the lse is allowed 2**-9 (bf16's rounding) of logsumexp(scale |q| |k|).
    _, spread = cpu.spec(q.abs(), [(swa.values.abs(), idx, lens)], SCALE, None)
    diff = (lse.cpu().double() - want_lse)[~empty].abs()
    allowed = 1e-4 + 1e-5 * want_lse[~empty].abs() + 2.0**-9 * spread[~empty].abs()
    assert (diff <= allowed).all(), f"seed {seed}: lse off by {float((diff / allowed).max()):.3g}x"


@pytest.mark.parametrize("heads", [8, 16])
def test_wgmma_kernel_with_unaligned_q_and_out(
    heads: int, gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q and out as views whose head stride is not a whole 16-byte vector (the kernel then
    moves them element by element): the same output as from contiguous tensors."""
    if torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the wgmma kernel is for compute capability 9.x (Hopper)")
    from dsv4_kernels import _paged_keys as pk

    launched = _count_wgmma_launches(monkeypatch)
    seed = fresh_seed()
    inp = cs.make_inputs(_shape("c4a", heads, fresh=True), gpu, seed)
    T, H, _ = inp.q.shape
    out, lse = _outputs(inp)
    inp.run_paged(out, lse)
    assert pk.whole_vectors(inp.q, out)
    wide = torch.empty((T, H, 517), dtype=torch.bfloat16, device=gpu)
    wide[..., :512] = inp.q
    inp.q = wide[..., :512]
    out2 = torch.empty((T, H, 517), dtype=torch.bfloat16, device=gpu)[..., :512]
    lse2 = torch.empty_like(lse)
    ts.poison_outputs(out2, lse2)
    assert not pk.whole_vectors(inp.q, out2)
    inp.run_paged(out2, lse2)
    assert launched == [True, True], f"the wgmma kernel ran {launched} (seed {seed})"
    assert torch.equal(out2, out) and torch.equal(lse2, lse), f"seed {seed}"


def _no_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if grouped rows are expanded per token (the wgmma kernel must take them)."""
    from dsv4_kernels import _paged_keys as pk

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("grouped rows were expanded per token")

    monkeypatch.setattr(pk, "expand_grouped_rows", refuse)


@pytest.mark.parametrize("heads, group", [(1, 4), (3, 2), (8, 2), (8, 4), (16, 2), (16, 4)])
@pytest.mark.parametrize("layer", ["swa", "c128a"])
@pytest.mark.parametrize("fresh", [False, True])
def test_grouped_rows_match_reference_and_per_token(
    heads: int, group: int, layer: str, fresh: bool, gpu: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Grouped rows through the wgmma kernel (or, past 32 MMA rows, expanded per token):
    every element written, a token sample against the float32 reference, all tokens
    against the per-token rows."""
    from dsv4_kernels import sparse_mla as sm

    seed = fresh_seed()
    inp = cs.make_inputs(_shape(layer, heads, fresh=fresh), gpu, seed)
    per = _paged_against_reference(inp, gpu, f"per-token, seed {seed}")
    rows = inp.build_grouped(group)
    if sm.group_rows(heads, group) <= sm.MAX_GROUP_ROWS:
        _no_expansion(monkeypatch)
    out, lse = _outputs(inp)
    inp.run_paged(out, lse, rows)
    _written(out, lse)
    tokens = cs.check_tokens(out.shape[0], gpu)
    want = cs.reference_sample(inp, tokens)
    cs.assert_close_attention((out[tokens], lse[tokens]), want, f"grouped {group}, seed {seed}")
    cs.assert_close_attention((out, lse), per, f"grouped {group} vs per-token, seed {seed}")


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("layer", ["swa", "c128a"])
def test_grouped_rows_with_requests_inside_groups(
    group: int, layer: str, gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests shorter than a group and starting inside one (several leaders per group),
    empty requests, cached prefixes: every token against the float32 reference."""
    from dsv4_kernels import reference as ref
    from dsv4_kernels.testing.prefill_indices import make_prefill_index_case

    seed = fresh_seed()
    g = torch.Generator(device=gpu).manual_seed(seed)
    ratio = 128 if layer == "c128a" else 1
    case = make_prefill_index_case(
        [5, 1, 0, 300, 2, 77, 3, 1], [0, 900, 40, 3000, 127, 5, 20000, 1],
        compress_ratio=ratio, device=gpu, seed=seed,
    )  # fmt: skip
    T, H = case.num_tokens, 8
    q = ts.random_q(T, H, generator=g, device=gpu)
    sink = ts.random_sink(H, generator=g, device=gpu)
    swa = ts.paged_cache(case.window_num_pages, 64, generator=g, device=gpu).cache
    kw: dict[str, object] = dict(swa_block_size=64, attn_sink=sink)
    per = case.build()
    if ratio > 1:
        comp = ts.paged_cache(case.comp_num_pages, case.comp_block_size, generator=g, device=gpu)
        kw.update(comp_cache=comp.cache, comp_block_size=case.comp_block_size)
    want = ref.sparse_mla_paged(
        q, swa, per.window, per.window_lens, SCALE, comp_indices=per.comp,
        comp_lens=per.comp_lens, **kw,
    )  # fmt: skip
    rows = dk.build_grouped_prefill_indices(
        case.query_start_loc, case.seq_lens, num_tokens=T, group_size=group,
        window_block_table=case.window_block_table,
        comp_block_table=case.comp_block_table if ratio > 1 else None,
        comp_block_size=case.comp_block_size if ratio > 1 else None,
        topk=case.topk if ratio > 1 else None,
    )  # fmt: skip
    _no_expansion(monkeypatch)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    lse = torch.full((T, H), float("nan"), device=gpu)
    dk.sparse_mla_paged(
        q, swa, rows.window, rows.window_lens, SCALE, comp_indices=rows.comp,
        comp_lens=rows.comp_lens, leads=rows.leads, group_size=group,
        swa_starts=rows.window_starts, out=out, lse=lse, **kw,
    )  # fmt: skip
    _written(out, lse)
    cs.assert_close_attention((out, lse), want, f"grouped {group}, seed {seed}")


@pytest.mark.parametrize("heads, group", [(8, 0), (16, 0), (8, 4), (16, 2)])
@pytest.mark.parametrize("fresh", [False, True])
def test_block_rows_equal_the_rows_of_slots(
    heads: int, group: int, fresh: bool, gpu: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C128A rows read through the compressed block table (``BlockRows``), per token and
    grouped, through the wgmma kernel (no expansion): every element written, bit-equal to
    the same call on the rows of slots (same keys in the same order), and a token sample
    against the float32 reference; then replayed in a CUDA graph with new requests' rows
    of the same shape."""
    seed = fresh_seed()
    inp = cs.make_inputs(_shape("c128a", heads, fresh=fresh), gpu, seed)
    slots = inp.build_grouped(group) if group else inp.rows
    blocks = inp.build_grouped(group, blocks=True) if group else inp.build_blocks()
    assert isinstance(blocks.comp, dk.BlockRows)
    if group:
        _no_expansion(monkeypatch)
    want = _outputs(inp)
    inp.run_paged(*want, slots)
    got = _outputs(inp)
    inp.run_paged(*got, blocks)
    _written(*got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed}"
    tokens = cs.check_tokens(got[0].shape[0], gpu)
    cs.assert_close_attention(
        (got[0][tokens], got[1][tokens]), cs.reference_sample(inp, tokens), f"seed {seed}"
    )
    # capture with these rows, replay after the compressed block table was rewritten (its
    # pages mapped to others of the cache: other keys, the same shapes)
    graph = torch.cuda.CUDAGraph()
    out, lse = _outputs(inp)
    with torch.cuda.graph(graph):
        inp.run_paged(out, lse, blocks)
    table = inp.index_case.comp_block_table
    g = torch.Generator(device=gpu).manual_seed(seed + 1)
    perm = torch.randperm(inp.index_case.comp_num_pages, generator=g, device=gpu)
    live = (table >= 0) & (table < perm.numel())  # past a request's pages: garbage ids
    moved = perm[table.clamp(0, perm.numel() - 1).long()].to(table.dtype)
    table.copy_(torch.where(live, moved, table))
    ts.poison_outputs(out, lse)
    graph.replay()
    torch.cuda.synchronize()
    again = _outputs(inp)
    inp.run_paged(*again, inp.build_grouped(group) if group else inp.index_case.build())
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), f"seed {seed}"
    assert not torch.equal(out, got[0]), "the rewritten table did not change the keys"
