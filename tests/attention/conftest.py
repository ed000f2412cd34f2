"""Fixtures the vLLM tests of the attention package share (vLLM is imported inside them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture
def workspace(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's own workspace manager on the CPU (reset afterwards)."""
    from vllm.v1.worker import workspace as ws

    # the one accelerator call of vLLM's manager (releasing cached memory before it
    # grows) has nothing to release on a CPU and raises there
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ws.init_workspace_manager(torch.device("cpu"))
    try:
        yield ws
    finally:
        ws.reset_workspace_manager()


@pytest.fixture(scope="module")
def peer_topk(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM's own ``compute_global_topk_indices_and_lens`` (its Triton kernel, staged
    from the installed vLLM and run through Triton's interpreter)."""
    from benchmarks.support import vllm_peer

    folder = tmp_path_factory.mktemp("vllm_peer_topk")
    vllm_peer.stage(Path(folder))
    return vllm_peer.load(folder).compute_global_topk_indices_and_lens


@dataclass
class PoolRecorder:
    """An allocation context as vLLM's workspace manager is given one under sleep mode
    (``pool``: stands in for the CuMem pool ``sleep()`` discards), and the addresses of
    the tensors ``torch.empty`` made inside it (``made``)."""

    made: set[int] = field(default_factory=set)
    depth: list[bool] = field(default_factory=list)
    real_empty: Any = torch.empty  # torch.empty itself (to stop recording mid-test)

    @contextlib.contextmanager
    def pool(self) -> Iterator[None]:
        self.depth.append(True)
        try:
            yield
        finally:
            self.depth.pop()


@pytest.fixture
def pool_recorder(monkeypatch: pytest.MonkeyPatch) -> PoolRecorder:
    """A :class:`PoolRecorder` with ``torch.empty`` recording into it (and vLLM's one
    accelerator call, which has nothing to release on a CPU, made a no-op)."""
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    recorder = PoolRecorder()
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if recorder.depth:
            recorder.made.add(t.data_ptr())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return recorder
