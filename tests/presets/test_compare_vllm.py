"""``dsv4 compare`` end to end against real vLLM CPU servers (the ``vllm`` nox session).

A tiny random Llama (``_tiny_model.py``, ``--load-format dummy``) is served
for real, in float32 (``--dtype float32``: vLLM-CPU's bf16 attention needs
working AMX, see ``_tiny_model.py``).  Server starts cost about 30-90 s each
on a small CPU machine, so the scenarios share starts where that stays honest:

* A/B/A with two real differing settings (``max-num-seqs`` 8 vs 1), killed
  outright (SIGKILL) right after the first run finished and the B server was
  started, then resumed: 3 full starts + 1 start cut short.
* A then B where B's server fails at start (a ``max-model-len`` beyond the
  model's): 1 full start + 1 failing start.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _process import group_alive
from _tiny_model import DTYPE, write_tiny_llama, write_tiny_serve_preset

from dsv4_presets.compare.report import per_request_tpot_ms
from dsv4_presets.vllm_launcher import providing_distribution

# Starts real vLLM servers: needs a runnable CPU build (vllm_serve: the 0.32 session only).
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_serve, pytest.mark.slow]

NUM_PROMPTS = 8


def _plugin_installed() -> bool:
    """Whether vLLM's plugin loader will find dsv4-attention in this environment."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any("dsv4" in ep.name or "dsv4" in ep.value for ep in plugins)


@dataclass(frozen=True)
class Setup:
    serve: Path
    bench: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("compare")
    model = write_tiny_llama(root / "tiny-llama")
    # float32, not the CPU's bf16 path (see _tiny_model.DTYPE)
    serve = write_tiny_serve_preset(root / "tiny.yaml", model)
    bench = root / "bench.yaml"
    bench.write_text(
        "backend: vllm\ndataset-name: random\nrandom-input-len: 32\nrandom-output-len: 16\n"
        f"num-prompts: {NUM_PROMPTS}\nnum-warmups: 1\nrequest-rate: inf\nignore-eos: true\n"
        "temperature: 0\nseed: 0\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    return Setup(serve, bench, env)


def _compare(setup: Setup, out: Path, a: str, b: str, pattern: str) -> list[str]:
    return [
        sys.executable, "-m", "dsv4_presets.cli", "compare",
        "--a", a, "--b", b, "--pattern", pattern,
        "--bench", str(setup.bench), "--no-validate", "--out", str(out),
        "--health-timeout", "900", "--bench-timeout", "600", "--stop-grace", "30",
        "--warmup-requests", "1", "--bootstrap-resamples", "500", "--no-progress",
    ]  # fmt: skip


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(
                f"campaign exited ({proc.returncode}) before {path.name}:\n"
                + log.read_text()[-3000:]
            )
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout:.0f}s:\n" + log.read_text()[-3000:])
        time.sleep(0.1)


def _assert_served_in_float32(run_dir: Path) -> None:
    """The run's server was asked for float32 and vLLM says it ran the model so."""
    server = json.loads((run_dir / "command.json").read_text())["server"]
    assert server[server.index("--dtype") + 1] == DTYPE
    assert f"dtype=torch.{DTYPE}," in (run_dir / "server.log").read_text()


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Process groups to kill if a test fails half-way (never a broad kill)."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)


def test_aba_killed_then_resumed(setup: Setup, tmp_path: Path, reaper: list[int]) -> None:
    out = tmp_path / "aba"
    cmd = _compare(
        setup,
        out,
        f"{setup.serve} label:seqs8",
        # B also switches the dsv4-attention plugin off: its server log must say so.
        f"{setup.serve} max-num-seqs=1 env:DSV4_KERNELS_DISABLE=1 label:seqs1",
        "ABA",
    )
    log = tmp_path / "first.log"
    with open(log, "wb") as fh:
        first = subprocess.Popen(cmd, env=setup.env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait_for(out / "runs" / "01-A1" / "result.json", first, 900, log)
        pid_file = out / "runs" / ".02-B1.partial" / "server.pid"
        _wait_for(pid_file, first, 120, log)
        orphan = json.loads(pid_file.read_text())["pid"]
        reaper.append(orphan)
        first.kill()  # SIGKILL: no clean-up at all
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert group_alive(orphan), "the killed campaign's B server should still be running"
    a1 = out / "runs" / "01-A1"
    a1_result = (a1 / "result.json").read_bytes()
    a1_bench = (a1 / "bench.json").read_bytes()

    resumed = subprocess.run(cmd, env=setup.env, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-5000:]
    assert "orphaned server process group" in resumed.stderr
    assert not group_alive(orphan)
    assert "A1: already ok (resumed)" in resumed.stderr
    assert "discarding unfinished run folder .02-B1.partial" in resumed.stderr
    # The finished run was not touched; nothing partial is left.
    assert (a1 / "result.json").read_bytes() == a1_result
    assert (a1 / "bench.json").read_bytes() == a1_bench
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["01-A1", "02-B1", "03-A2"]

    # Each run folder holds its spec, command, environment, versions, logs and vLLM's JSON.
    results = {}
    for folder in ("01-A1", "02-B1", "03-A2"):
        run_dir = out / "runs" / folder
        for name in (
            "spec.json",
            "command.json",
            "environment.json",
            "versions.json",
            "server.log",
            "bench.log",
            "bench.json",
            "result.json",
        ):
            assert (run_dir / name).is_file(), f"{folder}/{name} missing"
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "ok", result
        _assert_served_in_float32(run_dir)
        assert result["metrics"]["completed"] == NUM_PROMPTS
        assert result["metrics"]["failed"] == 0
        assert result["server"]["stopped_by"] == "SIGTERM"
        assert result["gpu_release"]["checked"] is False  # no nvidia-smi on this machine
        versions = json.loads((run_dir / "versions.json").read_text())
        installed = importlib.metadata.version(providing_distribution())
        assert versions["vllm_server"] == installed
        # What served the run, read from its server.log: vLLM's start-up line and
        # the dsv4-attention plugin's line (absent when the plugin is not installed).
        served = result["served_by"]
        assert served == versions["served_by"]
        assert served["vllm_version"] == installed
        assert served["vllm_version_source"] == "server.log"
        plugin = served["plugin"]
        if _plugin_installed() and folder == "02-B1":
            # Switched off: the plugin says so at start-up, with the reason.
            assert plugin["state"] == "inactive", plugin
            assert plugin["vllm_version"] == installed
            assert "DSV4_KERNELS_DISABLE" in plugin["reason"]
        elif _plugin_installed():
            # Installed and on: whatever it decided for this platform and model is
            # what its own line says (absent if it never had to decide).
            assert plugin["state"] in ("active", "inactive", "absent"), plugin
            assert all(line["vllm_version"] == installed for line in plugin["lines"])
            assert "DSV4_KERNELS_DISABLE" not in str(plugin.get("reason"))
        else:
            assert plugin == {"state": "absent", "lines": []}, plugin
        results[folder] = result

    # The two settings really differed in the servers that ran.
    a_log = (out / "runs" / "01-A1" / "server.log").read_text()
    b_log = (out / "runs" / "02-B1" / "server.log").read_text()
    assert "'max_num_seqs': 8" in a_log and "'max_num_seqs': 1" not in a_log
    assert "'max_num_seqs': 1" in b_log
    b_cmd = json.loads((out / "runs" / "02-B1" / "command.json").read_text())
    assert b_cmd["server"][b_cmd["server"].index("--max-num-seqs") + 1] == "1"
    ports = {r["port"] for r in results.values()}
    assert len(ports) == 3  # every run on its own port

    # The report is built from the saved results.
    report = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["ok", "ok", "ok"]
    (pair,) = report["pairs"]
    assert pair["b"] == "B1" and pair["a"] == ["A1", "A2"]
    thr = {k: r["metrics"]["output_throughput"] for k, r in results.items()}
    a_mean = (thr["01-A1"] + thr["03-A2"]) / 2
    expected = (thr["02-B1"] - a_mean) / a_mean * 100
    assert pair["output_throughput"]["relative_change_pct"] == pytest.approx(expected)
    # One request at a time against up to eight: B's throughput is far lower.
    assert expected < 0
    paired = report["summary"]["output_throughput"]["paired_interval"]
    assert paired["low"] is None and "one pair" in paired["undefined_reason"]
    boot = report["summary"]["mean_tpot_ms"]["request_bootstrap"]
    assert boot["low"] is not None and boot["low"] <= boot["estimate"] <= boot["high"]
    # Per-request TPOTs recomputed from vLLM's detailed JSON average to vLLM's mean TPOT.
    for folder, result in results.items():
        bench = json.loads((out / "runs" / folder / "bench.json").read_text())
        tpots = [t for (t,) in per_request_tpot_ms(bench)]
        assert len(tpots) == NUM_PROMPTS
        assert sum(tpots) / len(tpots) == pytest.approx(result["metrics"]["mean_tpot_ms"])
    md = (out / "report.md").read_text()
    a1m = results["01-A1"]["metrics"]
    assert (
        f"| A1 | seqs8 | {a1m['output_throughput']:.2f} tokens/s | {a1m['mean_tpot_ms']:.2f} ms |"
        in md
    )
    assert md in resumed.stdout
    assert "## Servers (read from each run's server.log)" in md
    for label in ("A1", "B1", "A2"):
        assert f"| {label} | {installed} | " in md
    if report.get("plot"):
        assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_b_fails_at_start(setup: Setup, tmp_path: Path) -> None:
    out = tmp_path / "fail"
    cmd = _compare(
        setup, out, str(setup.serve), f"{setup.serve} max-model-len=100000 label:broken", "AB"
    )
    done = subprocess.run(cmd, env=setup.env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 1, done.stdout + done.stderr[-5000:]
    report = json.loads((out / "report.json").read_text())
    a_run, b_run = report["runs"]
    assert a_run["status"] == "ok" and b_run["status"] == "failed"
    assert b_run["reason"].startswith("server exited with code")
    assert report["failed_runs"] == ["B1"]
    assert report["pairs"] == []
    b_dir = out / "runs" / "02-B1"
    b_result = json.loads((b_dir / "result.json").read_text())
    assert "max_model_len" in (b_dir / "server.log").read_text()
    assert any("max_model_len" in line for line in b_result["log_tail"])
    # A's run is intact and complete.
    a_dir = out / "runs" / "01-A1"
    _assert_served_in_float32(a_dir)
    b_server = json.loads((b_dir / "command.json").read_text())["server"]
    assert b_server[b_server.index("--dtype") + 1] == DTYPE
    a_result = json.loads((a_dir / "result.json").read_text())
    assert a_result["status"] == "ok"
    assert a_result["metrics"]["completed"] == NUM_PROMPTS
    bench = json.loads((a_dir / "bench.json").read_text())
    assert bench["completed"] == NUM_PROMPTS and bench["failed"] == 0
    md = (out / "report.md").read_text()
    assert "| B1 | broken | FAILED: server exited with code" in md
    assert "runs/02-B1/server.log" in md
    assert "interval undefined: no complete pair" in md
    assert not list((out / "runs").glob(".*"))
