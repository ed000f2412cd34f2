"""What the model-step benchmark's decode and prefill halves share: the model at a parallel
layout, the metadata kernels each path calls, CUDA-graph capture, the output checks.

A :class:`StepModel` is one checkpoint's attention layers (their kinds in vLLM's order,
from :mod:`benchmarks.model_facts`) at one layout: TP8 (the real local heads, 8 for
V4-Flash and 16 for V4-Pro; FlashMLA pads them to 64) or DP8 (each GPU holds all 64 / 128
heads, FlashMLA's native head count, and an eighth of the requests).

Metadata kernels (:class:`MetadataOps`): both paths call vLLM's own
``compute_global_topk_indices_and_lens`` once per C4A layer in a decode step (the plugin
does not replace it) and vLLM's path calls vLLM's ``combine_topk_swa_indices`` per layer
in a prefill chunk.  These are vLLM's Triton kernels, staged unmodified from an installed
vLLM by :mod:`benchmarks.support.vllm_peer` (``--vllm-peer``); without the staged folder
our kernels of the same contract stand in, and the run says so.  vLLM's prefill gathers
are its CuTe-DSL kernel on a CUDA build with ``cutlass`` (it cannot travel to the GPU
machine): ours stands in for it, measured at 0.96-1.07x its time (``docs/plugin.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCALE = 512**-0.5
TP = 8
# FlashMLA's head counts (vLLM pads the local heads up to the next)
FLASHMLA_HEADS = (64, 128)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """One checkpoint's attention layers at one layout."""

    name: str  # short model name (benchmarks.model_facts key), e.g. "v4-flash"
    layout: str  # "tp8" | "dp8"
    kinds: tuple[str, ...]  # per attention layer, in vLLM's order: swa | c4a | c128a
    heads: int  # local query heads at this layout
    topk: int  # the indexer's top-k (C4A row width)

    @property
    def padded_heads(self) -> int:
        """The heads vLLM gives FlashMLA (its native count at DP8)."""
        return next(h for h in FLASHMLA_HEADS if self.heads <= h)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.layout}"

    def checked_layers(self) -> list[int]:
        """The first and the last layer of each kind (the layers the checks compare)."""
        ends: dict[str, list[int]] = {}
        for i, kind in enumerate(self.kinds):
            ends.setdefault(kind, [i, i])[1] = i
        return sorted({i for pair in ends.values() for i in pair})


@dataclasses.dataclass
class StepPath:
    """One path through a whole step: ``run`` (on a GPU a graph replay for decode),
    ``outputs(i)`` (layer ``i``'s real heads after the last run, for ``i`` in ``kept``),
    ``poison`` (NaN into those outputs), ``ours`` (the layer kinds on our kernels)."""

    name: str
    run: Callable[[], None]
    outputs: Callable[[int], torch.Tensor]
    poison: Callable[[], None]
    ours: tuple[str, ...]
    kept: tuple[int, ...]
    indexer: Any = None  # decode: the C4A layers' indexer (model_step_indexer.IndexerPath)


def step_model(name: str, layout: str) -> StepModel:
    """A published checkpoint (``benchmarks/model_facts.json``) at ``tp8`` or ``dp8``."""
    from . import model_facts

    facts = model_facts.load()[name]
    if facts.family != "v4":
        raise ValueError(f"{name}: the model-step benchmark covers DeepSeek-V4 layer kinds")
    heads = facts.local_heads(TP) if layout == "tp8" else facts.num_attention_heads
    if layout not in ("tp8", "dp8"):
        raise ValueError(f"layout must be 'tp8' or 'dp8', got {layout!r}")
    return StepModel(name, layout, tuple(facts.kinds), heads, int(facts.index_topk))


# A small model for the CPU smoke run and tests: every kind, C4A twice.
TINY_KINDS = ("swa", "c4a", "c128a", "c4a")


def tiny_model(heads: int = 8, layout: str = "tp8", topk: int = 16) -> StepModel:
    return StepModel("tiny", layout, TINY_KINDS, heads, topk)


@dataclasses.dataclass
class MetadataOps:
    """The metadata kernels of vLLM's path: ``global_topk`` and ``combine`` with vLLM's
    signatures, ``source`` saying whose they are."""

    global_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    combine: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    source: str


def metadata_ops(peer: Path | None) -> MetadataOps:
    """vLLM's staged Triton kernels from ``peer`` (a folder made by
    ``python -m benchmarks.support.vllm_peer``) when it loads, else ours, labelled."""
    import dsv4_kernels as dk

    why = "no --vllm-peer folder given"
    if peer is not None:
        try:
            from .support import vllm_peer

            ops = vllm_peer.load(str(peer))
            return MetadataOps(
                ops.compute_global_topk_indices_and_lens,
                ops.combine_topk_swa_indices,
                f"vLLM {vllm_peer.version(str(peer))}'s Triton kernels (staged)",
            )
        except Exception as exc:  # a missing or broken staged tree: say why, use ours
            why = f"{peer} does not load ({type(exc).__name__}: {exc})"
    return MetadataOps(
        dk.compute_global_topk_indices_and_lens,
        dk.combine_topk_swa_indices,
        f"ours standing in for vLLM's ({why})",
    )


def capture(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` as one CUDA graph (run once on a side stream first: compile, warm up), or
    eager on a CPU.  What the step allocates while captured lives in the graph's pool, and
    every replay writes the same tensors."""
    if device.type != "cuda":
        return step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()

    def replay() -> None:
        graph.replay()

    # the graph and everything the step's closure holds (scratch, outputs, plans) live as
    # long as the callable: a buffer freed after capture would be reused by the next
    # allocation while the graph still reads and writes it
    replay.graph = graph  # type: ignore[attr-defined]
    replay.step = step  # type: ignore[attr-defined]
    return replay


def sample_tokens(num_tokens: int, device: torch.device, most: int = 64) -> torch.Tensor:
    """Every ``num_tokens // most``-th token and the last one (the tokens a check compares)."""
    idx = torch.arange(0, num_tokens, max(1, num_tokens // most), device=device)
    return torch.unique(torch.cat([idx, torch.tensor([num_tokens - 1], device=device)]))


def value_tolerance(want: torch.Tensor) -> float:
    """Absolute tolerance of a bf16 attention output: bf16 rounding of the probabilities and
    of the output is relative to the largest value the output can mix (values of ~10 give
    0.06 steps), so the tolerance grows with the largest reference element."""
    return 3e-2 + 8e-3 * float(want.abs().max()) if want.numel() else 3e-2


def assert_close(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16 attention output (real heads) against the float32 reference: no NaN (poisoned
    outputs were written), then within bf16 tolerance (:func:`value_tolerance`)."""
    assert not torch.isnan(out.float()).any(), f"{what}: NaN (unwritten) output"
    atol = value_tolerance(want)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=3e-2, msg=what)


def unique_key_bytes(*index_sets: tuple[torch.Tensor, torch.Tensor | None]) -> int:
    """FP8 bytes (584 per key and a 4-byte index) of the distinct valid slots of each
    (rows, lens) set: what a step must read at least, whoever computes it."""
    total = 0
    for rows, lens in index_sets:
        col = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)
        ok = rows >= 0
        if lens is not None:
            ok &= col < lens.to(torch.int64).unsqueeze(1)
        total += int(torch.unique(rows[ok]).numel()) * 584 + int(ok.sum()) * 4
    return total


def poison(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            t.fill_(float("nan"))
