"""``benchmarks.measure_table``: the table it writes is one the plugin's parser and policy
accept, found by exact device name in ``DSV4_TABLES_DIR`` (CPU; the measuring run itself
needs the GPU and FlashMLA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import measure_table

from dsv4_attention import policy, tables
from dsv4_attention.facts import LayerFacts
from dsv4_attention.policy import Device, Switches


def _decode_table() -> dict[str, dict[str, dict[int, float]]]:
    """A decode run's summary as ``cases_decode.summarise`` gives it: ours faster up to
    16 tokens (C4A, 8 heads), slower beyond; the MTP ratios lower at 16 tokens."""
    steps = [1, 2, 4, 8, 16, 32, 64]
    return {
        "c4a/8": {
            "ratios": {t: (1.4 if t <= 16 else 0.9) for t in steps},
            "mtp_ratios": {16: 0.95},
        },
        "swa/16": {"ratios": {t: 1.2 for t in steps}, "mtp_ratios": {}},
    }


def test_the_written_table_is_taken_on_that_gpu_only(tmp_path: Path) -> None:
    name = "NVIDIA H100 80GB HBM3"
    table = measure_table.table_from_decode(name, (9, 0), _decode_table(), "test run")
    path = measure_table.write_table(tmp_path, table)
    assert path.name == "NVIDIA_H100_80GB_HBM3.json"
    assert json.loads(path.read_text())["decode"]["ratios"]["c4a"]["8"]["16"] == 0.95
    tables.user_tables.cache_clear()
    got = tables.table_for(name, (9, 0), str(tmp_path))
    assert got is not None and got.source == "test run" and not got.combine
    assert tables.table_for("NVIDIA H800", (9, 0), str(tmp_path)) is None
    device = Device(name, (9, 0), wgmma=True)
    switches = Switches(tables_dir=str(tmp_path))
    c4a = LayerFacts("l", 4, 8, 128, 512, 1024, 8192, 128)
    assert policy.decode_choice(c4a, device, got, switches).ours
    faster = [t for t in (1, 2, 4, 8, 16, 32, 64) if policy.decode_faster(got.decode, "c4a", 8, t)]
    assert faster == [1, 2, 4, 8]  # 16: the MTP ratio 0.95 (the smaller of the two)
    assert not policy.prefill_choice(c4a, device, got, switches).ours  # prefill not measured
    c128a = LayerFacts("l", 128, 8, 128, 0, 1024, 8192, 128)
    assert not policy.decode_choice(c128a, device, got, switches).ours  # not in the run
    tables.user_tables.cache_clear()


def test_a_run_without_flashmla_gives_no_table() -> None:
    with pytest.raises(ValueError, match="no measured rows"):
        measure_table.table_from_decode("NVIDIA H100", (9, 0), {}, "empty")
