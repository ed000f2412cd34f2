"""Fixtures the vLLM tests of the attention package share (vLLM is imported inside them)."""

from __future__ import annotations

from collections.abc import Iterator
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
