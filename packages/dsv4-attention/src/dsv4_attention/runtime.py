"""The plugin's runtime object, one per engine: decisions, scratch, warm-ups and step state.

:class:`HeadExactRuntime` is built by the plugin when vLLM first builds a
DeepSeek-V4 attention layer.  It holds everything the head-exact paths need
across layers and steps, so there is no module state anywhere else:

* **Decisions, at start-up, all-or-nothing per layer kind.**  The first time a
  layer kind (SWA-only, C4A, C128A at its local head count) is seen -- in
  vLLM's memory profile run, before any request -- its facts are read once
  (:class:`~dsv4_attention.facts.LayerFacts`), the policy decides prefill and
  decode (``dsv4_attention.policy``, from the GPU's measured table), the
  kernels are compiled on a tiny batch within the token budget, and one log
  line says what the kind runs and why.  Whatever fails there (a scratch that
  cannot be reserved, a compile error, a kernel that does not build its fast
  variant) leaves that kind on vLLM's path for the whole run.
* **Scratch where vLLM keeps its workspace.**  Both scratches are reserved once,
  at the first layer (in vLLM's profile run, so its memory profile counts them),
  inside the allocation context of the engine's workspace manager (sleep mode's
  discarded pool), sized for the widest row and the largest step vLLM can schedule
  under the configuration (the token budget; DSpark's wider drafter rows); the
  bytes are logged once; a scratch no kind takes is released after the profile
  run.
* **Steps.**  A step's prefill plan (index rows shared by the layers of a kind)
  is keyed on vLLM's forward context, not on a metadata object (DSV4's two
  window KV-cache groups each get their own); its rows are keyed by each layer's
  own table, window and window floor, read from the layer's own metadata.  Any
  exception from our path in a step that is not being captured into a CUDA graph
  sends the call to vLLM's own method, logs one warning, and leaves that kind on
  vLLM's path from then on; under capture it propagates, so it fails vLLM's
  start-up instead of a request.

Design: ``docs/design.md`` (the runtime object and its decisions).

One module on purpose (over 500 lines): the runtime's state (kinds, scratch, step,
warnings) and the attention class it builds are one unit that every step touches;
its decisions (``policy``), facts (``facts``) and vLLM argument mapping
(``vllm_calls``) already live elsewhere.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import policy, vllm_calls
from .binding import LayerBinding
from .facts import FAMILY_RATIOS, LayerFacts, ServingConfig
from .indexer_part import IndexerPart
from .policy import Choice, Device, Switches
from .scratch import PrefillScratch, scratch_bytes, workspace_locked, workspace_pool
from .tables import MeasuredTable

__all__ = ["HeadExactRuntime", "KindState", "VllmAccess"]


def _never() -> bool:
    return False


def _nothing() -> Any:
    return None


def _view_key(view: Any) -> tuple[Any, ...] | None:
    """What identifies a cache view vLLM binds to a layer (its memory and shape)."""
    if not isinstance(view, torch.Tensor):
        return None if view is None else (id(view),)
    return (view.data_ptr(), tuple(view.shape), tuple(view.stride()))


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class VllmAccess:
    """How the runtime reaches vLLM (set by the plugin from the release's facts; tests
    pass their own): the current forward context or None, the workspace manager or
    None, vLLM's logger, whether dual-batch overlap is running, whether the
    current stream is being captured into a CUDA graph, and vLLM's tensor-parallel
    group of this rank (its ``GroupCoordinator``) or None."""

    forward_context: Callable[[], Any] = _nothing
    workspace: Callable[[], Any] = _nothing
    info: Callable[[str], None] = print
    warning: Callable[[str], None] = print
    dual_batch: Callable[[], bool] = _never
    capturing: Callable[[], bool] = _capturing
    tp_group: Callable[[], Any] = _nothing


@dataclass
class KindState:
    """What one layer kind runs, decided once."""

    facts: LayerFacts
    prefill: Choice
    decode: Choice
    warmup_seconds: float = 0.0
    # where ours is not taken: vLLM's own V4 prefill at the real heads (``native``)
    native: Choice = field(default_factory=lambda: Choice(False, "not decided"))
    # the decode launch entries the table's head row was measured with (None: defaults)
    decode_policy: Mapping[str, int] | None = None


@dataclass
class _Step:
    """One forward pass: its plan (rows shared by the layers that share a table, a
    window and a window floor) and what is read once per metadata object."""

    owner: Any = None  # weakref to the forward context (or metadata) of the step
    dict_id: int | None = None
    plan: Any = None
    batch: tuple[int, int, int] | None = None  # the plan's (decodes, prefills, tokens)
    mean_keys: dict[tuple[int, int, int], float] = field(default_factory=dict)
    # id(window metadata) -> (that metadata, held so its id stays its own; its floor)
    floors: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    def floor(self, swa_metadata: Any) -> Any:
        """The window floor of this metadata object (computed once per step)."""
        held = self.floors.get(id(swa_metadata))
        if held is None or held[0] is not swa_metadata:
            held = (swa_metadata, vllm_calls.window_floor(swa_metadata))
            self.floors[id(swa_metadata)] = held
        return held[1]

    def plan_for(self, swa_metadata: Any, scratch: Any) -> Any:
        """The step's plan for the batch this metadata describes: one per forward
        context; a metadata object describing another batch (never seen from vLLM)
        gets a plan of its own, which takes over the scratch (stream order: the rows
        of the previous plan were read by the layers launched before)."""
        batch = vllm_calls.prefill_batch(swa_metadata)
        if self.plan is None or self.batch != batch:
            self.plan = vllm_calls.prefill_plan(swa_metadata, scratch)
            self.batch = batch
        return self.plan


class HeadExactRuntime:
    """Everything the plugin decides and holds for one engine (module docstring).

    Args:
        serving: the served configuration, read once from vLLM's config.
        device: the GPU as vLLM's platform reports it.
        table: the GPU's measured table (None: nothing is taken over).
        switches: the environment switches, read once.
        access: how to reach vLLM.
    """

    def __init__(
        self,
        serving: ServingConfig,
        device: Device,
        table: MeasuredTable | None,
        switches: Switches,
        access: VllmAccess | None = None,
    ) -> None:
        self.serving = serving
        self.device = device
        self.table = table
        self.switches = switches
        self.access = access or VllmAccess()
        self.kinds: dict[tuple[int, int], KindState] = {}
        self.prefill_scratch: PrefillScratch | None = None
        self.decode_scratch: Any = None
        self.reserved: dict[str, int] = {}
        self._prefill_refusal = "no prefill scratch reserved"
        self._decode_refusal = "no decode scratch reserved"
        self._reserved_once = False
        self._decode_limits: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._step = _Step()
        self._warned: set[str] = set()
        self._captured = False  # a decode of ours was captured into a CUDA graph
        self._settled = False  # a step with metadata ran (vLLM's profile run is over)
        self.indexers = IndexerPart(self)  # the lightning indexer's decisions and scratch
        # C128A rows read through the compressed block table where this GPU's table says
        # it was measured (dsv4_kernels.BlockRows): no [tokens, entries] rows reserved
        self._c128a_blocks = table is not None and table.prefill.c128a_block_rows

    # --- facts and decisions --------------------------------------------------------

    def facts(self, layer: Any) -> LayerFacts:
        """The layer's facts, read on first contact and kept on the layer."""
        held = getattr(layer, "_dsv4_facts", None)
        if not isinstance(held, LayerFacts):
            held = LayerFacts.read(layer, self.serving)
            layer._dsv4_facts = held
        return held

    def _model_kinds(self, facts: LayerFacts) -> list[LayerFacts]:
        """The facts of every DSV4 layer kind at this layer's heads and widths (the
        model's other kinds share them: one top-k buffer, one context length; the
        model's indexer top-k where this layer holds no top-k buffer)."""
        topk = facts.topk or self.serving.index_topk
        return [
            dataclasses.replace(facts, compress_ratio=r, topk=topk)
            for r in FAMILY_RATIOS[facts.family]
        ]

    def kind_state(self, layer: Any, q: torch.Tensor) -> KindState:
        """This layer's kind decision, made (reserving, warming up, logging) at first
        contact."""
        facts = self.facts(layer)
        key = (facts.compress_ratio, facts.heads)
        state = self.kinds.get(key)
        if state is None:
            state = self._decide(facts, q)
            self.kinds[key] = state
        return state

    def _decide(self, facts: LayerFacts, q: torch.Tensor) -> KindState:
        if not self._reserved_once:
            self._reserved_once = True
            self._reserve(facts, q)
        prefill = policy.prefill_choice(facts, self.device, self.table, self.switches)
        decode = policy.decode_choice(facts, self.device, self.table, self.switches)
        if prefill.ours:
            prefill = self._fits_prefill(facts) or prefill
        if decode.ours:
            decode = self._fits_decode(facts) or decode
        native = policy.native_prefill_choice(facts, self.device, self.table, self.switches)
        kernels = None if self.table is None else self.table.decode.kernel_policy(facts.heads)
        state = KindState(facts, prefill, decode, native=native, decode_policy=kernels)
        if prefill.ours or decode.ours:
            self._warm_up(state, q.device)
        self.access.info(self.describe(state))
        return state

    def describe(self, state: KindState) -> str:
        """The one log line of a layer kind's decision."""
        f = state.facts
        parts = []
        for what, choice in (("prefill", state.prefill), ("decode", state.decode)):
            who = "ours" if choice.ours else "vLLM's"
            parts.append(f"{what} {who} ({choice.reason})")
        if state.native.ours:
            parts.append(
                f"vLLM's prefill, where it runs, at the real {f.heads} heads "
                f"({state.native.reason})"
            )
        return (
            f"dsv4-attention: {f.kind_text} layers, {f.heads} local heads, "
            f"{self.serving.model_text}: " + "; ".join(parts)
        )

    # --- memory ------------------------------------------------------------------------

    def workspace_manager(self) -> Any:
        """This engine's vLLM workspace manager (None before vLLM made it)."""
        return self.access.workspace()

    def _reserve(self, facts: LayerFacts, q: torch.Tensor) -> None:
        """Reserve both scratches once, for every kind the policy may hand us, in vLLM's
        profile run (a locked workspace leaves the kinds on vLLM's path)."""
        kinds = self._model_kinds(facts)
        prefill = [
            f
            for f in kinds
            if policy.prefill_choice(f, self.device, self.table, self.switches).ours
        ]
        decode = [
            f for f in kinds if policy.decode_choice(f, self.device, self.table, self.switches).ours
        ]
        manager = self.workspace_manager()
        if workspace_locked(manager):
            refusal = "vLLM's workspace was locked before this layer's first call"
            self._prefill_refusal = f"no prefill scratch could be reserved ({refusal})"
            self._decode_refusal = f"no decode scratch could be reserved ({refusal})"
            self.access.info(f"dsv4-attention: no scratch could be reserved ({refusal})")
            return
        if prefill:
            from dsv4_kernels import sparse_mla

            group = sparse_mla.prefill_group_size(q[:1, : facts.heads])
            spec = policy.prefill_scratch_spec(prefill, group, self._c128a_blocks)
            try:
                with workspace_pool(manager):
                    self.prefill_scratch = PrefillScratch(spec, device=q.device)
                self.reserved["prefill"] = scratch_bytes(spec)
            except Exception as exc:  # out of memory, ...
                self._prefill_refusal = f"no prefill scratch could be reserved ({exc})"
                self.access.info(f"dsv4-attention: {self._prefill_refusal}")
        if decode:
            try:
                with workspace_pool(manager):
                    self.decode_scratch = self._decode_buffers(decode, q.device)
                self.reserved["decode"] = 4 * int(self.decode_scratch.sizes.total)
            except Exception as exc:
                self._decode_refusal = f"no decode scratch could be reserved ({exc})"
                self.access.info(f"dsv4-attention: {self._decode_refusal}")
        if self.reserved:
            self.access.info(self.memory_line())

    def memory_line(self) -> str:
        """The once-per-engine line of reserved bytes (as vLLM logs its KV cache); where
        vLLM sizes the KV cache from ``--kv-cache-memory-bytes`` instead of its profile,
        it says how much to leave free for this scratch."""
        mib = {k: v / (1 << 20) for k, v in self.reserved.items() if v}
        total = sum(mib.values())
        what = ", ".join(f"{k} scratch {v:.2f} MiB" for k, v in mib.items()) or "nothing"
        if "prefill" in mib and self._c128a_blocks:
            what += ", C128A rows read through vLLM's block table"
        s = self.serving
        line = (
            f"dsv4-attention: reserved {total:.2f} MiB per GPU in vLLM's profile run, in its "
            f"workspace memory pool ({what}; budget {s.max_num_batched_tokens} tokens, "
            f"max_model_len {s.max_model_len}, widest decode window row "
            f"{s.decode_window_width})"
        )
        if s.kv_cache_memory_bytes is not None:
            line += (
                f"; --kv-cache-memory-bytes is set, so vLLM sized the KV cache without its "
                f"memory profile: leave {total:.2f} MiB per GPU free for this scratch "
                f"(lower the KV cache bytes by that much if the GPU is full)"
            )
        return line

    def release(self, what: str, reason: str) -> None:
        """Drop the ``what`` scratch (``"prefill"``/``"decode"``/``"indexer"``) and its bytes,
        with one line: nothing of ours will use it.  The decode and indexer scratches are
        kept once a step of ours was captured in a CUDA graph (the graph replays with it)."""
        if what == "decode" and self._captured:
            return
        if what == "indexer":
            if not self.indexers.release():
                return
        elif what == "prefill" and self.prefill_scratch is not None:
            self.prefill_scratch = None
            self._step = _Step()  # its plan held views of the scratch
        elif what == "decode" and self.decode_scratch is not None:
            self.decode_scratch = None
        else:
            return
        freed = self.reserved.pop(what, 0) / (1 << 20)
        self.access.info(f"dsv4-attention: released the {what} scratch ({freed:.2f} MiB): {reason}")

    @property
    def settled(self) -> bool:
        """Whether vLLM's profile run is over (a step with metadata ran)."""
        return self._settled

    def settle(self) -> None:
        """At the first step after vLLM's profile run: release what no kind takes."""
        if not self._settled:
            self.release_unused()

    def release_unused(self) -> None:
        """After vLLM's profile run (the first step with metadata), and whenever a kind is
        turned off later: release a scratch that no decided kind takes."""
        self._settled = True
        for what in ("prefill", "decode"):
            if not any(getattr(st, what).ours for st in self.kinds.values()):
                self.release(what, f"no layer kind runs our {what}")
        if not self.indexers.takes_any():
            self.release("indexer", "no indexer kind runs our decode indexer")

    def _decode_buffers(self, kinds: list[LayerFacts], device: torch.device) -> Any:
        from dsv4_kernels import decode_scratch_sizes, make_decode_scratch

        tokens, heads, row, window = policy.decode_limits(kinds)
        self._decode_limits = (tokens, heads, row, window)
        sizes = decode_scratch_sizes(tokens, heads, row, device, window=window)
        return make_decode_scratch(sizes, device)

    def _fits_prefill(self, facts: LayerFacts) -> Choice | None:
        """None when the reserved prefill scratch holds this kind's largest step."""
        if self.prefill_scratch is None:
            return Choice(False, self._prefill_refusal)
        spec = self.prefill_scratch.spec
        need = policy.prefill_scratch_spec([facts], spec.max_group, self._c128a_blocks)
        if spec.merged(need) != spec:
            return Choice(False, f"the prefill scratch was reserved for {spec}, not {need}")
        return None

    def _fits_decode(self, facts: LayerFacts) -> Choice | None:
        """None when the reserved decode scratch holds this kind's widest decode step."""
        if self.decode_scratch is None:
            return Choice(False, self._decode_refusal)
        need = policy.decode_limits([facts])
        if any(n > h for n, h in zip(need, self._decode_limits, strict=True)):
            return Choice(
                False,
                f"the decode scratch holds (tokens, heads, row, window) {self._decode_limits}, "
                f"this kind needs {need}",
            )
        return None

    def _warm_up(self, state: KindState, device: torch.device) -> None:
        """Compile this kind's kernels on a tiny batch within the token budget; a failure,
        or a Hopper kernel that fell back to its slow variant, declines the kind."""
        import time

        from dsv4_kernels.sparse_mla import wgmma_available

        from .warmup import warm_up_decode, warm_up_prefill

        f = state.facts
        began = time.perf_counter()
        try:
            if state.prefill.ours:
                warm_up_prefill(
                    device,
                    f.heads,
                    f.kernel_ratio,
                    f.topk or 512,
                    max_tokens=f.max_tokens,
                    topk_rows=f.topk_rows,
                    window=f.window,
                    c128a_blocks=self._c128a_blocks,
                    tiles=policy.prefill_tiles(f, self.table, self.switches),
                )
            if state.decode.ours:
                warm_up_decode(
                    device,
                    f.heads,
                    f.kernel_ratio,
                    f.decode_row_width,
                    self.decode_scratch,
                    tokens=policy.decode_warmup_tokens(f.max_tokens),
                    window_width=f.decode_window_width,
                    compressed=f.compressed,
                    policy=state.decode_policy,
                )
            if self.device.wgmma and not self.device.forced and not wgmma_available():
                raise RuntimeError("the Gluon wgmma kernel failed to build")
        except Exception as exc:
            reason = f"its warm-up failed: {type(exc).__name__}: {exc}"
            state.prefill = Choice(False, reason) if state.prefill.ours else state.prefill
            state.decode = Choice(False, reason) if state.decode.ours else state.decode
        state.warmup_seconds = time.perf_counter() - began

    # --- steps --------------------------------------------------------------------------

    def _step_state(self, swa_metadata: Any) -> _Step:
        """The shared state of the step ``swa_metadata`` belongs to: keyed on vLLM's
        forward context (one per forward pass) and its metadata dict; without a forward
        context (a layer driven by hand), on the metadata object."""
        ctx = self.access.forward_context()
        owner = ctx if ctx is not None else swa_metadata
        dict_id = id(getattr(ctx, "attn_metadata", None)) if ctx is not None else None
        held = self._step.owner
        if held is None or held() is not owner or self._step.dict_id != dict_id:
            try:
                ref: Callable[[], Any] = weakref.ref(owner)
            except TypeError:  # an object without weak references: held until the next step
                ref = lambda: owner  # noqa: E731
            self._step = _Step(ref, dict_id)
        return self._step

    def _step_mean_keys(self, facts: LayerFacts, swa_metadata: Any) -> float | None:
        """The step's mean C4A keys per token from vLLM's host copies of the lengths (no
        device synchronisation), once per step and row shape; None without them."""
        seq = getattr(swa_metadata, "prefill_seq_lens_cpu", None)
        qlen = getattr(swa_metadata, "prefill_query_lens_cpu", None)
        if seq is None or qlen is None or not facts.topk:
            return None
        step = self._step_state(swa_metadata)
        key = (facts.window, facts.topk, facts.compress_ratio)
        if key not in step.mean_keys:
            step.mean_keys[key] = policy.c4a_mean_keys(seq.tolist(), qlen.tolist(), *key)
        return step.mean_keys[key]

    def binding(
        self,
        layer: Any,
        facts: LayerFacts,
        q: torch.Tensor,
        swa_cache: Any,
        comp_cache: Any,
        swa_block_size: int,
        comp_block_size: int | None,
    ) -> LayerBinding | None:
        """This layer's binding (:class:`~dsv4_attention.binding.LayerBinding`) to the
        caches it holds: made once per layer and cache binding, checking that the caches
        have DSV4's FP8 page layout at vLLM's page sizes (``comp_block_size``: vLLM's
        metadata block size of the compressed cache, in tokens); None, with one line,
        where they do not (vLLM's attention runs)."""
        key = (
            _view_key(swa_cache),
            _view_key(comp_cache) if facts.compressed else None,
            swa_block_size,
            comp_block_size,
        )
        held = getattr(layer, "_dsv4_binding", None)
        if held is not None and held[0] == key:
            return held[1]
        problem = vllm_calls.cache_layout_problem(facts, swa_cache, swa_block_size, "window")
        slots = None
        if problem is None and facts.compressed:
            slots = None if comp_block_size is None else comp_block_size // facts.compress_ratio
            problem = vllm_calls.cache_layout_problem(facts, comp_cache, slots, "compressed")
        bound = None
        if problem is None:
            if facts.rows is None:
                problem = f"compress ratio {facts.compress_ratio} is not a DSV4 layer kind"
            else:
                try:
                    bound = LayerBinding.bind(
                        name=facts.name,
                        rows=facts.rows,
                        ratio=facts.kernel_ratio,
                        heads=facts.heads,
                        window_size=facts.window,
                        swa_cache=swa_cache,
                        swa_block_size=swa_block_size,
                        comp_cache=comp_cache if facts.compressed else None,
                        comp_block_size=slots,
                        scale=float(layer.scale),
                        q=q,
                        tiles=policy.prefill_tiles(facts, self.table, self.switches),
                    )
                except ValueError as exc:
                    problem = str(exc)
        layer._dsv4_binding = (key, bound)
        if problem is not None:
            self.access.info(
                f"dsv4-attention: {facts.name} keeps vLLM's attention (prefill and decode): "
                f"{problem}"
            )
        return bound

    def _failed(self, layer: Any, what: str, exc: BaseException) -> bool:
        """A step of ours raised outside capture: that kind's ``what`` goes back to vLLM
        for the rest of the run, with one warning; False (vLLM's method runs)."""
        facts = getattr(layer, "_dsv4_facts", None)
        kind = "an unknown layer kind"
        if isinstance(facts, LayerFacts):
            kind = f"{facts.kind_text} layers"
            state = self.kinds.setdefault(
                (facts.compress_ratio, facts.heads),
                KindState(facts, Choice(False, "not decided"), Choice(False, "not decided")),
            )
            reason = f"{what} raised {type(exc).__name__}"
            if what in ("prefill", "start-up"):
                state.prefill = Choice(False, reason)
            if what in ("decode", "start-up"):
                state.decode = Choice(False, reason)
            if self._settled:
                self.release_unused()
        self.warn_once(
            f"{what}/{kind}",
            f"dsv4-attention: the {what} of {kind} raised {type(exc).__name__}: {exc}; "
            f"this and later steps take vLLM's own {what} there",
        )
        return False

    def warn_once(self, key: str, text: str) -> None:
        """vLLM's warning ``text``, once per ``key`` in this process."""
        if key not in self._warned:
            self._warned.add(key)
            self.access.warning(text)

    def prefill(
        self,
        layer: Any,
        q: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        swa_metadata: Any,
    ) -> bool:
        """Run the head-exact prefill where it applies; False: vLLM's own must run."""
        try:
            self.settle()
            state = self.kind_state(layer, q)
            if not state.prefill.ours or self.access.dual_batch():
                return False
            if (
                getattr(swa_metadata, "prefill_left_visible", None) is not None
                or getattr(swa_metadata, "prefill_right_visible", None) is not None
            ):
                return False  # in-image visibility: vLLM's vision variant
            facts = state.facts
            assert self.table is not None
            mean = None
            limits = self.table.prefill
            if (
                facts.topk_rows
                and facts.heads > policy.prefill_heads_limit(facts, limits, self.switches)
                and policy.wide_prefill(facts, limits, self.switches) is None
            ):
                mean = self._step_mean_keys(facts, swa_metadata)
            if not policy.prefill_step_takes_ours(facts, self.table.prefill, self.switches, mean):
                return False
            comp_block = int(attn_metadata.block_size) if facts.compressed else None
            binding = self.binding(
                layer,
                facts,
                q,
                swa_k_cache,
                compressed_k_cache,
                int(swa_metadata.block_size),
                comp_block,
            )
            if binding is None:
                return False
            step = self._step_state(swa_metadata)
            vllm_calls.run_prefill(
                layer,
                binding,
                step.plan_for(swa_metadata, self.prefill_scratch),
                q,
                compressed_k_cache,
                swa_k_cache,
                output,
                attn_metadata,
                swa_metadata,
                step.floor(swa_metadata),
            )
            return True
        except Exception as exc:
            if self.access.capturing():
                raise
            return self._failed(layer, "prefill", exc)

    def decode(
        self,
        layer: Any,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata: Any,
        attn_metadata: Any,
        swa_only: bool,
        output: torch.Tensor,
        global_topk: Any,
    ) -> bool:
        """Run the head-exact decode where it applies; False: vLLM's own must run.  What
        it reads is fixed for a CUDA graph (the batch size, the layer), so a captured
        graph replays the same choice."""
        try:
            self.settle()
            state = self.kind_state(layer, q)
            if not state.decode.ours or self.access.dual_batch():
                return False
            facts = state.facts
            assert self.table is not None
            num_tokens = int(swa_metadata.num_decode_tokens)
            if not policy.decode_faster(
                self.table.decode, facts.kind or "", facts.heads, num_tokens
            ):
                return False
            comp_block = None if swa_only else int(attn_metadata.block_size)
            binding = self.binding(
                layer,
                facts,
                q,
                layer.swa_cache_layer.kv_cache,
                kv_cache,
                int(swa_metadata.block_size),
                comp_block,
            )
            if binding is None:
                return False
            if self.access.capturing():
                self._captured = True
            vllm_calls.run_decode(
                layer,
                binding,
                q,
                kv_cache,
                swa_metadata,
                attn_metadata,
                swa_only,
                output,
                self.decode_scratch,
                global_topk,
                state.decode_policy,
            )
            return True
        except Exception as exc:
            if self.access.capturing():
                raise
            return self._failed(layer, "decode", exc)

    def indexer(
        self,
        layer: Any,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor,
    ) -> bool:
        """Run our decode indexer for this layer's step where it applies; False: vLLM's op
        must run (``dsv4_attention.indexer_part``)."""
        return self.indexers.run(layer, hidden_states, index_q, index_q_scale, index_weights)

    def native_heads(self, layer: Any) -> int | None:
        """The real heads vLLM's own prefill of this layer runs at (None: as vLLM calls
        it); asked after :meth:`prefill` declined, so the kind is decided."""
        facts = getattr(layer, "_dsv4_facts", None)
        if not isinstance(facts, LayerFacts):
            return None
        state = self.kinds.get((facts.compress_ratio, facts.heads))
        return facts.heads if state is not None and state.native.ours else None

    def native_failed(self, layer: Any, exc: BaseException) -> None:
        """vLLM's prefill at the real heads raised outside capture: that kind's prefill
        runs as vLLM calls it from now on, with one warning."""
        if self.access.capturing():
            raise exc
        facts = getattr(layer, "_dsv4_facts", None)
        if isinstance(facts, LayerFacts):
            state = self.kinds.get((facts.compress_ratio, facts.heads))
            if state is not None:
                state.native = Choice(False, f"raised {type(exc).__name__}")
        self.warn_once(
            f"native/{getattr(facts, 'kind', None)}",
            f"dsv4-attention: vLLM's prefill at the real heads raised {type(exc).__name__}: "
            f"{exc}; this and later steps run it padded, as vLLM calls it",
        )

    def prepare(self, layer: Any, q: torch.Tensor) -> None:
        """vLLM's profile run (no metadata): decide this layer's kind now, reserving the
        scratch and compiling the kernels before vLLM locks its workspace and captures
        its graphs.  Never raises into vLLM: a failure declines the kind."""
        try:
            self.kind_state(layer, q)
        except Exception as exc:
            self._failed(layer, "start-up", exc)


def make_attention_cls(base: type, runtime: HeadExactRuntime) -> type:
    """A subclass of vLLM's ``DeepseekV4FlashMLAAttention`` whose prefill and decode ask
    ``runtime`` first and otherwise call vLLM's own methods with the same arguments."""
    import sys

    # the module of vLLM's class whose ``_forward_decode`` looks the mapping up by name
    module = next(
        (
            sys.modules[c.__module__]
            for c in base.__mro__
            if hasattr(sys.modules.get(c.__module__), "compute_global_topk_indices_and_lens")
        ),
        sys.modules[base.__module__],
    )

    def _forward_prefill(
        self: Any,
        q: torch.Tensor,
        positions: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        swa_metadata: Any,
    ) -> None:
        if runtime.prefill(
            self, q, compressed_k_cache, swa_k_cache, output, attn_metadata, swa_metadata
        ):
            return
        args = dict(
            q=q,
            positions=positions,
            compressed_k_cache=compressed_k_cache,
            swa_k_cache=swa_k_cache,
            output=output,
            attn_metadata=attn_metadata,
            swa_metadata=swa_metadata,
        )
        heads = runtime.native_heads(self)
        if heads is not None:
            from .native import real_heads

            try:
                with real_heads(heads):
                    base._forward_prefill(self, **args)  # type: ignore[attr-defined]
                return
            except Exception as exc:
                runtime.native_failed(self, exc)
        base._forward_prefill(self, **args)  # type: ignore[attr-defined]

    def _forward_decode(
        self: Any,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata: Any,
        attn_metadata: Any,
        swa_only: bool,
        output: torch.Tensor,
    ) -> None:
        # vLLM's own global top-k mapping, looked up as vLLM's method looks it up
        global_topk = module.compute_global_topk_indices_and_lens
        if runtime.decode(
            self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output, global_topk
        ):
            return
        base._forward_decode(  # type: ignore[attr-defined]
            self,
            q=q,
            kv_cache=kv_cache,
            swa_metadata=swa_metadata,
            attn_metadata=attn_metadata,
            swa_only=swa_only,
            output=output,
        )

    def forward_mqa(
        self: Any, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor
    ) -> None:
        base.forward_mqa(self, q, kv, positions, output)  # type: ignore[attr-defined]
        ctx = runtime.access.forward_context()
        if ctx is not None and getattr(ctx, "attn_metadata", None) is None:
            runtime.prepare(self, q)  # vLLM's profile / dummy run

    region: Any = getattr(base, "_sparse_indexer_and_attn", None)
    vllms_region: Any = getattr(region, "__wrapped__", region)  # vLLM's body, undecorated

    def _sparse_indexer_and_attn(
        self: Any,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor | None,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        out: Any,
    ) -> None:
        if (
            getattr(self, "indexer", None) is not None
            and index_q is not None
            and index_weights is not None
            and runtime.indexer(self, hidden_states, index_q, index_q_scale, index_weights)
        ):
            self.forward_mqa(q, kv, positions, out)
            return
        vllms_region(
            self, hidden_states, index_q, index_q_scale, index_weights, q, kv, positions, out
        )

    _sparse_indexer_and_attn.__doc__ = (
        "vLLM's indexer op then forward_mqa; the decode indexer is ours where the GPU's table "
        "measured it faster."
    )
    extra: dict[str, Any] = {}
    if callable(vllms_region):
        method: Any = _sparse_indexer_and_attn
        if region is not vllms_region:  # vLLM wraps its region for breakable CUDA graphs
            import importlib

            from .vllm_targets import EAGER_BREAK_MODULE

            method = importlib.import_module(EAGER_BREAK_MODULE).eager_break_during_capture(method)
        extra["_sparse_indexer_and_attn"] = method

    _forward_prefill.__doc__ = (
        "Head-exact sparse-MLA prefill from the FP8 pages where measured faster, else vLLM's own."
    )
    _forward_decode.__doc__ = (
        "Head-exact sparse FP8 decode where the GPU's table measured it faster, else vLLM's own."
    )
    forward_mqa.__doc__ = (
        "vLLM's forward_mqa; in its profile run the runtime also decides this layer's kind, "
        "reserves the scratch and compiles the kernels."
    )
    return type(
        "Dsv4HeadExactFlashMLAAttention",
        (base,),
        {
            "__doc__": "vLLM's FlashMLA DSV4 attention with dsv4-attention's head-exact paths.",
            "__module__": __name__,
            "_forward_prefill": _forward_prefill,
            "_forward_decode": _forward_decode,
            "forward_mqa": forward_mqa,
            "dsv4_runtime": runtime,
            **extra,
        },
    )
