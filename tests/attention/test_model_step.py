"""The model-step benchmark (``benchmarks/model_step*``) computes what it times: every
layer of a whole (tiny) model's decode step and prefill chunk, through vLLM's path (a
torch stand-in for FlashMLA on a CPU) and the plugin's (our kernels through Triton's
interpreter), equals the float64 oracle; a wrong or unwritten layer fails its check; the
published models' layer lists give TP8's and DP8's heads."""

from __future__ import annotations

import math

import pytest
import torch
from benchmarks import model_step as ms
from benchmarks import model_step_decode as md
from benchmarks import model_step_prefill as mp
from benchmarks.harness import Result
from benchmarks.model_step_common import metadata_ops, step_model, tiny_model

from dsv4_kernels.testing.common import fresh_seed

from ._model_step_oracle import check, decode_oracle, prefill_oracle

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> object:
    return metadata_ops(None)


@pytest.mark.parametrize(("requests", "per_request"), [(1, 1), (3, 2)])
def test_decode_step_every_layer_equals_the_oracle(ops: object, requests: int,
                                                   per_request: int) -> None:  # fmt: skip
    cell = md.DecodeCell(tiny_model(8), requests, per_request, 300)
    step = md.build_step(cell, CPU, fresh_seed())
    tokens = torch.arange(cell.tokens)
    paths = [md.vllm_path(step, ops, "vllm"), md.plugin_path(step, ops, "ours")]
    assert paths[1].ours, "the H200 table takes the tiny model's decode for ours"
    for path in paths:
        path.poison()
        path.run()
        for i, kind in enumerate(cell.model.kinds):
            check(path.outputs(i), decode_oracle(step, i, tokens), f"{path.name} layer {i} {kind}")


def test_decode_step_runs_each_c4a_layers_indexer(ops: object) -> None:
    """Every C4A layer's indexer runs in each path (ours standing in for vLLM's pair on
    a CPU) over its own pages: every row's top-k equals the float64 reference; the path's
    check fails on an unwritten (poisoned) indexer output."""
    from dsv4_kernels.reference import indexer as ref

    step = md.build_step(md.DecodeCell(tiny_model(8), 2, 2, 300), CPU, fresh_seed())
    ix = step.indexer
    assert ix is not None and sorted(ix.tables) == [1, 3]
    assert not torch.equal(ix.tables[1], ix.tables[3]), "each layer its own pages"
    req = torch.arange(ix.rows, dtype=torch.int32) // ix.per_request
    for path in (md.vllm_path(step, ops, "vllm"), md.plugin_path(step, ops, "ours")):
        assert path.indexer is not None and sorted(path.indexer.runs) == [1, 3]
        check_fn = md.checker(step, path)
        path.poison()
        path.run()
        check_fn()
        for i in (1, 3):
            want = ref.indexer_decode_topk(ix.q, ix.weights, ix.cache, ix.lens, req,
                                           ix.tables[i], ix.topk)  # fmt: skip
            got = path.indexer.outs[i]
            for t in range(ix.rows):
                assert sorted(got[t].tolist()) == sorted(want[t].tolist()), (path.name, i, t)
        path.poison()
        with pytest.raises(AssertionError, match="the indexer of layer"):
            check_fn()


def test_decode_layers_read_their_own_keys(ops: object) -> None:
    cell = md.DecodeCell(tiny_model(8), 2, 1, 300)
    step = md.build_step(cell, CPU, fresh_seed())
    c4a = [lay for lay in step.layers if lay.kind == "c4a"]
    assert len(c4a) == 2 and not torch.equal(c4a[0].comp_indices, c4a[1].comp_indices)
    assert not torch.equal(step.layers[0].swa_indices, step.layers[1].swa_indices)


def test_prefill_step_every_layer_equals_the_oracle(ops: object) -> None:
    cell = mp.PrefillCell(tiny_model(8), 2, 5, 300)
    step = mp.build_step(cell, CPU, fresh_seed())
    tokens = torch.arange(cell.tokens)
    ours = mp.takes_ours(step)
    assert set(ours) == {"swa", "c4a", "c128a"}
    for path in (mp.vllm_path(step, ops, "vllm"), mp.plugin_path(step, ops, "ours", ours)):
        path.poison()
        path.run()
        for i, kind in enumerate(cell.model.kinds):
            check(path.outputs(i), prefill_oracle(step, i, tokens), f"{path.name} layer {i} {kind}")


def test_dp8_prefill_takes_ours_only_where_a_wide_row_says(
    ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DP8 chunk (64 heads): the shipped H200 table has no wide row, so no kind is
    ours; with one for C4A and C128A at 64 heads, exactly those run ours, with the row's
    tiles, and every layer equals the oracle."""
    import dataclasses

    from benchmarks.cases_sparse_mla import wide_tiles

    from dsv4_attention import tables

    cell = mp.PrefillCell(tiny_model(64, "dp8"), 1, 4, 300)
    assert mp.cell_takes_ours(cell) == ()
    h200 = mp._h200()
    row = tables.WidePrefill(frozenset({"c4a", "c128a"}), wide_tiles(64))
    wide = dataclasses.replace(h200, prefill=dataclasses.replace(h200.prefill, wide={64: row}))
    monkeypatch.setattr(mp, "_h200", lambda: wide)
    assert mp.cell_takes_ours(cell) == ("c4a", "c128a")
    assert mp.cell_takes_ours(mp.PrefillCell(tiny_model(32, "dp8"), 1, 4, 300)) == ()
    step = mp.build_step(cell, CPU, fresh_seed())
    assert mp.kind_tiles(step, "c4a") == {"large": wide_tiles(64)}
    path = mp.plugin_path(step, ops, "dsv4-dp8", mp.takes_ours(step))
    path.poison()
    path.run()
    tokens = torch.arange(cell.tokens)
    for i, kind in enumerate(cell.model.kinds):
        check(path.outputs(i), prefill_oracle(step, i, tokens), f"layer {i} {kind}")


def test_prefill_layers_of_a_kind_differ(ops: object) -> None:
    step = mp.build_step(mp.PrefillCell(tiny_model(8), 1, 6, 300), CPU, fresh_seed())
    a, b = (inp for inp in step.layers if inp.shape.layer == "c4a")
    assert a.comp_cache.data_ptr() != b.comp_cache.data_ptr()
    assert not torch.equal(a.index_case.topk_indices, b.index_case.topk_indices)
    assert a.index_case.comp_block_table is b.index_case.comp_block_table  # one KV-cache group


@pytest.mark.parametrize("part", ["decode", "prefill"])
def test_the_check_catches_a_wrong_layer(ops: object, part: str) -> None:
    if part == "decode":
        step = md.build_step(md.DecodeCell(tiny_model(8), 2, 1, 300), CPU, fresh_seed())
        path, make_check = md.plugin_path(step, ops, "ours"), md.checker
    else:
        step = mp.build_step(mp.PrefillCell(tiny_model(8), 1, 6, 300), CPU, fresh_seed())
        path, make_check = mp.plugin_path(step, ops, "ours", mp.takes_ours(step)), mp.checker
    check_fn = make_check(step, path)
    path.run()
    check_fn()
    last = len(step.cell.model.kinds) - 1  # the last C4A layer: checked (first and last per kind)
    path.outputs(last).mul_(1.5)
    with pytest.raises(AssertionError):
        check_fn()
    path.outputs(last).fill_(float("nan"))
    with pytest.raises(AssertionError, match="unwritten"):
        check_fn()


def test_published_models_at_tp8_and_dp8() -> None:
    flash, pro = step_model("v4-flash", "tp8"), step_model("v4-pro", "tp8")
    assert (len(flash.kinds), flash.heads, flash.padded_heads, flash.topk) == (43, 8, 64, 512)
    assert (len(pro.kinds), pro.heads, pro.padded_heads, pro.topk) == (61, 16, 64, 1024)
    assert [flash.kinds.count(k) for k in ("swa", "c4a", "c128a")] == [2, 21, 20]
    assert [pro.kinds.count(k) for k in ("swa", "c4a", "c128a")] == [0, 30, 31]
    assert step_model("v4-flash", "dp8").heads == 64 and step_model("v4-pro", "dp8").heads == 128
    assert step_model("v4-pro", "dp8").padded_heads == 128
    with pytest.raises(ValueError, match="layout"):
        step_model("v4-flash", "tp4")


def test_rows_give_the_saving_per_step() -> None:
    def result(provider: str, us: float) -> Result:
        params = {"model": "m", "kinds": {"c4a": 1}, "requests": 8, "per_request": 1,
                  "context": 8192, "dp_requests": 1, "ours_kinds": ["c4a"]}  # fmt: skip
        return Result(ms.DECODE, provider, "m-b8", 8, us, us, us, 5.0, 100, params)

    vllm, ours, dp = 2.0 + fresh_seed() % 100, 1.0 + fresh_seed() % 50, 3.0
    rows = ms._rows([result(ms.VLLM, vllm), result(ms.OURS, ours), result(ms.DP8, dp)])
    assert len(rows) == 1
    r = rows[0]
    assert math.isclose(r["saving_us"], vllm - ours)
    assert math.isclose(r["saving_pct"], 100 * (vllm - ours) / vllm)
    assert math.isclose(r["speedup"], vllm / ours) and r[ms.DP8] == dp
    text = ms.table(rows, smoke=False)
    assert f"{vllm - ours:.1f}" in text and f"| {dp:.1f} | - | " in text and "nan" not in text
    # the DP8 step on the plugin's path (issue 41), faster than everything else here
    rows = ms._rows([result(ms.VLLM, vllm), result(ms.OURS, ours), result(ms.DP8, dp),
                     result(ms.DP8_OURS, 0.5)])  # fmt: skip
    assert rows[0][ms.DP8_OURS] == 0.5
    assert "| 0.5 | DP8 + plugin (1 req/GPU) |" in ms.table(rows, smoke=False)


@pytest.mark.vllm
def test_vllm_path_with_vllms_own_metadata_kernels(tmp_path: object) -> None:
    """vLLM's path through vLLM's own Triton top-k mapping and combine (staged from the
    installed vLLM, run through Triton's interpreter) with the arguments vLLM passes them."""
    from pathlib import Path

    from benchmarks.support import vllm_peer

    vllm_peer.stage(Path(str(tmp_path)))
    vllm_ops = metadata_ops(Path(str(tmp_path)))
    assert vllm_ops.source.startswith("vLLM "), vllm_ops.source
    dstep = md.build_step(md.DecodeCell(tiny_model(8), 2, 2, 300), CPU, fresh_seed())
    pstep = mp.build_step(mp.PrefillCell(tiny_model(8), 2, 5, 300), CPU, fresh_seed())
    for step, path, oracle_fn in (
        (dstep, md.vllm_path(dstep, vllm_ops, "vllm"), decode_oracle),
        (pstep, mp.vllm_path(pstep, vllm_ops, "vllm"), prefill_oracle),
    ):
        tokens = torch.arange(step.cell.tokens)
        path.poison()
        path.run()
        for i, kind in enumerate(step.cell.model.kinds):
            check(path.outputs(i), oracle_fn(step, i, tokens), f"{path.name} layer {i} {kind}")
