"""dsv4 compare without vLLM: SPEC grammar, run plan, CLI, the campaign runner."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _process import group_alive

from dsv4_presets import local_http
from dsv4_presets.compare import campaign, cli, process, report, runner
from dsv4_presets.compare.spec import parse_spec, plan_runs

# ---------------------------------------------------------------------------
# SPEC grammar and run plan
# ---------------------------------------------------------------------------


def test_parse_spec_all_token_kinds() -> None:
    spec = parse_spec(
        "h200-tp8-ep max-num-batched-tokens=8192 --block-size=256 env:DSV4_KERNELS_DISABLE=1 "
        "\"env:NOTE=a b\" vllm:'/opt/old/bin/python -m vllm.entrypoints.cli.main' label:old",
        variant="B",
    )
    assert spec.source == "h200-tp8-ep"
    assert spec.sets == ("max-num-batched-tokens=8192", "block-size=256")
    assert spec.env == (("DSV4_KERNELS_DISABLE", "1"), ("NOTE", "a b"))
    assert spec.vllm == ("/opt/old/bin/python", "-m", "vllm.entrypoints.cli.main")
    assert spec.label == "old" and spec.display == "old"
    plain = parse_spec("./my preset.yaml".replace(" ", "\\ "), variant="A")
    assert plain.source == "./my preset.yaml" and plain.display == "A"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "--a: expected a serve preset"),
        ("max-num-seqs=1", "--a: the first word"),
        ("p bogus", "--a: expected KEY=VALUE"),
        ("p env:1BAD=x", "valid environment variable"),
        ("p vllm:", "vllm: needs a command"),
        ("p label:", "label: needs a text"),
        ("p 'unclosed", "cannot split"),
    ],
)
def test_parse_spec_errors_name_the_argument(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(text, variant="A")


def test_plan_runs_labels_and_folders() -> None:
    runs = plan_runs("aba", 2)
    assert [r.label for r in runs] == ["A1", "B1", "A2", "A3", "B2", "A4"]
    assert [r.folder for r in runs][:2] == ["01-A1", "02-B1"]
    assert [r.variant for r in plan_runs("ABBA")] == ["A", "B", "B", "A"]
    for pattern, repeats, match in [
        ("AXA", 1, "only the letters"),
        ("AAA", 1, "both A and B"),
        ("", 1, "nothing"),
        ("ABA", 0, "--repeats"),
        ("AB", 150, "exceed"),
    ]:
        with pytest.raises(ValueError, match=match):
            plan_runs(pattern, repeats)


# ---------------------------------------------------------------------------
# CLI through the presets module (no vLLM needed for a dry run)
# ---------------------------------------------------------------------------


def _write_presets(tmp_path: Path) -> tuple[Path, Path]:
    serve = tmp_path / "tiny.yaml"
    serve.write_text(
        "model: /models/tiny\nload-format: dummy\nmax-model-len: 256\nmax-num-seqs: 8\n"
    )
    bench = tmp_path / "bench.yaml"
    bench.write_text(
        "backend: vllm\ndataset-name: random\nrandom-input-len: 32\nrandom-output-len: 8\n"
        "num-prompts: 4\nnum-warmups: 1\nrequest-rate: inf\nignore-eos: true\n"
    )
    return serve, bench


def test_cli_dry_run_renders_both_variants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSV4_VLLM", "myvllm --flag")
    serve, bench = _write_presets(tmp_path)
    code = cli.main(
        [
            "--a", str(serve),
            "--b", f"{serve} max-num-seqs=1 env:DSV4_KERNELS_DISABLE=1 vllm:othervllm label:one",
            "--bench", str(bench),
            "--no-validate", "--dry-run", "--out", str(tmp_path / "camp"),
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    lines = captured.out.splitlines()
    servers = [line for line in lines if line.strip().startswith("server:")]
    assert servers[0].split("server: ")[1].startswith("myvllm --flag serve /models/tiny")
    assert "--max-num-seqs 8" in servers[0]
    assert servers[1].split("server: ")[1].startswith("othervllm serve /models/tiny")
    assert "--max-num-seqs 1" in servers[1]
    assert "env: DSV4_KERNELS_DISABLE=1" in captured.out
    bench_line = next(line for line in lines if line.startswith("bench:"))
    assert "myvllm --flag bench serve" in bench_line
    assert "--num-prompts 4" in bench_line and "--save-detailed" in bench_line
    assert "--result-filename bench.json" in bench_line
    assert "runs: A1 B1 A2" in captured.out
    assert "validation skipped (--no-validate)" in captured.err
    assert not (tmp_path / "camp").exists()  # a dry run starts and writes nothing


def test_cli_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve, bench = _write_presets(tmp_path)
    assert cli.main(["--a", str(serve), "--bench", str(bench), "--no-validate"]) == 2
    assert "--a and --b" in capsys.readouterr().err
    args = ["--a", str(serve), "--b", f"{serve} nonsense", "--bench", str(bench), "--no-validate"]
    assert cli.main(args) == 2
    assert "--b: expected KEY=VALUE" in capsys.readouterr().err
    args = ["--a", str(tmp_path / "missing.yaml"), "--b", str(serve), "--no-validate"]
    assert cli.main([*args, "--bench", str(bench)]) == 2
    assert "--a:" in capsys.readouterr().err
    args = ["--a", str(serve), "--b", str(serve), "--pattern", "AXB", "--no-validate"]
    assert cli.main(args) == 2
    assert "--pattern" in capsys.readouterr().err


def test_cli_resume_refuses_a_different_campaign(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    serve, bench = _write_presets(tmp_path)
    out = tmp_path / "camp"
    out.mkdir()
    (out / "campaign.json").write_text(json.dumps({"identity": {"runs": [["A1", "A"]]}}))
    args = ["--a", str(serve), "--b", f"{serve} max-num-seqs=2", "--bench", str(bench)]
    assert cli.main([*args, "--no-validate", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds a different campaign" in err and "runs" in err
    assert not (out / "runs").exists()


def _no() -> bool:
    return False


def test_cli_validation_rejects_non_dsv4_preset_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only our rules here (vLLM's parser is exercised in the vllm session).
    monkeypatch.setattr(importlib.import_module("dsv4_presets.validate"), "vllm_available", _no)
    serve, bench = _write_presets(tmp_path)
    args = ["--a", str(serve), "--b", f"{serve} max-num-seqs=1", "--bench", str(bench)]
    assert cli.main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--a: the preset does not pass validation" in err
    assert "kv-cache-dtype" in err and "--no-validate" in err
    assert cli.main([*args, "--dry-run", "--no-validate"]) == 0
    assert "validation skipped" in capsys.readouterr().out


def test_cli_shipped_preset_passes_rules_and_differs_only_by_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.import_module("dsv4_presets.validate"), "vllm_available", _no)
    code = cli.main(
        ["--a", "h200-tp8-ep", "--b", "h200-tp8-ep env:DSV4_KERNELS_DISABLE=1", "--dry-run"]
    )
    out = capsys.readouterr().out
    assert code == 0
    servers = [line.split("server: ")[1] for line in out.splitlines() if "server: " in line]
    assert len(servers) == 2 and servers[0] == servers[1]
    assert "--kv-cache-dtype fp8 --block-size 256" in servers[0]
    assert out.count("validation passed") == 2
    assert "env: DSV4_KERNELS_DISABLE=1" in out


def test_cli_multi_node_preset_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--a", "dp16-ep-2node", "--b", "h200-tp8-ep", "--dry-run"]) == 2
    assert "multi-node" in capsys.readouterr().err


def test_dsv4_command_registers_compare(capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4_presets.cli import main as dsv4_main

    with pytest.raises(SystemExit) as exc:
        dsv4_main(["compare", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "env:NAME=VALUE" in text and "--pattern" in text and "--no-validate" in text


# ---------------------------------------------------------------------------
# The campaign loop with servers that cannot start (real processes, no vLLM)
# ---------------------------------------------------------------------------


def _campaign(out: Path, a_vllm: tuple[str, ...], b_vllm: tuple[str, ...], retry: bool = False):
    def variant(letter: str, vllm: tuple[str, ...]) -> campaign.ResolvedVariant:
        return campaign.ResolvedVariant(
            spec=parse_spec("tiny.yaml", variant=letter),
            preset="tiny",
            model="/models/tiny",
            served_model="/models/tiny",
            tokenizer=None,
            serve_args=("/models/tiny",),
            env={"DSV4_TEST_MARK": letter},
            vllm=vllm,
        )

    def build_args(**kwargs: Any) -> list[str]:
        return ["--num-prompts", "1", "--result-filename", kwargs["result_filename"]]

    bench = campaign.ResolvedBench(name="b", num_prompts=1, vllm=("true",), build_args=build_args)
    return campaign.Campaign(
        out_dir=out,
        runs=plan_runs("AB"),
        variants={"A": variant("A", a_vllm), "B": variant("B", b_vllm)},
        bench=bench,
        options=campaign.RunOptions(health_timeout=30, stop_grace=5, retry_failed=retry),
    )


def test_campaign_records_start_failures_and_resumes(tmp_path: Path) -> None:
    import io

    from dsv4_presets.compare.progress import Progress

    out = tmp_path / "camp"
    code_file = tmp_path / "exit-code"
    code_file.write_text("3")
    # A "server" that prints boom and exits with the code in code_file.
    script = (
        "import pathlib, sys; print('boom'); "
        f"sys.exit(int(pathlib.Path({str(code_file)!r}).read_text()))"
    )
    exits = (sys.executable, "-c", script)
    missing = (str(tmp_path / "no-such-vllm"),)
    stream = io.StringIO()
    results = runner.run_campaign(_campaign(out, exits, missing), Progress(2, stream=stream))
    assert [r.status for r in results] == ["failed", "failed"]
    assert results[0].reason is not None
    assert results[0].reason.startswith("server exited with code 3 before it was healthy")
    assert results[1].reason is not None and "could not start" in results[1].reason
    a = json.loads((out / "runs" / "01-A1" / "result.json").read_text())
    assert a["log_tail"][-1] == "boom"
    command = json.loads((out / "runs" / "01-A1" / "command.json").read_text())
    assert command["server"][:3] == list(exits)
    assert command["server"][-4:-1] == ["--host", "127.0.0.1", "--port"]
    assert command["server_env_overrides"] == {"DSV4_TEST_MARK": "A"}
    assert json.loads((out / "runs" / "01-A1" / "spec.json").read_text())["env"] == {
        "DSV4_TEST_MARK": "A"
    }
    assert not list((out / "runs").glob(".*"))
    # Resume: both runs are finished (failed), nothing is started again.
    again = runner.run_campaign(_campaign(out, exits, missing), Progress(2, stream=stream))
    assert [r.executed for r in again] == [False, False]
    assert "A1: already failed (resumed)" in stream.getvalue()
    # --retry-failed runs them again and keeps the failed attempt.
    code_file.write_text("0")
    runner.run_campaign(_campaign(out, exits, missing, retry=True), Progress(2, stream=stream))
    names = sorted(p.name for p in (out / "runs").iterdir())
    assert names == ["01-A1", "01-A1.failed-1", "02-B1", "02-B1.failed-1"]
    retried = json.loads((out / "runs" / "01-A1" / "result.json").read_text())
    assert retried["reason"].startswith("server exited with code 0")
    rep, text = report.write_report(out, plot=False)
    assert rep["failed_runs"] == ["A1", "B1"] and rep["pairs"] == []
    assert "No successful B run" in text
    # A changed variant on the same folder is refused rather than mixed in.
    with pytest.raises(ValueError, match="holds a different campaign"):
        runner.run_campaign(_campaign(out, missing, missing), Progress(2, stream=stream))


def test_http_helpers_talk_to_a_local_server_despite_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert local_http.get(base + "/health", timeout=5) == (200, b"ok")
        assert local_http.get(base + "/other", timeout=5)[0] == 503
        status, body = local_http.post_json(base + "/v1/completions", {"x": 1}, timeout=5)
        assert status == 200 and json.loads(body) == {"x": 1}
    finally:
        server.shutdown()
        server.server_close()
    # Nothing listening: status 0, no exception.
    assert local_http.get(base + "/health", timeout=2)[0] == 0


def _fake_nvidia_smi(bin_dir: Path, values_file: Path) -> None:
    """An nvidia-smi that prints the next line of values_file per call (then the last one)."""
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'f="{values_file}"\n'
        'n=$(head -n 1 "$f"); rest=$(tail -n +2 "$f")\n'
        'if [ -n "$rest" ]; then printf "%s\\n" "$rest" > "$f"; fi\n'
        'printf "%s\\n" "$n" | tr "," "\\n"\n'
    )
    script.chmod(0o755)


def test_gpu_release_waits_for_memory_to_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4_presets.compare.progress import Progress

    values = tmp_path / "values"
    # Two GPUs; memory falls back to the baseline on the fourth query.
    values.write_text("70000,69000\n40000,30000\n5000,900\n1200,800\n")
    _fake_nvidia_smi(tmp_path / "bin", values)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    camp = _campaign(tmp_path / "camp", ("true",), ("true",))
    camp.options = campaign.RunOptions(gpu_release_timeout=30, poll_interval=0.01)
    r = runner._Runner(camp, Progress(1, live=False))
    got = r._wait_gpu_release([1000, 700])
    assert got["checked"] and got["released"]
    assert got["used_mib"] == [1200, 800]  # within the 1 GiB margin
    # Memory that never comes back: the wait ends at its deadline and says so.
    values.write_text("50000,50000\n")
    camp.options = campaign.RunOptions(gpu_release_timeout=0.3, poll_interval=0.01)
    stuck = runner._Runner(camp, Progress(1, live=False))._wait_gpu_release([1000, 700])
    assert stuck["checked"] and not stuck["released"]
    assert "not back to baseline" in stuck["note"]
    assert process.gpu_memory_used_mib() == [50000, 50000]


def test_gpu_release_skipped_without_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4_presets.compare.progress import Progress

    monkeypatch.setenv("PATH", str(tmp_path))
    assert process.gpu_memory_used_mib() is None
    camp = _campaign(tmp_path / "camp", ("true",), ("true",))
    got = runner._Runner(camp, Progress(1, live=False))._wait_gpu_release(None)
    assert got == {"checked": False, "note": "nvidia-smi not found: no GPU memory to wait for"}


def test_sigterm_stops_the_server_and_exits_130(tmp_path: Path) -> None:
    # A "vLLM" that starts and never becomes healthy: the campaign sits in the health wait.
    fake = tmp_path / "fake_vllm.py"
    fake.write_text("import time\ntime.sleep(300)\n")
    serve, bench = _write_presets(tmp_path)
    out = tmp_path / "camp"
    vllm = f"vllm:'{sys.executable} {fake}'"
    cmd = [
        sys.executable, "-m", "dsv4_presets.compare",
        "--a", f"{serve} {vllm}", "--b", f"{serve} max-num-seqs=1 {vllm}",
        "--bench", str(bench), "--no-validate", "--out", str(out), "--no-progress",
        "--health-timeout", "120", "--stop-grace", "5",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = out / "runs" / ".01-A1.partial" / "server.pid"
    server_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server was never started"
            time.sleep(0.05)
        time.sleep(0.2)
        server_pid = json.loads(pid_file.read_text())["pid"]
        assert group_alive(server_pid)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server_pid is not None and group_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
            pytest.fail("the campaign left its server running")
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "resume" in stderr
    assert not list((out / "runs").iterdir())  # the unfinished run left nothing behind
    rep = json.loads((out / "report.json").read_text())
    assert rep["not_run"] == ["A1", "B1", "A2"]
    assert "Not run yet: A1, B1, A2" in stdout
