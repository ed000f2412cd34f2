"""The decode indexer split across vLLM's TP group (issue 40), in several processes with
vLLM's own distributed initialisation (``vllm`` session).

Eight processes, each one rank of a world vLLM initialises with its own
``init_distributed_environment`` (gloo, on the CPU) and groups by its own
``initialize_model_parallel`` at TP 2, 4 and 8 in turn (ranks past one TP group form
the next: vLLM's external data parallelism).  On every rank, with vLLM's
``GroupCoordinator`` of that TP size:

* the split step itself (``indexer_tp.run_split``), by rows and by keys, equals the
  unsharded reference top-k: shares that divide unevenly, rows shorter than k, an
  empty request, MTP rows one entry apart, a row count below the TP size (ranks
  without rows), one long request; padded rows cleared, nothing else written;
* through the plugin, on vLLM's indexer op, pages and metadata
  (``test_vllm_indexer``'s rig): the profile run decides on every rank and agrees over
  vLLM's CPU group, then decode steps (plain, MTP k=1, one request) take the split the
  table measured faster for their row count (rows at least TP, else keys) and equal
  the reference;
* when one rank's split warm-up fails, no rank splits (the agreement), and steps run
  whole and right.

The CPU runs the kernels' torch references (no Triton here); the Triton kernels of the
split are checked against the same references in ``tests/kernels/test_indexer_shards.py``.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import socket
import time
import traceback
from typing import Any

import pytest
import torch

from dsv4_kernels.testing.common import fresh_seed

pytestmark = pytest.mark.vllm

WORLD = 8
TP_SIZES = (2, 4, 8)
DEADLINE = float(
    os.environ.get("DSV4_TP_TEST_DEADLINE", 400)
)  # seconds for the whole world (about 80 on two cores)


def _kernel_splits(group: Any, seed: int, tp: int) -> list[str]:
    from dsv4_attention import indexer_tp
    from dsv4_attention.facts import IndexerFacts
    from dsv4_kernels.reference import indexer as ref
    from dsv4_kernels.testing.common import generator
    from dsv4_kernels.testing.indexer import make_indexer_step

    share = indexer_tp.TpShare(int(group.world_size), int(group.rank_in_group), group)
    assert share.size == tp, (share.size, tp)
    problems = []
    cases = (
        ([301, 0, 20, 64, 97], 2, 32),  # MTP rows, an empty request, rows shorter than k
        ([150, 40, 90], 3, 16),  # 9 rows: an uneven row split
        ([700], 1, 32),  # one long request: fewer rows than ranks
        ([90, 33, 200], 1, 16),  # 3 rows
    )
    for i, (entries, per, topk) in enumerate(cases):
        step = make_indexer_step(entries, generator(seed + i), heads=16, topk=topk,
                                 rows_per_request=per)  # fmt: skip
        rows = step.q.shape[0]
        facts = IndexerFacts(
            name="x", compress_ratio=4, heads=16, head_dim=128, topk=topk,
            max_entries=max(entries) + 3, page_entries=64, buffer_width=topk, max_rows=rows,
        )  # fmt: skip
        want = ref.indexer_decode_topk(step.q, step.weights, step.cache, step.lens,
                                       step.row_req, step.block_table, topk)  # fmt: skip
        sizes = indexer_tp.split_elements(facts, tp)
        for split in indexer_tp.SPLITS:
            out = torch.full((rows + 3, topk + 1), 7, dtype=torch.int32)
            scores = torch.full((sizes[split][0],), float("nan"))
            local = torch.full((sizes[split][1],), 9, dtype=torch.int32)
            indexer_tp.run_split(
                split, share, facts, q=step.q, weights=step.weights, cache=step.cache,
                lens=step.lens, block_table=step.block_table, rows=rows,
                rows_per_request=per, out=out, padded_rows=rows + 2, scores=scores,
                local=local,
            )  # fmt: skip
            where = f"TP{tp} rank {share.rank}, {split} split, case {i}, seed {seed}"
            for t in range(rows):
                g, w = out[t, :topk].tolist(), want[t].tolist()
                n = sum(1 for x in w if x >= 0)
                if g[n:] != [-1] * (topk - n) or sorted(g[:n]) != sorted(w[:n]):
                    problems.append(f"{where}: row {t} {sorted(g)} != {sorted(w)}")
            if not bool((out[rows : rows + 2, :topk] == -1).all()):
                problems.append(f"{where}: padded rows not cleared")
            if not (bool((out[rows + 2 :] == 7).all()) and bool((out[:, topk:] == 7).all())):
                problems.append(f"{where}: wrote outside the step's rows")
    return problems


def _plugin_splits(workspace: Any, tp_group: Any, seed: int, tp: int) -> list[str]:
    from vllm.forward_context import set_forward_context

    import dsv4_kernels
    from dsv4_attention import indexer_tp
    from dsv4_kernels.testing.common import generator

    from .test_vllm_indexer import (
        FASTER,
        HEADS,
        PREFIX,
        TOPK,
        _batch,
        _expected,
        _inputs,
        _profile,
        _region,
        _same_sets,
        make_rig,
    )

    assert FASTER.indexer is not None
    sharded = {
        tp: {
            HEADS: {
                TOPK: {
                    "rows": {1: {1024: 4.0, 4096: 4.0}, 64: {4096: 4.0}},
                    "keys": {1: {4096: 3.0}, 64: {4096: 3.0}},
                }
            }
        }
    }
    table = dataclasses.replace(
        FASTER, indexer=dataclasses.replace(FASTER.indexer, sharded=sharded)
    )
    rank = int(tp_group().rank_in_group)
    problems: list[str] = []
    taken: list[str] = []
    real = indexer_tp.run_split

    def spy(split: str, *args: Any, **kwargs: Any) -> None:
        taken.append(split)
        real(split, *args, **kwargs)

    indexer_tp.run_split = spy  # type: ignore[assignment]
    try:
        steps = (
            (0, [1500, 300, 2100, 260], [1, 1, 1, 1]),  # 4 rows
            (1, [1500, 301, 2101], [2, 2, 2]),  # MTP k=1: 6 rows
            (0, [2100], [1]),  # one request
        )
        for i, (k, seq_lens, query_lens) in enumerate(steps):
            g = generator(seed + 100 + i)
            r = make_rig(workspace, k, table, tp_group=tp_group)
            _profile(r)
            (state,) = r.runtime.indexers.kinds.values()
            where = f"TP{tp} rank {rank}, plugin case {i}, seed {seed}"
            if state.share is None or state.share.size != tp:
                problems.append(f"{where}: not split: {r.info}")
                continue
            if not any(f"TP{tp}: split where measured faster" in x for x in r.info):
                problems.append(f"{where}: the decision line: {r.info}")
            batch = _batch(r, g, seq_lens, query_lens)
            T = sum(query_lens)
            q, w = _inputs(g, T + 3)
            r.op.topk_indices_buffer.fill_(7)
            taken.clear()
            with set_forward_context({PREFIX: batch.meta}, r.config):
                _region(r, q, w)
            expect = "rows" if tp <= T else "keys"
            if taken != [expect]:
                problems.append(f"{where}: {T} rows took {taken}, not {expect}")
            buf = r.op.topk_indices_buffer
            try:
                _same_sets(buf[:T], _expected(r, batch, q, w), where)
            except AssertionError as exc:
                problems.append(str(exc))
            if not bool((buf[T : T + 3] == -1).all()) or not bool((buf[T + 3 :] == 7).all()):
                problems.append(f"{where}: padded rows")
            if r.warning:
                problems.append(f"{where}: warnings {r.warning}")
        if tp == TP_SIZES[0]:
            # one rank's split cannot be compiled: no rank splits; steps run whole
            real_shard = dsv4_kernels.indexer_shard_topk

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected on one rank")

            if rank == 1:
                dsv4_kernels.indexer_shard_topk = broken  # type: ignore[assignment]
            try:
                r = make_rig(workspace, 0, table, tp_group=tp_group)
                _profile(r)
            finally:
                dsv4_kernels.indexer_shard_topk = real_shard  # type: ignore[assignment]
            (state,) = r.runtime.indexers.kinds.values()
            where = f"TP{tp} rank {rank}, one rank's warm-up failed"
            if state.share is not None or not state.choice.ours:
                problems.append(f"{where}: share {state.share}, {state.choice}")
            if not any("not split" in x for x in r.info):
                problems.append(f"{where}: the decision line: {r.info}")
            g = generator(seed + 200)
            batch = _batch(r, g, [1500, 300, 2100], [1, 1, 1])
            q, w = _inputs(g, 3)
            taken.clear()
            with set_forward_context({PREFIX: batch.meta}, r.config):
                _region(r, q, w)
            if taken:
                problems.append(f"{where}: a split ran: {taken}")
            try:
                _same_sets(r.op.topk_indices_buffer[:3], _expected(r, batch, q, w), where)
            except AssertionError as exc:
                problems.append(str(exc))
    finally:
        indexer_tp.run_split = real  # type: ignore[assignment]
    return problems


def _worker(rank: int, port: int, seed: int, results: Any) -> None:
    """One rank: vLLM's distributed start, then every TP size in turn."""
    # a rank left in a collective says where, before the test gives up on it
    faulthandler.dump_traceback_later(DEADLINE - 30, exit=False)
    try:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        # what vLLM's CPU worker sets before its distributed start (the name its
        # shared-memory TP communicator gives the group: vLLM 0.32's CPU build uses it)
        os.environ["VLLM_DIST_IDENT"] = str(port)
        torch.set_num_threads(1)
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.v1.worker import workspace

        # as the workspace fixture: vLLM's manager releases accelerator memory, none here
        torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]
        problems: list[str] = []
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(
                WORLD, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo"
            )
            for tp in TP_SIZES:
                ps.initialize_model_parallel(tensor_model_parallel_size=tp)
                try:
                    problems += _kernel_splits(ps.get_tp_group(), seed, tp)
                    workspace.init_workspace_manager(torch.device("cpu"))
                    try:
                        problems += _plugin_splits(workspace, ps.get_tp_group, seed, tp)
                    finally:
                        workspace.reset_workspace_manager()
                finally:
                    ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        results.put((rank, problems[:10]))
    except BaseException:
        results.put((rank, [f"rank {rank} raised:\n{traceback.format_exc()}"]))


def test_split_indexer_equals_the_whole_at_tp_2_4_8() -> None:
    import torch.multiprocessing as mp

    seed = fresh_seed()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, seed, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE
    got: dict[int, list[str]] = {}
    # read while the ranks run: a rank's report blocks on a full pipe until it is read
    while len(got) < WORLD and time.monotonic() < deadline:
        while not results.empty():
            rank, problems = results.get()
            got[rank] = problems
        if len(got) < WORLD and not any(p.is_alive() for p in procs) and results.empty():
            break
        time.sleep(0.2)
    # a rank reports after its last collective and its distributed teardown: what is
    # left is its process exit, which a loaded machine (the suites run on every core)
    # can make slow; only a rank that never reported is one left in a collective
    exit_by = time.monotonic() + 60
    for p in procs:
        p.join(timeout=max(0.0, exit_by - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive() and r not in got]
    for p in procs:
        if p.is_alive():
            p.kill()
    problems = [x for r in sorted(got) for x in got[r]]
    said = f"seed {seed}; ranks that reported {sorted(got)}:\n" + "\n".join(problems[:20])
    assert not alive, (
        f"ranks {alive} still running after {DEADLINE} s (left in a collective); {said}"
    )
    assert sorted(got) == list(range(WORLD)), said
    assert not problems, said
