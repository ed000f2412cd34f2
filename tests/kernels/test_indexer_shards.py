"""The indexer split across ranks (issue 40), kernel side, on fresh random inputs: each key
shard's candidates (``indexer_shard_topk``) against the reference's, and the merge of all
shards' candidates (``indexer_merge_topk``) equal to the unsharded kernel's top-k, for 2
to 8 shards, uneven shares, rows shorter than k, empty rows, MTP rows and ties that
straddle the k-th place across a shard boundary; a row shard (``row_offset``) equal to
the whole step's rows; poisoned outputs written where they should be and nowhere else;
bad input named.  The ranks and the exchange are ``tests/attention/test_vllm_tp_indexer.py``'s
(vLLM's process groups)."""

from __future__ import annotations

import pytest
import torch

import dsv4_kernels as dk
from dsv4_kernels.reference import indexer as ref
from dsv4_kernels.testing.common import fresh_seed, generator
from dsv4_kernels.testing.indexer import make_indexer_step

from .test_indexer import _same_sets
from .test_indexer_reference import _copy_entry, _oracle_scores, _tie_pick

POISON = -7


def _candidates(step, topk: int, shards: int, max_entries: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every shard's packed candidates from the kernel, stacked shard by shard (what the
    all-gather returns), each checked against the reference shard's."""
    T = step.q.shape[0]
    stacked = []
    for r in range(shards):
        out = torch.full((T + 1, 2 * topk + 2), POISON, dtype=torch.int32)
        got = dk.indexer_shard_topk(
            step.q, step.weights, step.cache, step.lens, step.row_req, step.block_table, topk,
            out, shard=r, shards=shards, max_entries=max_entries,
        )  # fmt: skip
        assert got.data_ptr() == out.data_ptr()
        assert bool((out[T:] == POISON).all()) and bool((out[:, 2 * topk :] == POISON).all())
        want = ref.shard_topk(step.q, step.weights, step.cache, step.lens, step.row_req,
                              step.block_table, topk, r, shards)  # fmt: skip
        lens = step.lens.to(torch.int64)
        lo, hi = lens * r // shards, lens * (r + 1) // shards
        for t in range(T):
            n = min(int(hi[t] - lo[t]), topk)
            g_idx, w_idx = got[t, :topk].tolist(), want[t, :topk].tolist()
            assert g_idx[n:] == [-1] * (topk - n), f"shard {r} row {t}: the -1 fill"
            assert sorted(g_idx[:n]) == sorted(w_idx[:n]), f"shard {r} row {t}"
            assert all(int(lo[t]) <= j < int(hi[t]) for j in g_idx[:n]), "outside the share"
            g_val = got[t, topk:].contiguous().view(torch.float32)
            w_val = dict(
                zip(w_idx[:n], want[t, topk:].contiguous().view(torch.float32)[:n], strict=True)
            )
            for i, j in enumerate(g_idx[:n]):  # each score beside its own entry
                assert abs(float(g_val[i]) - float(w_val[j])) <= 1e-4 * (1 + abs(float(w_val[j])))
            assert bool(torch.isneginf(g_val[n:]).all()), "-inf beside a -1"
        stacked.append(got.clone())
    return torch.cat(stacked)


def _merged(candidates: torch.Tensor, topk: int, shards: int, extra: int = 2) -> torch.Tensor:
    T = candidates.shape[0] // shards
    out = torch.full((T + extra + 1, topk + 3), POISON, dtype=torch.int32)
    got = dk.indexer_merge_topk(candidates, topk, out, shards=shards, clear_rows=T + extra)
    assert got.data_ptr() == out.data_ptr()
    assert bool((out[T : T + extra, :topk] == -1).all()), "padding rows cleared"
    assert bool((out[T + extra :] == POISON).all()) and bool((out[:, topk:] == POISON).all())
    return out[:T, :topk]


def _whole(step, topk: int, max_entries: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.full((step.q.shape[0], topk), POISON, dtype=torch.int32)
    return dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, step.row_req,
                                  step.block_table, topk, out, max_entries=max_entries)  # fmt: skip


@pytest.mark.parametrize("shards", [2, 3, 8])
def test_merged_key_shards_equal_the_whole_rows(shards: int) -> None:
    """Rows longer and shorter than k, shares that divide unevenly, an empty request and
    MTP rows one entry apart."""
    seed = fresh_seed()
    g = generator(seed)
    topk = 32
    step = make_indexer_step([301, 0, 20, 64, 97], g, heads=16, topk=topk, rows_per_request=2,
                             entries_per_page=64)  # fmt: skip
    merged = _merged(_candidates(step, topk, shards, 320), topk, shards)
    whole = _whole(step, topk, 320)
    want = ref.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, step.row_req,
                                   step.block_table, topk)  # fmt: skip
    _same_sets(merged, whole, step.lens, f"seed {seed}, {shards} shards vs the whole kernel")
    _same_sets(merged, want, step.lens, f"seed {seed}, {shards} shards vs the reference")


def test_ties_straddling_the_kth_place_across_shards_lowest_position_first() -> None:
    """Entries tied with the k-th score in two shards: the merge keeps the lowest
    positions, as the unsharded top-k does."""
    seed = fresh_seed()
    g = generator(seed)
    topk, shards = 16, 4
    step = make_indexer_step([240], g, heads=16, topk=topk, entries_per_page=32)
    scores = _oracle_scores(step)[0]
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    kth = ranked[topk - 1]
    # copies of the k-th entry in every shard's range (60 entries each), below the k-th
    targets = [j for j in ranked[topk:] if j != kth]
    picked = []
    for r in range(shards):
        inside = [j for j in targets if 60 * r <= j < 60 * (r + 1)]
        picked += inside[-1:]
    for dst in picked:
        _copy_entry(step, 0, kth, dst)
    tied, kept = _tie_pick(step, 0, scores[kth], topk)
    assert len(tied) >= 3 and 1 <= len(kept) < len(tied), (seed, tied, kept)
    merged = _merged(_candidates(step, topk, shards, 256), topk, shards)
    _same_sets(merged, _whole(step, topk, 256), step.lens, f"seed {seed}")
    assert sorted(set(merged[0].tolist()) & set(tied)) == kept, "lowest position first"


def test_a_row_shard_is_the_whole_steps_rows() -> None:
    """``row_offset`` without ``row_req``: rows ``a .. b`` of a step computed alone, their
    requests ``(a + t) // rows_per_request``, equal those rows of the whole step."""
    seed = fresh_seed()
    g = generator(seed)
    topk, per = 32, 3
    step = make_indexer_step([90, 150, 33], g, heads=16, topk=topk, rows_per_request=per)
    whole = torch.full((9, topk), POISON, dtype=torch.int32)
    dk.indexer_decode_topk(step.q, step.weights, step.cache, step.lens, None, step.block_table,
                           topk, whole, max_entries=160, rows_per_request=per)  # fmt: skip
    for a, b in ((0, 4), (4, 8), (8, 9), (2, 7)):
        part = torch.full((b - a + 1, topk), POISON, dtype=torch.int32)
        dk.indexer_decode_topk(step.q[a:b], step.weights[a:b], step.cache, step.lens[a:b], None,
                               step.block_table, topk, part, max_entries=160,
                               rows_per_request=per, row_offset=a)  # fmt: skip
        _same_sets(part[: b - a], whole[a:b], step.lens[a:b], f"seed {seed}, rows {a}..{b}")
        assert bool((part[b - a :] == POISON).all())


def test_the_merge_equals_the_reference_merge_on_any_candidates() -> None:
    """Random candidate lists as shards give them (shard ``r``'s entries in a range above
    shard ``r - 1``'s, listed by score with equal scores lowest position first; holes of
    -1 anywhere; scores from a handful of values, so ties across shards are the rule)
    through the kernel and the reference merge: both equal the top-k spelled out."""
    seed = fresh_seed()
    g = generator(seed)
    shards, T, topk, span = 5, 6, 8, 40
    idx = torch.empty((shards, T, topk), dtype=torch.int32)
    val = torch.randint(0, 6, idx.shape, generator=g).to(torch.float32)
    for r in range(shards):
        for t in range(T):
            pos = r * span + torch.randperm(span, generator=g)[:topk]
            order = sorted(range(topk), key=lambda i: (-float(val[r, t, i]), int(pos[i])))
            idx[r, t] = pos[order].to(torch.int32)
            val[r, t] = val[r, t, order]
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    val[idx < 0] = float("-inf")
    cand = torch.cat([idx, val.view(torch.int32)], dim=2).reshape(shards * T, 2 * topk)
    got = _merged(cand, topk, shards)
    want = ref.merge_topk(cand, topk, shards)
    for t in range(T):
        pairs = [(float(val[r, t, s]), int(idx[r, t, s])) for r in range(shards)
                 for s in range(topk) if idx[r, t, s] >= 0]  # fmt: skip
        best = sorted(pairs, key=lambda p: (-p[0], p[1]))[:topk]
        expect = sorted(j for _, j in best) + [-1] * (topk - len(best))
        assert sorted(got[t].tolist(), key=lambda j: (j < 0, j)) == expect, f"seed {seed} row {t}"
        assert sorted(want[t].tolist(), key=lambda j: (j < 0, j)) == expect, f"seed {seed} row {t}"


def test_bad_shard_input_is_named() -> None:
    g = generator(fresh_seed())
    s = make_indexer_step([40], g, heads=16, topk=8)
    args = (s.q, s.weights, s.cache, s.lens, s.row_req, s.block_table, 8)
    packed = torch.zeros((1, 16), dtype=torch.int32)
    with pytest.raises(ValueError, match="shard must be"):
        dk.indexer_shard_topk(*args, packed, shard=2, shards=2, max_entries=40)
    with pytest.raises(ValueError, match="shards must be"):
        dk.indexer_shard_topk(*args, packed, shard=0, shards=0, max_entries=40)
    with pytest.raises(ValueError, match=r"out must be \[>= 1, >= 16\]"):
        dk.indexer_shard_topk(*args, packed[:, :8], shard=0, shards=2, max_entries=40)
    with pytest.raises(ValueError, match="scores must be"):
        dk.indexer_shard_topk(*args, packed, shard=0, shards=2, max_entries=40,
                              scores=torch.zeros(1, 19))  # fmt: skip
    out = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="candidates must be"):
        dk.indexer_merge_topk(torch.zeros((3, 16), dtype=torch.int32), 8, out, shards=2)
    with pytest.raises(ValueError, match="candidates must be"):
        dk.indexer_merge_topk(torch.zeros((4, 12), dtype=torch.int32), 8, out, shards=2)
    with pytest.raises(ValueError, match="out must be"):
        dk.indexer_merge_topk(torch.zeros((4, 16), dtype=torch.int32), 8, out, shards=2,
                              clear_rows=3)  # fmt: skip
    with pytest.raises(ValueError, match="row_offset"):
        dk.indexer_decode_topk(*args, out, max_entries=40, row_offset=-1)
