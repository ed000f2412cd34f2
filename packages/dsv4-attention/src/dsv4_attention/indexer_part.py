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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from . import policy, vllm_calls
from .facts import IndexerFacts
from .policy import Choice
from .scratch import workspace_locked, workspace_pool

__all__ = ["IndexerPart", "IndexerState"]


@dataclass
class IndexerState:
    """What one indexer kind runs, decided once."""

    facts: IndexerFacts
    choice: Choice
    warmup_seconds: float = 0.0


class IndexerPart:
    """The indexer decisions and scratch of one engine's runtime (module docstring)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.kinds: dict[tuple[int, int, int], IndexerState] = {}
        self.scores: torch.Tensor | None = None
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
        choice = policy.indexer_choice(facts, rt.device, rt.table, rt.switches)
        if choice.ours:
            choice = self._fits(facts, device) or choice
        state = IndexerState(facts, choice)
        if choice.ours:
            self._warm_up(state, device)
        rt.access.info(self.describe(state))
        return state

    def describe(self, state: IndexerState) -> str:
        """The one log line of an indexer kind's decision."""
        f = state.facts
        who = "ours" if state.choice.ours else "vLLM's"
        return (
            f"dsv4-attention: lightning indexer (ratio {f.compress_ratio}, {f.heads} index "
            f"heads, top-{f.topk}), {self.runtime.serving.model_text}: decode {who} "
            f"({state.choice.reason}); prefill vLLM's"
        )

    # --- memory ------------------------------------------------------------------------

    def _fits(self, facts: IndexerFacts, device: torch.device) -> Choice | None:
        """Reserve the scores scratch at the first kind that takes ours (vLLM's profile
        run); None when it holds this kind's largest step."""
        rt = self.runtime
        if self.scores is None:
            if facts.max_rows <= 0 or facts.max_entries <= 0:
                return Choice(False, "the largest decode step or context is not known")
            manager = rt._manager()
            if workspace_locked(manager):
                self._refusal = (
                    "no indexer scratch could be reserved (vLLM's workspace was locked "
                    "before the indexer's first call)"
                )
                return Choice(False, self._refusal)
            try:
                with workspace_pool(manager):
                    self.scores = torch.empty(
                        (facts.max_rows, facts.max_entries), dtype=torch.float32, device=device
                    )
            except Exception as exc:  # out of memory, ...
                self._refusal = f"no indexer scratch could be reserved ({exc})"
                return Choice(False, self._refusal)
            rt.reserved["indexer"] = facts.scores_bytes
            rt.access.info(rt.memory_line())
        rows, width = self.scores.shape
        if facts.max_rows > rows or facts.max_entries > width:
            return Choice(
                False,
                f"the indexer scratch holds {rows} rows of {width} scores, this kind needs "
                f"{facts.max_rows} of {facts.max_entries}",
            )
        return None

    def release(self) -> bool:
        """Drop the scores scratch (False: there was none, or a captured graph uses it)."""
        if self.scores is None or self.captured:
            return False
        self.scores = None
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
                                max_entries=n, scores=self.scores, clear_rows=2)  # fmt: skip
        except Exception as exc:
            state.choice = Choice(False, f"its warm-up failed: {type(exc).__name__}: {exc}")
        state.warmup_seconds = time.perf_counter() - began

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
            if not rt._settled and isinstance(metadata, dict):
                rt._release_unused()  # the first step after vLLM's profile run
            if not state.choice.ours or index_q_scale is not None or rt.access.dual_batch():
                return False
            op = indexer.indexer_op
            step = vllm_calls.indexer_step(op, metadata)
            if step is None or self.scores is None or step.rows > self.scores.shape[0]:
                return False
            assert rt.table is not None
            if not policy.indexer_faster(rt.table.indexer, facts.heads, facts.topk, step.rows):
                return False
            vllm_calls.run_indexer(
                facts,
                step,
                op,
                index_q,
                index_weights,
                int(hidden_states.shape[0]),
                self.scores,
            )
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
            if rt._settled:
                rt._release_unused()
        rt._warn_once(
            f"indexer/{None if facts is None else facts.key}",
            f"dsv4-attention: the decode indexer raised {type(exc).__name__}: {exc}; this and "
            "later steps take vLLM's own indexer there",
        )
        return False
