"""Process plumbing for one server run: ports, process groups, orphans, GPU memory.

Nothing here knows about campaigns or run folders: these are the operating
system operations the runner composes (start a command in its own process
group, stop the whole group, find a server a killed campaign left behind, read
GPU memory and the host's versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "free_port",
    "gpu_memory_used_mib",
    "host_versions",
    "kill_orphan",
    "process_start_time",
    "start_in_group",
    "stop_process_group",
]


def free_port(host: str) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_in_group(
    argv: Sequence[str], env: Mapping[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group, appending its output to ``log``.

    Raises ``OSError`` when the command cannot be started.
    """
    with open(log, "ab") as fh:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _nvidia_smi(query: str, fmt: str) -> list[str] | None:
    """The non-empty lines ``nvidia-smi --query-gpu=QUERY --format=FMT`` prints, or None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", f"--format={fmt}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_memory_used_mib() -> list[int] | None:
    """Used memory per GPU from ``nvidia-smi``, or None where there is no nvidia-smi."""
    lines = _nvidia_smi("memory.used", "csv,noheader,nounits")
    if lines is None:
        return None
    try:
        return [int(float(line)) for line in lines]
    except ValueError:
        return None


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen[bytes], grace: float) -> dict[str, Any]:
    """Stop a process started with ``start_new_session`` and everything in its group.

    SIGTERM to the group (the PID is the group id), then SIGKILL once ``grace``
    seconds have passed; returns how it went.
    """
    pid = proc.pid
    info: dict[str, Any] = {"pid": pid}
    t0 = time.monotonic()
    if proc.poll() is not None and not _process_group_alive(pid):
        info.update(exit_code=proc.returncode, stopped_by="already exited", seconds=0.0)
        return info
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    stopped_by = "SIGTERM"
    deadline = t0 + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _process_group_alive(pid):
            break
        time.sleep(0.1)
    else:
        stopped_by = "SIGKILL after grace"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 30
        while _process_group_alive(pid) and time.monotonic() < kill_deadline:
            proc.poll()
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    info.update(
        exit_code=proc.returncode,
        stopped_by=stopped_by,
        seconds=round(time.monotonic() - t0, 3),
        group_left=_process_group_alive(pid),
    )
    return info


def process_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) is in parentheses and may hold spaces.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def kill_orphan(pid_file: Path, grace: float = 30.0) -> str | None:
    """Stop a server left behind by a killed campaign, if it is still ours.

    ``pid_file`` holds ``{"pid": ..., "start_time": ..., "argv": [...]}``.  The
    process group is only signalled when the PID still belongs to the process
    we started: same start time in ``/proc/PID/stat`` (vLLM renames its
    processes, so the command line is not a reliable witness).  Returns what
    was done, or None when nothing of ours was running.
    """
    try:
        data = json.loads(pid_file.read_text())
        pid = int(data["pid"])
        recorded = data.get("start_time")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not recorded:
        return None
    current = process_start_time(pid)
    if current is None:
        if _process_group_alive(pid) and not Path("/proc").is_dir():
            return f"process group {pid} may be an orphaned server; /proc is missing, not touched"
        return None
    if current != recorded:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _process_group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _process_group_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return f"killed orphaned server process group {pid} (SIGKILL after {grace:.0f}s)"
    return f"stopped orphaned server process group {pid} (SIGTERM)"


def _git_sha() -> str:
    """``DSV4_GIT_SHA``, else the sha of the checkout this package runs from, else "unknown".

    Asked of the package's own folder, not of the current directory, so a run
    started from inside another repository does not record that one's sha.
    """
    if os.environ.get("DSV4_GIT_SHA"):
        return os.environ["DSV4_GIT_SHA"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha.stdout.strip() if sha.returncode == 0 and sha.stdout.strip() else "unknown"


def host_versions() -> dict[str, Any]:
    """Python, platform, host name, our version, the git sha and the GPUs (``nvidia-smi``)."""
    from .. import __version__

    versions: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "dsv4_presets": __version__,
    }
    versions["git_sha"] = _git_sha()
    versions["gpus"] = _nvidia_smi("name,driver_version", "csv,noheader")
    return versions
