"""Running ``vllm bench serve`` with a bench preset, and judging the result it saved.

``vllm bench serve`` exits 0 even when every request failed, so the saved
JSON is the only trustworthy verdict: :func:`read_bench_result` fails unless
every prompt completed and none failed.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv4_presets.presets import BenchConfig
from dsv4_presets.vllm_exec import vllm_command

# Headline metrics `dsv4 bench` prints, with their units.
SUMMARY_METRICS = (
    ("completed", ""),
    ("duration", "s"),
    ("request_throughput", "req/s"),
    ("output_throughput", "tok/s"),
    ("total_token_throughput", "tok/s"),
    ("mean_ttft_ms", "ms"),
    ("median_ttft_ms", "ms"),
    ("mean_tpot_ms", "ms"),
    ("median_tpot_ms", "ms"),
    ("mean_itl_ms", "ms"),
)


class BenchResultError(RuntimeError):
    """The benchmark did not produce a complete, failure-free result."""


def read_bench_result(path: str | Path, *, expected_prompts: int) -> dict[str, Any]:
    """Load a ``vllm bench serve --save-result`` JSON file and check it is complete.

    Raises :class:`BenchResultError` when the file is missing or unreadable,
    when any request failed, or when fewer than ``expected_prompts`` requests
    completed.
    """
    if isinstance(expected_prompts, bool) or not isinstance(expected_prompts, int):
        raise ValueError(f"expected_prompts must be an int, got {expected_prompts!r}")
    if expected_prompts < 1:
        raise ValueError(f"expected_prompts must be positive, got {expected_prompts}")
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchResultError(
            f"vllm bench serve saved no result at {path} (did it crash before the end?)"
        ) from None
    except (OSError, ValueError) as exc:
        raise BenchResultError(f"cannot read benchmark result {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise BenchResultError(f"benchmark result {path} is not a JSON object")
    completed = data.get("completed")
    failed = data.get("failed", 0)
    if not isinstance(completed, int):
        raise BenchResultError(f"benchmark result {path} has no 'completed' count")
    problems = []
    if isinstance(failed, int) and failed > 0:
        errors = [e for e in data.get("errors", []) or [] if e]
        if errors:
            first = f"; first error: {str(errors[0])[:300]}"
        else:
            first = " (the result keeps no per-request errors; --set save-detailed=true keeps them)"
        problems.append(f"{failed} of {expected_prompts} requests failed{first}")
    if completed < expected_prompts:
        problems.append(f"only {completed} of {expected_prompts} requests completed")
    if problems:
        raise BenchResultError(f"benchmark result {path}: " + "; ".join(problems))
    return dict(data)


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """Human-readable lines for the headline metrics present in ``result``."""
    lines = []
    for key, unit in SUMMARY_METRICS:
        value = result.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"  {key:<24} {text} {unit}".rstrip())
    return lines


def served_model(base_url: str, *, timeout: float = 10.0) -> str:
    """The first model id the OpenAI-compatible server at ``base_url`` serves."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.loads(response.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchResultError(
            f"cannot ask {url} which model it serves ({exc}); pass --model"
        ) from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchResultError(f"{url} lists no model; pass --model")
    return str(models[0]["id"])


def run_bench(
    config: BenchConfig,
    *,
    base_url: str,
    model: str,
    result_dir: str,
    result_filename: str,
    tokenizer: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> tuple[int, Path]:
    """Run ``vllm bench serve``; returns its exit status and the result file's path."""
    argv = [
        *vllm_command(),
        "bench",
        "serve",
        *config.to_argv(
            base_url=base_url,
            model=model,
            result_dir=result_dir,
            result_filename=result_filename,
            tokenizer=tokenizer,
        ),
    ]
    import os

    env = dict(os.environ)
    if extra_env:
        env.update(extra_env)
    completed = subprocess.run(argv, env=env, check=False)
    return completed.returncode, Path(result_dir) / result_filename
