"""One decode step of a whole DSV4 model's attention: vLLM's path and the plugin's.

A step is ``requests`` requests of ``per_request`` query tokens each (1, or 2 with MTP's
one draft token, as the presets run it) at ``context`` tokens, through every attention
layer of the model in vLLM's order.  Per layer, as vLLM's ``_forward_decode`` runs it:

* **vLLM's path**: C4A layers map the indexer's request-local top-k to cache slots
  (``compute_global_topk_indices_and_lens``, :class:`.model_step_common.MetadataOps`);
  then ``flash_mla_with_kvcache`` on the query padded to 64 heads (128 above 64) with
  the window rows and the layer's compressed rows, one ``FlashMLASchedMeta`` per layer
  kind per step (made fresh for each captured step, so the graph replays FlashMLA's
  planner once per kind per step, as vLLM's does);
* **the plugin's path**: the same top-k mapping, then, for layer kinds and step sizes
  the H200 table measured faster (:func:`dsv4_attention.decode_table.use_head_exact_decode`),
  :func:`dsv4_attention.decode.forward_decode` on the real heads into the padded output;
  FlashMLA as above for the others.

Per C4A layer, both run the layer's lightning indexer first (:mod:`.model_step_indexer`:
vLLM's pair on vLLM's path, ours on the plugin's where the table takes it).  Both are
captured whole, one CUDA graph per step.  Every layer reads its own keys: page
pools of 1-2 GB per key kind (far larger than the 50 MB L2, so one layer's keys are not
the next layer's cache hits) and, per layer, its own random block tables and top-k.
What vLLM's metadata builder computes once per step for every layer (the window rows,
C128A's global rows) is input to both paths, not timed.  On a CPU (the smoke run) a torch
reference on the padded heads stands in for FlashMLA and nothing is captured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .model_step_common import (
    SCALE,
    MetadataOps,
    StepModel,
    StepPath,
    assert_close,
    capture,
    sample_tokens,
)

POOL_BYTES = {"swa": 1 << 30, "c4a": 2 << 30, "c128a": 2 << 30}  # on a GPU
SMOKE_POOL_PAGES = {"swa": 64, "c4a": 64, "c128a": 512}
_POOLS: dict[tuple[str, str], Any] = {}


@dataclasses.dataclass(frozen=True)
class DecodeCell:
    model: StepModel
    requests: int  # on this GPU
    per_request: int
    context: int

    @property
    def tokens(self) -> int:
        return self.requests * self.per_request

    @property
    def name(self) -> str:
        return f"{self.model.label}-b{self.requests}x{self.per_request}@{self.context}"


@dataclasses.dataclass
class DecodeLayer:
    kind: str
    swa_indices: torch.Tensor  # [T, 128] global window slots
    swa_lens: torch.Tensor
    comp_indices: torch.Tensor | None  # [T, K] global slots (C4A: the reference mapping)
    comp_lens: torch.Tensor | None
    local: torch.Tensor | None = None  # C4A: the indexer's request-local top-k [T, topk]
    table: torch.Tensor | None = None  # C4A: the layer's compressed block table [R, pages]


@dataclasses.dataclass
class DecodeStep:
    cell: DecodeCell
    q: torch.Tensor  # [T, padded heads, 512]: vLLM's padded query buffer
    sink: torch.Tensor  # [padded heads], -inf past the real heads
    pools: dict[str, Any]  # kind -> dsv4_kernels.testing.sparse_mla.PagedCache
    layers: list[DecodeLayer]
    token_to_req: torch.Tensor  # [T] int32
    is_valid: torch.Tensor  # [T] bool
    indexer: Any = None  # model_step_indexer.IndexerInputs, None: left out
    indexer_pair: Any = None  # vLLM's staged DeepGEMM (None: ours stands in, or left out)
    indexer_note: str = ""


def pools(device: torch.device) -> dict[str, Any]:
    """The window, C4A and C128A page pools of ``device`` (made once, filled at random)."""
    from dsv4_kernels.geometry import page_stride_bytes, slots_per_page
    from dsv4_kernels.testing.sparse_mla import paged_cache

    g = torch.Generator(device=device).manual_seed(1234)
    out = {}
    for kind, ratio in (("swa", 1), ("c4a", 4), ("c128a", 128)):
        key = (str(device), kind)
        if key not in _POOLS:
            slots = 64 if kind == "swa" else slots_per_page(ratio)
            if device.type == "cuda":
                pages = POOL_BYTES[kind] // page_stride_bytes(slots)
            else:
                pages = SMOKE_POOL_PAGES[kind]
            _POOLS[key] = paged_cache(pages, slots, generator=g, device=device)
        out[kind] = _POOLS[key]
    return out


def _c4a_rows(
    pool: Any, cell: DecodeCell, pos: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A C4A layer's indexer output: per token ``min(n, topk)`` request-local entries drawn
    among its ``n = (pos + 1) // 4`` compressed entries (-1 after), and the layer's block
    table of random pool pages."""
    T, topk, bs = cell.tokens, cell.model.topk, pool.block_size
    n = (pos + 1) // 4
    j = torch.arange(topk, device=pos.device).unsqueeze(0)
    u = torch.rand((T, topk), generator=g, device=pos.device)
    entry = (u * n.clamp(min=1).unsqueeze(1)).long().clamp(max=int(n.max().clamp(min=1)) - 1)
    local = torch.where(j < n.clamp(max=topk).unsqueeze(1), entry, -1).to(torch.int32)
    width = max(1, (cell.context // 4) // bs + 1)
    table = torch.randint(
        0,
        pool.cache.shape[0],
        (cell.requests, width),
        generator=g,
        device=pos.device,
        dtype=torch.int32,
    )
    return local.contiguous(), table


def build_step(cell: DecodeCell, device: torch.device, seed: int) -> DecodeStep:
    """Random inputs of one decode step (queries, sinks, every layer's rows)."""
    from dsv4_kernels import reference as ref
    from dsv4_kernels.testing import decode as td
    from dsv4_kernels.testing.sparse_mla import random_q, random_sink

    g = torch.Generator(device=device).manual_seed(seed)
    m, R, G, C = cell.model, cell.requests, cell.per_request, cell.context
    T, H, hp = cell.tokens, m.heads, m.padded_heads
    p = pools(device)
    q = torch.zeros((T, hp, 512), dtype=torch.bfloat16, device=device)
    q[:, :H] = random_q(T, H, generator=g, device=device)
    sink = torch.full((hp,), float("-inf"), dtype=torch.float32, device=device)
    sink[:H] = random_sink(H, generator=g, device=device)
    req = torch.arange(R, device=device).repeat_interleave(G)
    pos = C - G + torch.arange(T, device=device) % G
    token_to_req = req.to(torch.int32)
    is_valid = torch.ones(T, dtype=torch.bool, device=device)
    layers = []
    for kind in m.kinds:
        comp = p["c128a"] if kind == "c128a" else None
        rows = td.decode_rows(
            td.DecodePools(kind if comp is not None else "swa", p["swa"], comp),
            [C] * R,
            G,
            generator=g,
            comp_width=C // 128 or 1,
        )
        layer = DecodeLayer(
            kind, rows.swa_indices, rows.swa_lens, rows.comp_indices, rows.comp_lens
        )
        if kind == "c4a":
            layer.local, layer.table = _c4a_rows(p["c4a"], cell, pos, g)
            layer.comp_indices, layer.comp_lens = ref.compute_global_topk_indices_and_lens(
                layer.local, token_to_req, layer.table, p["c4a"].block_size, is_valid
            )
        layers.append(layer)
    from . import model_step_indexer as mi

    pair, note = mi.vllm_pair(device)
    ix = None
    if device.type != "cuda" or pair is not None:
        ix = mi.build(m.kinds, R, G, C, m.topk, device, g)
    return DecodeStep(cell, q, sink, p, layers, token_to_req, is_valid, ix, pair, note)


def floor_bytes(step: DecodeStep) -> int:
    """The distinct keys' FP8 bytes and indices every layer reads, and its real-head query
    and output (bf16) and lse."""
    from .model_step_common import unique_key_bytes

    T, H = step.cell.tokens, step.cell.model.heads
    total = 0
    for layer in step.layers:
        sets = [(layer.swa_indices, layer.swa_lens)]
        if layer.comp_indices is not None:
            sets.append((layer.comp_indices, layer.comp_lens))
        total += unique_key_bytes(*sets) + T * H * (1024 + 1024 + 4)
    from .model_step_indexer import floor_bytes as indexer_bytes

    return total + indexer_bytes(step.indexer)


class _FlashMLA:
    """vLLM's per-layer decode call: ``flash_mla_with_kvcache`` (FlashMLA built from source)
    on the padded heads, or on a CPU a torch reference on the padded heads."""

    def __init__(self, step: DecodeStep) -> None:
        from .flashmla_decode import load_decode

        self.step = step
        self.fns, self.why = load_decode() if step.q.is_cuda else (None, "no GPU")
        if step.q.is_cuda and self.fns is None:
            raise RuntimeError(f"vLLM's decode path needs FlashMLA: {self.why}")
        self.metas: dict[str, Any] = {}

    def new_step(self) -> None:
        """One fresh scheduler plan per layer kind (vLLM's metadata builder makes them per
        step; the first layer of a kind plans, the others reuse)."""
        if self.fns is not None:
            self.metas = {kind: self.fns[1]()[0] for kind in set(self.step.cell.model.kinds)}

    def __call__(
        self, layer: DecodeLayer, comp: torch.Tensor | None, lens: torch.Tensor | None
    ) -> torch.Tensor:
        s = self.step
        cache = s.pools[layer.kind].cache if layer.kind != "swa" else None
        if self.fns is None:
            from dsv4_kernels import reference as ref

            kw: dict[str, Any] = {}
            if cache is not None:
                kw = dict(
                    comp_cache=cache,
                    comp_indices=comp,
                    comp_lens=lens,
                    comp_block_size=s.pools[layer.kind].block_size,
                )
            out, _ = ref.sparse_mla_paged(
                s.q,
                s.pools["swa"].cache,
                layer.swa_indices,
                layer.swa_lens,
                SCALE,
                swa_block_size=64,
                attn_sink=s.sink,
                **kw,
            )
            return out.unsqueeze(1)
        out, _ = self.fns[0](
            q=s.q.unsqueeze(1),
            k_cache=s.pools["swa"].cache.unsqueeze(-2),
            block_table=None,
            cache_seqlens=None,
            head_dim_v=512,
            tile_scheduler_metadata=self.metas[layer.kind],
            softmax_scale=SCALE,
            is_fp8_kvcache=True,
            indices=layer.swa_indices.unsqueeze(1),
            topk_length=layer.swa_lens,
            attn_sink=s.sink,
            extra_k_cache=None if cache is None else cache.unsqueeze(-2),
            extra_indices_in_kvcache=None if comp is None else comp.unsqueeze(1),
            extra_topk_length=lens,
        )
        return out


def _comp_rows(layer: DecodeLayer, step: DecodeStep, ops: MetadataOps) -> tuple[Any, Any]:
    """A layer's compressed rows as its decode call gets them: C4A through vLLM's top-k
    mapping (launched here, in the step), C128A from the step's metadata."""
    if layer.kind == "c4a":
        return ops.global_topk(
            layer.local, step.token_to_req, layer.table, step.pools["c4a"].block_size, step.is_valid
        )
    return layer.comp_indices, layer.comp_lens


def vllm_path(step: DecodeStep, ops: MetadataOps, name: str) -> StepPath:
    """vLLM's ``_forward_decode`` for every layer, one graph."""
    from . import model_step_indexer as mi

    fm = _FlashMLA(step)
    ix = mi.path(step.indexer, step.indexer_pair, ours=False)
    outs: list[torch.Tensor] = []

    def run() -> None:
        fm.new_step()
        outs.clear()
        for i, layer in enumerate(step.layers):
            if ix is not None and i in ix.runs:
                ix.runs[i]()
            outs.append(fm(layer, *_comp_rows(layer, step, ops)))

    replay = capture(run, step.q.device)
    H = step.cell.model.heads

    def poison() -> None:
        for o in outs:
            o.fill_(float("nan"))
        if ix is not None:
            ix.poison()

    every = tuple(range(len(step.layers)))
    return StepPath(name, replay, lambda i: outs[i][:, 0, :H], poison, (), every, ix)


def plugin_path(step: DecodeStep, ops: MetadataOps, name: str) -> StepPath:
    """The plugin's ``_forward_decode`` for every layer: the head-exact decode where the
    H200 table says, FlashMLA elsewhere; one graph."""
    import dsv4_kernels as dk
    from dsv4_attention.decode import forward_decode
    from dsv4_attention.decode_table import use_head_exact_decode

    m, T, dev = step.cell.model, step.cell.tokens, step.q.device
    H, hp = m.heads, m.padded_heads
    ours = tuple(sorted({k for k in m.kinds if use_head_exact_decode(k, H, T)}))
    widths = [
        128 + (lay.comp_indices.shape[1] if lay.comp_indices is not None else 0)
        for lay in step.layers
    ]
    scratch = dk.make_decode_scratch(dk.decode_scratch_sizes(T, H, max(widths), dev), dev)
    fixed = [
        torch.empty((T, hp, 512), dtype=torch.bfloat16, device=dev) if lay.kind in ours else None
        for lay in step.layers
    ]
    from . import model_step_indexer as mi

    fm = _FlashMLA(step)
    ours_indexer = step.indexer is not None and mi.plugin_runs_ours(step.indexer)
    ix = mi.path(step.indexer, step.indexer_pair, ours=ours_indexer)
    outs: list[torch.Tensor] = []

    def run() -> None:
        fm.new_step()
        outs.clear()
        for i, (layer, out) in enumerate(zip(step.layers, fixed, strict=True)):
            if ix is not None and i in ix.runs:
                ix.runs[i]()
            comp, lens = _comp_rows(layer, step, ops)
            if out is None:
                outs.append(fm(layer, comp, lens)[:, 0])
                continue
            kw: dict[str, Any] = {}
            if layer.kind != "swa":
                kw = dict(
                    comp_cache=step.pools[layer.kind].cache, comp_indices=comp, comp_lens=lens
                )
            forward_decode(
                step.q[:, :H],
                step.pools["swa"].cache,
                layer.swa_indices,
                layer.swa_lens,
                step.sink[:H],
                SCALE,
                out[:, :H],
                scratch,
                **kw,
            )
            outs.append(out)

    replay = capture(run, dev)

    def poison() -> None:
        for o in outs:
            o.fill_(float("nan"))
        if ix is not None:
            ix.poison()

    every = tuple(range(len(step.layers)))
    kinds = (*ours, "indexer") if ours_indexer else ours
    return StepPath(name, replay, lambda i: outs[i][:, :H], poison, kinds, every, ix)


def reference_outputs(step: DecodeStep, layers: list[int], tokens: torch.Tensor) -> dict[int, Any]:
    """The float32 reference of the sampled ``layers`` at the sampled ``tokens``."""
    from dsv4_kernels import reference as ref

    H = step.cell.model.heads
    want = {}
    for i in layers:
        lay = step.layers[i]
        kw: dict[str, Any] = {}
        if lay.comp_indices is not None:
            kw = dict(
                comp_cache=step.pools[lay.kind].cache,
                comp_indices=lay.comp_indices[tokens],
                comp_lens=lay.comp_lens[tokens],
                comp_block_size=step.pools[lay.kind].block_size,
            )
        want[i] = ref.sparse_mla_paged(
            step.q[tokens, :H],
            step.pools["swa"].cache,
            lay.swa_indices[tokens],
            lay.swa_lens[tokens],
            SCALE,
            swa_block_size=64,
            attn_sink=step.sink[:H],
            **kw,
        )[0]
    return want


def checker(step: DecodeStep, path: StepPath) -> Callable[[], None]:
    """A check of ``path``'s last run: every layer fully written (no NaN after poisoning),
    the first and last layer of each kind equal to the reference on sampled tokens."""
    from . import model_step_indexer as mi

    tokens = sample_tokens(step.cell.tokens, step.q.device)
    layers = step.cell.model.checked_layers()
    want = reference_outputs(step, layers, tokens)
    check_indexer = None if step.indexer is None else mi.checker(step.indexer)

    def check() -> None:
        if check_indexer is not None and path.indexer is not None:
            check_indexer(path.indexer, f"{path.name} {step.cell.name}")
        for i in path.kept:
            assert not torch.isnan(path.outputs(i).float()).any(), (
                f"{path.name} {step.cell.name}: layer {i} has unwritten (NaN) output"
            )
        for i in layers:
            got = path.outputs(i)[tokens]
            assert_close(
                got, want[i], f"{path.name} {step.cell.name} layer {i} ({step.layers[i].kind})"
            )

    return check
