"""The benchmark's bookkeeping: whose git sha a result records, what a CPU smoke run
claims, and the plot's colours.  (The providers themselves are checked by the
benchmark before it times them; ``python -m benchmarks.kernels`` runs them on CPU.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from benchmarks import harness, report
from benchmarks.harness import FLOOR, Result


def _git(root: Path, *args: str) -> str:
    res = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


def test_git_sha_only_from_the_projects_own_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the tree inside another checkout records "unknown", not that checkout's sha."""
    monkeypatch.delenv("DSV4_GIT_SHA", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("x\n")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    copy = tmp_path / "copy-of-dsv4-serving"
    copy.mkdir()
    assert harness.git_sha(copy) == "unknown"
    assert harness.git_sha(tmp_path) == _git(tmp_path, "rev-parse", "--short=12", "HEAD")
    (tmp_path / "f.txt").write_text("y\n")
    assert harness.git_sha(tmp_path).endswith("-dirty")
    assert harness.git_sha(tmp_path / "no-such-dir") == "unknown"
    monkeypatch.setenv("DSV4_GIT_SHA", "abc123")
    assert harness.git_sha(copy) == "abc123"


def _result(kernel: str, provider: str, case: str, p50: float) -> Result:
    return Result(kernel, provider, case, 16384, p50, p50, p50, 1.0, 100, {"issue_matrix": True})


RESULTS = [
    _result(kernel, provider, case, p50)
    for kernel, providers in (
        ("combine_topk_swa_indices", ("dsv4-kernels", "per-request-workers-256", FLOOR)),
        ("quantize_and_insert_k_cache", ("dsv4-kernels", "torch-copy-same-bytes", FLOOR)),
        ("dequantize_and_gather_k_cache", ("per-request-workers-128", "dsv4-kernels", FLOOR)),
    )
    for case in ("c4a-1x16384", "1x16384")
    for provider, p50 in zip(providers, (2.0, 3.0, 1.0), strict=True)
]


def test_cpu_smoke_summary_gives_no_verdicts() -> None:
    smoke = report.summarise(RESULTS, smoke=True)
    assert "[MET" not in smoke and "[MISS" not in smoke and "not evaluated" in smoke
    gpu = report.summarise(RESULTS, smoke=False)
    assert "[MET" in gpu or "[MISS" in gpu  # the same results on a GPU run do get verdicts
    # --smoke on a GPU: no verdict either, and no claim that it ran on a CPU
    small = report.summarise(RESULTS, smoke=True, gpu=True)
    assert "not evaluated" in small and "CPU" not in small and "[M" not in small


def test_each_provider_has_one_colour_in_every_panel() -> None:
    colours = report.provider_colours(RESULTS)
    providers = {r.provider for r in RESULTS}
    assert set(colours) >= providers
    assert len({colours[p] for p in providers}) == len(providers)
    # the colour does not depend on the order the kernels come in
    assert (
        report.provider_colours(list(reversed(RESULTS)))["dsv4-kernels"] == colours["dsv4-kernels"]
    )


def test_a_peer_that_cannot_run_is_said_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case and every kernel asks whether FlashMLA loads; the run says why not once."""
    monkeypatch.setattr(harness, "_SAID", set())
    said: list[str] = []
    for _ in range(4):
        harness.not_run("FlashMLA", "FlashMLA needs a CUDA GPU", said.append)
    harness.not_run("FlashMLA", "FlashMLA is not built at /tmp/fmla", said.append)
    assert said == [
        "FlashMLA: not run (FlashMLA needs a CUDA GPU)",
        "FlashMLA: not run (FlashMLA is not built at /tmp/fmla)",  # another reason is news
    ]
