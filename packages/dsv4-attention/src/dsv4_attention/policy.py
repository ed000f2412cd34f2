"""The plugin's decisions as pure functions of the facts, the device and the measured table.

No module state and no vLLM: every function here takes what it decides from
(:class:`~dsv4_attention.facts.LayerFacts`, :class:`Device`, the GPU's
:class:`~dsv4_attention.tables.MeasuredTable`, :class:`Switches`) and returns a
value, so the runtime object (``dsv4_attention.runtime``) and the tests ask the
same questions and get the same answers.

One module past 500 lines on purpose: every decision (prefill, vLLM's native-head
prefill, decode, the indexer) and the scratch sizes they imply read the same limits and
rows of the table, and split apart they would each import the others' rules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsv4_kernels.geometry import RowKind

from .facts import IndexerFacts, LayerFacts, ServingConfig
from .scratch import ScratchSpec
from .tables import (
    LAYER_NAMES,
    DecodeTable,
    IndexerTable,
    MeasuredTable,
    PrefillLimits,
    WidePrefill,
)

__all__ = [
    "Choice",
    "Device",
    "Switches",
    "c4a_mean_keys",
    "decode_choice",
    "decode_faster",
    "decode_limits",
    "indexer_choice",
    "indexer_faster",
    "indexer_mode",
    "native_prefill_choice",
    "prefill_choice",
    "prefill_heads_limit",
    "prefill_scratch_spec",
    "prefill_step_takes_ours",
    "prefill_tiles",
    "wide_prefill",
]

ENV_DISABLE = "DSV4_KERNELS_DISABLE"
ENV_FORCE = "DSV4_KERNELS_FORCE"
ENV_PREFILL_DISABLE = "DSV4_PREFILL_DISABLE"
ENV_DECODE_DISABLE = "DSV4_DECODE_DISABLE"
ENV_INDEXER_DISABLE = "DSV4_INDEXER_DISABLE"
ENV_MAX_HEADS = "DSV4_PREFILL_MAX_HEADS"
ENV_TABLES_DIR = "DSV4_TABLES_DIR"

# Distinct window row sets per step: two window KV-cache groups, each read with
# per-token rows (C4A layers) and grouped rows (SWA-only, C128A layers).
WINDOW_ROW_SETS = 4
# The decode step sizes the warm-up compiles: split over keys (few tokens), and one
# program per token (many); each clamped to the configured token budget.
DECODE_WARMUP_TOKENS = (1, 24, 512)


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Switches:
    """The environment switches, read once."""

    disable: bool = False
    force: bool = False
    prefill_disable: bool = False
    decode_disable: bool = False
    max_heads: int | None = None  # DSV4_PREFILL_MAX_HEADS
    tables_dir: str | None = None  # DSV4_TABLES_DIR: tables a user measured
    indexer_disable: bool = False  # DSV4_INDEXER_DISABLE

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> Switches:
        """The switches of ``env`` (the process environment by default); ``ValueError``
        naming the variable when ``DSV4_PREFILL_MAX_HEADS`` is not an integer >= 0."""
        env = os.environ if env is None else env
        raw = env.get(ENV_MAX_HEADS, "").strip()
        heads = None
        if raw:
            try:
                heads = int(raw)
            except ValueError:
                heads = -1
            if heads < 0:
                raise ValueError(f"{ENV_MAX_HEADS} must be an integer >= 0, got {raw!r}")
        return cls(
            disable=_flag(env, ENV_DISABLE),
            force=_flag(env, ENV_FORCE),
            prefill_disable=_flag(env, ENV_PREFILL_DISABLE),
            decode_disable=_flag(env, ENV_DECODE_DISABLE),
            indexer_disable=_flag(env, ENV_INDEXER_DISABLE),
            max_heads=heads,
            tables_dir=env.get(ENV_TABLES_DIR, "").strip() or None,
        )


@dataclass(frozen=True)
class Device:
    """The GPU as vLLM's platform reports it (no CUDA context needed).

    Attributes:
        name: device name (``NVIDIA H200``), None without a GPU.
        capability: (major, minor), None without a GPU.
        wgmma: whether the Gluon wgmma kernels build here (Hopper, a Triton with Gluon).
        forced: ``DSV4_KERNELS_FORCE`` on a machine without a measured table (tests on
            CPU): decisions are made as on the H200.
    """

    name: str | None
    capability: tuple[int, int] | None
    wgmma: bool = False
    forced: bool = False


@dataclass(frozen=True)
class Choice:
    """A decision and its reason (the reason is what the log line says)."""

    ours: bool
    reason: str


def prefill_heads_limit(
    facts: LayerFacts, limits: PrefillLimits, switches: Switches, *, short_rows: bool = False
) -> int:
    """Most local heads this layer kind takes the head-exact prefill at (in steps with
    short top-k rows when ``short_rows``), measured against the prefill vLLM runs for it:
    its padded call, or (``facts.vllm_native``: V4.1 on SM90 with vLLM 0.33) the bundled
    FlashMLA at the real heads; ``DSV4_PREFILL_MAX_HEADS`` overrides."""
    if switches.max_heads is not None:
        return switches.max_heads
    if facts.vllm_native:
        if facts.topk_rows:
            return limits.native_topk_max_heads
        return limits.native_shared_keys_max_heads
    if facts.topk_rows:
        return max(limits.c4a_max_heads, limits.c4a_short_rows_max_heads if short_rows else 0)
    return limits.shared_keys_max_heads


def wide_prefill(
    facts: LayerFacts, limits: PrefillLimits | None, switches: Switches
) -> WidePrefill | None:
    """The table's wide row (issue 41: more than 16 local heads, ours in the wgmma kernel's
    wide head blocks) that takes this DeepSeek-V4 layer kind at exactly its head count,
    or None (V4.1's kinds, vLLM's native-head prefill and ``DSV4_PREFILL_MAX_HEADS`` keep
    the limits)."""
    if limits is None or facts.family != "v4" or facts.vllm_native:
        return None
    if switches.max_heads is not None:
        return None
    row = limits.wide.get(facts.heads)
    if row is None or LAYER_NAMES.get(facts.compress_ratio) not in row.kinds:
        return None
    return row


def prefill_tiles(
    facts: LayerFacts, table: MeasuredTable | None, switches: Switches
) -> dict[str, dict[str, int]] | None:
    """The tiles this layer kind's prefill runs with: a wide row's (``sparse_mla_paged``'s
    ``tiles=``), else None (the kernels' defaults)."""
    row = wide_prefill(facts, None if table is None else table.prefill, switches)
    return None if row is None else {"large": dict(row.tiles)}


def _vllm_prefill_text(facts: LayerFacts) -> str:
    if facts.vllm_native:
        return f"vLLM's FlashMLA prefill at the real {facts.heads} heads"
    return f"vLLM's FlashMLA prefill (padded to {facts.padded_heads} heads)"


def _declined(facts: LayerFacts, device: Device, table: MeasuredTable | None) -> str | None:
    """Why neither prefill nor decode of this layer kind can be ours, or None."""
    if facts.kind is None:
        return f"compress ratio {facts.compress_ratio} is not a DSV4 layer kind"
    if facts.pcp:
        return "prefill context parallelism runs vLLM's own attention"
    if facts.dcp > 1:
        return (
            f"decode context parallelism (DCP {facts.dcp}: the KV cache interleaved across "
            "ranks) is not supported by ours; vLLM's own attention runs"
        )
    if table is None:
        return f"no measured table for {device.name or 'this device'}"
    return None


def _prefill_declined(
    facts: LayerFacts, device: Device, table: MeasuredTable | None, switches: Switches
) -> Choice | None:
    """The refusal both prefill decisions share (the switch, the layer, the table)."""
    if switches.prefill_disable:
        return Choice(False, f"{ENV_PREFILL_DISABLE}=1")
    declined = _declined(facts, device, table)
    return None if declined is None else Choice(False, declined)


def prefill_choice(
    facts: LayerFacts, device: Device, table: MeasuredTable | None, switches: Switches
) -> Choice:
    """Whether this layer kind's prefill may take ours (decided once, at start-up)."""
    refused = _prefill_declined(facts, device, table, switches)
    if refused is not None:
        return refused
    assert table is not None
    if table.prefill.requires_wgmma and not device.wgmma:
        return Choice(False, "the Gluon wgmma kernel does not build here")
    limit = prefill_heads_limit(facts, table.prefill, switches, short_rows=True)
    wide = wide_prefill(facts, table.prefill, switches)
    if facts.heads > limit and wide is not None:
        return Choice(
            True,
            f"every step, at {facts.heads} heads in blocks of {wide.tiles['WIDE_HT']} "
            f"(measured faster there, {table.device_name})",
        )
    if facts.heads > limit:
        return Choice(
            False,
            f"{facts.heads} local heads: {_vllm_prefill_text(facts)} is measured faster above "
            f"{limit} ({table.device_name})",
        )
    if facts.topk_rows and facts.heads > prefill_heads_limit(facts, table.prefill, switches):
        return Choice(
            True,
            f"in steps whose rows average at most {table.prefill.c4a_short_rows_mean_keys} "
            "valid keys per token",
        )
    return Choice(True, "every step")


def native_prefill_choice(
    facts: LayerFacts, device: Device, table: MeasuredTable | None, switches: Switches
) -> Choice:
    """Whether vLLM's own prefill of a DeepSeek-V4 layer kind runs at the real heads (the
    FlashMLA vLLM 0.33 bundles, as vLLM's V4.1 class calls it) where ours is not taken:
    only where that call was measured faster than vLLM's padded one at these heads."""
    refused = _prefill_declined(facts, device, table, switches)
    if refused is not None:
        return refused
    assert table is not None
    if facts.family != "v4":
        return Choice(False, "a DeepSeek-V4.1 layer: its prefill heads are its class's own")
    if facts.vllm_native:
        return Choice(False, "vLLM's own prefill already runs at the real heads")
    if not facts.native_prefill:
        return Choice(False, "this vLLM's FlashMLA has no small-heads sparse prefill here")
    if facts.heads >= facts.padded_heads or facts.heads not in table.prefill.native_faster_heads:
        return Choice(
            False,
            f"at {facts.heads} local heads vLLM's padded call was not measured slower "
            f"({table.device_name})",
        )
    return Choice(True, f"measured faster than the padded call at {facts.heads} heads")


def _keys_upto(n: int, window: int, topk: int, ratio: int = 4) -> int:
    """Valid keys of the top-k rows of positions ``0 .. n - 1`` together: position ``p``
    reads ``min(p + 1, window)`` window keys and ``min((p + 1) // ratio, topk)`` compressed
    ones (its top-k, or every compressed entry while there are fewer)."""
    w = n * (n + 1) // 2 if n <= window else window * (window + 1) // 2 + (n - window) * window
    c = min(n, ratio * topk - 1)  # (m // ratio) < topk for m <= c
    a, b = divmod(c, ratio)
    # positions 1..c: sum over m = p + 1 in 1..c of m // ratio
    comp = ratio * a * (a - 1) // 2 + (b + 1) * a + max(0, n - c) * topk
    return w + comp


def c4a_mean_keys(
    seq_lens: Sequence[int], query_lens: Sequence[int], window: int, topk: int, ratio: int = 4
) -> float:
    """Mean valid keys per prefill token of a top-k layer (C4A at ``ratio`` 4, V4.1's at 1
    or 2) for requests whose chunks end at ``seq_lens`` and hold ``query_lens`` tokens
    (0.0 for no tokens)."""
    tokens = sum(int(q) for q in query_lens)
    if tokens == 0:
        return 0.0
    total = sum(
        _keys_upto(int(s), window, topk, ratio) - _keys_upto(int(s) - int(q), window, topk, ratio)
        for s, q in zip(seq_lens, query_lens, strict=True)
    )
    return total / tokens


def prefill_step_takes_ours(
    facts: LayerFacts, limits: PrefillLimits, switches: Switches, mean_keys: float | None
) -> bool:
    """Whether a step of a layer kind whose prefill is ours runs ours: always within the
    head limit or at a wide row's head count; a top-k layer above the limit only when its
    rows are short (``mean_keys``, None when the step's host lengths are unknown) and
    vLLM's call is the padded one."""
    if facts.heads <= prefill_heads_limit(facts, limits, switches):
        return True
    if wide_prefill(facts, limits, switches) is not None:
        return True
    if facts.vllm_native or not facts.topk_rows:
        return False
    return mean_keys is not None and mean_keys <= limits.c4a_short_rows_mean_keys


def _bracketed_ratio(row: Mapping[int, float] | None, n: int) -> float | None:
    """The smaller ratio of the measured sizes bracketing ``n`` (the nearest at or below
    and at or above; past the largest measured size, the largest's); None: none."""
    if row is None or n <= 0:
        return None
    steps = sorted(row)
    below = [t for t in steps if t <= n]
    above = [t for t in steps if t >= n]
    sides = [below[-1]] if below else []
    sides += [above[0]] if above else []
    return min(row[t] for t in sides) if sides else None


def _bracketed_faster(row: Mapping[int, float] | None, n: int, min_ratio: float) -> bool:
    """Whether the measured sizes bracketing ``n`` (the nearest at or below and at or
    above) were both faster, or, past the largest measured size, the largest was."""
    ratio = _bracketed_ratio(row, n)
    return ratio is not None and ratio > min_ratio


def decode_faster(table: DecodeTable, layer: str | int, heads: int, num_tokens: int) -> bool:
    """Whether a decode step of ``num_tokens`` tokens was measured faster with ours: the
    measured steps bracketing it (the nearest at or below and at or above) were both
    faster, or, past the largest measured step, the largest was."""
    return _bracketed_faster(table.row(layer, heads), num_tokens, table.min_ratio)


def indexer_faster(table: IndexerTable | None, heads: int, topk: int, rows: int) -> bool:
    """Whether a decode indexer step of ``rows`` query rows was measured faster with ours
    at every context (the same bracketing rule as :func:`decode_faster`)."""
    if table is None:
        return False
    return _bracketed_faster(table.row(heads, topk), rows, table.min_ratio)


INDEXER_MODES = ("vllm", "ours", "rows", "keys")


def indexer_mode(
    table: IndexerTable | None,
    heads: int,
    topk: int,
    rows: int,
    tp: int = 1,
    max_len: int | None = None,
) -> str:
    """What a decode indexer step of ``rows`` query rows runs: ``"vllm"`` (vLLM's own,
    replicated on every rank), ``"ours"`` (ours, replicated), or ours split across a TP
    group of ``tp`` ranks by ``"rows"`` (only with at least ``tp`` rows) or by
    ``"keys"``: of those measured faster than vLLM's (the bracketing rule of
    :func:`decode_faster`; a split's ratio the smallest over the contexts measured up to
    ``max_len``), the fastest."""
    if table is None:
        return "vllm"
    best, mode = table.min_ratio, "vllm"
    candidates = [("ours", table.row(heads, topk))]
    if tp > 1:
        if rows >= tp:
            candidates.append(("rows", table.split_row(tp, heads, topk, "rows", max_len)))
        candidates.append(("keys", table.split_row(tp, heads, topk, "keys", max_len)))
    for name, row in candidates:
        ratio = _bracketed_ratio(row, rows)
        if ratio is not None and ratio > best:
            best, mode = ratio, name
    return mode


def indexer_choice(
    facts: IndexerFacts,
    device: Device,
    table: MeasuredTable | None,
    switches: Switches,
    tp: int = 1,
    max_len: int | None = None,
) -> Choice:
    """Whether this indexer kind's decode (scores + top-k) may take ours (decided once, at
    start-up), replicated or split across a TP group of ``tp`` ranks; which step sizes
    then do, and how, is :func:`indexer_mode`."""
    if switches.indexer_disable:
        return Choice(False, f"{ENV_INDEXER_DISABLE}=1")
    if facts.family != "v4":
        return Choice(False, "a DeepSeek-V4.1 indexer: vLLM's own (not measured)")
    if facts.fp4:
        return Choice(False, "an MXFP4 index cache: ours reads the FP8 one only")
    if facts.candidates:
        return Choice(
            False,
            "DeepSeek-V4.1's candidate-block selection (two-level top-k) is vLLM's own",
        )
    if facts.dcp > 1:
        return Choice(False, f"decode context parallelism (DCP {facts.dcp}) is vLLM's own")
    if facts.buffer_width != facts.topk:
        return Choice(
            False,
            f"vLLM's top-k buffer is {facts.buffer_width} wide for a top-{facts.topk} indexer",
        )
    if table is None:
        return Choice(False, f"no measured table for {device.name or 'this device'}")
    if table.indexer is None:
        return Choice(False, f"the decode indexer was not measured on {table.device_name}")
    t = table.indexer
    rows = {"replicated": t.row(facts.heads, facts.topk)}
    if tp > 1:
        for split in ("rows", "keys"):
            rows[f"split by {split} over TP{tp}"] = t.split_row(
                tp, facts.heads, facts.topk, split, max_len
            )
    said = []
    for name, row in rows.items():
        faster = [] if row is None else [r for r, x in row.items() if x > t.min_ratio]
        if faster:
            assert row is not None
            said.append(f"{name} at the row counts measured faster ({len(faster)} of {len(row)})")
    if not said:
        split = f" (nor split over TP{tp})" if tp > 1 else ""
        return Choice(
            False,
            f"{facts.heads} index heads at top-{facts.topk} were not measured faster{split} "
            f"({table.device_name})",
        )
    return Choice(True, "; ".join(said))


def decode_choice(
    facts: LayerFacts, device: Device, table: MeasuredTable | None, switches: Switches
) -> Choice:
    """Whether this layer kind's decode may take ours (decided once, at start-up); which
    step sizes then do is :func:`decode_faster`."""
    if switches.decode_disable:
        return Choice(False, f"{ENV_DECODE_DISABLE}=1")
    declined = _declined(facts, device, table)
    if declined is not None:
        return Choice(False, declined)
    assert table is not None and facts.kind is not None
    if table.decode.requires_wgmma and not device.wgmma:
        return Choice(False, "the Gluon wgmma kernel does not build here")
    row = table.decode.row(facts.kind, facts.heads)
    if row is None:
        return Choice(
            False, f"{facts.heads} local heads were not measured faster ({table.device_name})"
        )
    faster = [t for t, r in sorted(row.items()) if r > table.decode.min_ratio]
    if not faster:
        return Choice(False, f"no step size measured faster ({table.device_name})")
    return Choice(True, f"at the step sizes measured faster ({len(faster)} of {len(row)})")


def decode_limits(facts: Sequence[LayerFacts]) -> tuple[int, int, int, int]:
    """(largest decode batch, local heads, widest row, widest window part) the decode
    scratch must hold for these layers: the token budget, their heads, and the widest
    row vLLM can build for any of them (DSpark's drafter rows included)."""
    return (
        max(f.max_tokens for f in facts),
        max(f.heads for f in facts),
        max(f.decode_row_width for f in facts),
        max(f.decode_window_width for f in facts),
    )


def prefill_scratch_spec(
    facts: Sequence[LayerFacts], max_group: int, c128a_blocks: bool = False
) -> ScratchSpec:
    """The largest prefill step of these layers: the token budget, their heads, the
    widest group of grouped rows, and the row widths of the kinds present
    (``c128a_blocks``: the C128A rows read through the block table, the table's
    ``prefill.c128a_block_rows``)."""
    return ScratchSpec(
        max_tokens=max(f.max_tokens for f in facts),
        max_heads=max(f.heads for f in facts),
        window_size=max(f.window for f in facts),
        max_group=max_group,
        c4a_topk=max((f.topk for f in facts if f.topk_rows), default=0),
        c128a_width=max((f.c128a_width for f in facts if f.rows is RowKind.ALL), default=0),
        window_slots=WINDOW_ROW_SETS,
        c128a_slots=1,
        c128a_blocks=int(c128a_blocks),
    )


def decode_warmup_tokens(max_tokens: int) -> tuple[int, ...]:
    """The decode step sizes the warm-up compiles, within the token budget."""
    return tuple(sorted({min(t, max_tokens) for t in DECODE_WARMUP_TOKENS if max_tokens >= 1}))


def reserved_bytes(
    serving: ServingConfig,
    heads: int,
    topk: int,
    *,
    max_group: int,
    sms: int,
    c128a_blocks: bool = False,
) -> dict[str, int]:
    """The bytes the runtime reserves per GPU for a served configuration where every layer
    kind's prefill and decode are ours (the most it reserves): ``{"prefill": ...,
    "decode": ...}``.  ``max_group``: the grouped rows' group size on the GPU (4 at 8
    heads, 2 at 16 on Hopper); ``sms``: its multiprocessors (132 on an H200)."""
    from dsv4_kernels import decode_scratch_sizes

    from .facts import c128a_width
    from .scratch import scratch_bytes

    assert serving.max_num_batched_tokens is not None and serving.max_model_len is not None
    kinds = [
        LayerFacts(
            name="",
            compress_ratio=r,
            heads=heads,
            window=128,
            topk=topk,
            c128a_width=c128a_width(serving.max_model_len),
            max_tokens=serving.max_num_batched_tokens,
            decode_window_width=serving.decode_window_width,
        )
        for r in (1, 4, 128)
    ]
    tokens, h, row, window = decode_limits(kinds)
    sizes = decode_scratch_sizes(tokens, h, row, "cpu", window=window, sms=sms)
    return {
        "prefill": scratch_bytes(prefill_scratch_spec(kinds, max_group, c128a_blocks)),
        "decode": 4 * sizes.total,
    }
