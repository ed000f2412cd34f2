"""What a CPU smoke run prints (``table.md``, the per-token and decode summaries, the run's
log): banner kept, times only (no bold, speed-ups, floor ratios, rates, bandwidth, columns
of providers that did not run, tables without rows), while a GPU run keeps all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from benchmarks import cases_decode, cases_sparse_mla, harness, report
from benchmarks.harness import FLOOR, Result

ENV = {"gpu": "cpu", "torch": "2.13.0", "triton": "3.7.0", "git_sha": "abc", "mode": "cpu-smoke"}


def _row(kernel: str, provider: str, case: str, p50: float) -> Result:
    return Result(kernel, provider, case, 64, p50, p50, p50, 0.001, 100, {})


# Interpreter times against a tiny floor: the kind of row that printed "149545x".
ROWS = [
    _row("combine_topk_swa_indices", provider, case, p50)
    for case in ("c4a-1x64", "swa-2x32")
    for provider, p50 in (
        ("per-request-workers-128", 50.0),
        ("per-request-workers-256", 40.0),
        ("dsv4-kernels", 149545.0),
        (FLOOR, 1.0),
    )
]


def _table(tmp_path: Path, mode: str) -> str:
    text = report.write_table(ROWS, {**ENV, "mode": mode}, tmp_path / "table.md", "cmd")
    assert (tmp_path / "table.md").read_text() == text
    return text


def test_smoke_table_keeps_the_banner_and_shows_times_only(tmp_path: Path) -> None:
    text = _table(tmp_path, "cpu-smoke")
    assert text.startswith("**CPU smoke run**")
    assert "say nothing about GPU speed" in text
    body = text.split("### combine_topk_swa_indices", 1)[1]
    assert "**" not in body
    assert "x |" not in body and "149545.00x" not in text
    for word in ("speed-up", "floor", "256 vs 128", "faster"):
        assert word not in body, word
    header = next(line for line in body.splitlines() if line.startswith("| case"))
    assert header == (
        "| case | tokens | per-request-workers-128 | per-request-workers-256 | dsv4-kernels |"
    )
    assert "| c4a-1x64 | 64 | 50.00 | 40.00 | 149545.00 |" in body


def test_gpu_table_still_bolds_ours_and_prints_ratios(tmp_path: Path) -> None:
    text = _table(tmp_path, "gpu")
    assert "CPU smoke run" not in text
    assert "**149545.00**" in text
    assert "ours / floor" in text and "149545.00x" in text
    assert "speed-up vs per-request-workers-256" in text


# ---- issue 31: a smoke run shows what it can honestly show, and nothing else ----
#
# Results shaped like each kind of run: a CPU smoke run (interpreter wall clock, FlashMLA
# not run, no graphs) and a GPU run (the same kernels with FlashMLA and the floor).

DECODE = cases_decode.KERNEL
PER_TOKEN = "sparse_mla"
CPU_WHY = {
    cases_decode.FLASHMLA: "FlashMLA needs a CUDA GPU",
    cases_decode.VLLM_FLASHMLA: "vLLM 0.33.0's bundled FlashMLA needs a CUDA GPU",
}


def _decode_row(provider: str, case: str, p50: float, gpu: bool, floor_us: float) -> Result:
    params = {"layer": case.split("-")[0], "model": "h8", "heads": 8, "tokens": 2,
              "per_request": 1, "keys_mean": 140.0, "calls_per_graph": 8 if gpu else 2,
              "splits": 3, "chunk": 64, "seed": 1, "graph": gpu}  # fmt: skip
    return Result(DECODE, provider, case, 2, p50, p50, p50, floor_us, 1000, params)


def _decode_results(gpu: bool, peers: tuple[str, ...] = ()) -> list[Result]:
    floor = 4.0 if gpu else 0.03  # on a CPU: bytes over the host's copy bandwidth
    out = []
    for case in ("c4a-h8-t2", "c128a-h8-t2"):
        out.append(_decode_row(cases_decode.OURS, case, 10.0 if gpu else 106189.0, gpu, floor))
        out += [_decode_row(peer, case, 15.0, gpu, floor) for peer in peers]
        out.append(_decode_row(FLOOR, case, floor, gpu, floor))
    return out


def _per_token_results() -> list[Result]:
    params = {"heads": 8, "keys_mean": 144.0, "keys_total": 864}
    return [
        Result(PER_TOKEN, provider, "c4a-h8-1x6@300", 6, p50, p50, p50, 0.02, 600_000, params)
        for provider, p50 in (("dsv4-kernels", 334785.0), ("dsv4-kernels+index", 431638.0),
                              (FLOOR, 0.02))
    ]  # fmt: skip


def _tables_have_rows(text: str) -> None:
    """Every markdown table's separator line is followed by at least one row."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            assert i + 1 < len(lines) and lines[i + 1].startswith("| "), (
                f"a table without rows: {lines[i - 1]!r}"
            )


def _no_speed_figures(text: str) -> None:
    """What an interpreter wall-clock run cannot honestly show."""
    for word in ("nan", "TF/s", "GB/s", "bandwidth", "floor", "**", "graph-replayed"):
        assert word not in text, f"{word!r} in a CPU smoke output:\n{text}"
    assert not re.search(r"\dx \|", text), f"a ratio in a CPU smoke output:\n{text}"


def test_cpu_decode_summary_shows_times_only_and_says_once_why_flashmla_did_not_run() -> None:
    text, table = cases_decode.summarise(_decode_results(gpu=False), smoke=True, why_not=CPU_WHY)
    _no_speed_figures(text)
    _tables_have_rows(text)
    head = text.splitlines()[0]
    assert head == "| case | layer | heads | tokens | per req | splits | ours us |"
    assert "| c4a-h8-t2 | c4a | 8 | 2 | 1 | 3 | 106189.00 |" in text
    assert text.count("FlashMLA: not run (FlashMLA needs a CUDA GPU)") == 1
    assert text.count("vLLM 0.33 bundled FlashMLA: not run (vLLM 0.33.0's bundled") == 1
    assert "No dispatch summary" in text and "geomean" not in text  # no empty table
    assert table == {}


def test_gpu_decode_summary_keeps_its_peers_floor_and_dispatch_table() -> None:
    peers = (cases_decode.FLASHMLA, cases_decode.VLLM_FLASHMLA)
    text, table = cases_decode.summarise(_decode_results(gpu=True, peers=peers), why_not={})
    assert text.splitlines()[0] == (
        "| case | layer | heads | tokens | per req | splits | ours us | FlashMLA us | "
        "FlashMLA / ours | vLLM 0.33 FlashMLA us | vLLM 0.33 FlashMLA / ours | floor us | "
        "ours / floor |"
    )
    assert "| c4a-h8-t2 | c4a | 8 | 2 | 1 | 3 | **10.00** | 15.00 | 1.50x | 15.00 | 1.50x | " \
        "4.00 | 2.50x |" in text  # fmt: skip
    assert "nan" not in text and "not run" not in text
    _tables_have_rows(text)
    # the dispatch table; no MTP steps in these results: "-", not "nanx"
    assert "| c4a | 8 | 1.50x | 1.50x | 1/1 | 1/1 | - |" in text
    assert table["c4a/8"]["ratios"] == {2: 1.5}


def test_gpu_decode_summary_drops_a_peer_that_did_not_run_and_dashes_a_refused_case() -> None:
    results = _decode_results(gpu=True, peers=(cases_decode.FLASHMLA, cases_decode.VLLM_FLASHMLA))
    # vLLM's build refused one case (said at run time): "-" there, not nan
    refused = (cases_decode.VLLM_FLASHMLA, "c128a-h8-t2")
    results = [r for r in results if (r.provider, r.case) != refused]
    text, _ = cases_decode.summarise(results, why_not={})
    assert "nan" not in text
    assert "| c128a-h8-t2 | c128a | 8 | 2 | 1 | 3 | **10.00** | 15.00 | 1.50x | - | - |" in text
    # FlashMLA not built on this GPU: its columns go, one line says why; the floor stays
    why = {cases_decode.FLASHMLA: "FlashMLA is not built at /tmp/fmla"}
    gpu_only_ours = _decode_results(gpu=True)
    text, _ = cases_decode.summarise(gpu_only_ours, why_not=why)
    assert "FlashMLA us" not in text and "nan" not in text
    assert "floor us" in text and "ours / floor" in text and "2.50x" in text
    assert text.count("FlashMLA: not run (FlashMLA is not built at /tmp/fmla)") == 1
    _tables_have_rows(text)


def test_per_token_table_on_cpu_has_no_rates_or_floor_on_gpu_keeps_them() -> None:
    results = _per_token_results()
    cpu = cases_sparse_mla.summarise_per_token(results, PER_TOKEN, smoke=True)
    _no_speed_figures(cpu)
    _tables_have_rows(cpu)
    assert cpu.splitlines()[0] == "| case | heads | keys/token | provider | ns/token |"
    assert len(cpu.splitlines()) == 2 + 2  # head, separator, ours and ours+index: no floor row
    gpu = cases_sparse_mla.summarise_per_token(results, PER_TOKEN)
    assert "useful TF/s" in gpu and "GB/s (floor bytes)" in gpu
    assert "| floor |" in gpu and len(gpu.splitlines()) == 2 + 3


def test_smoke_table_has_a_column_only_for_providers_that_ran(tmp_path: Path) -> None:
    launch = [_row("empty_triton_launch", "triton", "launch", 528.0),
              _row("empty_triton_launch", FLOOR, "launch", 0.0)]  # fmt: skip
    env = {**ENV, "copy_bandwidth_gbps": "39.8"}
    text = report.write_table(ROWS + launch, env, tmp_path / "table.md", "cmd")
    body = text.split("### empty_triton_launch", 1)[1]
    assert "| case | tokens | triton |" in body and "dsv4-kernels" not in body
    assert "| launch | 64 | 528.00 |" in body
    assert "copy bandwidth" not in text and "GB/s" not in text and "nan" not in text
    _tables_have_rows(text)
    gpu = report.write_table(ROWS + launch, {**env, "mode": "gpu"}, tmp_path / "g.md", "cmd")
    assert "copy bandwidth 39.8 GB/s" in gpu  # a GPU run keeps its columns and bandwidth
    assert (
        "| case | tokens | triton | dsv4-kernels | speed-up vs triton | floor | ours / floor |"
        in gpu
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run is the one without CUDA")
def test_a_real_smoke_run_prints_no_figure_it_cannot_stand_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m benchmarks.kernels`` on a CPU: the launch case and one decode case."""
    from benchmarks import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(harness, "_SAID", set())
    monkeypatch.setattr(harness, "NOT_RUN", [])
    monkeypatch.setattr(cases_decode, "SMOKE", cases_decode.SMOKE[:1])
    assert kernels.main(["--only", "empty_triton_launch,sparse_mla_decode", "--out",
                         str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    log, tables = out.split("**CPU smoke run**", 1)
    assert log.startswith("=" * 78) and "CPU SMOKE RUN" in log
    tables = tables.split("\n\n", 1)[1]  # after table.md's banner
    _no_speed_figures(tables)
    for word in ("nan", "TF/s", "GB/s", "bandwidth", "graph-replayed"):
        assert word not in log, word
    _tables_have_rows(tables)
    for peer in ("FlashMLA", "vLLM 0.33 bundled FlashMLA"):
        said = [line for line in log.splitlines() if line.startswith(f"{peer}: not run (")]
        assert len(said) == 1, (peer, said)  # once for the run, not once per case
    # the decode progress line gives the time per call, as the tables do
    result = next(
        json.loads(line)
        for line in (tmp_path / "results.jsonl").read_text().splitlines()
        if json.loads(line)["provider"] == cases_decode.OURS
    )
    case, p50 = result["case"], result["p50_us"]
    assert f"{p50:9.2f} us per call (2 calls per timed run)" in log
    assert f"| {case} | 1 | {p50:.2f} |" in tables  # the kernel table
    assert f"| {case} | c4a | 3 | 1 | 1 | " in tables and f" | {p50:.2f} |" in tables
    assert "| case | tokens | triton |\n" in tables  # no column for ours, which did not run
    assert "Targets: not evaluated" in tables
    # table.md says once which peers did not run, and why (no "unavailable" line besides)
    said = [line for line in tables.splitlines() if line.startswith("Not run: ")]
    assert len(said) == 1 and "unavailable" not in tables
    assert "FlashMLA (FlashMLA needs a CUDA GPU)" in said[0]
    assert "vLLM 0.33 bundled FlashMLA (vLLM 0.33.0's bundled FlashMLA needs" in said[0]
    decode_md = (tmp_path / "decode.md").read_text().splitlines()
    assert sum(line.startswith("FlashMLA: not run (") for line in decode_md) == 1


def test_the_table_says_once_which_peers_did_not_run(tmp_path: Path) -> None:
    why = "vLLM 0.33.0's bundled FlashMLA needs a CUDA GPU"
    not_run = f"FlashMLA (FlashMLA needs a CUDA GPU); vLLM 0.33 bundled FlashMLA ({why})"
    env = {**ENV, "vllm_flashmla": f"unavailable: {why}", "not_run": not_run}
    text = report.write_table(ROWS, env, tmp_path / "table.md", "cmd")
    assert text.count("not run") + text.count("Not run") == 1 and "unavailable" not in text
    assert f"Not run: {not_run}." in text
    # a GPU run with both peers loaded: its status line as before, no "Not run" line
    loaded = {**ENV, "mode": "gpu", "vllm_flashmla": "loaded from /x (vllm 0.33.0)"}
    text = report.write_table(ROWS, loaded, tmp_path / "gpu.md", "cmd")
    assert "vLLM 0.33 bundled FlashMLA: loaded from /x (vllm 0.33.0)" in text
    assert "not run" not in text.lower()
