"""The measured tables the plugin decides by: data files keyed by GPU, loaded once.

Like vLLM's tuned MoE configurations, each table is one JSON file per device
name under ``dsv4_attention/tables/`` (``NVIDIA_H200.json``: the device name
with spaces as underscores).  A table says, from curated benchmark runs on that
GPU (its ``source``), whether the combine kernel replaces vLLM's, up to how
many local heads the head-exact prefill is faster per layer kind, the
decode speed-up of every measured step size, and (where measured) the decode
indexer's speed-up per index heads, top-k and query rows.

A table is used only on the GPU it was measured on, by exact device name: an H100,
H800, H20 or GH200 is not an H200 (other memory bandwidth, clocks and SM counts move
the crossovers), so a GPU without its own table keeps vLLM's path everywhere, with a
line naming the command that measures one (:data:`MEASURE_COMMAND`).  Tables a user
measured are read from the folder named by ``DSV4_TABLES_DIR`` (same file names),
before the shipped ones.  Regenerate a shipped table from a new curated run and name
the run in its ``source``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any

__all__ = [
    "ENV_TABLES_DIR",
    "MEASURE_COMMAND",
    "DecodeTable",
    "IndexerTable",
    "MeasuredTable",
    "PrefillLimits",
    "all_tables",
    "table_for",
    "user_tables",
]

ENV_TABLES_DIR = "DSV4_TABLES_DIR"
# what measures a table for a GPU that has none (run from a clone of dsv4-serving)
MEASURE_COMMAND = "python3 -m benchmarks.measure_table --out DIR"

LAYER_NAMES = {1: "swa", 4: "c4a", 128: "c128a"}


@dataclass(frozen=True)
class WidePrefill:
    """A head count above 16 (DP attention's 32, 64 or 128 local heads, issue 41) at which
    ours was measured faster than vLLM's prefill: the layer kinds (``"swa"``, ``"c4a"``,
    ``"c128a"``) and the tiles of the run (``dsv4_kernels.sparse_mla.TILES["large"]``'s
    entries with the wgmma kernel's wide head blocks: ``KERNEL`` 2, ``WIDE_HT`` 32 or
    64).  Looked up at exactly its head count: another is never borrowed."""

    kinds: frozenset[str]
    tiles: Mapping[str, int]


WIDE_KINDS = tuple(LAYER_NAMES.values())  # DeepSeek-V4's kinds


@dataclass(frozen=True)
class PrefillLimits:
    """Up to how many local heads the head-exact prefill is measured faster.

    The first four limits compare ours with vLLM's padded FlashMLA call (64 heads);
    the ``native_*`` ones with the FlashMLA vLLM 0.33 bundles run at the real heads
    (what vLLM's DeepSeek-V4.1 class calls on SM90); ``native_faster_heads`` are the
    local head counts at which that native-head call was measured faster than the
    padded one on every measured step (where the plugin runs vLLM's own V4 prefill at
    the real heads when ours is not taken).
    """

    requires_wgmma: bool
    c4a_max_heads: int
    shared_keys_max_heads: int  # SWA-only and C128A layers (grouped rows)
    c4a_short_rows_max_heads: int  # C4A layers in steps whose rows are short
    c4a_short_rows_mean_keys: int
    native_topk_max_heads: int = 0  # top-k rows (C4A, V4.1) against the native-head call
    native_shared_keys_max_heads: int = 0  # SWA-only and C128A against it
    native_faster_heads: tuple[int, ...] = ()
    # C128A rows read through the compressed block table (dsv4_kernels.BlockRows): no
    # [tokens, entries] row of slots reserved or built; taken once measured on the GPU
    c128a_block_rows: bool = False
    # head counts above 16 taken where measured (local heads -> kinds and tiles)
    wide: Mapping[int, WidePrefill] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class DecodeTable:
    """FlashMLA's padded decode time over ours, per layer kind, head row and step size."""

    requires_wgmma: bool
    max_heads: int
    min_ratio: float
    ratios: Mapping[str, Mapping[int, Mapping[int, float]]]
    # per head row: the decode launch entries (``dsv4_kernels.DECODE_TILES``: among
    # :data:`KERNEL_ENTRIES`) the row was measured with, e.g. issue 41's wide blocks
    kernels: Mapping[int, Mapping[str, int]] = field(default_factory=lambda: MappingProxyType({}))

    @staticmethod
    def head_row(heads: int) -> int:
        """The row a local head count is looked up in: 8 up to 8 heads, 16 up to 16, 64 up
        to 64 (FlashMLA pads every count up to 64 to 64 heads, and ours costs at most its
        64-head time there), 128 above (FlashMLA's other padded count)."""
        return 8 if heads <= 8 else 16 if heads <= 16 else 64 if heads <= 64 else 128

    def row(self, layer: str | int, heads: int) -> Mapping[int, float] | None:
        """The measured steps of a layer kind (``"c4a"``, V4.1's ``"c1a"``, or a V4 ratio) at
        ``heads`` local heads (:meth:`head_row`), up to the table's ``max_heads``, where
        the table has the row; None where nothing was measured."""
        name = LAYER_NAMES.get(layer, "") if isinstance(layer, int) else layer
        if name not in self.ratios or not 1 <= heads <= self.max_heads:
            return None
        return self.ratios[name].get(self.head_row(heads))

    def kernel_policy(self, heads: int) -> Mapping[str, int] | None:
        """The decode launch entries ``heads`` local heads' row was measured with (the
        ``policy=`` of ``dsv4_kernels.sparse_mla_decode``; None: the kernels' defaults)."""
        return self.kernels.get(self.head_row(heads))


@dataclass(frozen=True)
class IndexerTable:
    """vLLM's decode indexer (its scores + top-k kernels) over ours, per index heads, top-k
    and query rows of a step: the smallest ratio over the contexts measured (above
    ``min_ratio``: ours was faster at every context of that row count)."""

    min_ratio: float
    ratios: Mapping[int, Mapping[int, Mapping[int, float]]]  # heads -> topk -> rows -> ratio
    source: str = ""
    # the split across a TP group (issue 40): vLLM's replicated indexer over one rank's
    # share and the exchange, per TP size -> heads -> topk -> split ("rows" or "keys")
    # -> rows -> context (tokens) -> ratio; empty where no several-GPU machine measured it
    sharded: Mapping[int, Any] = field(default_factory=lambda: MappingProxyType({}))

    def row(self, heads: int, topk: int) -> Mapping[int, float] | None:
        """The measured row counts at exactly these index heads and top-k (None: not
        measured; another head count or top-k is never borrowed)."""
        return self.ratios.get(heads, {}).get(topk)

    def split_row(
        self, tp: int, heads: int, topk: int, split: str, max_len: int | None
    ) -> Mapping[int, float] | None:
        """A split's measured row counts at exactly this TP size, index heads and top-k,
        each the smallest ratio over the contexts measured up to ``max_len`` (the
        engine's longest context; the shortest measured context always counts, since a
        captured step serves every context); None: not measured."""
        by_rows = self.sharded.get(tp, {}).get(heads, {}).get(topk, {}).get(split)
        if not by_rows:
            return None
        out = {}
        for rows, by_context in by_rows.items():
            if not by_context:
                continue
            shortest = min(by_context)
            seen = [x for c, x in by_context.items() if c == shortest or max_len is None
                    or c <= max_len]  # fmt: skip
            out[rows] = min(seen)
        return MappingProxyType(out) if out else None


@dataclass(frozen=True)
class MeasuredTable:
    """One GPU's measured table (one JSON file); ``indexer`` None where the decode
    indexer was not measured on it (vLLM's indexer then runs)."""

    device_name: str
    family: str
    source: str
    combine: bool
    prefill: PrefillLimits
    decode: DecodeTable
    indexer: IndexerTable | None = None


def _frozen_ratios(raw: Mapping[str, object]) -> Mapping[str, Mapping[int, Mapping[int, float]]]:
    out = {}
    for layer, by_heads in raw.items():
        if not isinstance(by_heads, dict):
            raise ValueError(f"decode ratios of {layer!r} must be an object")
        out[layer] = MappingProxyType(
            {
                int(h): MappingProxyType({int(t): float(r) for t, r in steps.items()})
                for h, steps in by_heads.items()
            }
        )
    return MappingProxyType(out)


# Decode launch entries a table row may name: launch choices that leave the scratch's
# sizes as they are (the split policy's entries would change them).
KERNEL_ENTRIES = ("HEAD_BLOCKS", "PDL", "WIDE_HT")


def _kernels(raw: object) -> Mapping[int, Mapping[str, int]]:
    """``decode.kernels``: head row -> launch entries (among :data:`KERNEL_ENTRIES`)."""
    if raw is None:
        return MappingProxyType({})
    assert isinstance(raw, dict), "decode.kernels must be an object"
    out = {}
    for heads, entries in raw.items():
        assert isinstance(entries, dict), f"decode.kernels[{heads!r}] must be an object"
        unknown = sorted(set(entries) - set(KERNEL_ENTRIES))
        assert not unknown, f"decode.kernels[{heads!r}]: {unknown} not among {KERNEL_ENTRIES}"
        out[int(heads)] = MappingProxyType({str(k): int(v) for k, v in entries.items()})
    return MappingProxyType(out)


def _wide(raw: object) -> Mapping[int, WidePrefill]:
    """``prefill.wide``: local heads -> ``{"kinds": [...], "tiles": {...}}`` (WidePrefill)."""
    from dsv4_kernels.sparse_mla import TILES, WIDE_BLOCK_HEADS

    if raw is None:
        return MappingProxyType({})
    assert isinstance(raw, dict), "prefill.wide must be an object"
    known = {*TILES["large"], "KERNEL", "ASYNC_PV", "WIDE_HT"}
    out = {}
    for heads, row in raw.items():
        where = f"prefill.wide[{heads!r}]"
        assert isinstance(row, dict), f"{where} must be an object"
        assert int(heads) > 16, f"{where}: only head counts above 16 (up to 16: the limits)"
        kinds = row.get("kinds")
        assert isinstance(kinds, list) and set(kinds) <= set(WIDE_KINDS), (
            f"{where}.kinds must be a list among {WIDE_KINDS}"
        )
        tiles = row.get("tiles")
        assert isinstance(tiles, dict), f"{where}.tiles must be an object"
        unknown = sorted(set(tiles) - known)
        assert not unknown, f"{where}.tiles: {unknown} not among {sorted(known)}"
        assert tiles.get("KERNEL") == 2 and tiles.get("WIDE_HT") in WIDE_BLOCK_HEADS, (
            f"{where}.tiles must name the wgmma kernel's wide blocks (KERNEL 2, WIDE_HT one "
            f"of {WIDE_BLOCK_HEADS})"
        )
        entries = {str(k): int(v) for k, v in tiles.items()}
        out[int(heads)] = WidePrefill(frozenset(kinds), MappingProxyType(entries))
    return MappingProxyType(out)


SPLITS = ("rows", "keys")


def _sharded(raw: object) -> Mapping[int, Any]:
    """``indexer.sharded``: TP size -> heads -> topk -> split -> rows -> context -> ratio."""
    if raw is None:
        return MappingProxyType({})
    assert isinstance(raw, dict), "indexer.sharded must be an object"

    def level(obj: object, depth: int) -> Any:
        assert isinstance(obj, dict), "indexer.sharded's levels must be objects"
        if depth == 3:  # split names
            assert set(obj) <= set(SPLITS), f"indexer.sharded splits must be among {SPLITS}"
            return MappingProxyType({str(k): level(v, 4) for k, v in obj.items()})
        if depth == 5:  # context -> ratio
            return MappingProxyType({int(k): float(v) for k, v in obj.items()})
        return MappingProxyType({int(k): level(v, depth + 1) for k, v in obj.items()})

    return level(raw, 0)


def _indexer_table(raw: object) -> IndexerTable | None:
    if raw is None:
        return None
    assert isinstance(raw, dict), "indexer must be an object"
    ratios = raw["ratios"]
    assert isinstance(ratios, dict), "indexer.ratios must be an object"
    return IndexerTable(
        sharded=_sharded(raw.get("sharded")),
        min_ratio=float(raw["min_ratio"]),
        ratios=MappingProxyType(
            {
                int(h): MappingProxyType(
                    {
                        int(k): MappingProxyType({int(r): float(x) for r, x in rows.items()})
                        for k, rows in by_topk.items()
                    }
                )
                for h, by_topk in ratios.items()
            }
        ),
        source=str(raw.get("source", "")),
    )


def _flag(value: object) -> bool:
    """A table's yes/no entry: a JSON boolean, nothing else."""
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def parse_table(data: Mapping[str, object], name: str = "<table>") -> MeasuredTable:
    """A :class:`MeasuredTable` from a table file's JSON; ``ValueError`` naming the file
    and the field when one is missing or of the wrong type."""
    try:
        prefill = data["prefill"]
        decode = data["decode"]
        assert isinstance(prefill, dict) and isinstance(decode, dict)
        native = prefill.get("versus_native", {})
        assert isinstance(native, dict)
        return MeasuredTable(
            device_name=str(data["device_name"]),
            family=str(data["family"]),
            source=str(data["source"]),
            combine=bool(data["combine"]["replace"]),  # type: ignore[index]
            prefill=PrefillLimits(
                requires_wgmma=bool(prefill["requires_wgmma"]),
                c4a_max_heads=int(prefill["c4a_max_heads"]),
                shared_keys_max_heads=int(prefill["shared_keys_max_heads"]),
                c4a_short_rows_max_heads=int(prefill["c4a_short_rows_max_heads"]),
                c4a_short_rows_mean_keys=int(prefill["c4a_short_rows_mean_keys"]),
                native_topk_max_heads=int(native.get("topk_max_heads", 0)),
                native_shared_keys_max_heads=int(native.get("shared_keys_max_heads", 0)),
                native_faster_heads=tuple(
                    int(h) for h in native.get("faster_than_padded_heads", ())
                ),
                c128a_block_rows=_flag(prefill.get("c128a_block_rows", False)),
                wide=_wide(prefill.get("wide")),
            ),
            decode=DecodeTable(
                requires_wgmma=bool(decode["requires_wgmma"]),
                max_heads=int(decode["max_heads"]),
                min_ratio=float(decode["min_ratio"]),
                ratios=_frozen_ratios(decode["ratios"]),
                kernels=_kernels(decode.get("kernels")),
            ),
            indexer=_indexer_table(data.get("indexer")),
        )
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise ValueError(
            f"measured table {name} is malformed: {type(exc).__name__}: {exc}"
        ) from exc


def file_name(device_name: str) -> str:
    """The table file of a device name as vLLM's platform reports it."""
    return device_name.strip().replace(" ", "_") + ".json"


@functools.cache
def all_tables() -> Mapping[str, MeasuredTable]:
    """Every table shipped with the package, by file name (read once per process)."""
    found = {}
    for entry in resources.files(__package__).joinpath("tables").iterdir():
        if entry.name.endswith(".json"):
            found[entry.name] = parse_table(json.loads(entry.read_text()), entry.name)
    return MappingProxyType(found)


def family_of(capability: tuple[int, int] | None) -> str | None:
    """``sm90`` for compute capability (9, 0); None without a device."""
    return None if capability is None else f"sm{capability[0]}0"


@functools.cache
def user_tables(folder: str) -> Mapping[str, MeasuredTable]:
    """The tables in ``folder`` (``DSV4_TABLES_DIR``), by file name (read once per
    process); ``ValueError`` naming the folder or file when one cannot be read."""
    from pathlib import Path

    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{ENV_TABLES_DIR}={folder!r} is not a folder")
    found = {}
    for entry in sorted(path.glob("*.json")):
        try:
            data = json.loads(entry.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"measured table {entry} cannot be read: {exc}") from exc
        found[entry.name] = parse_table(data, str(entry))
    return MappingProxyType(found)


def table_for(
    device_name: str | None,
    capability: tuple[int, int] | None = None,
    folder: str | None = None,
) -> MeasuredTable | None:
    """The table measured on this GPU, by exact device name: from ``folder`` (a user's
    ``DSV4_TABLES_DIR``) first, else shipped; None when this GPU was never measured
    (then nothing is replaced on it).  ``capability`` is not used to borrow another
    GPU's table (kept for callers that pass it)."""
    if not device_name:
        return None
    name = file_name(device_name)
    if folder:
        mine = user_tables(folder)
        if name in mine:
            return mine[name]
    return all_tables().get(name)
