"""One prefill chunk of a whole DSV4 model's attention: vLLM's path and the plugin's.

A chunk is ``requests`` requests of ``query_len`` new tokens ending at ``context`` tokens
(a 4,096- or 16,384-token chunk of one long prompt; at an 8K context a 16K-token step is
two fresh 8K prompts), through every attention layer in vLLM's order.  Per layer:

* **vLLM's path** (its ``_forward_prefill``): gather the layer's compressed entries and
  its window region into the bf16 workspace (``dequantize_and_gather_k_cache``: ours
  stands in for vLLM's CuTe-DSL gather, :mod:`.model_step_common`), build the combined
  rows (``combine_topk_swa_indices``, vLLM's Triton kernel where staged), then FlashMLA's
  sparse prefill on the query padded to 64 heads (128 above 64);
* **the plugin's path**: one :class:`dsv4_attention.prefill.PrefillPlan` per step (the
  rows a layer kind shares are built by its first layer; each C4A layer maps its own
  top-k) and :func:`dsv4_attention.prefill.forward_prefill` on the real heads, for the
  layer kinds the H200 table takes at these heads and this step
  (:func:`dsv4_attention.policy.prefill_step_takes_ours`); vLLM's path above for the
  others (with the plugin's combine, which replaces vLLM's on the H200).

vLLM runs prefill attention eagerly (its piecewise CUDA graphs leave attention out), so
the paths run eagerly here too, host work included.  Layers of a kind share the step's
block tables and lengths (one KV-cache group) and have their own caches (the first
layer's pages in another order: the same FP8 records at other addresses) and, for C4A,
their own top-k (the first layer's entries rotated within each token's range).  Our
window rows are built once per layer kind here; vLLM's two window groups would need two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .inputs_sparse_mla import AttnInputs, AttnShape, make_inputs
from .model_step_common import (
    SCALE,
    MetadataOps,
    StepModel,
    StepPath,
    assert_close,
    sample_tokens,
    unique_key_bytes,
)


@dataclasses.dataclass(frozen=True)
class PrefillCell:
    model: StepModel
    requests: int
    query_len: int
    context: int

    @property
    def tokens(self) -> int:
        return self.requests * self.query_len

    @property
    def name(self) -> str:
        return f"{self.model.label}-{self.requests}x{self.query_len}@{self.context}"


def chunk_cell(model: StepModel, chunk: int, context: int) -> PrefillCell:
    """A ``chunk``-token step at ``context``: one request's chunk, or fresh prompts of
    ``context`` tokens filling it where the chunk is longer than the context."""
    if chunk <= context:
        return PrefillCell(model, 1, chunk, context)
    return PrefillCell(model, chunk // context, context, context)


@dataclasses.dataclass
class PrefillStep:
    cell: PrefillCell
    kinds: dict[str, AttnInputs]  # the first layer of each kind (tables, q, workspace)
    layers: list[AttnInputs]  # every layer: its kind's inputs with its own caches / top-k
    # what vLLM's combine gets as ``topk_indices`` where the layer has no top-k: C128A's
    # request-local rows (``c128a_prefill_topk_indices``, built once per step by vLLM's
    # metadata builder), the indexer's buffer for SWA-only layers (read for 0 columns)
    vllm_rows: dict[str, torch.Tensor]


def _positions(inp: AttnInputs) -> torch.Tensor:
    """Each chunk token's position in its request (the reference index builder's mapping)."""
    from dsv4_kernels.reference.prefill_indices import _positions as positions

    c = inp.index_case
    return positions(c.query_start_loc, c.seq_lens, c.num_tokens)[1]


def _rotated_topk(inp: AttnInputs, g: torch.Generator) -> torch.Tensor:
    """Another layer's top-k: each token's entries shifted by a random offset modulo its
    entry count (distinct entries stay distinct; -1 stays -1)."""
    local = inp.index_case.topk_indices
    T = local.shape[0]
    n = ((_positions(inp) + 1) // inp.shape.ratio).clamp(min=1).unsqueeze(1)
    shift = torch.randint(0, 1 << 30, (T, 1), generator=g, device=local.device)
    return torch.where(local >= 0, (local.to(torch.int64) + shift) % n, -1).to(torch.int32)


def _other_pages(cache: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The cache's pages in a random order, in a new allocation with the same page stride."""
    perm = torch.randperm(cache.shape[0], generator=g, device=cache.device)
    buf = torch.empty(cache.shape[0] * cache.stride(0), dtype=cache.dtype, device=cache.device)
    view = buf.as_strided(cache.shape, cache.stride())
    view.copy_(cache[perm])
    return view


def build_step(cell: PrefillCell, device: torch.device, seed: int) -> PrefillStep:
    m = cell.model
    g = torch.Generator(device=device).manual_seed(seed)
    kinds: dict[str, AttnInputs] = {}
    for n, kind in enumerate(dict.fromkeys(m.kinds)):
        shape = AttnShape(
            f"{kind}-{cell.name}",
            kind,
            cell.requests,
            cell.query_len,
            cell.context,
            m.heads,
            m.topk,
        )
        kinds[kind] = make_inputs(shape, device, seed + n)
    layers = []
    seen: set[str] = set()
    for kind in m.kinds:
        first = kinds[kind]
        if kind not in seen:
            seen.add(kind)
            layers.append(first)
            continue
        case = first.index_case
        if first.shape.topk_rows:
            case = dataclasses.replace(case, topk_indices=_rotated_topk(first, g))
        comp = None if first.comp_cache is None else _other_pages(first.comp_cache, g)
        layers.append(
            dataclasses.replace(
                first, swa_cache=_other_pages(first.swa_cache, g), comp_cache=comp, index_case=case
            )
        )
    return PrefillStep(cell, kinds, layers, {k: _vllm_rows(inp) for k, inp in kinds.items()})


def _vllm_rows(inp: AttnInputs) -> torch.Tensor:
    c = inp.index_case
    if inp.shape.topk_rows:
        return c.topk_indices
    T, dev = c.num_tokens, c.seq_lens.device
    if inp.comp_cache is None:
        return torch.full((T, max(inp.shape.topk, 1)), -1, dtype=torch.int32, device=dev)
    j = torch.arange(c.topk, device=dev).unsqueeze(0)
    n = ((_positions(inp) + 1) // inp.shape.ratio).unsqueeze(1)
    return torch.where(j < n, j, -1).to(torch.int32)


def floor_bytes(step: PrefillStep) -> int:
    """Per layer: the distinct keys' FP8 bytes and the real heads' query, output and lse."""
    T, H = step.cell.tokens, step.cell.model.heads
    total = 0
    for inp in step.kinds.values():
        sets = [(inp.rows.window, inp.rows.window_lens)]
        if inp.rows.comp is not None:
            sets.append((inp.rows.comp, inp.rows.comp_lens))
        per_layer = unique_key_bytes(*sets) + T * H * (1024 + 1024 + 4)
        total += per_layer * sum(k == inp.shape.layer for k in step.cell.model.kinds)
    return total


def _gather_and_combine(inp: AttnInputs, rows: torch.Tensor, ops: MetadataOps | None) -> None:
    """vLLM's per-layer workspace: the two gathers and the combined rows, through vLLM's
    combine (``ops``) with the arguments vLLM passes, or the plugin's (``ops`` None)."""
    c = inp.index_case
    inp.build_workspace()
    if ops is None:
        inp.build_combined()
        return
    # vLLM's: always a top-k tensor, the chunk's tokens from ``out``
    ops.combine(c.topk_indices if inp.shape.topk_rows else rows, c.query_start_loc, c.seq_lens,
                inp.gather_lens, 128, inp.shape.ratio, inp.topk_width, inp.M, inp.N,
                out=(inp.combined, inp.combined_lens))  # fmt: skip


class _FlashMLA:
    """FlashMLA's sparse prefill on the padded heads over a kind's workspace (one padded
    query per kind, as vLLM's projection writes it); a torch reference on a CPU."""

    def __init__(self, step: PrefillStep) -> None:
        from .flashmla_provider import PaddedFlashMLA, load_sparse_fwd

        fn, self.why = load_sparse_fwd() if _gpu(step) else (None, "no GPU")
        if _gpu(step) and fn is None:
            raise RuntimeError(f"vLLM's prefill path needs FlashMLA: {self.why}")
        self.padded = {}
        if fn is not None:
            for kind, inp in step.kinds.items():
                self.padded[kind] = PaddedFlashMLA(
                    inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, inp.sink, fn=fn
                )

    def __call__(self, inp: AttnInputs) -> torch.Tensor:
        if not self.padded:
            from dsv4_kernels import reference as ref

            return ref.sparse_mla_workspace(
                inp.q, inp.workspace, inp.combined, inp.combined_lens, SCALE, attn_sink=inp.sink
            )[0]
        fm = self.padded[inp.shape.layer]
        fm()
        return fm.outputs()[0]


def _gpu(step: PrefillStep) -> bool:
    return next(iter(step.kinds.values())).q.is_cuda


def _h200() -> Any:
    from dsv4_attention.tables import table_for

    table = table_for("NVIDIA H200", (9, 0))
    assert table is not None
    return table


def _kind_facts(cell: PrefillCell, kind: str) -> Any:
    """The plugin's facts of a DeepSeek-V4 layer kind of the chunk's model (vLLM's V4 class
    pads its prefill to ``padded_heads``)."""
    from dsv4_attention.facts import LayerFacts
    from dsv4_attention.tables import LAYER_NAMES

    m = cell.model
    ratio = {name: r for r, name in LAYER_NAMES.items()}[kind]
    return LayerFacts(name=kind, compress_ratio=ratio, heads=m.heads, window=128, topk=m.topk,
                      c128a_width=0, max_tokens=cell.tokens, decode_window_width=128,
                      padded_heads=m.padded_heads, vllm_prefill_heads=m.padded_heads)  # fmt: skip


def cell_takes_ours(cell: PrefillCell) -> tuple[str, ...]:
    """The layer kinds whose prefill the plugin runs as ours in this chunk on the H200: the
    start-up choice (the table's head limits, and above 16 heads a wide row for the kind),
    then the step's rule (C4A above 8 heads only in steps with short rows)."""
    from dsv4_attention import policy

    table, m, switches = _h200(), cell.model, policy.Switches()
    hopper = policy.Device("NVIDIA H200", (9, 0), wgmma=True)
    seq = [cell.context] * cell.requests
    qlen = [cell.query_len] * cell.requests
    ours = []
    for kind in dict.fromkeys(m.kinds):
        facts = _kind_facts(cell, kind)
        if not policy.prefill_choice(facts, hopper, table, switches).ours:
            continue
        mean = policy.c4a_mean_keys(seq, qlen, 128, m.topk) if kind == "c4a" else None
        if policy.prefill_step_takes_ours(facts, table.prefill, switches, mean):
            ours.append(kind)
    return tuple(ours)


def takes_ours(step: PrefillStep) -> tuple[str, ...]:
    """:func:`cell_takes_ours` of the step's chunk."""
    return cell_takes_ours(step.cell)


def kind_tiles(step: PrefillStep, kind: str) -> Any:
    """The tiles the plugin runs a kind's prefill with on the H200 (a wide row's above 16
    heads; None: the kernels' defaults)."""
    from dsv4_attention import policy

    return policy.prefill_tiles(_kind_facts(step.cell, kind), _h200(), policy.Switches())


def vllm_path(
    step: PrefillStep,
    ops: MetadataOps,
    name: str,
    ours: tuple[str, ...] = (),
    keep: Sequence[int] | None = None,
    plugin: bool = False,
) -> StepPath:
    """vLLM's ``_forward_prefill`` for every layer, vLLM's combine included (``plugin``:
    the plugin's path instead, :func:`plugin_path`: ours for the kinds in ``ours``, the
    plugin's combine for the rest).  ``keep``: the layers whose outputs stay readable
    after a run (default every layer; a 16K-token chunk's padded output is 1 GB a layer,
    so the benchmark keeps the layers it checks)."""
    from dsv4_attention.prefill import PrefillPlan, forward_prefill

    from .cases_prefill_layer import layer_kwargs

    fm = _FlashMLA(step)
    vllm_ops = None if plugin else ops  # the plugin replaces vLLM's combine on the H200
    first = next(iter(step.kinds.values())).index_case
    dev = first.seq_lens.device
    T, H = step.cell.tokens, step.cell.model.heads
    kept = tuple(range(len(step.layers)) if keep is None else sorted(keep))

    def buffer() -> torch.Tensor:
        return torch.empty((T, H, 512), dtype=torch.bfloat16, device=dev)

    spare = buffer()  # the output of our layers that are not kept
    fixed = {i: buffer() if i in kept else spare for i, inp in enumerate(step.layers)
             if inp.shape.layer in ours}  # fmt: skip
    tiles = {kind: kind_tiles(step, kind) for kind in ours}
    lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    outs: dict[int, torch.Tensor] = {}

    def run() -> None:
        plan = PrefillPlan(first.query_start_loc, first.seq_lens, num_tokens=first.num_tokens)
        outs.clear()
        for i, inp in enumerate(step.layers):
            if i in fixed:
                forward_prefill(inp.q, plan, out=fixed[i], lse=lse,
                                tiles=tiles[inp.shape.layer], **layer_kwargs(inp))  # fmt: skip
                out = fixed[i]
            else:
                _gather_and_combine(inp, step.vllm_rows[inp.shape.layer], vllm_ops)
                out = fm(inp)
            if i in kept:
                outs[i] = out

    def poison() -> None:
        for o in outs.values():
            o.fill_(float("nan"))

    return StepPath(name, run, lambda i: outs[i], poison, ours, kept)


def plugin_path(
    step: PrefillStep,
    ops: MetadataOps,
    name: str,
    ours: tuple[str, ...],
    keep: Sequence[int] | None = None,
) -> StepPath:
    """The plugin's prefill for every layer: ours for the kinds in ``ours``
    (:func:`takes_ours`), vLLM's path with the plugin's combine for the rest."""
    return vllm_path(step, ops, name, ours, keep, plugin=True)


def checker(step: PrefillStep, path: StepPath) -> Callable[[], None]:
    """Every kept layer fully written; the first and last layer of each kind equal to the
    float32 reference on sampled tokens."""
    from .inputs_sparse_mla import reference_sample

    T = step.cell.tokens
    tokens = sample_tokens(T, next(iter(step.kinds.values())).q.device)
    checked = step.cell.model.checked_layers()
    want = {}
    for i in checked:
        inp = step.layers[i]
        if inp.index_case is not step.kinds[inp.shape.layer].index_case:
            inp = dataclasses.replace(inp, rows=inp.index_case.build())
        want[i] = reference_sample(inp, tokens)[0]

    def check() -> None:
        for i in path.kept:
            assert not torch.isnan(path.outputs(i)[:T].float()).any(), (
                f"{path.name} {step.cell.name}: layer {i} has unwritten (NaN) output"
            )
        for i in checked:
            kind = step.layers[i].shape.layer
            assert_close(
                path.outputs(i)[tokens], want[i], f"{path.name} {step.cell.name} layer {i} ({kind})"
            )

    return check
