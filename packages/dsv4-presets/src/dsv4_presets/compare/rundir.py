"""The run folder's on-disk format: which file holds what, and how it is written and read.

A campaign folder (``--out``) holds ``campaign.json`` (the plan, the variants'
commands and the identity a resumption must match) and ``runs/``, one folder
per finished run, ``NN-LABEL``.  A run is written into
``runs/.NN-LABEL.partial`` and renamed when it is over, so a folder with the
final name is always complete.  Inside a run folder:

``spec.json``, ``command.json``, ``environment.json``
    what was asked, the exact server and bench commands, the recorded
    environment (no credentials);
``server.log``, ``bench.log``
    the server's and the benchmark client's output;
``bench.json``
    vLLM's own ``--save-result --save-detailed`` JSON;
``versions.json``
    host versions, the server's vLLM version and the dsv4-attention plugin's
    state, both read from ``server.log``;
``result.json``
    our verdict: status, reason, metrics, timings, plugin and version record.

The runner writes this format and the report reads it; neither needs the other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_FILE",
    "BENCH_LOG",
    "CAMPAIGN_FILE",
    "PARTIAL_SUFFIX",
    "RESULT_FILE",
    "SERVER_LOG",
    "SERVER_PID_FILE",
    "VERSIONS_FILE",
    "load_result",
    "partial_folder",
    "read_bench_metrics",
    "recorded_environment",
    "tail",
    "write_json",
]

RESULT_FILE = "result.json"
BENCH_FILE = "bench.json"
CAMPAIGN_FILE = "campaign.json"
VERSIONS_FILE = "versions.json"
SERVER_LOG = "server.log"
BENCH_LOG = "bench.log"
SERVER_PID_FILE = "server.pid"
PARTIAL_SUFFIX = ".partial"

# Environment variables recorded with each run (by prefix); names that look
# like credentials are never written.
_ENV_PREFIXES = (
    "VLLM_",
    "DSV4_",
    "CUDA_",
    "NCCL_",
    "HF_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "NVIDIA_",
    "TRITON_",
    "LD_LIBRARY_PATH",
    "PATH",
    "VIRTUAL_ENV",
)
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL", "AUTH")


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def recorded_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment worth recording (no credentials)."""
    out = {}
    for name, value in sorted(env.items()):
        if not name.startswith(_ENV_PREFIXES):
            continue
        if any(word in name.upper() for word in _SECRET_WORDS):
            continue
        out[name] = value
    return out


def tail(path: Path, lines: int = 40) -> list[str]:
    """The last ``lines`` lines of a text file (empty when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def read_bench_metrics(data: Mapping[str, Any]) -> dict[str, Any]:
    """The summary numbers of one vLLM bench JSON (0.32 field names)."""
    keys = (
        "completed",
        "failed",
        "num_prompts",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    return {k: data[k] for k in keys if k in data}


def load_result(folder: Path) -> dict[str, Any] | None:
    """The ``result.json`` of a finished run folder, or None."""
    path = folder / RESULT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def partial_folder(runs_dir: Path, folder: str) -> Path:
    """Where a run is written while it is in progress."""
    return runs_dir / f".{folder}{PARTIAL_SUFFIX}"
