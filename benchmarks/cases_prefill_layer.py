"""Benchmark cases for one DSV4 attention layer's prefill: what a prefill step costs per layer.

Where ``cases_sparse_mla.py`` times the kernels, this times the layer forward a user's
prefill step runs through :mod:`dsv4_attention.prefill` (argument checks, the step plan,
the index rows, sparse MLA with sink into the caller's output) against what vLLM runs at
that layer.  Matrix: the three layer types (SWA-only, C4A, C128A) at V4-Flash TP8 (8
heads, top-k 512) and V4-Pro TP8 (16 heads, top-k 1024), for one request's prefill chunk
of 1,024, 4,096 and 16,384 tokens ending at a 131,072-token context and for 16 fresh
1,024-token requests.  Inputs (FP8 pages, block tables, indexer top-k, vLLM's bf16
workspace) are those of the sparse MLA benchmark (:func:`.inputs_sparse_mla.make_inputs`).

Providers, each poisoned, run, checked on every token against the torch reference
:func:`dsv4_attention.prefill.reference_forward_prefill`, then timed:

* ``dsv4-attention``: :func:`dsv4_attention.prefill.forward_prefill` with the step's
  :class:`~dsv4_attention.prefill.PrefillPlan` already holding the rows its layer type
  shares (every SWA-only or C128A layer after the first of its type in a step: no index
  build; a C4A layer still builds its own top-k rows, as every C4A layer does);
* ``dsv4-attention+plan``: the same with a new plan per call (the first layer of its type
  in a step, which builds the shared rows);
* ``flashmla-64h+gather``: vLLM's path at that layer, as ``cases_sparse_mla.py`` runs it:
  the workspace gathers and the index combine, then FlashMLA's sparse prefill on heads
  padded to 64 (when FlashMLA imports; else reported unavailable);
* ``vllm-flashmla-native+gather``: the same gathers and combine, then vLLM 0.33's bundled
  FlashMLA (:mod:`.flashmla_vllm`) at the real heads (when its staged files load; else
  reported unavailable).

The rows here come from torch's caching allocator; in vLLM the plugin takes them from
preallocated scratch.  ``floor``: the sparse MLA benchmark's byte count
(:func:`.cases_sparse_mla.floor_bytes`: the valid keys' FP8 bytes and indices, q, out
and lse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cases_metadata import fresh_seed
from .cases_sparse_mla import (
    FLASHMLA_GATHER,
    VLLM_FLASHMLA_GATHER,
    attention_provider,
    case_params,
    flashmla_available,
    flashmla_providers,
    floor_bytes,
    vllm_flashmla_available,
    vllm_flashmla_providers,
)
from .harness import BenchCase
from .inputs_sparse_mla import SCALE, SWA_BLOCK, AttnInputs, AttnShape, make_inputs, shape_matrix

KERNEL = "prefill_layer"
OURS = "dsv4-attention"
OURS_PLAN = "dsv4-attention+plan"

MODELS = (("flash-tp8", 8, 512), ("pro-tp8", 16, 1024))
CHUNKS = (
    ("1x1024@131072", 1, 1024, 131072),
    ("1x4096@131072", 1, 4096, 131072),
    ("1x16384@131072", 1, 16384, 131072),
    ("16x1024", 16, 1024, 1024),
)
MATRIX = shape_matrix(CHUNKS, MODELS, ("swa", "c4a", "c128a"))
# CPU smoke (Triton's interpreter): the same three layer types and two head counts, tiny.
SMOKE = [
    AttnShape("swa-flash-tp8-2x5", "swa", 2, 5, 5, 8, 0),
    AttnShape("c4a-flash-tp8-1x6@300", "c4a", 1, 6, 300, 8, 16),
    AttnShape("c128a-pro-tp8-2x4@700", "c128a", 2, 4, 700, 16, 0),
]


def layer_kwargs(inp: AttnInputs) -> dict[str, Any]:
    """The layer's arguments to :func:`~dsv4_attention.prefill.forward_prefill` (and its
    reference), from the benchmark's inputs as vLLM's metadata would give them."""
    c = inp.index_case
    ratio = inp.shape.ratio
    kw: dict[str, Any] = dict(
        compress_ratio=ratio,
        scale=SCALE,
        swa_cache=inp.swa_cache,
        swa_block_table=c.window_block_table,
        swa_block_size=SWA_BLOCK,
        attn_sink=inp.sink,
    )
    if ratio > 1:
        kw.update(
            comp_cache=inp.comp_cache,
            comp_block_table=c.comp_block_table,
            comp_block_size=inp.comp_block_size,
        )
    if ratio == 4:
        kw["topk_indices"] = c.topk_indices
    if ratio == 128:
        kw["c128a_topk"] = c.topk
    return kw


def new_plan(inp: AttnInputs) -> Any:
    """A step's :class:`~dsv4_attention.prefill.PrefillPlan` for the inputs' chunk."""
    from dsv4_attention.prefill import PrefillPlan

    c = inp.index_case
    return PrefillPlan(c.query_start_loc, c.seq_lens, num_tokens=c.num_tokens)


def reference(inp: AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of every token from the torch reference forward."""
    from dsv4_attention.prefill import reference_forward_prefill

    T, H, _ = inp.q.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=inp.q.device)
    out = reference_forward_prefill(inp.q, new_plan(inp), lse=lse, **layer_kwargs(inp))
    return out, lse


def layer_case(inp: AttnInputs, flashmla: bool, vllm_flashmla: bool = False) -> BenchCase:
    """One case: our layer forward (plan reused, new plan) and vLLM's path at that layer
    (with the source-built FlashMLA and with vLLM 0.33's bundled one, where they load)."""
    from dsv4_attention.prefill import forward_prefill
    from dsv4_kernels.testing import sparse_mla as ts

    T, H, _ = inp.q.shape
    tokens = torch.arange(T, device=inp.q.device)
    want = reference(inp)
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=inp.q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=inp.q.device)
    kw = layer_kwargs(inp)
    step_plan = new_plan(inp)  # holds the shared rows from its first (checked) run on

    def poison() -> None:
        ts.poison_outputs(out, lse)

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        return out, lse

    def later_layer() -> None:
        forward_prefill(inp.q, step_plan, out=out, lse=lse, **kw)

    def first_layer() -> None:
        forward_prefill(inp.q, new_plan(inp), out=out, lse=lse, **kw)

    providers = [
        attention_provider(OURS, later_layer, outputs, poison, inp, want, tokens),
        attention_provider(OURS_PLAN, first_layer, outputs, poison, inp, want, tokens),
    ]
    if flashmla:
        providers += [p for p in flashmla_providers(inp, want, tokens) if p.name == FLASHMLA_GATHER]
    if vllm_flashmla:
        providers += [
            p for p in vllm_flashmla_providers(inp, want, tokens) if p.name == VLLM_FLASHMLA_GATHER
        ]
    return BenchCase(KERNEL, inp.shape.name, T, floor_bytes(inp), providers, case_params(inp))


def build_cases(
    device: torch.device, smoke: bool, shapes: Sequence[AttnShape] | None = None
) -> list[BenchCase]:
    flashmla = flashmla_available()
    vllm_flashmla = vllm_flashmla_available()
    return [
        layer_case(make_inputs(shape, device, fresh_seed()), flashmla, vllm_flashmla)
        for shape in (shapes if shapes is not None else (SMOKE if smoke else MATRIX))
    ]
