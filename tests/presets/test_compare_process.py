"""dsv4 compare's process plumbing on real (non-vLLM) processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _process import group_alive

from dsv4_presets.compare import process, rundir

# ---------------------------------------------------------------------------
# Process handling on real (non-vLLM) processes
# ---------------------------------------------------------------------------


def test_stop_process_group_stops_children(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    time.sleep(0.3)
    info = process.stop_process_group(proc, grace=10)
    assert info["stopped_by"] == "SIGTERM"
    assert not group_alive(proc.pid)


def test_stop_process_group_kills_after_grace(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; while true; do sleep 0.1; done"], start_new_session=True
    )
    time.sleep(0.3)
    t0 = time.monotonic()
    info = process.stop_process_group(proc, grace=1.0)
    assert info["stopped_by"] == "SIGKILL after grace"
    assert time.monotonic() - t0 >= 1.0
    assert not group_alive(proc.pid)
    assert proc.returncode == -signal.SIGKILL


def test_kill_orphan_only_touches_the_recorded_process(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(300)"]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        time.sleep(0.3)
        start = process.process_start_time(proc.pid)
        assert start is not None and start.isdigit()
        wrong = tmp_path / "wrong.pid"
        # Same PID but another start time: a reused PID, never signalled.
        wrong.write_text(json.dumps({"pid": proc.pid, "start_time": str(int(start) + 1)}))
        assert process.kill_orphan(wrong, grace=5) is None
        assert proc.poll() is None
        right = tmp_path / "right.pid"
        right.write_text(json.dumps({"pid": proc.pid, "start_time": start, "argv": argv}))
        what = process.kill_orphan(right, grace=5)
        assert what is not None and str(proc.pid) in what
        proc.wait(timeout=10)
        assert not group_alive(proc.pid)
        # Nothing left to do the second time.
        assert process.kill_orphan(right, grace=5) is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_free_port_is_bindable() -> None:
    import socket

    port = process.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_recorded_environment_drops_credentials() -> None:
    env = {"VLLM_X": "1", "HF_TOKEN": "secret", "DSV4_KERNELS_DISABLE": "1", "HOME": "/root"}
    assert rundir.recorded_environment(env) == {"DSV4_KERNELS_DISABLE": "1", "VLLM_X": "1"}
