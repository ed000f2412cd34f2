"""Preallocated buffers for the head-exact prefill: nothing allocated during a step.

vLLM sizes the KV cache from a profile run, so memory a real step takes beyond
what the profile saw can run out later.  The prefill's index rows and its lse
therefore come from buffers reserved once, in the profile run, at the size the
largest step needs (:func:`prefill_scratch_sizes`), and every step takes views
of them (:meth:`PrefillScratch.take`).  In vLLM the buffers are the workspace
manager's persistent resources (``get_persistent``), reserved before vLLM
locks its workspace; here they are plain named flat tensors so the module
needs no vLLM.

Which buffers (all int32 but the lse):

* ``window{i}`` / ``window{i}_lens`` / ``_leads`` / ``_starts``: the window
  rows of the ``i``-th window block table seen in a step (vLLM puts DSV4's
  window caches in two KV-cache groups, so a step has two window tables);
* ``c128a{i}`` / ``c128a{i}_lens`` / ``_leads``: the C128A rows of the ``i``-th
  C128A table (with ``c128a_blocks``, ``c128a{i}_req`` instead of ``c128a{i}``: each
  token's request, the rows read through the block table);
* ``c4a`` / ``c4a_lens``: a C4A layer's top-k rows (rebuilt by every C4A
  layer, used at once);
* ``lse``: ``[T, H]`` float32, written by the attention kernel.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PrefillScratch",
    "ScratchSpec",
    "ScratchTooSmall",
    "prefill_scratch_sizes",
    "workspace_locked",
    "workspace_pool",
]


@contextlib.contextmanager
def workspace_pool(manager: Any) -> Iterator[None]:
    """Allocate where vLLM allocates its workspace: inside the workspace manager's
    allocation context (under sleep mode vLLM's CuMem pool tagged ``"workspace"``, which
    ``sleep()`` discards and ``wake_up()`` maps again at the same addresses), else as
    torch allocates.  Our scratch holds nothing across steps, so discarding it is safe."""
    context = getattr(manager, "_alloc_context", None)
    if callable(context):
        with context():
            yield
    else:
        yield


def workspace_locked(manager: Any) -> bool:
    """Whether vLLM's workspace manager (None: none) is locked (its profile run is over,
    so nothing reserved now would be counted)."""
    locked = getattr(manager, "is_locked", None)
    return manager is not None and callable(locked) and bool(locked())


class ScratchTooSmall(RuntimeError):
    """A step needs more than was reserved: the caller takes vLLM's own path."""


@dataclass(frozen=True)
class ScratchSpec:
    """The largest step the buffers must hold.

    Attributes:
        max_tokens: prefill tokens in one step (vLLM's ``max_num_batched_tokens``).
        max_heads: local query heads.
        window_size: sliding window W.
        max_group: the largest group size of grouped rows (1: per-token rows only).
        c4a_topk: C4A row width (the indexer's top-k), 0 without C4A layers.
        c128a_width: C128A row width (vLLM's widest ``c128a_prefill_topk_indices``),
            0 without C128A layers.
        window_slots: distinct window block tables per step.
        c128a_slots: distinct C128A block tables per step.
        c128a_blocks: 1 when the C128A rows are read through the compressed block
            table (:class:`dsv4_kernels.BlockRows`): each slot then holds each token's
            length and request, not a ``[tokens, c128a_width]`` row of slots.
    """

    max_tokens: int
    max_heads: int
    window_size: int = 128
    max_group: int = 1
    c4a_topk: int = 0
    c128a_width: int = 0
    window_slots: int = 2
    c128a_slots: int = 1
    c128a_blocks: int = 0

    def merged(self, other: ScratchSpec) -> ScratchSpec:
        """The spec that covers both (elementwise maximum)."""
        return ScratchSpec(*(max(a, b) for a, b in zip(_fields(self), _fields(other), strict=True)))


def _fields(spec: ScratchSpec) -> tuple[int, ...]:
    return (
        spec.max_tokens,
        spec.max_heads,
        spec.window_size,
        spec.max_group,
        spec.c4a_topk,
        spec.c128a_width,
        spec.window_slots,
        spec.c128a_slots,
        spec.c128a_blocks,
    )


def prefill_scratch_sizes(spec: ScratchSpec) -> dict[str, tuple[int, torch.dtype]]:
    """Buffer name -> (elements, dtype) for the largest step ``spec`` describes."""
    t = spec.max_tokens
    sizes: dict[str, tuple[int, torch.dtype]] = {"lse": (t * spec.max_heads, torch.float32)}
    width = spec.window_size + spec.max_group - 1
    for i in range(spec.window_slots):
        sizes[f"window{i}"] = (t * width, torch.int32)
        for part in ("lens", "leads", "starts"):
            sizes[f"window{i}_{part}"] = (t, torch.int32)
    if spec.c4a_topk:
        sizes["c4a"] = (t * spec.c4a_topk, torch.int32)
        sizes["c4a_lens"] = (t, torch.int32)
    if spec.c128a_width:
        for i in range(spec.c128a_slots):
            if spec.c128a_blocks:  # each token's request: the kernel reads the table
                sizes[f"c128a{i}_req"] = (t, torch.int32)
            else:
                sizes[f"c128a{i}"] = (t * spec.c128a_width, torch.int32)
            sizes[f"c128a{i}_lens"] = (t, torch.int32)
            sizes[f"c128a{i}_leads"] = (t, torch.int32)
    return sizes


def scratch_bytes(spec: ScratchSpec) -> int:
    """Bytes :func:`prefill_scratch_sizes` asks for."""
    return sum(n * dtype.itemsize for n, dtype in prefill_scratch_sizes(spec).values())


class PrefillScratch:
    """Named flat buffers; :meth:`take` returns a view of one shaped for this step.

    Args:
        spec: the largest step (:class:`ScratchSpec`).
        allocate: ``(name, elements, dtype) -> tensor``: where the memory comes from
            (vLLM's workspace manager in a server; ``torch.empty`` by default).
        device: where :func:`torch.empty` allocates when ``allocate`` is None.
    """

    def __init__(
        self,
        spec: ScratchSpec,
        allocate: Callable[[str, int, torch.dtype], torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec = spec
        if allocate is None:

            def allocate(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty((n,), dtype=dtype, device=device)

        self.buffers: Mapping[str, torch.Tensor] = {
            name: allocate(name, n, dtype)
            for name, (n, dtype) in prefill_scratch_sizes(spec).items()
        }

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of buffer ``name`` shaped ``shape`` (its first elements); raises
        :class:`ScratchTooSmall` when the buffer is missing or too small."""
        buffer = self.buffers.get(name)
        need = math.prod(shape)
        if buffer is None or buffer.numel() < need:
            have = 0 if buffer is None else buffer.numel()
            raise ScratchTooSmall(
                f"prefill scratch {name!r} holds {have} elements, the step needs {need} "
                f"{tuple(shape)}"
            )
        return buffer[:need].view(shape)
