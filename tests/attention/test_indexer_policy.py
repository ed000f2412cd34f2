"""The decode indexer's decision and its table section (pure functions; no vLLM).

``policy.indexer_choice`` decides once per indexer kind (every refusal named in its
reason), ``policy.indexer_faster`` per step by the same bracketing rule as the decode,
at exactly the measured index heads and top-k; the table's ``indexer`` section parses
(and a malformed one is named); the shipped H200 table has no such section yet, so
nothing of the indexer is taken on any GPU until it is measured.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dsv4_attention import policy, tables
from dsv4_attention.facts import IndexerFacts, ServingConfig
from dsv4_attention.policy import Device, Switches
from dsv4_attention.tables import IndexerTable

H200 = tables.table_for("NVIDIA H200")
assert H200 is not None
HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)
FACTS = IndexerFacts(
    name="model.layers.2.self_attn.indexer.k_cache",
    compress_ratio=4,
    heads=64,
    head_dim=128,
    topk=512,
    max_entries=32768,
    page_entries=64,
    buffer_width=512,
    max_rows=512,
)
MEASURED = IndexerTable(1.0, {64: {512: {1: 2.5, 8: 2.0, 32: 0.9, 128: 1.4}}})
TABLE = dataclasses.replace(H200, indexer=MEASURED)


def test_the_shipped_h200_table_has_no_indexer_section_yet() -> None:
    assert H200.indexer is None
    choice = policy.indexer_choice(FACTS, HOPPER, H200, Switches())
    assert not choice.ours and "not measured on NVIDIA H200" in choice.reason


@pytest.mark.parametrize(
    ("change", "switches", "table", "reason"),
    [
        ({}, Switches(indexer_disable=True), TABLE, "DSV4_INDEXER_DISABLE=1"),
        ({"fp4": True}, None, TABLE, "MXFP4"),
        ({"candidates": True}, None, TABLE, "candidate-block selection"),
        ({"dcp": 2}, None, TABLE, "DCP 2"),
        ({"family": "v41"}, None, TABLE, "DeepSeek-V4.1"),
        ({"buffer_width": 1024}, None, TABLE, "1024 wide for a top-512"),
        ({}, None, None, "no measured table"),
        ({"heads": 32}, None, TABLE, "32 index heads at top-512 were not measured"),
        ({"topk": 1024, "buffer_width": 1024}, None, TABLE, "top-1024 were not measured"),
    ],
)
def test_every_refusal_is_named(
    change: dict, switches: Switches | None, table: tables.MeasuredTable | None, reason: str
) -> None:
    facts = dataclasses.replace(FACTS, **change)
    choice = policy.indexer_choice(facts, HOPPER, table, switches or Switches())
    assert not choice.ours and reason in choice.reason, choice.reason


def test_taken_at_the_row_counts_measured_faster() -> None:
    choice = policy.indexer_choice(FACTS, HOPPER, TABLE, Switches())
    assert choice.ours and "3 of 4" in choice.reason, choice.reason
    faster = [r for r in range(1, 300) if policy.indexer_faster(MEASURED, 64, 512, r)]
    # 1..8 bracketed by faster sizes; 9..127 touch 32 (slower); 128 itself and beyond
    assert faster == list(range(1, 9)) + list(range(128, 300))
    assert not policy.indexer_faster(MEASURED, 64, 512, 0)
    assert not policy.indexer_faster(MEASURED, 32, 512, 1), "another head count never borrowed"
    assert not policy.indexer_faster(None, 64, 512, 1)


def test_the_section_parses_and_a_malformed_one_is_named(tmp_path: Path) -> None:
    data = json.loads((Path(tables.__file__).parent / "tables" / "NVIDIA_H200.json").read_text())
    data["indexer"] = {"min_ratio": 1.0, "ratios": {"64": {"512": {"1": 2.5, "32": 0.9}}}}
    parsed = tables.parse_table(data, "mine.json")
    assert parsed.indexer is not None
    assert dict(parsed.indexer.row(64, 512) or {}) == {1: 2.5, 32: 0.9}
    assert parsed.indexer.row(64, 1024) is None
    data["indexer"] = {"ratios": {}}
    with pytest.raises(ValueError, match=r"mine\.json is malformed.*min_ratio"):
        tables.parse_table(data, "mine.json")


def test_the_scores_scratch_is_sized_by_the_largest_decode_step() -> None:
    serving = ServingConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_decode_query_len=2)
    assert serving.max_decode_rows == 512
    assert ServingConfig(max_num_batched_tokens=256, max_num_seqs=256).max_decode_rows == 256
    assert ServingConfig(max_num_batched_tokens=64).max_decode_rows == 64
    facts = dataclasses.replace(FACTS, max_rows=512, max_entries=1048576 // 4)
    assert facts.scores_bytes == 512 << 20  # 1M context, 256 requests x 2 rows
