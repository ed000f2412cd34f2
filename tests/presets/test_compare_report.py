"""dsv4 compare's report from constructed run folders, and what served each run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsv4_presets.bench import bench_verdict
from dsv4_presets.compare import cli, report, rundir

# ---------------------------------------------------------------------------
# Report from constructed run folders (the seed's numbers)
# ---------------------------------------------------------------------------


def _bench_json(throughput: float, tpots_ms: list[float], output_len: int = 5) -> dict[str, Any]:
    # Per-request data consistent with the TPOTs: latency = ttft + tpot * (n - 1).
    ttft = 0.05
    lat = [ttft + t / 1000.0 * (output_len - 1) for t in tpots_ms]
    return {
        "completed": len(tpots_ms),
        "failed": 0,
        "num_prompts": len(tpots_ms),
        "output_throughput": throughput,
        "mean_tpot_ms": sum(tpots_ms) / len(tpots_ms),
        "mean_itl_ms": sum(tpots_ms) / len(tpots_ms),
        "latencies": lat,
        "ttfts": [ttft] * len(tpots_ms),
        "output_lens": [output_len] * len(tpots_ms),
        "itls": [[t / 1000.0] * (output_len - 1) for t in tpots_ms],
        "errors": [""] * len(tpots_ms),
    }


def _write_campaign(out: Path, runs: list[tuple[str, str, dict[str, Any] | None, str]]) -> None:
    """runs: (label, variant, bench json or None, status)."""
    planned = []
    for i, (label, variant, bench, status) in enumerate(runs, start=1):
        folder = f"{i:02d}-{label}"
        planned.append({"index": i, "label": label, "variant": variant, "folder": folder})
        if status == "not run":
            continue
        d = out / "runs" / folder
        d.mkdir(parents=True)
        result: dict[str, Any] = {"label": label, "variant": variant, "status": status}
        if bench is not None:
            (d / "bench.json").write_text(json.dumps(bench))
            result["metrics"] = rundir.read_bench_metrics(bench)
        result["reason"] = None if status == "ok" else "health timeout: constructed"
        (d / "result.json").write_text(json.dumps(result))
    manifest = {
        "runs": planned,
        "variants": {
            "A": {"spec": {"text": "h200-tp8-ep", "label": "256 workers"}, "preset": "h200-tp8-ep"},
            "B": {"spec": {"text": "h200-tp8-ep env:X=1", "label": None}, "preset": "h200-tp8-ep"},
        },
        "bench": {"name": "random-1024-64", "num_prompts": 4},
    }
    (out / "campaign.json").write_text(json.dumps(manifest))


def test_report_seed_numbers(tmp_path: Path) -> None:
    _write_campaign(
        tmp_path,
        [
            ("A1", "A", _bench_json(638.67, [102.0, 102.52, 102.26, 102.26]), "ok"),
            ("B1", "B", _bench_json(629.61, [104.8, 104.6, 105.0, 104.8]), "ok"),
            ("A2", "A", _bench_json(639.44, [101.88, 101.88, 101.5, 102.26]), "ok"),
        ],
    )
    rep, text = report.write_report(tmp_path, resamples=200, plot=False)
    assert "| A1 | 256 workers | 638.67 tokens/s | 102.26 ms |" in text
    assert "| B1 | B | 629.61 tokens/s | 104.80 ms |" in text
    (pair,) = rep["pairs"]
    assert pair["a"] == ["A1", "A2"]
    assert pair["output_throughput"]["a_mean"] == pytest.approx(639.055)
    assert pair["output_throughput"]["relative_change_pct"] == pytest.approx(-1.4779636, abs=1e-6)
    assert pair["mean_tpot_ms"]["relative_change_pct"] == pytest.approx(2.6746351, abs=1e-6)
    assert "(-1.48%)" in text and "(+2.67%)" in text
    # One pair: the paired interval is undefined, and the report says so.
    paired = rep["summary"]["output_throughput"]["paired_interval"]
    assert paired["low"] is None and "one pair" in paired["undefined_reason"]
    assert "interval undefined: only one pair" in text
    # The request bootstrap is defined and brackets its estimate, which equals the pair change
    # computed from the per-request TPOTs (their means are the runs' mean TPOT).
    boot = rep["summary"]["mean_tpot_ms"]["request_bootstrap"]
    assert boot["estimate"] == pytest.approx(2.6746351, abs=1e-6)
    assert boot["low"] <= boot["estimate"] <= boot["high"]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["pairs"] == json.loads(json.dumps(rep["pairs"]))
    assert (tmp_path / "report.md").read_text() == text


def test_report_excludes_failed_and_unrun_runs(tmp_path: Path) -> None:
    _write_campaign(
        tmp_path,
        [
            ("A1", "A", _bench_json(100.0, [10.0, 10.0]), "ok"),
            ("B1", "B", None, "failed"),
            ("A2", "A", _bench_json(110.0, [9.0, 9.0]), "ok"),
            ("A3", "A", _bench_json(105.0, [9.5, 9.5]), "ok"),
            ("B2", "B", _bench_json(90.0, [11.0, 11.0]), "ok"),
            ("A4", "A", None, "not run"),
        ],
    )
    rep, text = report.write_report(tmp_path, resamples=100, plot=False)
    assert rep["failed_runs"] == ["B1"]
    assert rep["not_run"] == ["A4"]
    assert "| B1 | B | FAILED: health timeout: constructed" in text
    # B2 pairs with A3 only (A4 has not run); B1 is failed and absent from the pairs.
    (pair,) = rep["pairs"]
    assert pair["b"] == "B2" and pair["a"] == ["A3"] and pair["a_failed"] == ["A4"]
    assert pair["output_throughput"]["relative_change_pct"] == pytest.approx(
        (90.0 - 105.0) / 105.0 * 100
    )
    assert "Failed runs (never averaged in)" in text


def test_report_plot_written(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the test extra installs it; no silent skip)

    _write_campaign(
        tmp_path,
        [
            ("A1", "A", _bench_json(100.0, [10.0, 10.0]), "ok"),
            ("B1", "B", None, "failed"),
            ("A2", "A", _bench_json(110.0, [9.0, 9.0]), "ok"),
        ],
    )
    rep, _ = report.write_report(tmp_path, resamples=50, plot=True)
    png = tmp_path / "report.png"
    assert rep["plot"] == "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_request_tpot_matches_vllm_definition() -> None:
    bench = {
        "latencies": [1.0, 2.0, 0.5, 3.0],
        "ttfts": [0.1, 0.2, 0.5, 0.0],
        "output_lens": [10, 5, 1, 0],
        "errors": ["", "", "", "boom"],
        "itls": [[0.1] * 9, [0.45] * 4, [], []],
    }
    assert report.per_request_tpot_ms(bench) == [
        [pytest.approx(100.0)],
        [pytest.approx(450.0)],
    ]
    itl = report.per_request_itl_ms(bench)
    assert len(itl) == 2 and itl[1] == [pytest.approx(450.0)] * 4


def test_bench_failure_rules() -> None:
    assert bench_verdict({"completed": 8, "failed": 0}, 8) is None
    why = bench_verdict({"completed": 6, "failed": 2, "errors": ["", "HTTP 500"]}, 8)
    assert why is not None and "2 of 8 requests failed" in why and "HTTP 500" in why
    assert "only 5 of 8" in (bench_verdict({"completed": 5, "failed": 0}, 8) or "")
    assert "no 'completed'" in (bench_verdict({}, 8) or "")


def test_report_only_needs_a_campaign(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--report-only", "--out", str(tmp_path)]) == 2
    assert "campaign.json" in capsys.readouterr().err
    assert cli.main(["--report-only"]) == 2


def test_report_warns_when_tokens_arrive_in_bursts(tmp_path: Path) -> None:
    steady = _bench_json(100.0, [10.0, 10.0, 10.0])
    bursty = _bench_json(100.0, [10.0, 10.0, 10.0])
    # Whole outputs delivered at once: every gap ~0, the time sits in the TTFT.
    bursty["itls"] = [[0.0, 0.0, 0.0, 0.00002]] * 3
    assert report.burst_fraction(steady) == 0.0
    assert report.burst_fraction(bursty) == 1.0
    _write_campaign(
        tmp_path, [("A1", "A", steady, "ok"), ("B1", "B", bursty, "ok"), ("A2", "A", steady, "ok")]
    )
    rep, text = report.write_report(tmp_path, resamples=50, plot=False)
    assert [bool(r.get("warning")) for r in rep["runs"]] == [False, True, False]
    assert "## Warnings" in text and "- B1: 100% of inter-token latencies" in text


# --------------------------------------------------------------------------
# What served each run: vLLM's version and the dsv4-attention plugin, from server.log
# --------------------------------------------------------------------------

_VLLM_START = "INFO 11-30 23:01:02 [api_utils.py:330] vLLM server version 0.32.0, serving model m"
_LOGO = (
    "INFO 11-30 23:01:02 [api_utils.py:345] \x1b[1m█     █     █▄   ▄█\x1b[0m\n"
    "INFO 11-30 23:01:02 [api_utils.py:345]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version "
    "\x1b[1m0.32.1rc1\x1b[0m\n"
    "INFO 11-30 23:01:02 [api_utils.py:345]   █▄█▀ █     █     █     █  model   \x1b[1mm\x1b[0m"
)
_ACTIVE = (
    "INFO 11-30 23:01:00 [plugin.py:80] dsv4-attention 0.2.0: active on vLLM 0.32.0 (cuda); "
    "replaced: combine_topk_swa_indices, compute_global_topk_indices_and_lens"
)
_INACTIVE = (
    "WARNING 11-30 23:01:00 [plugin.py:70] dsv4-attention 0.2.0: inactive on vLLM 0.33.0: "
    "vLLM 0.33.0 is not a supported version (0.32.x)"
)


@pytest.mark.parametrize(
    ("text", "state", "version"),
    [
        (f"{_ACTIVE}\n{_ACTIVE}\n{_VLLM_START}", "active", "0.32.0"),
        (f"{_INACTIVE}\n{_LOGO}", "inactive", "0.32.1rc1"),
        (f"{_VLLM_START}\nINFO other line", "absent", "0.32.0"),
        (f"{_ACTIVE}\n{_INACTIVE}", "mixed", None),
        ("", "absent", None),
    ],
)
def test_server_log_says_what_served_the_run(text: str, state: str, version: str | None) -> None:
    from dsv4_presets.compare.server_log import parse_server_log

    seen = parse_server_log(text)
    assert seen["plugin"]["state"] == state
    assert seen["vllm_version"] == version
    if state == "active":
        plugin = seen["plugin"]
        assert plugin["replaced"] == [
            "combine_topk_swa_indices",
            "compute_global_topk_indices_and_lens",
        ]
        assert plugin["vllm_version"] == "0.32.0" and plugin["plugin_version"] == "0.2.0"
        assert [line["platform"] for line in plugin["lines"]] == ["cuda", "cuda"]
    if state == "inactive":
        assert seen["plugin"]["reason"].startswith("vLLM 0.33.0 is not a supported version")
        assert seen["plugin"]["vllm_version"] == "0.33.0"


def test_runner_records_and_report_shows_what_served_each_run(tmp_path: Path) -> None:
    from dsv4_presets.compare.runner import _served_by

    log = tmp_path / "server.log"
    log.write_text(f"{_ACTIVE}\n{_VLLM_START}\n")
    served = _served_by(log, "9.9.9")
    assert served["vllm_version"] == "0.32.0" and served["vllm_version_source"] == "server.log"
    assert served["plugin"]["state"] == "active"
    log.write_text("no start-up line\n")
    fallback = _served_by(log, "0.32.0")
    assert fallback["vllm_version_source"] == "GET /version"
    assert fallback["plugin"]["state"] == "absent"
    text = report.render_markdown(
        {
            "variants": {"A": {"display": "A", "spec": "x"}, "B": {"display": "B", "spec": "y"}},
            "bench": {"name": "b", "num_prompts": 1},
            "runs": [
                {
                    "label": "A1",
                    "display": "A",
                    "status": "failed",
                    "reason": "r",
                    "server_log": "runs/01-A1/server.log",
                    "served_by": served,
                },
                {
                    "label": "B1",
                    "display": "B",
                    "status": "failed",
                    "reason": "r",
                    "server_log": "runs/02-B1/server.log",
                    "served_by": fallback,
                },
            ],
            "pairs": [],
            "confidence": 0.95,
            "summary": {
                "output_throughput": {"paired_interval": {"undefined_reason": "n"}},
                "mean_tpot_ms": {
                    "paired_interval": {"undefined_reason": "n"},
                    "request_bootstrap": {"undefined_reason": "n", "resamples": 1},
                },
                "mean_itl_ms": {"request_bootstrap": {"undefined_reason": "n", "resamples": 1}},
            },
            "not_run": [],
        }
    )
    assert "| A1 | 0.32.0 | active (0.2.0; replaced: combine_topk_swa_indices, " in text
    assert (
        "| B1 | 0.32.0 (from GET /version) | absent (no dsv4-attention line: not installed" in text
    )
