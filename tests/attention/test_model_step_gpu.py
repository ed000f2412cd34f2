"""The model-step benchmark on the H200 at the real shapes: one decode step and one prefill
chunk of V4-Flash and V4-Pro at TP8 (every layer, in vLLM's order), the plugin's path and
vLLM's (FlashMLA built from source, ``bash .fmla/build-on-gpu.sh``), each layer checked
for NaN (poisoned first) and the first and last layer of each kind against the float64
oracle on sampled tokens."""

from __future__ import annotations

import pytest
import torch
from benchmarks import model_step_decode as md
from benchmarks import model_step_prefill as mp
from benchmarks.flashmla_provider import load_sparse_fwd
from benchmarks.model_step_common import metadata_ops, sample_tokens, step_model

from dsv4_kernels.testing.common import fresh_seed

from ._model_step_oracle import check, decode_oracle, prefill_oracle

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _flashmla() -> None:
    if load_sparse_fwd()[0] is None:
        pytest.skip(f"vLLM's path needs FlashMLA: {load_sparse_fwd()[1]}")


def _check_paths(step: object, paths: list, oracle_fn: object) -> None:
    tokens = sample_tokens(step.cell.tokens, CUDA, most=48)
    want = {i: oracle_fn(step, i, tokens) for i in step.cell.model.checked_layers()}
    for path in paths:
        path.poison()
        path.run()
        torch.cuda.synchronize()
        for i in range(len(step.layers)):
            assert not torch.isnan(path.outputs(i).float()).any(), f"{path.name}: layer {i} NaN"
        for i, w in want.items():
            check(path.outputs(i)[tokens], w, f"{path.name} {step.cell.name} layer {i}")


@pytest.mark.parametrize("model", ["v4-flash", "v4-pro"])
def test_decode_step_real_shapes(model: str) -> None:
    _flashmla()
    ops = metadata_ops(None)
    step = md.build_step(md.DecodeCell(step_model(model, "tp8"), 8, 2, 131072), CUDA, fresh_seed())
    paths = [md.plugin_path(step, ops, "ours"), md.vllm_path(step, ops, "vllm")]
    assert paths[0].ours, "the H200 table takes some layer kind's decode"
    _check_paths(step, paths, decode_oracle)


@pytest.mark.parametrize("model", ["v4-flash", "v4-pro"])
def test_prefill_chunk_real_shapes(model: str) -> None:
    _flashmla()
    ops = metadata_ops(None)
    step = mp.build_step(mp.chunk_cell(step_model(model, "tp8"), 4096, 131072), CUDA, fresh_seed())
    ours = mp.takes_ours(step)
    assert ours, "the H200 table takes some layer kind's prefill"
    paths = [mp.plugin_path(step, ops, "ours", ours), mp.vllm_path(step, ops, "vllm")]
    _check_paths(step, paths, prefill_oracle)
