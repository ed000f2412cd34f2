"""The measured decode table: the H200 file against the curated measurement it was made from,
the bracketing rule and the head mapping on a table built by hand, and which table a GPU
gets."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from dsv4_attention import decode_table as dt
from dsv4_attention import policy, tables
from dsv4_attention.tables import DecodeTable

ROOT = Path(__file__).resolve().parents[2]
CURATED = ROOT / "docs" / "results" / "h200-decode-v2" / "decode_table.json"
# DeepSeek-V4.1's top-k layers (c1a, c2a), measured on V4.1's pages (issue 30)
CURATED_V41 = ROOT / "docs" / "results" / "h200-issue30" / "v41-decode" / "decode_table.json"


def _h200_file() -> dict:
    """The H200 table as shipped in the package (the file itself, not its parsed view)."""
    path = resources.files("dsv4_attention").joinpath("tables", "NVIDIA_H200.json")
    return json.loads(path.read_text())


def test_table_is_the_curated_measurement() -> None:
    """Every measured layer kind and head row up to the table's head limit is in the file,
    with exactly the curated step sizes, each the smaller of the 1- and 2-token-per-request
    ratios (rounded to 2 decimals); rows above the limit are left out."""
    curated = {**json.loads(CURATED.read_text()), **json.loads(CURATED_V41.read_text())}
    raw = _h200_file()["decode"]
    assert raw["max_heads"] == dt.H200.max_heads == 64
    assert raw["min_ratio"] == dt.H200.min_ratio == 1.0
    want_rows = {
        tuple(key.split("/")) for key in curated if int(key.split("/")[1]) <= raw["max_heads"]
    }
    got_rows = {(layer, str(h)) for layer, by in raw["ratios"].items() for h in by}
    kinds = ("swa", "c4a", "c128a", "c1a", "c2a")
    dp = {(k, "64") for k in ("swa", "c4a", "c128a")}  # DP attention: V4's kinds
    assert got_rows == want_rows == {(k, h) for k in kinds for h in ("8", "16")} | dp
    for layer, heads in sorted(want_rows):
        measured = curated[f"{layer}/{heads}"]
        steps = raw["ratios"][layer][heads]
        assert set(steps) == set(measured["ratios"]), (layer, heads)
        for t, ratio in steps.items():
            want = min(measured["ratios"][t], measured["mtp_ratios"].get(t, 99.0))
            assert abs(ratio - want) < 0.006, (layer, heads, t, ratio, want)
    # the parsed views the plugin and the tools read hold the same numbers
    assert {
        layer: {int(h): {int(t): r for t, r in steps.items()} for h, steps in by.items()}
        for layer, by in raw["ratios"].items()
    } == dt.MEASURED
    assert tables.table_for("NVIDIA H200", (9, 0)).decode == dt.H200  # type: ignore[union-attr]


def test_curated_h200_steps_are_all_faster() -> None:
    """On the H200 every measured step at 8 and 16 heads was faster (what the plugin's
    H200 decisions rest on), so every step size up to the largest and beyond takes ours;
    at 17-64 heads (DP attention, the 64-head row) only the small steps measured faster
    do, and V4.1's kinds (not measured there) never."""
    for layer in ("swa", "c4a", "c128a", "c1a", "c2a"):
        for heads in (1, 8, 9, 16):
            row = dt.H200.row(layer, heads)
            assert row is not None
            assert dt.faster_steps(layer, heads) == tuple(sorted(row))
            assert all(dt.use_head_exact_decode(layer, heads, t) for t in range(1, 2049))
        assert not dt.use_head_exact_decode(layer, 65, 1)
        assert not dt.use_head_exact_decode(layer, 128, 1)
    for layer in ("c1a", "c2a"):
        assert not any(dt.use_head_exact_decode(layer, h, 1) for h in (17, 32, 64))
    curated = json.loads(CURATED.read_text())
    for layer in ("swa", "c4a", "c128a"):
        ratios = curated[f"{layer}/64"]["ratios"]
        faster = [int(t) for t, r in ratios.items() if r > 1.0]
        # the measured faster steps are the smallest ones: ours from 1 token up to the
        # largest of them, FlashMLA from the first slower one
        last = max(faster)
        assert sorted(faster) == [int(t) for t in sorted(ratios, key=int) if int(t) <= last]
        for heads in (17, 32, 64):
            taken = [t for t in range(1, 2049) if dt.use_head_exact_decode(layer, heads, t)]
            assert taken == list(range(1, last + 1)), (layer, heads, taken[-3:])


HAND = DecodeTable(
    requires_wgmma=True,
    max_heads=16,
    min_ratio=1.0,
    ratios={"swa": {8: {1: 1.2, 4: 1.1, 16: 0.9, 64: 1.5}, 16: {1: 0.8, 64: 1.2}}},
)


def test_bracketing_rule_and_heads() -> None:
    def use(layer: str | int, heads: int, tokens: int, table: DecodeTable = HAND) -> bool:
        got = dt.use_head_exact_decode(layer, heads, tokens, table=table)
        assert got == policy.decode_faster(table, layer, heads, tokens)  # one rule
        return got

    assert use("swa", 8, 1) and use(1, 3, 2)  # the ratio names the kind; 3 heads: row 8
    assert use("swa", 8, 4)
    assert not use("swa", 8, 5)  # between 4 (faster) and 16 (slower)
    assert not use("swa", 8, 16)
    assert not use("swa", 8, 17)  # between 16 and 64
    assert not use("swa", 8, 63)
    assert use("swa", 8, 64) and use("swa", 8, 4096)  # past the largest: the largest decides
    assert not use("swa", 16, 1)
    assert not use("swa", 12, 32)  # 12 heads: row 16
    assert use("swa", 12, 100)
    assert not use("swa", 17, 64)  # more than the table's head limit: never
    dp = DecodeTable(True, 64, 1.0, {"swa": {8: {1: 1.2}, 64: {1: 1.3, 8: 0.9}}})
    assert use("swa", 17, 1, dp) and use("swa", 64, 1, dp)  # 17-64 heads: the 64-head row
    assert not use("swa", 17, 8, dp) and not use("swa", 65, 1, dp)
    assert not use("swa", 0, 64)
    assert not use("c4a", 8, 64) and not use(4, 8, 64)  # unmeasured layer kind
    assert not use(2, 8, 64)  # not a DSV4 layer kind
    assert not use("swa", 8, 0) and not use("swa", 8, -1)
    assert dt.faster_steps("swa", 8, HAND) == (1, 4, 64)
    assert dt.faster_steps("swa", 16, HAND) == (64,)
    assert dt.faster_steps("c4a", 8, HAND) == ()
    # the bracketing at every step size: ours only at and between faster measured steps
    assert [t for t in range(1, 100) if use("swa", 8, t)] == [1, 2, 3, 4, *range(64, 100)]
    assert [t for t in range(1, 100) if use("swa", 16, t)] == list(range(64, 100))


def test_min_ratio_is_the_threshold() -> None:
    """A ratio at the threshold is not faster; the threshold is the table's."""
    at_one = DecodeTable(True, 16, 1.0, {"c128a": {8: {1: 1.0, 8: 1.05}}})
    assert not dt.use_head_exact_decode("c128a", 8, 1, table=at_one)
    assert [t for t in range(1, 20) if dt.use_head_exact_decode(128, 8, t, table=at_one)] == list(
        range(8, 20)
    )
    stricter = DecodeTable(True, 16, 1.1, {"c128a": {8: {1: 1.0, 8: 1.05}}})
    assert not any(dt.use_head_exact_decode(128, 8, t, table=stricter) for t in range(1, 20))
    assert dt.faster_steps(128, 8, stricter) == ()


@pytest.mark.parametrize(
    ("name", "capability", "found"),
    [
        ("NVIDIA H200", (9, 0), "NVIDIA H200"),
        ("NVIDIA H100 80GB HBM3", (9, 0), None),  # exact names only: no family's table
        ("NVIDIA H20", (9, 0), None),
        ("NVIDIA H800", (9, 0), None),
        ("NVIDIA GH200 480GB", (9, 0), None),
        ("NVIDIA B200", (10, 0), None),
        ("NVIDIA A100-SXM4-80GB", (8, 0), None),
        ("NVIDIA RTX PRO 6000", (12, 0), None),
        (None, None, None),
    ],
)
def test_table_for_a_gpu(name: str | None, capability: tuple[int, int] | None, found: str) -> None:
    """A table is the GPU's own, by exact device name, or none."""
    table = tables.table_for(name, capability)
    assert (None if table is None else table.device_name) == found
    if table is not None:
        assert table.family == "sm90" and table.combine
        assert table.source.startswith("docs/results/h200-decode")


def test_user_tables_come_first_and_bad_ones_are_named(tmp_path: Path) -> None:
    """``DSV4_TABLES_DIR``'s tables (by exact device name) come before the shipped ones;
    a folder that is not one, or a malformed file, is a ``ValueError`` naming it."""
    shipped = json.loads(resources.files("dsv4_attention").joinpath(
        "tables", "NVIDIA_H200.json").read_text())  # fmt: skip
    folder = tmp_path / "mine"
    folder.mkdir()
    for name, source in (("NVIDIA H200", "my H200 run"), ("NVIDIA H100 80GB HBM3", "my H100")):
        data = {**shipped, "device_name": name, "source": source}
        (folder / tables.file_name(name)).write_text(json.dumps(data))
    tables.user_tables.cache_clear()
    got = tables.table_for("NVIDIA H100 80GB HBM3", (9, 0), str(folder))
    assert got is not None and got.source == "my H100"
    mine = tables.table_for("NVIDIA H200", (9, 0), str(folder))
    assert mine is not None and mine.source == "my H200 run"
    assert tables.table_for("NVIDIA H20", (9, 0), str(folder)) is None
    with pytest.raises(ValueError, match=r"DSV4_TABLES_DIR=.*is not a folder"):
        tables.table_for("NVIDIA H200", None, str(tmp_path / "missing"))
    (folder / "NVIDIA_H20.json").write_text('{"device_name": "NVIDIA H20"}')
    tables.user_tables.cache_clear()
    with pytest.raises(ValueError, match=r"NVIDIA_H20\.json is malformed"):
        tables.table_for("NVIDIA H200", None, str(folder))
    tables.user_tables.cache_clear()


def test_decode_kernels_entries_are_parsed_and_bad_ones_named() -> None:
    """``decode.kernels`` (head row -> launch entries) is read from a table file; an entry
    that would change the scratch's sizes, or is not an object, is named."""
    shipped = json.loads(resources.files("dsv4_attention").joinpath(
        "tables", "NVIDIA_H200.json").read_text())  # fmt: skip
    assert tables.parse_table(shipped).decode.kernels == {}  # the shipped H200 table: none
    data = json.loads(json.dumps(shipped))
    data["decode"]["kernels"] = {"128": {"WIDE_HT": 64, "PDL": 1}}
    got = tables.parse_table(data, "mine.json").decode
    assert got.kernel_policy(128) == {"WIDE_HT": 64, "PDL": 1} and got.kernel_policy(8) is None
    for bad, match in (
        ({"64": {"MIN_TILES_PER_SPLIT": 2}}, r"decode.kernels\['64'\]: \['MIN_TILES_PER_SPLIT'\]"),
        ({"64": 3}, r"decode.kernels\['64'\] must be an object"),
        ([1], "decode.kernels must be an object"),
    ):
        data["decode"]["kernels"] = bad
        with pytest.raises(ValueError, match=r"mine\.json is malformed.*" + match):
            tables.parse_table(data, "mine.json")


def test_c128a_block_rows_flag_is_parsed_and_a_bad_one_named() -> None:
    """``prefill.c128a_block_rows`` (C128A rows read through the block table) is off in
    the shipped H200 table (not run on the GPU yet), on where a table says true, and
    anything but a JSON boolean is named."""
    shipped = json.loads(resources.files("dsv4_attention").joinpath(
        "tables", "NVIDIA_H200.json").read_text())  # fmt: skip
    assert tables.parse_table(shipped).prefill.c128a_block_rows is False
    data = json.loads(json.dumps(shipped))
    data["prefill"]["c128a_block_rows"] = True
    assert tables.parse_table(data, "mine.json").prefill.c128a_block_rows is True
    data["prefill"]["c128a_block_rows"] = "yes"
    with pytest.raises(ValueError, match=r"mine\.json is malformed.*expected true or false"):
        tables.parse_table(data, "mine.json")


def test_a_kernel_variant_wins_its_head_row_by_geomean() -> None:
    """The table tool: a decode run's wide-block rows (``layer/heads/wide64``) replace the
    default's in a head row where their geomean over every layer and step is higher,
    and the table then names the row's launch entries; elsewhere the default stays."""
    from benchmarks.support.decode_table import decode_rows_and_kernels

    def row(*ratios: float) -> dict[str, object]:
        return {"ratios": {str(2**i): r for i, r in enumerate(ratios)}, "mtp_ratios": {}}

    run = {
        "c4a/64": row(1.3, 0.5), "c4a/64/wide64": row(1.2, 0.6),  # wide: 0.85 > 0.81
        "swa/64": row(1.4, 0.9), "swa/64/wide64": row(1.3, 0.9),
        "c4a/128": row(1.1, 0.4), "c4a/128/wide64": row(0.9, 0.4),  # default higher
        "c4a/8": row(2.0),
    }  # fmt: skip
    rows, kernels = decode_rows_and_kernels([run])
    assert kernels == {"64": {"WIDE_HT": 64}}
    assert rows["c4a"]["64"] == {"1": 1.2, "2": 0.6} and rows["swa"]["64"] == {"1": 1.3, "2": 0.9}
    assert rows["c4a"]["128"] == {"1": 1.1, "2": 0.4} and rows["c4a"]["8"] == {"1": 2.0}
    with pytest.raises(ValueError, match="unknown kernel variant 'tiny'"):
        decode_rows_and_kernels([{"c4a/64/tiny": row(1.0)}])
