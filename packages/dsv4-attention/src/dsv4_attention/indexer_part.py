"""The runtime's lightning-indexer part: decisions, the scores scratch and the decode step.

One per engine, held by :class:`~dsv4_attention.runtime.HeadExactRuntime` (whose access
to vLLM, table, switches, memory pool and warnings it shares), under the same rules as
the attention:

* **Decided at start-up, all-or-nothing per indexer kind** (compress ratio, index heads,
  top-k): at an indexer's first call, in vLLM's memory profile run, its facts are read
  once (:class:`~dsv4_attention.facts.IndexerFacts`), the policy decides from the GPU's
  measured table (``policy.indexer_choice``), the scores scratch is reserved inside the
  engine's workspace pool (so vLLM's profile counts it), both kernels are compiled on a
  tiny batch, and one line says what the kind runs and why.
* **Steps.**  A decode-only step whose rows vLLM lays out uniformly (one block-table row
  per request, or per row where vLLM flattened MTP rows) and whose row count the table
  measured faster runs ours into vLLM's top-k buffer; everything else (a prefill in the
  step, vLLM's padded or varlen layouts, more rows than the scratch holds) runs vLLM's
  own op with the same arguments.  What decides is fixed for a CUDA graph (the row count,
  the layout), so a captured graph replays the same choice.
* **Errors.**  An exception of ours outside capture runs vLLM's op for that call and
  every later one of the kind, with one warning; under capture it propagates (vLLM's
  start-up fails instead of a request).
* **Tensor parallelism** (issue 40, :mod:`.indexer_tp`).  Under TP the kind may also
  split a step across vLLM's TP group, by rows or by keys, where the table measured
  that split faster at this TP size (``policy.indexer_mode`` picks, per row count, the
  fastest of vLLM's, ours replicated and the splits).  Whether a kind may split is
  agreed by every rank of the group at start-up; a split step runs the same on every
  rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from . import indexer_tp, policy, vllm_calls
from .facts import IndexerFacts
from .indexer_tp import TpShare
from .policy import Choice
from .scratch import workspace_locked, workspace_pool

__all__ = ["IndexerPart", "IndexerState"]


@dataclass
class IndexerState:
    """What one indexer kind runs, decided once."""

    facts: IndexerFacts
    choice: Choice
    warmup_seconds: float = 0.0
    share: TpShare | None = None  # the TP group it may split across (agreed at start-up)
    tp_note: str = ""  # why it does not split, where TP > 1


class IndexerPart:
    """The indexer decisions and scratch of one engine's runtime (module docstring)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.kinds: dict[tuple[int, int, int], IndexerState] = {}
        self.scores: torch.Tensor | None = None  # flat float32 scores scratch
        self.local: torch.Tensor | None = None  # flat int32: a rank's part of a split step
        self.captured = False  # a step of ours was captured into a CUDA graph
        self._refusal = "no indexer scratch reserved"

    # --- decisions ---------------------------------------------------------------------

    def facts(self, indexer: Any) -> IndexerFacts:
        """The indexer's facts, read on first contact and kept on the module."""
        held = getattr(indexer, "_dsv4_indexer_facts", None)
        if not isinstance(held, IndexerFacts):
            held = IndexerFacts.read(indexer, self.runtime.serving)
            indexer._dsv4_indexer_facts = held
        return held

    def state(self, indexer: Any, device: torch.device) -> IndexerState:
        """This indexer's kind decision, made (reserving, warming up, logging) at first
        contact."""
        facts = self.facts(indexer)
        state = self.kinds.get(facts.key)
        if state is None:
            state = self._decide(facts, device)
            self.kinds[facts.key] = state
        return state

    def _decide(self, facts: IndexerFacts, device: torch.device) -> IndexerState:
        rt = self.runtime
        share, why = indexer_tp.read_tp(rt.access.tp_group(), rt.serving, device)
        tp = share.size if share is not None else 1
        choice = policy.indexer_choice(
            facts, rt.device, rt.table, rt.switches, tp, rt.serving.max_model_len
        )
        modes = self._modes(facts, tp) if choice.ours else set()
        if choice.ours:
            choice = self._fits(facts, device, modes, tp) or choice
        state = IndexerState(facts, choice, tp_note=why)
        if choice.ours:
            self._warm_up(state, device)
        if share is not None:  # every rank of the group is here (the same first call)
            self._agree_split(state, share, modes, device)
        rt.access.info(self.describe(state))
        return state

    def _modes(self, facts: IndexerFacts, tp: int) -> set[str]:
        """The ways this kind was measured faster somewhere (``ours`` replicated, or a
        split at this TP size)."""
        rt = self.runtime
        assert rt.table is not None and rt.table.indexer is not None
        t = rt.table.indexer
        rows = {"ours": t.row(facts.heads, facts.topk)}
        for split in indexer_tp.SPLITS if tp > 1 else ():
            rows[split] = t.split_row(tp, facts.heads, facts.topk, split, rt.serving.max_model_len)
        return {m for m, row in rows.items() if row and any(x > t.min_ratio for x in row.values())}

    def _agree_split(
        self, state: IndexerState, share: TpShare, modes: set[str], device: torch.device
    ) -> None:
        """Whether the kind splits: this rank may (ours taken, a split measured faster,
        its kernels compiled) and every rank of the group says so; then one exchange
        through vLLM's TP group, so its first use is not a step."""
        ok = state.choice.ours and bool(modes & set(indexer_tp.SPLITS))
        if ok:
            ok = self._warm_up_split(state, share, device)
        if not indexer_tp.agree(share, ok):
            state.tp_note = f"{share.text}: not split (not measured faster, or a rank could not)"
            return
        share.group.all_gather(torch.zeros((1, 2), device=device), dim=0)
        state.share = share
        state.tp_note = f"{share.text}: split where measured faster"

    def describe(self, state: IndexerState) -> str:
        """The one log line of an indexer kind's decision."""
        f = state.facts
        who = "ours" if state.choice.ours else "vLLM's"
        # under TP, whether it splits and why (nothing where there is no TP group)
        quiet = ("", "TP1", "no tensor-parallel group")
        tp = "" if state.tp_note in quiet else f"; {state.tp_note}"
        return (
            f"dsv4-attention: lightning indexer (ratio {f.compress_ratio}, {f.heads} index "
            f"heads, top-{f.topk}), {self.runtime.serving.model_text}: decode {who} "
            f"({state.choice.reason}{tp}); prefill vLLM's"
        )

    # --- memory ------------------------------------------------------------------------

    @staticmethod
    def _needs(facts: IndexerFacts, modes: set[str], tp: int) -> tuple[int, int]:
        """(float32 scores, int32 candidate elements) the kind's largest step needs in
        the ways it may run."""
        scores = facts.max_rows * max(facts.max_entries, 1) if "ours" in modes else 0
        local = 0
        if tp > 1:
            for split, (s, c) in indexer_tp.split_elements(facts, tp).items():
                if split in modes:
                    scores, local = max(scores, s), max(local, c)
        return scores, local

    def _fits(
        self, facts: IndexerFacts, device: torch.device, modes: set[str], tp: int
    ) -> Choice | None:
        """Reserve the scratch at the first kind that takes ours (vLLM's profile run);
        None when it holds this kind's largest step."""
        rt = self.runtime
        scores, local = self._needs(facts, modes, tp)
        if self.scores is None:
            if facts.max_rows <= 0 or facts.max_entries <= 0:
                return Choice(False, "the largest decode step or context is not known")
            manager = rt.workspace_manager()
            if workspace_locked(manager):
                self._refusal = (
                    "no indexer scratch could be reserved (vLLM's workspace was locked "
                    "before the indexer's first call)"
                )
                return Choice(False, self._refusal)
            try:
                with workspace_pool(manager):
                    self.scores = torch.empty(scores, dtype=torch.float32, device=device)
                    self.local = torch.empty(local, dtype=torch.int32, device=device)
            except Exception as exc:  # out of memory, ...
                self.scores = self.local = None
                self._refusal = f"no indexer scratch could be reserved ({exc})"
                return Choice(False, self._refusal)
            rt.reserved["indexer"] = 4 * (scores + local)
            rt.access.info(rt.memory_line())
        assert self.local is not None
        if scores > self.scores.numel() or local > self.local.numel():
            return Choice(
                False,
                f"the indexer scratch holds {self.scores.numel()} scores and "
                f"{self.local.numel()} candidates, this kind needs {scores} and {local}",
            )
        return None

    def release(self) -> bool:
        """Drop the scores scratch (False: there was none, or a captured graph uses it)."""
        if self.scores is None or self.captured:
            return False
        self.scores = self.local = None
        return True

    def takes_any(self) -> bool:
        return any(st.choice.ours for st in self.kinds.values())

    def _warm_up(self, state: IndexerState, device: torch.device) -> None:
        """Compile both kernels as serving launches them (vLLM's page size, the top-k, rows
        by request) on a tiny batch; a failure declines the kind."""
        from dsv4_kernels import indexer_decode_topk

        f = state.facts
        began = time.perf_counter()
        try:
            entries = max(f.page_entries, 1)
            n = min(f.max_entries, f.topk + 1, 2 * entries)
            cache = torch.zeros((2, entries, f.head_dim + 4), dtype=torch.uint8, device=device)
            q = torch.zeros((1, f.heads, f.head_dim), device=device).to(torch.float8_e4m3fn)
            weights = torch.zeros((1, f.heads), dtype=torch.float32, device=device)
            lens = torch.full((1,), n, dtype=torch.int32, device=device)
            table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
            out = torch.empty((2, f.topk), dtype=torch.int32, device=device)
            assert self.scores is not None
            indexer_decode_topk(q, weights, cache, lens, None, table, f.topk, out,
                                max_entries=n, scores=self.scores[: n].view(1, n),
                                clear_rows=2)  # fmt: skip
        except Exception as exc:
            state.choice = Choice(False, f"its warm-up failed: {type(exc).__name__}: {exc}")
        state.warmup_seconds = time.perf_counter() - began

    def _warm_up_split(self, state: IndexerState, share: TpShare, device: torch.device) -> bool:
        """Compile a split step's kernels (a row share, a key share, the merge of this
        rank's candidates alone) on a tiny batch, without the exchange: a failure
        here is this rank's, and the agreement that follows keeps every rank whole."""
        from dsv4_kernels import indexer_decode_topk, indexer_merge_topk, indexer_shard_topk

        f = state.facts
        began = time.perf_counter()
        try:
            assert self.scores is not None and self.local is not None
            entries = max(f.page_entries, 1)
            n = min(f.max_entries, f.topk + 1, 2 * entries)
            cache = torch.zeros((2, entries, f.head_dim + 4), dtype=torch.uint8, device=device)
            q = torch.zeros((1, f.heads, f.head_dim), device=device).to(torch.float8_e4m3fn)
            weights = torch.zeros((1, f.heads), dtype=torch.float32, device=device)
            lens = torch.full((1,), n, dtype=torch.int32, device=device)
            # one block-table row per rank: the row share's row ``rank`` reads its own
            table = torch.tensor([[0, 1]] * share.size, dtype=torch.int32, device=device)
            args = (q, weights, cache, lens, None, table, f.topk)
            out = torch.empty((2, 2 * f.topk), dtype=torch.int32, device=device)
            indexer_decode_topk(*args, out, max_entries=n, scores=self.scores[:n].view(1, n),
                                row_offset=share.rank)  # fmt: skip
            w = -(-n // share.size)
            indexer_shard_topk(*args, out[:1], shard=share.rank, shards=share.size,
                               max_entries=n, scores=self.scores[:w].view(1, w))  # fmt: skip
            indexer_merge_topk(out[:1], f.topk, out[1:], shards=1)
        except Exception as exc:
            state.tp_note = f"{share.text}: the split's warm-up failed: {type(exc).__name__}"
            return False
        finally:
            state.warmup_seconds += time.perf_counter() - began
        return True

    # --- steps --------------------------------------------------------------------------

    def run(
        self,
        layer: Any,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor,
    ) -> bool:
        """Run our decode indexer for this layer's step where it applies; False: vLLM's op
        must run (module docstring)."""
        rt = self.runtime
        indexer = getattr(layer, "indexer", None)
        if indexer is None:
            return False
        facts: IndexerFacts | None = None
        try:
            state = self.state(indexer, hidden_states.device)
            facts = state.facts
            metadata = getattr(rt.access.forward_context(), "attn_metadata", None)
            if isinstance(metadata, dict):
                rt.settle()  # the first step after vLLM's profile run releases
            if not state.choice.ours or index_q_scale is not None or rt.access.dual_batch():
                return False
            op = indexer.indexer_op
            step = vllm_calls.indexer_step(op, metadata)
            if step is None or self.scores is None or step.rows > facts.max_rows:
                return False
            assert rt.table is not None
            share = state.share
            mode = policy.indexer_mode(
                rt.table.indexer, facts.heads, facts.topk, step.rows,
                share.size if share is not None else 1, rt.serving.max_model_len,
            )  # fmt: skip
            padded = int(hidden_states.shape[0])
            if mode == "vllm":
                return False
            if mode == "ours":
                width = max(facts.max_entries, 1)
                scores = self.scores[: facts.max_rows * width].view(facts.max_rows, width)
                vllm_calls.run_indexer(facts, step, op, index_q, index_weights, padded, scores)
            else:
                assert share is not None and self.local is not None
                indexer_tp.run_split(
                    mode, share, facts, q=index_q, weights=index_weights,
                    cache=op.k_cache.kv_cache, lens=step.lens, block_table=step.block_table,
                    rows=step.rows, rows_per_request=step.rows_per_request,
                    out=op.topk_indices_buffer, padded_rows=padded, scores=self.scores,
                    local=self.local,
                )  # fmt: skip
            if rt.access.capturing():
                self.captured = True  # the graph replays with the scratch: keep it
            return True
        except Exception as exc:
            if rt.access.capturing():
                raise
            return self._failed(facts, exc)

    def _failed(self, facts: IndexerFacts | None, exc: BaseException) -> bool:
        """A step of ours raised outside capture: the kind's indexer goes back to vLLM for
        the rest of the run, with one warning; False (vLLM's op runs)."""
        rt = self.runtime
        if facts is not None and facts.key in self.kinds:
            self.kinds[facts.key].choice = Choice(False, f"raised {type(exc).__name__}")
            if rt.settled:
                rt.release_unused()
        rt.warn_once(
            f"indexer/{None if facts is None else facts.key}",
            f"dsv4-attention: the decode indexer raised {type(exc).__name__}: {exc}; this and "
            "later steps take vLLM's own indexer there",
        )
        return False
